"""How much memory does a train step hold at each level, beside Keras's policies?

What each backend exposes of the program it runs (`keras_mp`'s
`compiled_census.memory`), nothing timed:

- JAX: XLA's buffer assignment of `fit`'s train step, compiled for this
  machine with its state donated as `fit` donates it: the temporary bytes
  (activations kept for the backward pass, gradients, workspaces).
- PyTorch: one `train_on_batch`: the peak of the tensors the step creates
  alive at once, and the tensors autograd saves for the backward pass, by
  dtype, each storage once.
- TensorFlow: the traced train step: the forward values the gradient
  tape's ops read (what the backward pass keeps), by dtype.

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
    "O3 bfloat16",
    "keras mixed_bfloat16",
    "O2 float16",
    "O3 float16",
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    args = parser.parse_args()
    import keras

    import keras_mp  # noqa: F401  (compile's amp_level)
    from keras_mp._src.tools import compiled_census

    print("| model | configuration | held MiB | saved for backward MiB (by dtype) |")
    print("|---|---|---|---|")
    for name in args.models:
        for config in args.configs:
            model, loss, (x, y) = _compiled(keras, name, config)
            try:
                memory = compiled_census.memory(model, x, y)
            except Exception as error:  # noqa: BLE001 (Keras's own step may not build)
                print(f"| {name} | {config} | {type(error).__name__} | |", flush=True)
                continue
            held = "" if memory.held is None else f"{memory.held / 2**20:.0f}"
            saved = ""
            if memory.saved is not None:
                by = ", ".join(
                    f"{k} {v / 2**20:.0f}" for k, v in sorted(memory.saved.items()) if v >= 2**19
                )
                saved = f"{memory.saved_bytes / 2**20:.0f} ({by})"
            print(f"| {name} | {config} | {held} | {saved} |", flush=True)


if __name__ == "__main__":
    main()
