"""What a float32 head returns to a `call` computing in half.

The head rule puts in float32 a head whose outputs float16 could overflow
(`conditions.may_overflow_float16`: a price regression's 1e5). Inside a
`call` computing in half (a subclassed model's at O3, float16), the
boundary rule would return its outputs in that dtype (`boundaries.py`),
and the values float16 cannot hold would turn to inf on their way to the
model's outputs. From the trace of that call (`output_heads.py`):

- where the head's outputs go to the call's outputs alone, through
  operations that take no other float tensor (`ops.squeeze`, `x[:, 0]`,
  `x * 2.0`) and layers that only move values, or into layers that cast
  their inputs, it returns float32, which the model's outputs keep;
- where they meet other tensors (`price + base`, a concatenation), the
  subclassed model's own arithmetic computes in float32 (its half layers
  return float32 to it), as torch.autocast promotes an addition of float32
  and half to float32: TensorFlow's raw ops refuse to mix the dtypes;
- where its call could not be traced, the same, not knowing.

A `call` computing in float32 (a subclassed model's at O1 and O2 in
float16, a head layer of yours that the rule put in float32) takes the
head's float32 as it is; bfloat16 holds the range.
"""

import keras

from keras_mp._src import keras_internals
from keras_mp._src.precision import boundaries
from keras_mp._src.precision import conditions
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision.layer_kinds import DATA_MOVEMENT


def flows_alone(caller, outputs, consumed):
    """`{id(layer): alone}` for each layer `caller` holds that its traced
    `call` called: whether what it returned there reaches `outputs` (the
    trace's) alone, or goes into layers that cast their inputs. `consumed`:
    the trace's count of the calls taking in an operation's outputs
    (`keras_internals.symbolic_calls`); a call the walk back from
    `outputs` does not meet (a value computed from it and not returned)
    makes it not alone."""
    takers, called = _takers(outputs)
    return {
        id(layer): _alone(layer, takers, consumed)
        for layer in keras_internals.children(caller)
        if id(layer) in called
    }


def _takers(outputs):
    """`({id(operation): {call: (taker, arguments, count)}}, ids of the
    operations called)` of the calls met walking back from `outputs`: each
    call taking in an operation's outputs, and how many of them it takes."""
    takers, called, calls = {}, set(), set()
    stack = [t for t in keras.tree.flatten(outputs) if isinstance(t, keras.KerasTensor)]
    while stack:
        made = keras_internals.made_by(stack.pop())
        if made is None:
            continue
        taker, _, inputs, arguments = made
        called.add(id(taker))
        call = (id(taker), tuple(id(t) for t in inputs))
        if call in calls:  # another of its outputs
            continue
        calls.add(call)
        for t in inputs:
            source = keras_internals.made_by(t)
            if source is not None:
                count = takers.setdefault(id(source[0]), {}).get(call, (0, 0, 0))[2]
                takers[id(source[0])][call] = (taker, arguments, count + 1)
            stack.append(t)
    return takers, called


def _alone(layer, takers, consumed):
    stack, seen = [layer], set()
    while stack:
        operation = stack.pop()
        if id(operation) in seen:
            continue
        seen.add(id(operation))
        taking = takers.get(id(operation), {}).values()
        if sum(count for *_, count in taking) != consumed(operation):
            return False  # a call off the ways to the outputs
        for taker, arguments, _ in taking:
            if isinstance(taker, DATA_MOVEMENT):
                stack.append(taker)  # passes on what it receives
            elif isinstance(taker, keras.layers.Layer):
                if not taker.autocast:  # the `Embedding` family keeps its inputs' dtype
                    return False
            elif any(_other_float(x, operation) for x in keras.tree.flatten(arguments)):
                return False
            else:
                stack.append(taker)
    return True


def _floating(x):
    dtype = getattr(x, "dtype", None)
    if dtype is None or isinstance(x, (str, bytes)):
        return False
    try:
        return keras.backend.is_float_dtype(keras.backend.standardize_dtype(dtype))
    except ValueError:
        return False


def _other_float(x, operation):
    """A float tensor, variable or array another operation made (or none)."""
    if not _floating(x):
        return False
    made = keras_internals.made_by(x) if isinstance(x, keras.KerasTensor) else None
    return made is None or made[0] is not operation


def set_boundaries(model, amp, heads, outputs, entry_dtype):
    """`boundaries.set_boundaries`, with what each float32 head returns
    (above). Returns its list of returns, and `[(model, note)]` for each
    subclassed model whose own arithmetic now computes in float32, the
    note saying for which head's outputs and why."""
    returning, own_float32 = set(), {}
    half = entry_dtype is not None and keras.backend.standardize_dtype(entry_dtype) != "float32"
    for layer, caller in layer_tree.tree(model) if half else ():
        # A subclassed model's `call`, whose outputs leave in float32. A
        # composite layer on the way computes in float32 as a head, but for
        # one you put in half (`allow=`), which returns its outputs as they
        # are: float32 from it could meet half in your code.
        model_io = layer_tree.is_subclassed(caller) and (
            caller is model or any(caller is o for o in outputs)
        )
        if not model_io or not _float32_head(layer, amp, heads):
            continue
        alone = heads.alone.get(id(layer))
        if alone:
            returning.add(id(layer))
        elif id(caller) not in own_float32:
            why = "meet other tensors" if alone is False else "its call could not be traced"
            note = f"own arithmetic in float32 ({layer.name}'s float32 outputs: {why})"
            own_float32[id(caller)] = (caller, note)
    returns = boundaries.set_boundaries(model, outputs, entry_dtype, returning, own_float32)
    return returns, list(own_float32.values())


def _float32_head(layer, amp, heads):
    """A head computing in float32 whose outputs float16 could overflow."""
    if keras.backend.standardize_dtype(layer.compute_dtype) != "float32":
        return False
    place = conditions.Place(amp, None, head=heads.head(layer), loss=heads.loss(layer))
    return conditions.may_overflow_float16(layer, place)
