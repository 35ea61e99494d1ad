"""The one table renderer of keras_mp's reports (`precision_summary`, `analyze`)."""

import dataclasses
import textwrap

WIDTH = 100  # the reports fit this many columns where they can


@dataclasses.dataclass(frozen=True, repr=False)
class Report:
    """A report's findings as data, and its table as text.

    `print(report)` (or `str(report)`) gives the table; in a notebook, a cell
    that ends with the report shows it too.

    Attributes:
        text: the table.
        rows: one dict per layer.
    """

    text: str
    rows: list

    def __str__(self):
        return self.text

    def __repr__(self):
        return self.text

    def _repr_pretty_(self, printer, cycle):  # IPython
        printer.text(self.text)


def render(headers, rows, notes=None, shrink=0, width=WIDTH):
    """A text table: left-aligned columns two spaces apart, a rule under the headers.

    Args:
        headers: the column titles.
        rows: sequences of cell strings, one per row.
        notes: optional, one text (or None) per row, wrapped on the lines
            below it, indented.
        shrink: the column narrowed, where needed, so that the table fits
            `width`: its longer cells keep their end (`...attention/query`).
        width: the width to fit; None keeps every cell whole.

    Returns:
        A list of lines.
    """
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]
    if width is not None:
        others = sum(w for i, w in enumerate(widths) if i != shrink) + 2 * (len(headers) - 1)
        widths[shrink] = max(len(headers[shrink]), min(widths[shrink], width - others))

    def line(cells):
        cells = list(cells)
        if len(cells[shrink]) > widths[shrink]:
            cells[shrink] = "..." + cells[shrink][3 - widths[shrink] :]
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    lines = [line(headers), "-" * len(line(headers))]
    for i, row in enumerate(rows):
        lines.append(line(row))
        if notes is not None and notes[i]:
            lines += textwrap.wrap(
                notes[i], width or WIDTH, initial_indent="    ", subsequent_indent="    "
            )
    return lines
