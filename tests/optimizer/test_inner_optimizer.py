"""The optimizer inside: one wrapper per inner optimizer, its settings set
where they belong, and every optimizer feature at every level, with float32
and half variables.

At O3 a model holds half variables beside float32 ones (BatchNorm with
`keep_batchnorm_fp32`, the output layer). Keras's optimizers assume one
gradient dtype in their clipping; keras_mp clips in float32. Each cell trains
a few steps with one optimizer configuration at one level and compares the
weight updates with the same configuration in float32 (O0): the same
direction and size, within the half dtype's precision.
"""

import gc

import keras
import numpy as np
import pytest

import keras_mp

STEPS = 4
BATCH = 4


def _schedule(initial):
    return keras.optimizers.schedules.CosineDecay(initial, decay_steps=STEPS, alpha=0.1)


# Clipping thresholds are small enough that every step is clipped; steps are
# large enough to move a half weight (half an ulp of 0.5 is 2.4e-4 in float16).
OPTIMIZERS = {
    "adamw_global_clipnorm_ema_schedule": lambda: keras.optimizers.AdamW(
        _schedule(1e-2), weight_decay=0.05, global_clipnorm=0.05, use_ema=True, epsilon=1e-3
    ),
    "sgd_clipnorm_accumulation": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, clipnorm=0.05, gradient_accumulation_steps=2
    ),
    "adam_clipvalue_ema_overwrite": lambda: keras.optimizers.Adam(
        1e-2, clipvalue=0.01, use_ema=True, ema_overwrite_frequency=2, epsilon=1e-3
    ),
    "rmsprop_global_clipnorm_weight_decay": lambda: keras.optimizers.RMSprop(
        1e-2, weight_decay=0.05, global_clipnorm=0.05, epsilon=1e-3
    ),
    "sgd_clipvalue_schedule": lambda: keras.optimizers.SGD(_schedule(1.0), clipvalue=0.01),
}
ADAM_FAMILY = ("adamw_global_clipnorm_ema_schedule", "adam_clipvalue_ema_overwrite")
CELLS = [("O1", "bfloat16"), ("O2", "float16"), ("O3", "float16"), ("O3", "bfloat16")]
# Bounds on the cosine similarity of all weight updates against float32's,
# and on their norms' ratio, each measured from the weights its level
# starts from. O1/O2 keep float32 variables: the same updates. O3 updates
# float32 master copies and rounds them to half: the updates are float32's,
# rounded (in bfloat16 the EMA cell's few small steps measure 0.93 with
# master weights; without them the Adam cells fall far lower).
BOUNDS = {
    "O1": (0.99, 0.95),
    "O2": (0.99, 0.95),
    "O3-float16": (0.99, 0.95),
    "O3-bfloat16": (0.9, 0.9),
}


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 8)).astype("float32")
    return x, rng.integers(0, 3, STEPS * BATCH)


def _model():
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def _updates(name, level="O0", half="float16", **amp):
    model = _model()
    model.compile(
        optimizer=OPTIMIZERS[name](),
        loss="sparse_categorical_crossentropy",
        amp_level=level,
        amp_dtype=half,
        keep_batchnorm_fp32=True if level == "O3" else None,
        **amp,
    )
    # From the weights the level starts from (O3's rounded to half).
    before = [
        np.asarray(keras.ops.convert_to_numpy(v), "float64") for v in model.trainable_variables
    ]
    x, y = _data()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    after = [
        np.asarray(keras.ops.convert_to_numpy(v), "float64") for v in model.trainable_variables
    ]
    return model, history, np.concatenate([(a - b).ravel() for a, b in zip(after, before)])


_REFERENCE = {}


def _reference(name):
    if name not in _REFERENCE:
        _REFERENCE[name] = _updates(name)[2]
    return _REFERENCE[name]


# One cell per optimizer, rotated over the backends: every cell runs the same
# wrapper code (the inner optimizer's own step on float32 variables or master
# copies), so the grid's other cells would prove it again. Each backend still
# runs O3 with each half type for some optimizer.
ROTATION = {"tensorflow": 0, "jax": 1, "torch": 2}.get(keras.backend.backend(), 0)


def _cases():
    for i, name in enumerate(OPTIMIZERS):
        level, half = CELLS[(i + ROTATION) % len(CELLS)]
        yield pytest.param(name, level, half, id=f"{name}-{level}-{half}")


@pytest.mark.parametrize("name, level, half", list(_cases()))
def test_optimizer_feature_at_level(name, level, half):
    model, history, updates = _updates(name, level, half)
    if level == "O3":
        dtypes = {v.dtype for v in model.trainable_variables}
        assert dtypes == {half, "float32"}, dtypes  # mixed: the case under test
    assert np.isfinite(history.history["loss"]).all(), history.history
    assert np.isfinite(updates).all()
    if "skipped_steps" in history.history:
        assert history.history["skipped_steps"][-1] == 0
    reference = _reference(name)
    min_cosine, min_ratio = BOUNDS.get(level, BOUNDS.get(f"{level}-{half}"))
    cosine = updates @ reference / (np.linalg.norm(updates) * np.linalg.norm(reference))
    assert cosine >= min_cosine, cosine
    ratio = np.linalg.norm(updates) / np.linalg.norm(reference)
    assert min_ratio <= ratio <= 1 / min_ratio, ratio


@pytest.mark.parametrize("master_weights", [True, False, "compensated"])
def test_adam_moves_bfloat16_weights_at_o3(master_weights):
    """Without master weights, Keras's Adam cannot move a bfloat16 weight.

    It computes its bias correction in the variable's dtype: in bfloat16
    beta_2=0.999 rounds to 1 and every update is 0 (Keras's own bfloat16
    policy alike). The float32 copies are what makes O3 bfloat16 learn, or
    compensated updates (float32 steps, bfloat16 buffers).
    """
    name = "adam"
    OPTIMIZERS[name] = lambda: keras.optimizers.Adam(1e-2, epsilon=1e-3)
    model, _, updates = _updates(name, "O3", "bfloat16", master_weights=master_weights)
    half = np.concatenate(
        [np.ones(v.shape).ravel() * (v.dtype == "bfloat16") for v in model.trainable_variables]
    ).astype(bool)
    reference = _reference(name)
    moved = np.linalg.norm(updates[half]) / np.linalg.norm(reference[half])
    if master_weights:
        assert 0.9 <= moved <= 1.1, moved
    else:
        assert moved < 0.1, moved  # the documented reason for master weights


def test_an_optimizer_is_wrapped_by_one_loss_scale_optimizer_only():
    inner = keras.optimizers.SGD(0.01)
    first = keras_mp.LossScaleOptimizer(inner, name="first")
    with pytest.raises(
        ValueError, match="already wrapped by another LossScaleOptimizer \\('first'\\)"
    ) as info:
        keras_mp.LossScaleOptimizer(inner)
    assert f"inner_optimizer=SGD(name={inner.name!r})" in str(info.value)
    del first
    gc.collect()
    keras_mp.LossScaleOptimizer(inner)  # the first wrapper is gone


@pytest.mark.parametrize(
    "name, value",
    [
        ("use_ema", True),
        ("clipnorm", 1.0),
        ("global_clipnorm", 1.0),
        ("clipvalue", 0.5),
        ("weight_decay", 0.01),
        ("gradient_accumulation_steps", 2),
        ("ema_momentum", 0.9),
    ],
)
def test_inner_settings_set_on_the_wrapper_are_refused_by_name(name, value):
    optimizer = keras_mp.LossScaleOptimizer(keras.optimizers.Adam())
    with pytest.raises(ValueError) as info:
        setattr(optimizer, name, value)
    message = str(info.value)
    assert f"optimizer.inner_optimizer.{name} = {value!r}" in message
    assert "inner optimizer (Adam)" in message and f"Received: {name}={value!r}" in message
    setattr(optimizer, name, getattr(optimizer, name))  # an unchanged value passes
    setattr(optimizer.inner_optimizer, name, value)  # where it belongs
    assert getattr(optimizer.inner_optimizer, name) == value
