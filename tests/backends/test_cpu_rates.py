"""`cpu_rates`: the CPU's matmul and elementwise rates per dtype and its
cost a launch, measured once per process (plausible, not timed here)."""

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


def test_elementwise_rates_and_the_launch_cost_are_measured_once():
    """Issue 75.5: what a step costs beyond its matmuls, with this backend."""
    rate = cpu_rates.elementwise_rate("float32")
    assert 1e6 < rate < 1e12  # values a second
    each = cpu_rates.launch_seconds("float32")
    # Microseconds to milliseconds a launch: a step's fixed cost over 20.
    assert 1e-7 < each < 0.1
    start = time.perf_counter()
    assert cpu_rates.elementwise_rate("float32") == rate
    assert cpu_rates.launch_seconds("float32") == each
    # Both half dtypes were timed in turns with O0: nothing is timed again.
    assert all(1e-7 < cpu_rates.launch_seconds(d) < 0.1 for d in ("bfloat16", "float16"))
    assert time.perf_counter() - start < 0.01


def test_a_tied_head_s_table_is_read_as_the_device_multiplies(monkeypatch):
    """`KERAS_MP_TIED_HEAD` forces a form; unset, a CPU whose flags name no
    native bfloat16 matmul reads the table in float32, any other device in
    half; a form it does not know is an error naming the variable."""
    monkeypatch.setenv(cpu_rates.TIED_HEAD_ENV, "half")
    assert cpu_rates.tables_in_half("bfloat16")
    monkeypatch.setenv(cpu_rates.TIED_HEAD_ENV, "float32")
    assert not cpu_rates.tables_in_half("bfloat16")
    monkeypatch.delenv(cpu_rates.TIED_HEAD_ENV)
    flags = cpu_rates.cpu_flags()
    if cpu_rates.runs_on_a_cpu() and flags and not cpu_rates.native(flags, "bfloat16"):
        assert not cpu_rates.tables_in_half("bfloat16")
    assert cpu_rates.tables_in_half("bfloat16") is (
        not cpu_rates.half_matmuls_converted("bfloat16")
    )
    monkeypatch.setenv(cpu_rates.TIED_HEAD_ENV, "fp32")
    with pytest.raises(ValueError, match=r"KERAS_MP_TIED_HEAD must be one of .*Received: 'fp32'"):
        cpu_rates.tables_in_half("bfloat16")
