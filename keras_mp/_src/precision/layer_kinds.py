"""What kind of layer a layer is: the lists and tests the precision rules use.

Each test takes a layer (and, for a router, the layer that calls it) and
answers from its class: `isinstance` on Keras's classes and on the library
classes a rule names (`of_library_class`), and the naming conventions that
KerasHub's and users' layers follow (`...Norm`, `...Attention`,
`...MoeBlock`, `...Router`). The table that reads them is `rules.py`.
"""

import importlib
import sys
import warnings

import keras

from keras_mp._src.precision import layer_tree

L = keras.layers


def _keras_layers(*names):
    """The Keras layer classes of these names this Keras has."""
    return tuple(getattr(L, name) for name in names if hasattr(L, name))


# O1 computes in half on these only: matrix multiplications and convolutions,
# where half precision pays and is numerically safe (Apex's and MindSpore's
# O1 white lists). Recurrent layers go with their cells.
ALLOW_LIST = _keras_layers(
    "Dense",
    "EinsumDense",
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "Conv1DTranspose",
    "Conv2DTranspose",
    "Conv3DTranspose",
    "DepthwiseConv1D",
    "DepthwiseConv2D",
    "SeparableConv1D",
    "SeparableConv2D",
    "MultiHeadAttention",
    "GroupedQueryAttention",
    "RNN",
    "SimpleRNNCell",
    "LSTMCell",
    "GRUCell",
    "ConvLSTM1D",
    "ConvLSTM2D",
    "ConvLSTM3D",
)

# O2 computes in half everywhere except on these: reductions over many values
# (normalisations) and exponentials (softmax), where float16's range and
# precision lose accuracy. Also every class named `...Norm(alization)`
# (`is_normalization`). A model's output layers compute as their level says
# and return float32; probabilities are computed in float32
# (`PROBABILITY_ACTIVATIONS`).
DENY_LIST = _keras_layers(
    "BatchNormalization",
    "LayerNormalization",
    "GroupNormalization",
    "UnitNormalization",
    "RMSNormalization",
    "SpectralNormalization",
    "Softmax",
)

# Keras's categorical and text preprocessing layers: their outputs are
# indices, one-hot vectors, counts and bins, exact in float32. In half, hash
# bins and vocabulary indices above 2048 (float16) or 256 (bfloat16) round
# to their neighbours', bin boundaries move, and TensorFlow's bincount has
# no half kernel. Keras pins most of them to `floatx()` under any global
# policy; keras_mp keeps them in float32 at every level.
EXACT_PREPROCESSING = _keras_layers(
    "CategoryEncoding",
    "Discretization",
    "HashedCrossing",
    "Hashing",
    "IntegerLookup",
    "StringLookup",
    "TextVectorization",
) + ((keras.utils.FeatureSpace,) if hasattr(keras.utils, "FeatureSpace") else ())

# Keras's attention layers call `ops.dot_product_attention`, which on JAX
# asks for float16 x float16 -> float32 logits: XLA's CPU backend has no
# such dot_general ("F16_F16_F32"). On JAX's CPU they compute in float32 at
# float16 levels; their projections (EinsumDense sublayers) stay half.
FUSED_ATTENTION = _keras_layers("MultiHeadAttention", "GroupedQueryAttention")

_WARNED = {"jax_cpu_attention": False}


def warn_jax_cpu_attention_once(layer):
    if _WARNED["jax_cpu_attention"]:
        return
    _WARNED["jax_cpu_attention"] = True
    warnings.warn(
        "keras_mp: JAX's CPU backend has no float16 x float16 -> float32 "
        "matmul, which Keras's dot_product_attention needs; attention layers "
        "(MultiHeadAttention, GroupedQueryAttention, KerasHub's) compute in "
        "float32 here, their projections in float16. On a GPU they compute "
        "in float16.",
        stacklevel=5,
    )


# Packages whose composite layers are written for Keras's mixed policies (they
# run under them in production): at O2 they compute in half. A layer defined
# anywhere else that contains other layers computes its own arithmetic in
# float32 at O2 in float16 (`runs_unknown_arithmetic`).
MIXED_PRECISION_AWARE_PACKAGES = ("keras", "keras_hub", "keras_nlp", "keras_cv", "keras_rs")


# -- classes and kinds ----------------------------------------------------------


# Activations whose outputs are probabilities or their logarithms: in half,
# softmax's small probabilities and sigmoid's near 0 and 1 round to 0 and 1
# before the loss takes their log. They run in float32 wherever they sit
# (`probabilities.py`), as under torch.autocast.
PROBABILITY_ACTIVATIONS = ("softmax", "log_softmax", "sigmoid")
# Activations whose outputs are bounded whatever their inputs: an output
# layer ending in one cannot overflow float16.
BOUNDED_ACTIVATIONS = (
    "softmax",
    "sigmoid",
    "tanh",
    "hard_sigmoid",
    "softsign",
    "hard_tanh",
    "sparse_sigmoid",
    "sparsemax",
)

# Layers that only move values (no arithmetic): they pass on the dtype they
# receive, so that a float32 probability on its way to an output stays
# float32 and a half activation stays half (`probabilities.py`).
DATA_MOVEMENT = _keras_layers(
    "Reshape",
    "Flatten",
    "Permute",
    "RepeatVector",
    "Cropping1D",
    "Cropping2D",
    "Cropping3D",
    "Identity",
)


def bounded_activation(layer):
    """The name of a bounded activation `layer` applies itself, or None."""
    name = getattr(getattr(layer, "activation", None), "__name__", None)
    return name if name in BOUNDED_ACTIVATIONS else None


def probability_activation(layer):
    """The name of the probability activation `layer` applies itself (a
    `Dense(10, activation="softmax")`, an `Activation("sigmoid")`), or None."""
    name = getattr(getattr(layer, "activation", None), "__name__", None)
    return name if name in PROBABILITY_ACTIVATIONS else None


def computes_probabilities(layer):
    """A layer that is nothing but a probability activation (`Softmax`, an
    `Activation` of softmax, log_softmax or sigmoid): no matmul to gain."""
    if isinstance(layer, L.Softmax):
        return True
    return isinstance(layer, L.Activation) and probability_activation(layer) is not None


def of_class(*classes):
    """A test: the layer is an instance of one of `classes` (subclasses too)."""

    def condition(layer):
        return isinstance(layer, classes)

    condition.__name__ = f"of_class({', '.join(c.__name__ for c in classes)})"
    return condition


def of_library_class(*paths):
    """A test: the layer is an instance of a library's class, given by its import
    path (`"keras_hub.src.models.t5.t5_multi_head_attention.T5MultiHeadAttention"`).

    The class is imported only once its package is: a model cannot hold a
    KerasHub layer before `keras_hub` is imported, and keras_mp does not
    import KerasHub (nor need it installed) for the others. A path that
    this version of the library lacks matches nothing.
    """
    resolved = {}

    def classes():
        for path in paths:
            if path in resolved or path.split(".", 1)[0] not in sys.modules:
                continue
            module, name = path.rsplit(".", 1)
            try:
                resolved[path] = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                resolved[path] = None
        return tuple(c for c in resolved.values() if c is not None)

    def condition(layer):
        return isinstance(layer, classes())

    condition.__name__ = f"of_library_class({', '.join(p.rsplit('.', 1)[1] for p in paths)})"
    return condition


def matches(layer, entries):
    """Whether `layer` is one of `allow`/`deny`'s entries: a class it is an
    instance of, its name, or the layer itself."""
    for entry in entries:
        if isinstance(entry, str):
            if layer.name == entry:
                return True
        elif isinstance(entry, keras.layers.Layer):
            if layer is entry:
                return True
        elif isinstance(layer, entry):
            return True
    return False


def from_aware_package(layer):
    """Whether `layer`'s class is Keras's, KerasHub's, ... (written for
    Keras's mixed policies)."""
    return type(layer).__module__.split(".", 1)[0] in MIXED_PRECISION_AWARE_PACKAGES


def runs_users_code(layer):
    """Its `call` is the user's code: a class defined outside Keras and
    KerasHub, or a `Lambda` (its function is the user's)."""
    return not from_aware_package(layer) or isinstance(layer, keras.layers.Lambda)


def quantized(layer):
    """Its kernel is int8 or float8: a float policy would change what it computes."""
    return layer.dtype_policy.quantization_mode is not None


def computes_no_float(layer):
    """It computes in a dtype that is not a float (Hashing's int64 bins,
    StringLookup's strings, a user's `dtype="int32"`)."""
    return not keras.backend.is_float_dtype(keras.backend.standardize_dtype(layer.compute_dtype))


def is_normalization(layer):
    """A normalisation layer: Keras's, or a class named `...Norm(alization)`.

    KerasHub's models bring their own (Gemma's `RMSNormalization`, T5's
    `T5LayerNorm`, ...), and users theirs; the name is the convention they
    all follow.
    """
    return any(cls.__name__.endswith(("Norm", "Normalization")) for cls in type(layer).__mro__)


def is_attention(layer):
    """Keras's attention layers, and those of KerasHub (`LlamaAttention`,
    ...), whose own `call` computes the attention (most of them through
    `ops.dot_product_attention`)."""
    return isinstance(layer, FUSED_ATTENTION) or (
        type(layer).__name__.endswith("Attention") and from_aware_package(layer)
    )


def routes_experts(layer):
    """A mixture-of-experts block: KerasHub's `...SparseMoeBlock`, `...MoEBlock`.

    Its own `call` routes: router softmax, top-k, the routing weights and the
    load-balancing loss. Routing in half is unstable (Switch Transformer's
    "selective precision" keeps the router in float32), and KerasHub's
    load-balancing loss multiplies the half routing weights by a float32
    padding mask, which TensorFlow refuses (Keras's own mixed policies fail
    there). The experts, its sublayers, compute in half as the level says;
    the router's projection in float32 (`is_router`).
    """
    return type(layer).__name__.endswith(("MoeBlock", "MoEBlock"))


def is_router(layer, parent):
    """A mixture-of-experts router: a `...Router` layer, or the projection of
    an expert block to one logit per expert.

    In half, near ties between experts' logits round to the same value and
    top-k picks another expert: the output jumps. The projection is tiny
    (hidden size x experts); Switch Transformer computes it in float32.
    """
    if type(layer).__name__.endswith("Router"):
        return True
    experts = getattr(parent, "num_experts", None)
    return (
        experts is not None
        and routes_experts(parent)
        and isinstance(layer, L.Dense)
        and layer.units == experts
    )


def runs_unknown_arithmetic(layer):
    """Whether `layer`'s own `call` is code keras_mp knows nothing of.

    True for a layer with sublayers whose class is defined outside Keras and
    KerasHub (a user's attention block or subclassed model). Its own
    arithmetic may hold constants outside float16's range: the tutorial's
    attention mask `logits += mask * -1e9` is `0 * -inf = nan` in float16.
    """
    if layer_tree.is_graph(layer) or from_aware_package(layer):
        return False
    return layer_tree.has_sublayers(layer)


_HUB = "keras_hub.src.models."
# Library layers whose own `call` computes what float16 cannot hold (NaN
# under Keras's `mixed_float16`). Their sublayers (projections, MLPs) still
# compute in half; their own arithmetic in float32.
#
# `-1e9` is `-inf` in float16, and `0 * -inf` is NaN. T5's attention builds
# its mask itself; T5Gemma's and T5Gemma2's encoder and decoder layers build
# theirs (`(1 - mask) * -1e9` in the hidden states' dtype), which their
# attention layers add to the logits: a padded query past the sliding window
# then has only `-inf` logits, and its softmax is NaN, which the values'
# matmul spreads to every position.
MASKS_WITH_1E9 = of_library_class(
    _HUB + "t5.t5_multi_head_attention.T5MultiHeadAttention",
    _HUB + "t5gemma.t5gemma_encoder.T5GemmaEncoderLayer",
    _HUB + "t5gemma.t5gemma_decoder.T5GemmaDecoderLayer",
    _HUB + "t5gemma.t5gemma_attention.T5GemmaAttention",
    _HUB + "t5gemma2.t5gemma2_encoder.T5Gemma2EncoderLayer",
    _HUB + "t5gemma2.t5gemma2_decoder.T5Gemma2DecoderLayer",
    _HUB + "t5gemma2.t5gemma2_attention.T5Gemma2Attention",
    _HUB + "t5gemma2.t5gemma2_attention.T5Gemma2MergedAttention",
)
# RWKV-7's time mix normalizes its keys with `rsqrt(sum(k**2) + 1e-12)`:
# 1e-12 is 0 in float16, and a padded token's keys (zeroed) give `0 * inf`.
EPS_1E12 = of_library_class(_HUB + "rwkv7.rwkv7_layer.RWKV7TimeMix")
# Qwen3.5's gated delta net L2-normalizes its queries and keys,
# `x * rsqrt(sum(x**2) + 1e-6)`, before its float32 recurrence: for a short
# key the gradient of rsqrt (`-rsqrt(s)**3 / 2`, up to 5e8) is inf in
# float16, and every step overflows whatever the loss scale.
OWN_L2_NORM = of_library_class(_HUB + "qwen3_5.qwen3_5_gated_delta_net.Qwen3_5GatedDeltaNet")
