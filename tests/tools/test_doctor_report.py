"""The doctor's report: its table's width and notes, its percentages."""

import numpy as np
import pytest

from keras_mp._src.tools import doctor_report
from keras_mp._src.tools.table import WIDTH

pytestmark = pytest.mark.one_backend


def _row(name, reason=None):
    return {
        "layer": name,
        "class": "Dense",
        "compute_dtype": "float16",
        "max_activation": 3.0,
        "activation_share_of_max": 3.0 / 65504,
        "underflow_current": 0.25,
        "underflow_recommended": 0.0,
        "overflow_current": 0.0,
        "overflow_recommended": 0.0,
        "keep_float32": reason is not None,
        "reason": reason,
    }


def test_percent_says_what_a_reader_needs():
    assert doctor_report.percent(None) == "-"
    assert doctor_report.percent(0) == "0%"
    assert doctor_report.percent(0.25) == "25.0%"
    assert doctor_report.percent(1e-5) == "<0.1%"


def test_the_table_fits_its_width_with_long_names_and_notes():
    rows = [
        _row("model/" + "very_long_block_name/" * 6 + "attention/query"),
        _row("model/dense", reason="activations near the maximum " * 6),
    ]
    gradients = [np.array([1e-9, 1e-3, 1.0], "float32")]
    text = doctor_report.render(rows, "float16", 2.0**15, 2.0**8, "Lower the scale.", gradients)
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    assert "attention/query" in text  # a long name keeps its end
    assert "keep float32" in text and "Lower the scale." in text
