"""Matmuls in HLO text (`backends/hlo_text.py`): a module written by hand,
as JAX lowers one and as XLA's GPU passes rewrite one, counted by hand."""

import pytest

from keras_mp._src.backends import hlo_text

MODULE = """HloModule train_step

%fused_convert (param_0: f32[4,8]) -> bf16[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  ROOT %convert.1 = bf16[4,8]{1,0} convert(%param_0)
}

%fused_gemm (p0: bf16[4,8], p1: bf16[8,16]) -> bf16[4,16] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = bf16[8,16]{1,0} parameter(1)
  ROOT %dot.2 = bf16[4,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[4,8], b: bf16[8,16], b32: f32[8,16], img: f16[2,8,8,3], k: f16[3,3,3,4]) -> f32[] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = bf16[8,16]{1,0} parameter(1)
  %b32 = f32[8,16]{1,0} parameter(2)
  %img = f16[2,8,8,3]{3,2,1,0} parameter(3)
  %k = f16[3,3,3,4]{3,2,1,0} parameter(4)
  %fusion = bf16[4,8]{1,0} fusion(%a), kind=kLoop, calls=%fused_convert
  %fusion.1 = bf16[4,16]{1,0} fusion(%fusion, %b), kind=kCustom, calls=%fused_gemm
  %cc = (f32[4,16]{1,0}, s8[1024]{0}) custom-call(f32[4,8]{1,0} %a, f32[8,16]{1,0} %b32), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %conv = f16[2,8,8,4]{3,2,1,0} convolution(%img, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  %ones = f32[4]{0} parameter(5)
  %sum = f32[8]{0} dot(%ones, %a), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  ROOT %r = f32[] parameter(6)
}
"""


@pytest.mark.perf
def test_dots_gemms_and_convolutions_with_their_dtypes_and_flops():
    matmuls, converts, convert_bytes = hlo_text.census(MODULE)
    assert sorted(matmuls) == sorted(
        [
            ("dot", "bfloat16", 2 * 4 * 16 * 8),  # the Triton GEMM's dot
            ("dot", "float32", 2 * 4 * 16 * 8),  # the cuBLAS call
            ("convolution", "float16", 2 * (2 * 8 * 8 * 4) * (3 * 3 * 3)),
        ]
    )  # the dot with a vector (a sum) is not matmul work
    assert (converts, convert_bytes) == (1, 4 * 8 * 2)


@pytest.mark.perf
def test_a_convolution_s_three_forms_count_alike():
    """cuDNN's forward, input-gradient and filter-gradient calls of one
    convolution: each is worth the forward's FLOPs."""
    x, w, y = "f16[2,8,8,3]{3,2,1,0}", "f16[3,3,3,4]{3,2,1,0}", "f16[2,8,8,4]{3,2,1,0}"
    labels = 'window={size=3x3}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$conv'
    module = "\n".join(
        [
            "ENTRY %main () -> f32[] {",
            f'  %f = ({y}, u8[0]{{0}}) custom-call({x} %x, {w} %w), {labels}Forward"',
            f'  %i = ({x}, u8[0]{{0}}) custom-call({y} %y, {w} %w), {labels}BackwardInput"',
            f'  %g = ({w}, u8[0]{{0}}) custom-call({x} %x, {y} %y), {labels}BackwardFilter"',
            "}",
        ]
    )
    flops = [n for _, _, n in hlo_text.census(module)[0]]
    assert flops == [2 * (2 * 8 * 8 * 4) * (3 * 3 * 3)] * 3
