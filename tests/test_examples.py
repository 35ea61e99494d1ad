"""Every example runs, with the fewest steps its flags allow; `--help`
answers before Keras loads. What an example shows that unit tests prove on
each backend (the loss scale, the skip, saving, export) runs once, the
cells rotated over the backends (LeNet-5 on PyTorch, the others on
TensorFlow); the GAN, whose example holds a training step per backend, runs
on each. The main job runs as a user runs it (its own process: no
TensorFlow start-up lines); the others run in this process through their
`main`, which saves an import of every framework per example.

`custom_training_loop.py` is run by `test_readme.py` (its loops are the
README's), the notebook by `test_notebook.py`.
"""

import os
import re
import runpy
import subprocess
import sys

import keras
import pytest

BACKEND = keras.backend.backend()
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


def _run(name, *args, timeout=300):
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), *args],
        env=dict(os.environ, KERAS_BACKEND=BACKEND),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _main(name, capsys, *args):
    """Runs the example's `main(args)` here; returns what it printed."""
    example = runpy.run_path(os.path.join(EXAMPLES, name), run_name=f"example_{name[:-3]}")
    example["main"](list(args))
    return capsys.readouterr().out


ONCE = pytest.mark.skipif(
    BACKEND != "tensorflow", reason="what it shows is proven on each backend by unit tests"
)


@ONCE
@pytest.mark.slow(reason="the README's main job as a user runs it: a process training three levels")
def test_main_job_as_a_user_runs_it_shows_the_scale_the_skip_and_both_levels():
    # Two steps: the scale (2**24) overflows and halves on each, the story's
    # first line. One epoch: its times include compiling the step, which
    # the table's arithmetic does not mind.
    result = _run("train_mixed_precision.py", "--epochs", "1", "--steps", "2")
    out = result.stdout
    # As a user runs it: quiet, without TensorFlow's native start-up lines.
    assert "absl::InitializeLog" not in result.stderr and "I0000" not in result.stderr
    # The scale starts at 2**24 and backs off on the first overflowing steps.
    assert re.search(r"steps 1-\d+: +overflow: skipped, the scale halved each time", out), out
    assert "then it held at" in out
    # The corrupted batch: skipped, one more skipped step, nothing changed.
    assert re.search(r"the \d+ variables \(.*\): unchanged, bit for bit", out), out
    assert "CHANGED" not in out
    rows = {
        m[0]: m
        for m in re.findall(r"^(O[02] \w+) +([\d.]+) +([\d.]+) ms +([\d.]+)x +(\S+)$", out, re.M)
    }
    # Issue 64.4: on a CPU, O2 bfloat16 beside them (no loss scale: a fixed
    # 1 that skips a non-finite step), and what `auto` picks here and why;
    # the speed reports for this machine and for an H100.
    assert set(rows) == {"O0 float32", "O2 float16", "O2 bfloat16"}, out
    assert rows["O0 float32"][4] == "-" and float(rows["O2 float16"][4]) >= 1
    assert rows["O2 bfloat16"][4] == "1" and rows["O0 float32"][3] == "1.00"
    for name in ("O2 float16", "O2 bfloat16"):
        speedup = float(rows["O0 float32"][2]) / float(rows[name][2])
        assert abs(float(rows[name][3]) - speedup) < 0.02, out
    assert re.search(
        r"keras_mp: amp_level='auto' picked O[02] .*"
        r"(a bfloat16 matmul ran at|bfloat16 is converted to float32)",
        out,
    ), out
    assert "Speed report (this machine): O2 bfloat16 on " in out and "a bfloat16 matmul ran" in out
    assert "Speed report (H100): O2 float16 on an NVIDIA H100 SXM" in out


@pytest.mark.one_backend
def test_lenet5_runs_each_scale_setting_on_real_data(capsys):
    out = _main("lenet5_amp.py", capsys, "--epochs", "1", "--steps", "1", "--levels", "O0", "O2")
    rows = re.findall(r"^(O[0-3]) +(.+?) +([\d.]+) +(\S+) +(\S+) +[\d.]+ ms$", out, re.M)
    assert [(level, setting) for level, setting, *_ in rows] == [
        ("O0", "no scaling"),
        ("O2", "fixed 1024, skip"),
        ("O2", "fixed 1024, no skip"),
        ("O2", "dynamic x4 / 3000"),
    ], out
    assert rows[0][3:] == ("-", "-")  # O0: no loss scale
    assert [r[3] for r in rows[1:]] == ["1024", "1024", "32768"]
    assert "digits upscaled to 32x32" in out


def test_gan_trains_both_networks_with_two_optimizers_at_o2_and_o3(capsys):
    """examples/gan.py: a GAN's own compile and train_step (a jitted loop on
    JAX), at O2 float16 and O3 bfloat16: both networks move, each optimizer
    has its own scale, nothing is skipped on clean data."""
    out = _main("gan.py", capsys, "--epochs", "1", "--steps", "1")
    blocks = re.split(r"^== ", out, flags=re.M)[1:]
    assert [b.split("\n", 1)[0] for b in blocks] == ["O2 float16", "O3 bfloat16"], out
    for block, scale in zip(blocks, ("32768", "1")):
        for name in ("d_optimizer", "g_optimizer"):
            assert f"{name}: loss scale {scale}, 0 skipped steps" in block, block
        moved = re.search(r"discriminator ([\d.e+-]+), generator ([\d.e+-]+)", block)
        assert moved and float(moved.group(1)) > 1e-3 and float(moved.group(2)) > 1e-3, block
        losses = re.search(r"d_loss ([\d.]+)  g_loss ([\d.]+)", block)
        assert losses and all(0 < float(v) < 5 for v in losses.groups()), block
        if BACKEND != "jax":  # fit wrapped them, and said so
            assert "keras_mp: wrapped `d_optimizer` (Adam" in block, block


@pytest.mark.one_backend
@pytest.mark.parametrize("name", ["train_mixed_precision.py", "lenet5_amp.py", "gan.py"])
def test_help_describes_every_option_before_keras_loads(name):
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{name!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_path({os.path.join(EXAMPLES, name)!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('keras imported' if 'keras' in sys.modules else 'keras not imported')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout
    assert out.rstrip().endswith("keras not imported"), out
    listing = out.split("options:", 1)[1]
    blocks = re.split(r"\n  (?=-)", listing)[1:]  # one per option
    names = [re.match(r"(-h, )?(--[\w-]+)", b).group(2) for b in blocks]
    assert "--steps" in names and "--epochs" in names, names
    for name, block in zip(names, blocks):
        if name != "--help":
            # Each option has a description and says its default.
            assert "(default:" in block, (name, block)


@ONCE
def test_export_example_runs(tmp_path, capfd, monkeypatch):
    # In this process (its serving process imports TensorFlow alone, as shown).
    example = runpy.run_path(os.path.join(EXAMPLES, "export_savedmodel.py"), run_name="example")
    monkeypatch.setattr(
        sys, "argv", ["export_savedmodel.py", "--out", str(tmp_path), "--epochs", "1"]
    )
    example["main"]()
    out = capfd.readouterr().out
    assert out.count("predicted classes:") == 2
    # As trained and in float32: the in-memory model's probabilities, to
    # float16's rounding.
    differences = re.findall(r"largest difference from the in-memory model: (\S+)", out)
    assert len(differences) == 2 and max(map(float, differences)) < 1e-2, out
    assert os.path.exists(tmp_path / "model.keras")
