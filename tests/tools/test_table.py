"""The table renderer of the reports: aligned columns, a fitted width, notes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keras_mp._src.tools import table

pytestmark = pytest.mark.one_backend


def test_columns_are_aligned_under_their_headers():
    lines = table.render(("Layer", "Compute"), [("dense", "float16"), ("norm", "float32")])
    assert lines == [
        "Layer  Compute",
        "--------------",
        "dense  float16",
        "norm   float32",
    ]


def test_a_long_cell_keeps_its_end_and_notes_go_below_their_row():
    name = "model/" + "block/" * 30 + "attention/query"
    lines = table.render(("Layer", "Rule"), [(name, "O2 deny-list")], notes=["keep it"], width=40)
    assert max(map(len, lines)) <= 40
    assert lines[2].startswith("...") and "attention/query" in lines[2]
    assert lines[3] == "    keep it"
    whole = table.render(("Layer", "Rule"), [(name, "O2 deny-list")], width=None)
    assert name in whole[2]  # no width: every cell whole


@given(
    st.lists(
        st.tuples(st.text("abc/_", min_size=1, max_size=150), st.text("xyz", max_size=10)),
        min_size=1,
        max_size=5,
    ),
    st.integers(40, 120),
)
def test_the_table_fits_its_width(rows, width):
    lines = table.render(("Layer", "Class"), rows, width=width)
    assert max(map(len, lines)) <= max(width, len("Layer") + 2 + max(len(r[1]) for r in rows))
    assert len(lines) == len(rows) + 2


def test_a_report_prints_as_its_table():
    report = table.Report("the table", [{"layer": "dense"}])
    assert str(report) == repr(report) == "the table"
