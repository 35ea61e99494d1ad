"""Why steps keep being skipped, told from where the scale stands: each cause
gets the advice that fits it (a pinned floor is not helped by a lower
learning rate; no scale helps a loss that is not finite)."""

import keras
import pytest

import keras_mp
from keras_mp._src.model.skip_advice import diagnosis

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="a rule's decision: proven once"
)


def _optimizer(**arguments):
    return keras_mp.LossScaleOptimizer(keras.optimizers.SGD(), **arguments)


def test_a_scale_pinned_at_min_scale_needs_a_lower_floor():
    cause, advice = diagnosis(_optimizer(min_scale=1.0), 1.0)
    assert "even at the lowest scale that min_scale=1 allows" in cause
    assert "`min_scale=None`" in advice and "normalize the targets" in advice
    assert "`clipnorm` does not help" in advice
    assert "a lower learning rate, or" not in advice


def test_the_lowest_scale_without_a_floor_means_the_loss_itself_is_not_finite():
    cause, advice = diagnosis(_optimizer(), 2.0**-126)
    assert "no loss scale makes the steps finite, down to 2**-126" in cause
    for remedy in ("NaN", "normalize the targets", "amp_deny", "bfloat16", "lower learning rate"):
        assert remedy in advice, remedy
    assert "min_scale" not in advice


def test_a_scale_still_falling_is_finding_its_level():
    cause, advice = diagnosis(_optimizer(), 2.0**-3)
    assert "backs off at each skipped step (now 0.125)" in cause
    assert "finding the scale the gradients need" in advice
    assert "normalize the targets" in advice


@pytest.mark.parametrize("scale", [1024.0, 1.0])
def test_a_fixed_scale_is_told_of_a_dynamic_one(scale):
    cause, advice = diagnosis(_optimizer(dynamic=False, initial_scale=scale), scale)
    assert "loss_scale='dynamic'" in advice
    assert ("fixed loss scale 1024" in cause) if scale > 1 else ("nothing scaled" in cause)
