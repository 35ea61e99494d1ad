"""Tiny configurations of the model families Keras users train.

Random weights, random data, no downloads: each builder returns
`(model, x, y, loss)` for a model small enough to build and train a few
steps in seconds on a CPU, with the same layer classes and the same code
paths (masks, residuals, gates, BatchNorm, preprocessing layers) as the
full-size model. The keras.applications CNNs are built in `applications.py`.
"""

import functools

import keras
import keras_hub
import numpy as np

from tests.zoo.applications import convnext
from tests.zoo.applications import efficientnet
from tests.zoo.applications import mobilenet_v2
from tests.zoo.applications import resnet50

VOCAB = 100
SEQ = 12
BATCH = 8


def _logits_loss():
    """KerasHub's tasks output logits (their own `compile` default)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _rng():
    return np.random.default_rng(0)


def _tokens(rng, vocabulary=VOCAB, seq=SEQ):
    ids = rng.integers(1, vocabulary, size=(BATCH, seq)).astype("int32")
    padding = np.ones((BATCH, seq), "int32")
    padding[:, -3:] = 0  # padded tail, masked in attention
    ids[padding == 0] = 0
    return ids, padding


def bert(dtype=None, vocabulary=VOCAB, seq=SEQ, hidden_dim=16, intermediate_dim=32):
    """`dtype` as `from_preset(..., dtype=...)` passes it to the backbone."""
    rng = _rng()
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary,
        num_layers=2,
        num_heads=2,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
        max_sequence_length=16,
        dtype=dtype,
    )
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None)
    ids, padding = _tokens(rng, vocabulary, seq)
    x = {"token_ids": ids, "padding_mask": padding, "segment_ids": np.zeros_like(ids)}
    return model, x, rng.integers(0, 3, BATCH), _logits_loss()


def _causal_lm(rng, model, vocabulary=VOCAB, seq=SEQ):
    """A causal LM task with its batch: token ids, padding mask, next tokens."""
    ids, padding = _tokens(rng, vocabulary, seq)
    x = {"token_ids": ids, "padding_mask": padding}
    return model, x, rng.integers(0, vocabulary, (BATCH, seq)), _logits_loss()


def gpt2(vocabulary=VOCAB, seq=SEQ, hidden_dim=16, intermediate_dim=32):
    rng = _rng()
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary,
        num_layers=2,
        num_heads=2,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
        max_sequence_length=16,
    )
    model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
    return _causal_lm(rng, model, vocabulary, seq)


def gemma(
    num_key_value_heads=1,
    vocabulary=VOCAB,
    seq=SEQ,
    hidden_dim=16,
    intermediate_dim=32,
    head_dim=8,
):
    rng = _rng()
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=vocabulary,
        num_layers=2,
        num_query_heads=2,
        num_key_value_heads=num_key_value_heads,
        hidden_dim=hidden_dim,
        intermediate_dim=intermediate_dim,
        head_dim=head_dim,
    )
    model = keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)
    return _causal_lm(rng, model, vocabulary, seq)


def mixtral():
    """KerasHub's Mixtral: a sparse mixture of experts (router, top-2 of 4
    experts, load-balancing loss) behind grouped-query attention."""
    rng = _rng()
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
        num_experts=4,
        top_k=2,
    )
    return _causal_lm(rng, keras_hub.models.MixtralCausalLM(backbone, preprocessor=None))


def t5():
    """KerasHub's T5 encoder-decoder: relative attention bias, T5's RMS norm,
    gated feed-forward, cross-attention; a sequence-to-sequence LM head."""
    rng = _rng()
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=VOCAB,
        num_layers=1,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        key_value_dim=8,
        dropout=0.0,
    )
    model = keras_hub.models.T5Seq2SeqLM(backbone, preprocessor=None)
    ids, padding = _tokens(rng)
    x = {
        "encoder_token_ids": ids,
        "encoder_padding_mask": padding,
        "decoder_token_ids": ids,
        "decoder_padding_mask": padding,
    }
    return model, x, rng.integers(0, VOCAB, (BATCH, SEQ)), _logits_loss()


def _t5gemma(backbone_class, task_class, **kwargs):
    rng = _rng()
    common = dict(num_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    common = dict(hidden_dim=16, intermediate_dim=32, **common)
    layer_types = ["full_attention", "sliding_attention"]
    backbone = backbone_class(
        vocabulary_size=VOCAB,
        **{f"encoder_{k}": v for k, v in common.items()},
        encoder_layer_types=layer_types,
        **{f"decoder_{k}": v for k, v in common.items()},
        decoder_layer_types=layer_types,
        sliding_window=2,
        cross_attention_hidden_size=16,
        **kwargs,
    )
    model = task_class(backbone, preprocessor=None)
    ids, padding = _tokens(rng)
    x = {
        "encoder_token_ids": ids,
        "encoder_padding_mask": padding,
        "decoder_token_ids": ids,
        "decoder_padding_mask": padding,
    }
    return model, x, rng.integers(0, VOCAB, (BATCH, SEQ)), _logits_loss()


def t5gemma():
    """KerasHub's T5Gemma encoder-decoder (Gemma layers, full and sliding
    attention, cross-attention): its encoder and decoder layers build their
    attention masks with `-1e9` in their compute dtype. The sliding window
    (2) is shorter than the padding (3): a padded query's keys are all
    masked. Outside FAMILIES' level matrix: `test_zoo`'s T5Gemma test
    trains it at O1, O2 and O3 in bfloat16."""
    return _t5gemma(keras_hub.models.T5GemmaBackbone, keras_hub.models.T5GemmaSeq2SeqLM)


def t5gemma2():
    """KerasHub's T5Gemma2 (Gemma 3 layers, merged self- and cross-attention
    in the decoder, a bidirectional sliding window in the encoder), text only."""
    return _t5gemma(
        keras_hub.models.T5Gemma2Backbone,
        keras_hub.models.T5Gemma2Seq2SeqLM,
        eoi_token_index=VOCAB - 1,
    )


def qwen3_5():
    """KerasHub's Qwen3.5 causal LM: a gated delta net layer (linear
    attention with a causal convolution and a chunked recurrence, whose
    63-step loop per layer is most of its ops) and a full attention layer,
    at a few heads of 8 (its defaults are 16 and 32 of 128)."""
    rng = _rng()
    backbone = keras_hub.models.Qwen3_5Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_query_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        hidden_dim=16,
        intermediate_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    return _causal_lm(rng, keras_hub.models.Qwen3_5CausalLM(backbone, preprocessor=None))


def rwkv7():
    """KerasHub's RWKV-7 causal LM (time mix with its recurrent state,
    channel mix); the padded tail's tokens are zeroed in the time mix."""
    rng = _rng()
    backbone = keras_hub.models.RWKV7Backbone(
        hidden_size=16,
        head_size=8,
        num_layers=2,
        vocabulary_size=VOCAB,
        intermediate_dim=32,
        gate_lora=8,
        mv_lora=8,
        aaa_lora=8,
        decay_lora=8,
    )
    return _causal_lm(rng, keras_hub.models.RWKV7CausalLM(backbone, preprocessor=None))


def resnet():
    """KerasHub's ResNet image classifier (BatchNorm, residual adds)."""
    rng = _rng()
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        use_pre_activation=False,
        image_shape=(32, 32, 3),
    )
    model = keras_hub.models.ResNetImageClassifier(backbone, num_classes=3, preprocessor=None)
    x = rng.normal(size=(BATCH, 32, 32, 3)).astype("float32")
    return model, x, rng.integers(0, 3, BATCH), _logits_loss()


def transformer_encoder():
    """KerasHub's encoder block without dropout: Keras's fused attention path."""
    rng = _rng()
    inputs = keras.Input((SEQ,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(VOCAB, SEQ, 16, mask_zero=True)(inputs)
    x = keras_hub.layers.TransformerEncoder(32, 2)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    ids, _ = _tokens(rng)
    return (
        keras.Model(inputs, outputs),
        ids,
        rng.integers(0, 3, BATCH),
        "sparse_categorical_crossentropy",
    )


def lstm_masked():
    """An LSTM and a GRU over `Embedding(mask_zero=True)`: the mask flows."""
    rng = _rng()
    inputs = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 16, mask_zero=True)(inputs)
    x = keras.layers.LSTM(16, return_sequences=True)(x)
    x = keras.layers.GRU(16)(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    ids, _ = _tokens(rng)
    return (
        keras.Model(inputs, outputs),
        ids,
        rng.integers(0, 3, BATCH),
        "sparse_categorical_crossentropy",
    )


@keras.saving.register_keras_serializable(package="keras_mp_zoo")
class TutorialAttention(keras.layers.Layer):
    """A user's attention block, masked as in TensorFlow's transformer tutorial.

    `logits += mask * -1e9`: in float16 `-1e9` is `-inf`, and `0 * -inf` is
    NaN (TensorFlow, JAX); a row with every key masked is all `-inf`, whose
    softmax is NaN (every backend). So this block gives NaN wherever its own
    arithmetic runs in float16.
    """

    def __init__(self, dim, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.query = keras.layers.Dense(dim)
        self.key = keras.layers.Dense(dim)
        self.value = keras.layers.Dense(dim)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x, padded):
        q, k, v = self.query(x), self.key(x), self.value(x)
        logits = keras.ops.matmul(q, keras.ops.transpose(k, (0, 2, 1))) / self.dim**0.5
        logits += keras.ops.cast(padded[:, None, :], logits.dtype) * -1e9
        weights = keras.ops.softmax(logits, axis=-1)
        return self.norm(x + keras.ops.matmul(weights, v))

    def get_config(self):
        return {**super().get_config(), "dim": self.dim}


def tutorial_attention():
    rng = _rng()
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    padded = keras.Input((SEQ,), name="padded")
    x = keras.layers.Embedding(VOCAB, 16)(tokens)
    x = TutorialAttention(16)(x, padded)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    ids, padding = _tokens(rng)
    padding[0] = 0  # an empty sequence: every logit of its rows is masked
    x = {"tokens": ids, "padded": (1 - padding).astype("float32")}
    model = keras.Model({"tokens": tokens, "padded": padded}, outputs)
    return model, x, rng.integers(0, 3, BATCH), "sparse_categorical_crossentropy"


def two_outputs():
    """A functional model with two heads, `loss_weights` and `sample_weight`."""
    rng = _rng()
    inputs = keras.Input((10,))
    h = keras.layers.Dense(32, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)
    label = keras.layers.Dense(3, activation="softmax", name="label")(h)
    value = keras.layers.Dense(1, name="value")(h)
    model = keras.Model(inputs, {"label": label, "value": value})
    x = rng.normal(size=(BATCH, 10)).astype("float32")
    y = {"label": rng.integers(0, 3, BATCH), "value": rng.normal(size=(BATCH, 1)).astype("float32")}
    loss = {"label": "sparse_categorical_crossentropy", "value": "mse"}
    return model, x, y, loss


KERAS_HUB = {
    "bert": bert,
    "gpt2": gpt2,
    "gemma": gemma,
    "t5": t5,
    "transformer_encoder": transformer_encoder,
    "resnet": resnet,
    "mixtral": mixtral,
}
# FP8-aligned configurations (every GEMM dimension a multiple of 16), for
# `amp_dtype="float8"`: the families above have 8-wide heads.
_FP8_SIZES = dict(vocabulary=128, seq=16, hidden_dim=32, intermediate_dim=64)


def fp8_mlp():
    """The digits MLP's shape, 64-64-64-64-10: two layers between the first
    and the output one in FP8."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(64, activation="relu") for _ in range(3)]
    model = keras.Sequential([keras.Input((64,)), *layers, keras.layers.Dense(10)])
    x = _rng().normal(size=(32, 64)).astype("float32")
    return model, x, np.zeros(32, "int32"), _logits_loss()


APPLICATIONS = {
    "resnet50": resnet50,
    "mobilenet_v2": mobilenet_v2,
    "efficientnet": efficientnet,
    "convnext": convnext,
}
OTHERS = {
    "lstm_masked": lstm_masked,
    "tutorial_attention": tutorial_attention,
    "two_outputs": two_outputs,
}
FAMILIES = {**KERAS_HUB, **APPLICATIONS, **OTHERS}
FP8 = {
    "gemma": functools.partial(gemma, head_dim=16, **_FP8_SIZES),
    "gpt2": functools.partial(gpt2, **_FP8_SIZES),
    "bert": functools.partial(bert, **_FP8_SIZES),
}
