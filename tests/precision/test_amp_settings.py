"""A level resolved once from the user's arguments (`AmpSettings`): what each
level and dtype means, the defaults `compile` fills in, and bad arguments
refused by name."""

import keras
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keras_mp._src.precision import amp_settings
from keras_mp._src.precision.levels import Compute

pytestmark = pytest.mark.one_backend

# level: (what computes in half, container policy, a subclassed model's inside)
MEANING = {
    "O0": (Compute.NONE, "float32", "float32"),
    "O1": (Compute.ALLOW, "float32", "float32"),
    "O2": (Compute.DENY, "mixed_H", "H"),
    "O3": (Compute.ALL, "H", "H"),
}
# (level, dtype): the loss scale `compile` sets up when none is given.
DEFAULT_LOSS_SCALE = {
    ("O0", "float16"): None,
    ("O1", "float16"): "dynamic",
    ("O2", "float16"): "dynamic",
    ("O3", "float16"): None,  # master weights check and skip
    ("O0", "bfloat16"): None,
    ("O1", "bfloat16"): 1.0,  # checked: a non-finite step is skipped
    ("O2", "bfloat16"): 1.0,
    ("O3", "bfloat16"): None,
}


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_each_level_means_what_the_table_says(level, half):
    amp = amp_settings.for_compile(level, half)
    compute, container, inner = MEANING[level]
    assert amp.name == level and amp.half == half and amp.compute is compute
    assert amp.container_policy == container.replace("H", half)
    assert amp.inner_dtype == inner.replace("H", half)
    assert amp.mixed == f"mixed_{half}"
    assert amp.half_variables == (level == "O3")
    assert amp.keep_batchnorm_fp32 == (level != "O3")
    assert amp.loss_scale == DEFAULT_LOSS_SCALE[(level, half)]


def test_given_arguments_win_over_the_level_s_defaults():
    amp = amp_settings.for_compile("o3", "bfloat16", None, True, "compensated", ["x"], ())
    assert amp.name == "O3" and amp.loss_scale is None and amp.keep_batchnorm_fp32
    assert amp.master_weights == "compensated" and amp.allow == ("x",)
    assert amp_settings.for_compile("O2", loss_scale=128.0).loss_scale == 128.0
    assert amp_settings.for_layers("O3", keep_batchnorm_fp32=True).keep_batchnorm_fp32


def test_auto_is_resolved_once_to_a_level(capsys):
    amp = amp_settings.for_compile("auto")
    assert amp.name in ("O0", "O2")
    assert f"amp_level='auto' picked {amp.name}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda: amp_settings.for_compile("O5"), ValueError, "amp_level='O5'"),
        (lambda: amp_settings.for_compile("O2", "int8"), ValueError, "amp_dtype='int8'"),
        (lambda: amp_settings.for_compile("O2", loss_scale=0), ValueError, "loss_scale=0"),
        (
            lambda: amp_settings.for_compile("O2", keep_batchnorm_fp32=1),
            TypeError,
            "keep_batchnorm_fp32=1",
        ),
        (lambda: amp_settings.for_compile("O2", amp_deny=[3]), TypeError, "amp_deny=[3]"),
        (
            lambda: amp_settings.for_compile("O2", "float16", master_weights="compensated"),
            ValueError,
            "amp_dtype='float16', master_weights='compensated'",
        ),
        (lambda: amp_settings.for_layers("O2", allow=(1.5,)), TypeError, "allow=(1.5,)"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)


@given(
    st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-5, 5),
        st.text(max_size=8),
        st.booleans(),
        st.none(),
    )
)
def test_any_loss_scale_is_accepted_or_refused_by_name(value):
    valid = (
        value is None
        or value == "dynamic"
        or (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and 0 < value <= 2.0**126
        )
    )
    if valid:
        assert amp_settings.for_compile("O2", loss_scale=value).loss_scale == value
    else:
        with pytest.raises(ValueError, match="`loss_scale` must be"):
            amp_settings.for_compile("O2", loss_scale=value)


def test_allow_and_deny_take_one_entry_or_many():
    dense = keras.layers.Dense(2)
    assert amp_settings.check_layer_list(None, "allow") == ()
    assert amp_settings.check_layer_list("name", "allow") == ("name",)
    assert amp_settings.check_layer_list(dense, "deny") == (dense,)
    assert amp_settings.check_layer_list([keras.layers.Dense, "x"], "deny") == (
        keras.layers.Dense,
        "x",
    )
