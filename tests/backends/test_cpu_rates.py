"""`cpu_rates`: the CPU's matmul rate per dtype, measured once per process."""

import time

import pytest

from keras_mp._src.backends import cpu_rates


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rate_is_measured_once_and_is_plausible(dtype):
    rate = cpu_rates.matmul_rate(dtype)
    # Between an emulated dtype on a slow core and a large AMX machine.
    assert 1e8 < rate < 1e14
    start = time.perf_counter()
    assert cpu_rates.matmul_rate(dtype) == rate  # cached: no second measurement
    assert time.perf_counter() - start < 0.01


def test_flags_and_native_bfloat16():
    flags = cpu_rates.cpu_flags()
    assert isinstance(flags, frozenset)
    assert cpu_rates.native({"avx2", "amx_bf16", "avx512_bf16"}, "bfloat16") == [
        "amx_bf16",
        "avx512_bf16",
    ]
    assert cpu_rates.native({"avx2"}, "bfloat16") == []
    assert 1e8 < cpu_rates.memory_bandwidth() < 1e13
