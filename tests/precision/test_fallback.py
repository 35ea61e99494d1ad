"""Layers of your own that cannot compute in half (`fallback.py`): keras-io's
VAE samples `z_mean + exp(0.5 * z_log_var) * keras.random.normal(...)`, a
float32 draw beside half inputs, which TensorFlow refuses (under Keras's
own mixed policies too). Found at the first call, kept in float32, named
once."""

import functools
import warnings

import keras
import numpy as np
import pytest

import keras_mp
from tests import keras_io

BACKEND = keras.backend.backend()


def _fit(model, x, y=None, epochs=2):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, epochs=epochs, batch_size=64, verbose=0)
    return history.history["loss"], [str(w.message) for w in caught]


def _row(model, name):
    rows = keras_mp.precision_summary(model).rows
    found = [r for r in rows if r["layer"].split("/")[-1] == name]
    assert len(found) == 1, [r["layer"] for r in rows]
    return found[0]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="keras-io's VAE steps with tf.GradientTape")
@pytest.mark.parametrize(
    "level, dtype", [("O1", "float16"), ("O2", "float16"), ("O2", "bfloat16"), ("O3", "bfloat16")]
)
def test_keras_io_vae_trains_as_written(level, dtype):
    """Before: the first step died in Sampling's `Mul` (float16 x float32),
    at O2 and O3, in float16 and bfloat16. The encoder's outputs (z_mean,
    z_log_var and Sampling's z), which the VAE's own `train_step` computes
    its losses from, are float32 now, as a model's outputs are. z_mean and
    z_log_var, which Sampling takes in too, compute in bfloat16; in float16
    they compute in float32, as outputs a loss keras_mp does not know reads
    (the VAE's own step: its KL term takes `exp(z_log_var)`)."""
    x, _ = keras_io.digits()
    reference = _vae_o0_losses()
    model = _compiled(keras_io.vae(scaled=True), level, dtype)
    losses, told = _fit(model, x)
    assert not [t for t in told if "keras_mp" in t], told
    assert _row(model, "sampling")["compute_dtype"] == "float32"
    # z_mean and z_log_var feed Sampling and leave the encoder in float32,
    # as a feature extractor's outputs do.
    assert _row(model, "encoder_hidden")["compute_dtype"] == dtype
    for name in ("z_mean", "z_log_var"):
        row = _row(model, name)
        if dtype == "float16":
            assert row["compute_dtype"] == "float32", name
            assert "no loss keras_mp knows" in row["rule"], row
        else:
            assert row["compute_dtype"] == dtype, name
    for output in model.encoder(x[:4]):
        assert keras.backend.standardize_dtype(output.dtype) == "float32"
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, reference, rtol=0.1)  # a frozen VAE stays at 44


@functools.lru_cache(maxsize=None)
def _vae_o0_losses():
    """The float32 VAE's losses every level is compared with (one per process)."""
    return tuple(_fit(_compiled(keras_io.vae(), "O0", "float16"), keras_io.digits()[0])[0])


def _compiled(model, level, dtype):
    keras_mp.apply_amp(model, level, dtype)
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    return model


def _compiled_classifier(model, **amp):
    """`model` compiled for the digits' 10 classes (logits), with `amp`'s
    `amp_level`/`amp_dtype` (none: float32)."""
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **amp,
    )
    return model


def _sampling_classifier():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((8, 8, 1))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(inputs))
    z = keras_io.Sampling(name="sampling")(
        [keras.layers.Dense(4)(hidden), keras.layers.Dense(4)(hidden)]
    )
    return keras.Model(inputs, keras.layers.Dense(10)(z))


@pytest.mark.parametrize("level, dtype", [("O2", "float16"), ("O3", "bfloat16")])
def test_a_sampling_layer_in_a_functional_model_trains_on_every_backend(level, dtype):
    """The VAE's Sampling layer inside a model that Keras's own step trains:
    on TensorFlow it falls back to float32 at its first call, named once,
    with its reason in `precision_summary`. JAX and PyTorch promote float16
    x float32 to float32 rather than refuse it: nothing falls back there,
    and it trains all the same."""
    x, y = keras_io.digits()
    model = _compiled_classifier(_sampling_classifier(), amp_level=level, amp_dtype=dtype)
    losses, told = _fit(model, x, y, epochs=3)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0]
    falls_back = BACKEND == "tensorflow"
    named = [t for t in told if "'sampling' (Sampling) cannot compute in" in t]
    assert len(named) == (1 if falls_back else 0), told
    row = _row(model, "sampling")
    assert (row["compute_dtype"] == "float32") == falls_back
    if falls_back:
        assert "deny=[Sampling]" in named[0] and "mixes" in row["rule"]


class _NoHalfKernel(keras.layers.Layer):
    """A layer whose own code refuses half inputs, and float32 ones too."""

    def call(self, x):
        raise TypeError(f"no float16 kernel here for {keras.backend.standardize_dtype(x.dtype)}")

    def compute_output_shape(self, shape):
        return shape


class _Broken(keras.layers.Layer):
    def call(self, x):
        raise ValueError("a bug of its own")

    def compute_output_shape(self, shape):
        return shape


def test_a_layer_that_fails_in_float32_too_is_named_with_the_fix():
    model = keras.Sequential([keras.Input((4,)), _NoHalfKernel(name="nk"), keras.layers.Dense(4)])
    keras_mp.apply_amp(model, "O3", "bfloat16")
    with pytest.raises(TypeError, match=r"layer 'nk' \(_NoHalfKernel\).*deny=\[_NoHalfKernel\]"):
        model(np.ones((2, 4), "float32"))


def test_other_errors_pass_through_untouched():
    model = keras.Sequential([keras.Input((4,)), _Broken(name="b"), keras.layers.Dense(4)])
    keras_mp.apply_amp(model, "O2", "bfloat16")
    with pytest.raises(ValueError, match="a bug of its own") as raised:
        model(np.ones((2, 4), "float32"))
    assert "keras_mp" not in str(raised.value)


def test_deny_keeps_such_a_layer_float32_from_the_start():
    model = _sampling_classifier()
    keras_mp.apply_amp(model, "O2", "bfloat16", deny=[keras_io.Sampling])
    row = _row(model, "sampling")
    assert row["compute_dtype"] == "float32" and "deny=" in row["rule"]


class _NoHalfGradient(keras.layers.Dense):
    """A Dense whose backward has no half kernel here, as PyTorch's CPU
    convolution backward has been for float16 (`slow_conv2d: grad_weight
    must be contiguous`): its forward works, its backward raises."""

    def call(self, x):
        import torch

        class Backward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, y):
                ctx.half = y.dtype in (torch.float16, torch.bfloat16)
                return y.clone()

            @staticmethod
            def backward(ctx, grad):
                if ctx.half:
                    raise RuntimeError("slow_conv2d: grad_weight must be contiguous")
                return grad

        return Backward.apply(super().call(x))


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's eager step can be run again")
@pytest.mark.parametrize("level, dtype", [("O2", "float16"), ("O3", "bfloat16")])
def test_a_layer_without_a_half_gradient_kernel_falls_back_at_the_first_step(level, dtype):
    """The failure comes in `backward()`, after every call returned, naming no
    layer: the layers that fail alone in half are found, kept in float32,
    named once, and the step runs again; training goes on as in float32."""
    x, y = keras_io.digits()

    def model():
        keras.utils.set_random_seed(5)
        return keras.Sequential(
            [
                keras.Input((8, 8, 1)),
                keras.layers.Flatten(),
                _NoHalfGradient(16, activation="relu", name="no_half_grad"),
                keras.layers.Dense(10),
            ]
        )

    want, _ = _fit(_compiled_classifier(model()), x, y)
    half = _compiled_classifier(model(), amp_level=level, amp_dtype=dtype)
    losses, told = _fit(half, x, y)
    named = [t for t in told if "'no_half_grad' (_NoHalfGradient) fails in" in t]
    assert len(named) == 1 and "deny=[_NoHalfGradient]" in named[0], told
    row = _row(half, "no_half_grad")
    assert row["compute_dtype"] == "float32" and "grad_weight must be contiguous" in row["rule"]
    np.testing.assert_allclose(losses, want, rtol=0.05)
    assert losses[-1] < losses[0]


def _fit_a_step_raising(error):
    """`fit` at O2 of a model whose own `train_step` raises `error`."""

    class Broken(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            raise error

    model = Broken()
    model.compile(optimizer="sgd", loss="mse", amp_level="O2")
    model.fit(np.ones((4, 3), "float32"), np.ones((4, 2), "float32"), verbose=0)


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's eager step can be run again")
def test_a_step_that_fails_for_another_reason_keeps_its_own_error():
    with pytest.raises(ValueError, match="a bug of the step's own"):
        _fit_a_step_raising(ValueError("a bug of the step's own"))


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's eager step can be run again")
def test_a_device_error_is_raised_as_it_is():
    """Tensors on a GPU and on the CPU (a keras-io GAN's `train_step` on an
    H100): no layer is probed in half, nor is half precision named."""
    device_error = RuntimeError(
        "Expected all tensors to be on the same device, but found at least two "
        "devices, cuda:0 and cpu!"
    )
    with pytest.raises(RuntimeError, match="same device") as raised:
        _fit_a_step_raising(device_error)
    assert not any("keras_mp" in note for note in getattr(raised.value, "__notes__", []))
