"""The speed report's peak rates (`gpu_peaks.py`): the data sheets' numbers,
and what a GPU without a unit falls back to."""

import pytest

from keras_mp._src.backends import gpu_peaks

pytestmark = pytest.mark.one_backend


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
    with pytest.raises(ValueError, match="Received: device='V100'"):
        gpu_peaks.peaks_of("V100")


def test_the_cpu_is_measured_and_the_bound_never_charges_half_below_float32():
    """Issue 64.2: without a GPU, this CPU's measured rates; an emulated
    half dtype is estimated at its rate but bounded at float32's."""
    cpu = gpu_peaks.peaks_of("cpu")
    assert cpu.kind == "cpu" and cpu.float8 is None and cpu.tf32 is None
    assert cpu.o0_rate(tf32=True) == cpu.float32 * gpu_peaks.O0_ATTAINED["cpu"]
    slow = gpu_peaks.Peaks("slow", 1e9, 1e9, None, 1e11, 1e10, kind="cpu")
    assert slow.matmul_rate("bfloat16", aligned=False) == 1e9
    assert slow.bound_rate("bfloat16") == 1e11
    fast = gpu_peaks.Peaks("fast", 1e11, 3e11, None, 1e11, 1e10, kind="cpu")
    assert fast.bound_rate("bfloat16") == fast.matmul_rate("bfloat16") == 3e11


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA L4", "NVIDIA L4"),
        ("NVIDIA L40S", "NVIDIA L40S (not in the table"),
        ("NVIDIA GH200 480GB", "NVIDIA GH200 480GB (not in the table"),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe (not in the table"),
        ("NVIDIA A100-PCIE-40GB", "NVIDIA A100-PCIE-40GB (not in the table"),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB PCIe (not in the table"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM 80GB"),
        ("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-16GB (not in the table"),
    ],
)
def test_this_machines_gpu_is_matched_by_its_exact_name(name, expected):
    assert gpu_peaks.gpu_of_name(name).name.startswith(expected)


def test_native_must_name_half_dtypes():
    with pytest.raises(ValueError, match="`native` must be None or a tuple"):
        gpu_peaks.Peaks("a CPU", 1e9, 1e9, None, 1e11, 2e10, kind="cpu", native="bfloat16")
    with pytest.raises(ValueError, match="Received: native=\\('avx512_bf16',\\)"):
        gpu_peaks.Peaks("a CPU", 1e9, 1e9, None, 1e11, 2e10, kind="cpu", native=("avx512_bf16",))


def test_o0_is_charged_at_what_measurements_reached():
    h100 = gpu_peaks.peaks_of("H100")
    assert h100.o0_rate(tf32=True) == 495e12 * gpu_peaks.O0_ATTAINED["tf32"]
    assert h100.o0_rate(tf32=False) == 67e12 * gpu_peaks.O0_ATTAINED["float32"]
