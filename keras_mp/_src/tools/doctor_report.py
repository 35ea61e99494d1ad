"""The doctor's report: `PrecisionReport`, its table and its plot."""

import dataclasses
import math
import textwrap

import numpy as np

from keras_mp._src.tools import table
from keras_mp._src.tools.half_range import HALF_RANGE
from keras_mp._src.tools.half_range import overflow_share
from keras_mp._src.tools.half_range import underflow_share
from keras_mp._src.tools.table import WIDTH


@dataclasses.dataclass(frozen=True, repr=False)
class PrecisionReport(table.Report):
    """The doctor's table (`.text`, or print it), with the findings as data.

    Attributes:
        text: the table.
        rows: one dict per layer (see `analyze`).
        dtype: the half dtype analysed against.
        current_loss_scale, recommended_loss_scale: floats.
        advice: why that scale is recommended (one sentence).
        keep_float32: names of the layers flagged to stay in float32.
        gradients: `{variable path: float32 NumPy array}`, for your own plots.
    """

    dtype: str
    current_loss_scale: float
    recommended_loss_scale: float
    advice: str
    keep_float32: list
    gradients: dict

    def plot(self, path=None):
        """A histogram of gradient magnitudes against the half dtype's range.

        Like MindSpore's loss-scale tutorial: log2 |g| of every gradient
        value, with the underflow threshold at the current and at the
        recommended loss scale. Needs matplotlib (not a dependency of
        keras_mp).

        Args:
            path: optional file to save the figure to (e.g. "grads.png").

        Returns:
            The matplotlib `Figure`.
        """
        try:
            import matplotlib

            if path is not None:
                matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError(
                "PrecisionReport.plot needs matplotlib: `pip install matplotlib`."
            ) from e
        values = np.concatenate(
            [np.abs(g).ravel() for g in self.gradients.values()] or [np.zeros(0)]
        )
        values = values[values > 0]
        figure, axis = plt.subplots(figsize=(8, 4))
        axis.hist(np.log2(values), bins=80, color="tab:blue", alpha=0.8)
        largest, tiny = HALF_RANGE[self.dtype]
        for scale, style, label in (
            (self.current_loss_scale, "--", "current"),
            (self.recommended_loss_scale, "-", "recommended"),
        ):
            axis.axvline(
                math.log2(tiny / 2 / scale),
                color="tab:red",
                linestyle=style,
                label=f"{self.dtype} underflow at {label} scale {scale:g}",
            )
            axis.axvline(
                math.log2(largest / scale),
                color="tab:orange",
                linestyle=style,
                label=f"{self.dtype} overflow at {label} scale {scale:g}",
            )
        axis.set_xlabel("log2 |gradient| (float32 values)")
        axis.set_ylabel("count")
        axis.set_title("Gradient magnitudes against the half-precision range")
        axis.legend(fontsize="small")
        figure.tight_layout()
        if path is not None:
            figure.savefig(path)
        return figure


def percent(share):
    if share is None:
        return "-"
    if share == 0:
        return "0%"
    return f"{share:.1%}" if share >= 0.001 else "<0.1%"


def render(rows, half, scale, recommended, advice, gradients):
    """The report as text, at most `WIDTH` columns wide.

    Layer names longer than their column keep their end (`...attention/query`);
    a flagged layer's note goes on the lines below its row.
    """
    headers = (
        "Layer (class)",
        "Compute",
        "Max |act|",
        "% max",
        "Underflow now/rec",
        "Overflow now/rec",
    )
    cells = []
    for r in rows:
        cells.append(
            (
                f"{r['layer']} ({r['class']})",
                r["compute_dtype"],
                "-" if r["max_activation"] is None else f"{r['max_activation']:.3g}",
                "-"
                if r["activation_share_of_max"] is None
                else percent(r["activation_share_of_max"]),
                f"{percent(r['underflow_current'])} / {percent(r['underflow_recommended'])}",
                f"{percent(r['overflow_current'])} / {percent(r['overflow_recommended'])}",
            )
        )
    lines = textwrap.wrap(
        f"Gradient values lost in {half}, per layer: now = at the current loss scale "
        f"{scale:g}, rec = at the recommended {recommended:g}.",
        WIDTH,
    )
    notes = [("keep float32: " + r["reason"]) if r["keep_float32"] else None for r in rows]
    lines += table.render(headers, cells, notes=notes, shrink=0, width=WIDTH)
    values = [np.abs(g).ravel() for g in gradients]
    values = np.concatenate(values) if values else np.zeros(0)
    summary = [
        f"Gradients (float32 pass, {values.size} values): underflow to zero in {half} "
        f"{percent(underflow_share(values, scale, half))} at the current loss scale {scale:g}, "
        f"{percent(underflow_share(values, recommended, half))} at the recommended "
        f"{recommended:g}; "
        f"overflow {percent(overflow_share(values, scale, half))} / "
        f"{percent(overflow_share(values, recommended, half))}.",
        f"Recommended initial loss scale: {recommended:g}"
        + ("" if half == "bfloat16" else f" (2**{int(math.log2(recommended))})")
        + f": {advice}",
    ]
    flagged = [r["layer"] for r in rows if r["keep_float32"]]
    summary.append(
        "Keep in float32: "
        + (", ".join(flagged) + " (see the notes)." if flagged else "none flagged.")
    )
    lines.append("")
    for paragraph in summary:
        lines += textwrap.wrap(paragraph, WIDTH, subsequent_indent="  ")
    return "\n".join(lines)
