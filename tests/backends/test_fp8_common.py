"""An FP8 layer's einsum as one GEMM (`fp8_common.gemm_form`): a Dense's
matmul over the last axis at any rank, an EinsumDense's equation with or
without an ellipsis, and the einsums that are not one GEMM (an axis summed
away, a batch axis on both operands, a repeated axis), which keep Keras's
own call."""

import pytest

from keras_mp._src.backends import fp8_common


@pytest.mark.one_backend
@pytest.mark.parametrize(
    "equation, ndim, form",
    [
        (None, 2, ("ay", "yz", "az")),
        (None, 3, ("aby", "yz", "abz")),
        ("btd,dnh->btnh", 3, ("btd", "dnh", "btnh")),
        ("btnh,nhd->btd", 4, ("btnh", "nhd", "btd")),
        ("...b,bc->...c", 3, ("adb", "bc", "adc")),
        ("abc,cd->ad", 3, None),  # b summed away
        ("abc,acd->abd", 3, None),  # a batch axis on both operands
        ("aab,bc->ac", 3, None),  # a repeated axis
        ("ab,cd->abcd", 2, None),  # nothing contracted
    ],
)
def test_an_einsum_is_one_gemm_or_none(equation, ndim, form):
    assert fp8_common.gemm_form(equation, ndim) == form
