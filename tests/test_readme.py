"""The README's code: the quickstart runs as pasted, and the custom loops are
the example's text and train.

`examples/custom_training_loop.py` holds one `train_step` per backend; the
README shows the TensorFlow one under a `<!-- custom-loop: NAME -->` marker.
The text must match, and the example must train on the backend this process
runs, skipping its NaN batch with the weights and BatchNorm's moving
statistics left as they were.
"""

import os
import re
import runpy
import textwrap

import keras
import numpy as np
import pytest

import keras_mp

BACKEND = keras.backend.backend()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "custom_training_loop.py")


def _readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _readme_blocks():
    return dict(re.findall(r"<!-- custom-loop: (\w+) -->\n```python\n(.*?)\n```", _readme(), re.S))


def _python_blocks():
    """Every Python block of the README, in order, with the marker above it."""
    return re.findall(r"(?:<!-- ([\w: -]+) -->\n)?```python\n(.*?)\n```", _readme(), re.S)


@pytest.mark.floor
def test_every_block_runs_as_pasted(capsys):
    """The blocks run in order in one namespace, as a reader pastes them:
    the quickstart, then the manual control of its model, the optimizer, and
    the custom loop (defined; run by the example's test below)."""
    blocks = _python_blocks()
    assert blocks[0][0] == "quickstart" and len(blocks) >= 4
    namespace = {}
    exec(compile(blocks[0][1], "README:quickstart", "exec"), namespace)
    model = namespace["model"]
    assert model.get_compile_config()["amp_level"] == "O2"
    assert model.layers[0].compute_dtype == "float16"
    assert model.layers[1].compute_dtype == "float32"  # BatchNormalization
    assert model.layers[0].kernel.dtype == "float32"
    out = capsys.readouterr().out
    # (Whole numbers, `loss_scale: 32768 - skipped_steps: 0`, where Keras's bar
    # keeps the value's type: test_callbacks.py; Keras 3.10 prints 32768.0000.)
    assert re.search(r"loss_scale: 32768(\.0+)? - skipped_steps: 0\b", out), out[-500:]
    assert "Compute" in out and "O2 deny-list" in out  # the summary printed
    for number, (marker, code) in enumerate(blocks[1:], 1):
        code = compile(code, f"README:block {number}", "exec")
        if marker.startswith("custom-loop") and marker != f"custom-loop: {BACKEND}":
            continue  # another backend's loop: compiled only
        exec(code, namespace)
    assert isinstance(namespace["optimizer"], keras_mp.LossScaleOptimizer)
    assert namespace["optimizer"].min_scale is None
    assert model.layers[0].compute_dtype == "bfloat16"  # to_float, kept by compile


def _example_blocks():
    with open(EXAMPLE) as f:
        text = f.read()
    setup = text.split("# -- the README's set-up")[1].split("\n", 1)[1].split("\n# ----")[0]
    blocks = {"setup": setup.strip("\n")}
    for backend in ("tensorflow", "jax", "torch"):
        body = []
        for line in text.split(f'if BACKEND == "{backend}":\n', 1)[1].split("\n"):
            if line and not line.startswith(" "):
                break
            body.append(line)
        blocks[backend] = textwrap.dedent("\n".join(body)).strip("\n")
    return blocks


@pytest.mark.one_backend
def test_readme_shows_the_examples_loops():
    readme = _readme_blocks()
    example = _example_blocks()
    assert readme and set(readme) <= set(example)
    for name, code in readme.items():
        # The example's block may go on after the README's (driver code).
        assert example[name].startswith(code), name
        compile(code, f"README:{name}", "exec")  # valid Python as shown


@pytest.fixture(scope="module")
def example():
    keras.config.set_dtype_policy("float32")
    return runpy.run_path(EXAMPLE, run_name="custom_training_loop")


@pytest.mark.floor
def test_example_loop_trains_and_skips_its_nan_batch(example):
    losses, scale, skipped, applied = example["main"]()  # 60 steps, a NaN at step 30
    assert skipped == 1 and applied == 59
    assert scale == 2.0**14  # 2**15, halved once; 2000 good steps never reached
    assert np.isnan(losses[30]) and np.isfinite(losses[:30] + losses[31:]).all()
    assert losses[-1] < 0.5 * losses[0]

    model, optimizer = example["model"], example["optimizer"]
    before = [np.array(keras.ops.convert_to_numpy(v)) for v in model.variables]
    slots = [np.array(keras.ops.convert_to_numpy(v)) for v in optimizer.inner_optimizer.variables]
    x = np.ones((4, 20), "float32")
    x[1, 3] = np.inf
    example["run_step"](x, np.zeros(4, "int32"))
    if BACKEND == "jax":
        example["sync_state"]()
    # Weights, and BatchNorm's moving statistics (README's one line).
    assert any("moving_mean" in v.path for v in model.non_trainable_variables)
    for old, variable in zip(before, model.variables):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable), variable.path)
    for old, variable in zip(slots, optimizer.inner_optimizer.variables):
        np.testing.assert_array_equal(old, keras.ops.convert_to_numpy(variable))
    assert int(keras.ops.convert_to_numpy(optimizer.skipped_steps)) == 2
