"""KerasHub's own layers and forms at a level: a model built in bfloat16 or
quantized to int8, Llama's attention (its fused `dot_product_attention`),
Mixtral's router."""

import keras
import numpy as np
import pytest

import keras_mp
from tests.zoo import families
from tests.zoo import runs
from tests.zoo.runs import JAX
from tests.zoo.runs import np64

pytestmark = pytest.mark.zoo


def _quantized_policies(model):
    return {
        layer.path: layer.dtype_policy.name
        for layer in model._flatten_layers()
        if layer.dtype_policy.quantization_mode is not None
    }


@pytest.mark.parametrize(
    "form",
    [
        # What the level decides for a model built in bfloat16 is the same
        # Keras code on every backend.
        pytest.param("dtype_argument", marks=pytest.mark.one_backend),
        # The quantized layers' step: PyTorch's, and TensorFlow's graph
        # (JAX's takes 30 s to quantize and compile on a CPU, CI's time).
        pytest.param(
            "int8", marks=pytest.mark.skipif(JAX, reason="CI time: compiled on TensorFlow")
        ),
    ],
)
def test_keras_hub_model_with_its_own_dtype_trains_at_a_level(form):
    """A KerasHub model built in bfloat16 (what `from_preset(..., dtype=)`
    does) or quantized to int8, then compiled with `amp_level="O2"`: the level
    decides the float layers (float32 variables, float16 compute), quantized
    layers keep their policy, and the model trains."""
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    model, x, y, loss = families.bert(dtype="bfloat16" if form == "dtype_argument" else None)
    if form == "int8":
        model.backbone.quantize("int8")
        assert _quantized_policies(model)
    else:
        assert {v.dtype for v in model.trainable_variables} == {"bfloat16"}
    quantized = _quantized_policies(model)
    reference = np64(model(x, training=False))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, amp_level="O2")
    assert _quantized_policies(model) == quantized
    assert {v.dtype for v in model.trainable_variables} == {"float32"}
    out = model(x, training=False)
    assert keras.backend.standardize_dtype(out.dtype) == "float32"
    np.testing.assert_allclose(np64(out), reference, atol=0.1 * (1 + np.abs(reference).max()))
    before = [np64(v) for v in model.trainable_variables]
    history = model.fit(x, y, batch_size=runs.batch(x), epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["skipped_steps"][-1] <= 1
    after = [np64(v) for v in model.trainable_variables]
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))


@pytest.mark.skipif(
    runs.BACKEND == "tensorflow", reason="backend-independent but on JAX's CPU: PyTorch's"
)
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_keras_hub_llama_attention_in_float16(level):
    """KerasHub's own attention layers (here `LlamaAttention`) call
    `ops.dot_product_attention`: on JAX's CPU, which has no float16 x
    float16 -> float32 matmul, they compute in float32 (Keras's own
    `mixed_float16` fails there); elsewhere in float16."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=families.VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
    )
    ids, padding = families._tokens(np.random.default_rng(0))
    x = {"token_ids": ids, "padding_mask": padding}
    keras_mp.apply_amp(backbone, level, "float16")
    jax_cpu = JAX and __import__("jax").default_backend() == "cpu"
    rows = {r["class"]: r for r in keras_mp.precision_summary(backbone).rows}
    assert rows["LlamaAttention"]["compute_dtype"] == ("float32" if jax_cpu else "float16")
    assert rows["EinsumDense"]["compute_dtype"] == "float16"  # its projections
    assert np.isfinite(np64(backbone.predict(x, batch_size=len(ids), verbose=0))).all()


@pytest.mark.one_backend
@pytest.mark.parametrize("level, half", [("O1", "float16"), ("O2", "float16"), ("O3", "bfloat16")])
def test_keras_hub_mixtral_routes_in_float32(level, half):
    """The router's projection and the routing (softmax, top-k, weights,
    load-balancing loss) in float32; the experts and attention as the level
    says. On TensorFlow, Keras's own mixed policies cannot train it: the
    load-balancing loss multiplies half weights by a float32 mask (the zoo
    trains it there, `test_levels.TRAINED`)."""
    model, x, y, loss = runs.model("mixtral")
    keras_mp.apply_amp(model, level, half)
    rows = {r["class"]: r for r in keras_mp.precision_summary(model).rows}
    assert rows["MixtralSparseMoeBlock"]["compute_dtype"] == "float32"
    router = next(r for r in rows.values() if r["rule"].endswith("expert router, float32"))
    assert router["layer"].endswith("sparse_feedforward_gate_dense")
    experts = half if level != "O1" else "float32"  # O1: only the allow-list
    assert rows["MixtralMoeExperts"]["compute_dtype"] == experts
    # With a router allowed into half, the user's word wins.
    keras_mp.apply_amp(model, level, half, allow=["sparse_feedforward_gate_dense"])
    assert "router" not in runs.rule(model, "Dense")
