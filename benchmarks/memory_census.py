"""(Issue 65, a first census) How much memory does a train step hold, beside Keras?

What each backend exposes of the program it runs, nothing timed:

- JAX: XLA's buffer assignment of `fit`'s train step, compiled for this
  machine (`jax.jit(model.train_step).lower(...).compile().memory_analysis()`):
  the temporary bytes (activations kept for the backward pass, workspaces),
  and those of the loss's gradient alone (`jax.grad` of a stateless call).
- PyTorch: the tensors autograd saves for the backward pass of one forward
  pass and loss (`torch.autograd.graph.saved_tensors_hooks`), by dtype,
  each storage counted once.
- TensorFlow: nothing comparable on a CPU (its allocator's peak,
  `tf.config.experimental.get_memory_info`, is a GPU's): not measured.

Models as issue 65 names them, from configs with random weights: a KerasHub
BERT classifier (hidden 512, 4 layers, 256 tokens, batch 4), a KerasHub
Gemma (vocabulary 32000, hidden 512, 4 layers, 256 tokens, batch 4), and
keras.applications' ResNet50 (64x64, batch 8).

    KERAS_BACKEND=jax python benchmarks/memory_census.py
    KERAS_BACKEND=torch python benchmarks/memory_census.py --models bert
"""

import argparse

import _checkout  # noqa: F401  (this checkout's keras_mp, not an installed one)
from _common import built_for
from _common import level_of

MODELS = ("bert", "gemma", "resnet50")
CONFIGS = (
    "O0",
    "O2 bfloat16",
    "keras mixed_bfloat16",
    "O2 float16",
    "keras mixed_float16",
)


def _build(keras, name):
    """The model, its loss and one batch (x, y)."""
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3), classes=10)
        x = rng.normal(size=(8, 64, 64, 3)).astype("float32")
        loss = keras.losses.SparseCategoricalCrossentropy()
        return model, loss, (x, rng.integers(0, 10, size=8))
    import keras_hub

    batch, tokens = 4, 256
    ids = rng.integers(0, 1000, size=(batch, tokens + 1)).astype("int32")
    mask = np.ones((batch, tokens), "int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "bert":
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=30522, num_layers=4, num_heads=8, hidden_dim=512,
            intermediate_dim=2048, max_sequence_length=tokens,
        )  # fmt: skip
        model = keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)
        x = {"token_ids": ids[:, :-1], "segment_ids": 0 * mask, "padding_mask": mask}
        return model, loss, (x, rng.integers(0, 2, size=batch))
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=32000, num_layers=4, num_query_heads=8, num_key_value_heads=8,
        hidden_dim=512, intermediate_dim=2048, head_dim=64,
    )  # fmt: skip
    model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    return model, loss, ({"token_ids": ids[:, :-1], "padding_mask": mask}, ids[:, 1:])


def _compiled(keras, name, config):
    model, loss, batch = built_for(keras, config, lambda: _build(keras, name))
    if config.startswith("keras "):
        model.compile(optimizer="adam", loss=loss)
    else:
        level, dtype = level_of(config)
        model.compile(optimizer="adam", loss=loss, amp_level=level, amp_dtype=dtype)
    return model, loss, batch


def jax_census(keras, model, loss, batch):
    """(train step's temp bytes, the loss gradient's temp bytes)."""
    import jax

    from keras_mp._src import keras_internals

    keras_internals.build_for_training(model, batch)
    state = keras_internals.jax_training_state(model)
    step = jax.jit(model.train_step).lower(state, batch).compile()
    trainable, non_trainable = state[0], state[1]
    loss_fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    x, y = batch

    def compute(trainable):
        y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, y_pred)

    grad = jax.jit(jax.grad(compute)).lower(trainable).compile()
    return (
        step.memory_analysis().temp_size_in_bytes,
        grad.memory_analysis().temp_size_in_bytes,
    )


def torch_census(keras, model, loss, batch):
    """{dtype: bytes} of the tensors autograd saves for one forward pass."""
    import torch

    saved, seen = {}, set()

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            name = str(t.dtype).replace("torch.", "")
            saved[name] = saved.get(name, 0) + t.untyped_storage().nbytes()
        return t

    loss_fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    x, y = batch
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = loss_fn(y, model(x, training=True))
    value.backward()
    return saved


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    args = parser.parse_args()
    import keras

    import keras_mp  # noqa: F401  (compile's amp_level)

    backend = keras.backend.backend()
    if backend == "jax":
        print("| model | configuration | train step temp MiB | loss gradient temp MiB |")
        print("|---|---|---|---|")
    elif backend == "torch":
        print("| model | configuration | saved for backward MiB | by dtype (MiB) |")
        print("|---|---|---|---|")
    else:
        raise SystemExit("TensorFlow exposes no step memory on a CPU: run with jax or torch")
    for name in args.models:
        for config in args.configs:
            model, loss, batch = _compiled(keras, name, config)
            if backend == "jax":
                step, grad = jax_census(keras, model, loss, batch)
                print(
                    f"| {name} | {config} | {step / 2**20:.0f} | {grad / 2**20:.0f} |", flush=True
                )
            else:
                saved = torch_census(keras, model, loss, batch)
                by = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(saved.items()))
                total = sum(saved.values()) / 2**20
                print(f"| {name} | {config} | {total:.0f} | {by} |", flush=True)


if __name__ == "__main__":
    main()
