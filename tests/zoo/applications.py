"""Tiny configurations of keras.applications' CNNs: the same layer classes
and blocks as the full-size models (Keras's own builders), at a few stages
and a fraction of the width, 32x32 images, random weights."""

import keras
import numpy as np

BATCH = 8  # families.BATCH


def _rng():
    return np.random.default_rng(0)


def _application(constructor, **kwargs):
    rng = _rng()
    model = constructor(weights=None, input_shape=(32, 32, 3), classes=3, **kwargs)
    x = rng.uniform(0, 255, size=(BATCH, 32, 32, 3)).astype("float32")
    return model, x, rng.integers(0, 3, BATCH), "sparse_categorical_crossentropy"


def resnet50():
    """ResNet50's bottleneck blocks (Conv-BN-ReLU, projection shortcuts) in
    two stages of one block at a quarter width: Keras's own ResNet builder."""
    from keras.src.applications.resnet import ResNet
    from keras.src.applications.resnet import stack_residual_blocks_v1

    def stacks(x):
        x = stack_residual_blocks_v1(x, 16, 1, stride1=1, name="conv2")
        return stack_residual_blocks_v1(x, 32, 1, name="conv3")

    return _application(ResNet, stack_fn=stacks, preact=False, use_bias=True, name="resnet50")


def mobilenet_v2():
    """MobileNetV2's layers (inverted residual blocks: pointwise expansion,
    depthwise convolution, ReLU6, BatchNorm, a residual add) in its first
    three blocks at alpha 0.35, with its head: Keras's own block builder, as
    MobileNetV2 is. The full model's 17 blocks cost XLA's CPU 35-150 s a cell
    to compile and run (its depthwise convolutions in bfloat16) for the same
    layers. Inputs in [-1, 1], as its `preprocess_input` gives them."""
    from keras.src.applications.mobilenet_v2 import _inverted_res_block

    rng = _rng()
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(16, 3, strides=2, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization(epsilon=1e-3)(x))
    for block, (filters, stride, expansion) in enumerate([(16, 1, 1), (24, 2, 6), (24, 1, 6)]):
        x = _inverted_res_block(x, expansion, stride, 0.35, filters, block_id=block)
    x = keras.layers.Conv2D(128, 1, use_bias=False)(x)
    x = keras.layers.ReLU(6.0)(keras.layers.BatchNormalization(epsilon=1e-3)(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3, activation="softmax", name="predictions")(x)
    x = rng.uniform(-1, 1, size=(BATCH, 32, 32, 3)).astype("float32")
    model = keras.Model(inputs, outputs, name="mobilenet_v2")
    return model, x, rng.integers(0, 3, BATCH), "sparse_categorical_crossentropy"


def efficientnet():
    """EfficientNetB0's layers (Rescaling and Normalization preprocessing,
    squeeze-excite gates, drop-connect residuals) in its first three stages
    at a quarter of the width: Keras's own builder, as EfficientNetB0 is."""
    from keras.src.applications.efficientnet import DEFAULT_BLOCKS_ARGS
    from keras.src.applications.efficientnet import EfficientNet

    return _application(
        EfficientNet,
        width_coefficient=0.25,
        depth_coefficient=1.0,
        default_size=32,
        blocks_args=DEFAULT_BLOCKS_ARGS[:3],
        name="efficientnet",
    )


def convnext():
    """ConvNeXtTiny's layers (LayerNorm, layer scale, a Normalization
    preprocessing layer) at a small depth and width: ConvNeXtTiny itself has
    28M parameters whatever the input size. Built by Keras's own builder."""
    from keras.src.applications.convnext import ConvNeXt

    return _application(
        ConvNeXt, depths=[1, 1, 2, 1], projection_dims=[16, 32, 64, 128], name="convnext"
    )
