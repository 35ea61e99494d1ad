"""The speed report's peak rates (`gpu_peaks.py`): the data sheets' numbers,
and what a GPU without a unit falls back to."""

import pytest

from keras_mp._src.tools import gpu_peaks


def test_h100_rates_are_the_data_sheets():
    h100 = gpu_peaks.peaks_of("h100")
    assert h100.matmul_rate("float16") == h100.matmul_rate("bfloat16") == 989e12
    assert h100.matmul_rate("float32", tf32=True) == 495e12
    assert h100.matmul_rate("float32") == 67e12
    assert h100.bandwidth == 3.35e12


def test_t4_has_no_bfloat16_and_no_tf32_tensor_cores():
    t4 = gpu_peaks.peaks_of("T4")
    assert t4.matmul_rate("bfloat16") == t4.matmul_rate("float32") == 8.1e12
    assert t4.matmul_rate("float32", tf32=True) == 8.1e12
    assert t4.matmul_rate("float16") == 65e12


def test_a_misaligned_half_matmul_runs_off_the_tensor_cores():
    a100 = gpu_peaks.peaks_of("A100")
    assert a100.matmul_rate("float16", aligned=False) == 2 * 19.5e12


def test_a_peaks_of_ones_own_is_taken():
    mine = gpu_peaks.Peaks("mine", 1.0, 1.0, None, 0.5, 1.0)
    assert gpu_peaks.peaks_of(mine) is mine
    with pytest.raises(ValueError, match="Received: gpu='V100'"):
        gpu_peaks.peaks_of("V100")
