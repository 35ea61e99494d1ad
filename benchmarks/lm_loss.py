"""A language model's loss chunk by chunk (keras_mp O2 bfloat16, the rule
on) beside Keras's `mixed_bfloat16` (the whole logits, and their float32
copy): the train step's temporaries and its time.

A KerasHub Gemma from a config with random weights: vocabulary 256000,
hidden 512, 2 layers (4 query heads of 128, 1 key-value head, MLP 1024).

- Memory (`--memory`): JAX, XLA's buffer assignment of `fit`'s train step,
  compiled for this machine with its state donated as `fit` donates it
  (`compiled_census.memory`: temporaries beyond the variables and the
  batch), and the largest array of the lowered program; nothing run.
  TensorFlow: the forward values the gradient's ops read, and the largest
  tensor of the traced graph.
- Time (`--time`): `train_on_batch`, the median of `--steps` after one to
  compile, on a smaller batch than the memory's where this CPU cannot run
  the full one (`--tokens`).

    KERAS_BACKEND=jax python benchmarks/lm_loss.py --memory --batch 2 --tokens 2048
    KERAS_BACKEND=jax python benchmarks/lm_loss.py --time --batch 2 --tokens 256
"""

import argparse
import statistics
import time

import _checkout  # noqa: F401  (this checkout's keras_mp, not an installed one)
import numpy as np

VOCABULARY, HIDDEN, LAYERS = 256000, 512, 2


def build(config, batch, tokens, vocabulary=VOCABULARY):
    import keras
    import keras_hub

    import keras_mp  # noqa: F401 (the compile keywords)

    keras.config.set_dtype_policy("mixed_bfloat16" if config == "keras" else "float32")
    keras.utils.set_random_seed(0)
    try:
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=vocabulary,
            num_layers=LAYERS,
            num_query_heads=4,
            num_key_value_heads=1,
            hidden_dim=HIDDEN,
            intermediate_dim=2 * HIDDEN,
            head_dim=128,
        )
        model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    finally:
        keras.config.set_dtype_policy("float32")
    amp = {} if config == "keras" else {"amp_level": "O2", "amp_dtype": "bfloat16"}
    if config == "plain":
        amp["chunked_loss"] = False
    model.compile(optimizer=keras.optimizers.Adam(1e-4), **amp)
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, vocabulary, (batch, tokens)).astype("int32"),
        "padding_mask": np.ones((batch, tokens), bool),
    }
    y = rng.integers(0, vocabulary, (batch, tokens)).astype("int32")
    return model, x, y


def memory(config, batch, tokens):
    from keras_mp._src.tools import compiled_census

    model, x, y = build(config, batch, tokens)
    census = compiled_census.memory(model, x, y)
    largest = compiled_census.largest_tensor(model, x, y)
    held = census.held if census.held is not None else census.saved_bytes
    return held, largest


def step_time(config, batch, tokens, steps):
    model, x, y = build(config, batch, tokens)
    model.train_on_batch(x, y)  # compiles
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    import keras

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=["keras", "chunked"])
    args = parser.parse_args()
    backend = keras.backend.backend()
    logits = args.batch * args.tokens * VOCABULARY
    print(f"{backend}: Gemma vocabulary {VOCABULARY}, hidden {HIDDEN}, {LAYERS} layers, ")
    print(f"batch {args.batch} x {args.tokens} tokens (logits {logits:,} elements)")
    names = {
        "keras": "Keras mixed_bfloat16",
        "plain": "keras_mp O2 bfloat16, chunked_loss=False",
        "chunked": "keras_mp O2 bfloat16 (chunked by rule)",
    }
    results = {}
    for config in args.configs:
        row = {}
        if args.memory:
            held, largest = memory(config, args.batch, args.tokens)
            row["MiB"] = held / 2**20
            row["largest"] = largest
        if args.time:
            row["s"] = step_time(config, args.batch, args.tokens, args.steps)
        results[config] = row
        shown = ", ".join(
            f"{k} {v:,.3g}" if isinstance(v, float) else f"{k} {v:,}" for k, v in row.items()
        )
        print(f"{names[config]}: {shown}", flush=True)
    if "keras" in results and "chunked" in results:
        base, ours = results["keras"], results["chunked"]
        for key in ("MiB", "s"):
            if key in base:
                print(f"chunked / Keras {key}: {ours[key] / base[key]:.3f}")


if __name__ == "__main__":
    main()
