"""`precision_summary`: who computes in what, and the rule that said so."""

import dataclasses

import keras

from keras_mp._src import keras_internals
from keras_mp._src.model import lm_step
from keras_mp._src.model import wrapping
from keras_mp._src.precision import fallback
from keras_mp._src.precision import float8
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import probability_ops
from keras_mp._src.precision.layer_policy import rule_of
from keras_mp._src.precision.policies import auto_choice
from keras_mp._src.precision.policies import check_model
from keras_mp._src.tools import table


@dataclasses.dataclass(frozen=True, repr=False)
class PrecisionSummary(table.Report):
    """`precision_summary`'s table (`.text`, or print it) and its `.rows`;
    `.optimizers`: one dict per optimizer the model holds (`optimizer`,
    `class`, `settings`); `.loss`: how `fit`'s step computes the loss of a
    model compiled at a level (chunk by chunk or not, and why), or None."""

    optimizers: list = dataclasses.field(default_factory=list)
    loss: str = None


def precision_summary(model, print_fn=None):
    """A per-layer table: compute dtype, variable dtype, and the rule that set it.

    Args:
        model: a Keras model or layer.
        print_fn: optional callable given the text (e.g. `print`).

    Returns:
        A `PrecisionSummary`: print it for the table (`.text`); `.rows` is
        a list of dicts with keys `layer`, `class`, `compute_dtype`,
        `variable_dtype`, `policy` and `rule`.
    """
    check_model(model)
    rows = []
    layers = layer_tree.layers_in_order(model)
    for layer in layers:
        policy = layer.dtype_policy
        rule = rule_of(layer)
        fell_back = fallback.fell_back(layer)
        rows.append(
            {
                "layer": _path(layer),
                "class": type(layer).__name__,
                "compute_dtype": "float32" if fell_back else policy.compute_dtype,
                "variable_dtype": policy.variable_dtype,
                "policy": policy.name,
                "rule": f"{rule}; {fell_back}" if fell_back else rule,
            }
        )
    _add_operation_rows(rows, layers)
    columns = ("layer", "class", "compute_dtype", "variable_dtype", "rule")
    headers = ("Layer", "Class", "Compute", "Variables", "Rule")
    cells = [[str(r[c]) for c in columns] for r in rows]
    lines = table.render(headers, cells, width=None)
    users = [_path(layer) for layer in layers if probability_ops.in_users_code(layer)]
    if users:
        lines += ["", f"{probability_ops.USERS_CODE_NOTE}: {', '.join(users)}."]
    fp8 = [r["layer"] for r in rows if r["policy"].startswith("float8_from_")]
    kept_out = [r["layer"] for r in rows if " float8: " in r["rule"] and r["layer"] not in fp8]
    if fp8 or kept_out:
        lines += ["", f"FP8 matmuls: {', '.join(fp8) or 'none'}."]
        if kept_out:
            lines += [f"Kept out of FP8 (the rule of each above): {', '.join(kept_out)}."]
    if fp8:
        from keras_mp._src.precision.auto_level import float8_gemms_absent

        absent = float8_gemms_absent()
        if absent is not None:
            lines += ["", f"FP8: {absent}."]
        if float8.quantize_dequantize_note():
            lines += ["", f"FP8: {float8.quantize_dequantize_note()}."]
    # `to_float` on a layer inside since: auto's choice no longer the story.
    if auto_choice(model) and not any(r["rule"].startswith("to_float(") for r in rows):
        lines += ["", auto_choice(model)]
    optimizers = _optimizer_rows(model)
    if optimizers:
        lines += [""] + table.render(
            ("Optimizer", "Class", "Settings"),
            [[o["optimizer"], o["class"], o["settings"]] for o in optimizers],
            width=None,
        )
    loss = _loss(model)
    if loss:
        lines += ["", f"Loss: {loss}"]
    summary = PrecisionSummary("\n".join(lines), rows, optimizers, loss)
    if print_fn is not None:
        print_fn(summary.text)
    return summary


def _loss(model):
    """The loss rule's reason (`rules.LOSS_RULES`): the latest step's, or
    before any step what the model's shape says (`lm_step.expected`)."""
    if not isinstance(model, keras.Model):
        return None
    decided = lm_step.decision(model)
    if decided is not None:
        return decided[1]
    expected = lm_step.expected(model)
    if expected is None:
        return None
    return expected[1]


def _path(layer):
    return layer.path if getattr(layer, "path", None) else layer.name


def _add_operation_rows(rows, layers):
    """A row for each probability operation of a functional graph that
    computes in float32 (`keras.ops.softmax(x)`: no layer), after the rows
    of what it takes in."""
    at = {id(layer): i for i, layer in enumerate(layers)}
    last = {}  # a layer's row -> the last row of the layers inside it
    for layer in reversed(layers):
        last[id(layer)] = max(
            [at[id(layer)]]
            + [last[id(c)] for c in keras_internals.children(layer) if id(c) in last]
        )
    inserted = []  # (after row, row), in the order found
    for graph in layers:
        if not isinstance(graph, keras_internals.Functional):
            continue
        found = {}  # an operation that is no layer -> the row it comes after
        for op, parents in keras_internals.operations_from_inputs(graph):
            after = [last[id(p)] for p in parents if id(p) in last]
            after += [found[id(p)] for p in parents if id(p) in found]
            found[id(op)] = max(after, default=at[id(graph)])
        for op, name, _ in probability_ops.operations(graph):
            if not probability_ops.computed_in_float32(op):
                continue
            row = {
                "layer": f"{_path(graph)}/{op.name}",
                "class": f"ops.{name}",
                "compute_dtype": "float32",
                "variable_dtype": "",
                "policy": "",
                "rule": probability_ops.rule_of_operation(op, name, graph),
            }
            inserted.append((found[id(op)], len(inserted), row))
    # From the last: each insertion leaves the rows before it where they are.
    for after, _, row in sorted(inserted, key=lambda item: item[:2], reverse=True):
        rows.insert(after + 1, row)


def _optimizer_rows(model):
    """One row per optimizer the model holds, with what keras_mp gave it."""
    if not isinstance(model, keras.Model):
        return []
    rows = []
    for label, _, optimizer, holder, _ in wrapping.find_optimizers(model):
        half = wrapping.has_half_variables(holder)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and hasattr(
            optimizer, "config"
        ):
            inner = type(optimizer.inner_optimizer).__name__
            settings = wrapping.describe(optimizer, half)
            name = f"LossScaleOptimizer({inner})"
        else:
            name = type(optimizer).__name__
            settings = "as given (no keras_mp loss scale, skip or master weights)"
        rows.append({"optimizer": label, "class": name, "settings": settings})
    return rows
