"""The boundary rule: the dtypes a layer takes and returns across its `call`.

A model's outputs leave in float32: its output layers compute as the level
says and cast what they return (a probability activation runs in float32
wherever it sits: `probabilities.py`); a subclassed model's inputs arrive in float32
and are cast to the level's dtype inside its `call`; inside a layer that
runs its own `call`, a sublayer whose compute dtype differs from its
caller's returns its outputs in the caller's dtype. Each is a cast wrapped
around the layer's `call` (`set_boundary_casts`), installed once, which
reads the latest dtypes at each call.
"""

import functools
import threading

import keras

from keras_mp._src import keras_internals
from keras_mp._src.backends import cpu_rates
from keras_mp._src.precision import handoff
from keras_mp._src.precision import layer_tree
from keras_mp._src.precision import probabilities
from keras_mp._src.precision import probability_ops
from keras_mp._src.precision import recomputed
from keras_mp._src.precision.probabilities import computes_in_float32

_CASTS_ATTRIBUTE = "_keras_mp_boundary_casts"
_ENTRY_DTYPE_ATTRIBUTE = "_keras_mp_entry_dtype"
_OUTPUT_DTYPE_ATTRIBUTE = "_keras_mp_output_dtype"
# On a model held by a subclassed model: the dtype it returns when called
# from outside that model's `call` (its `train_step`, `compute_loss`).
_OUTSIDE_DTYPE_ATTRIBUTE = "_keras_mp_outside_dtype"
# On a float32 probability layer returning half: its backward pass keeps
# the half output (`probabilities.kept_in_half`).
_HALF_KEPT_ATTRIBUTE = "_keras_mp_half_kept"
_HALF = ("float16", "bfloat16")
# How many subclassed models' own `call`s are running (this thread).
_MODEL_CALLS = threading.local()


def casts_of(layer):
    """`(entry_dtype, output_dtype)` of a layer's boundary casts
    (`set_boundary_casts`' arguments), or None."""
    if not getattr(layer, _CASTS_ATTRIBUTE, False):
        return None
    return (getattr(layer, _ENTRY_DTYPE_ATTRIBUTE), getattr(layer, _OUTPUT_DTYPE_ATTRIBUTE))


def reads_a_float32_table(layer, compute, variables):
    """Whether `layer`, computing in `compute` with `variables` of that
    dtype, is one whose float32 weights the device decides the read of
    (`cpu_rates.tables_in_half`): it does not autocast (a tied embedding
    read in reverse), computes in half, holds float32 weights (not O3's
    half table) and casts none itself (no `reverse_dtype`)."""
    return (
        compute in _HALF
        and variables == "float32"
        and not getattr(layer, "autocast", True)
        and getattr(layer, "reverse_dtype", None) is None
    )


def reads_weights_in_float32(layer):
    """The half dtype of the inputs a layer that does not autocast (a tied
    embedding read in reverse) multiplies by its weights read in float32 on
    this device (`cpu_rates.tables_in_half`), or None."""
    casts = casts_of(layer)
    if casts is None:
        return None
    variables = keras.backend.standardize_dtype(layer.variable_dtype)
    if not reads_a_float32_table(layer, casts[0], variables):
        return None
    return None if cpu_rates.tables_in_half(casts[0]) else casts[0]


def outside_dtype_of(layer):
    """The dtype a layer held by a subclassed model returns when called from
    outside that model's `call` (its `train_step`), or None."""
    return getattr(layer, _OUTSIDE_DTYPE_ATTRIBUTE, None)


def set_outside_dtype(layer, dtype):
    object.__setattr__(layer, _OUTSIDE_DTYPE_ATTRIBUTE, dtype)


def set_boundary_casts(layer, entry_dtype=None, output_dtype=None, *_):
    """Makes `layer` take `entry_dtype` inside its `call` and return `output_dtype`.

    - `entry_dtype`: its float32 inputs are cast to it inside `call`. A
      subclassed model's own policy is float32, so its inputs arrive in
      float32 (and `model.export` gets a float32 serving signature); inside
      `call` they are cast to the level's dtype, as a mixed policy on the
      model would, so that raw ops in `call` (a residual `x + attention(x)`)
      see the same dtype as the layers' outputs. An output layer that does
      not cast its own inputs (Keras's `Embedding` family: a tied
      embedding's logits) gets them in its compute dtype, and reads its
      weights in it where its inputs are floats (not a lookup's ids).
    - `output_dtype`: the layer's floating outputs are cast to it on the way
      out (Keras masks kept). Set for a model's float32 outputs, and for a
      sublayer whose compute dtype differs from the layer that calls it
      (`apply_amp`'s boundary rule), so that the caller's own arithmetic
      on its sublayers' outputs sees one dtype.

    `None` turns a cast off (a third value, saved by earlier releases, is
    ignored: `probabilities.py` computes probabilities in float32).
    Idempotent: the wrapper is installed once and reads the latest dtypes at
    each call.
    """
    installed = getattr(layer, _CASTS_ATTRIBUTE, False)
    if not installed and entry_dtype is None and output_dtype is None:
        return
    _install(layer)
    object.__setattr__(layer, _ENTRY_DTYPE_ATTRIBUTE, entry_dtype)
    object.__setattr__(layer, _OUTPUT_DTYPE_ATTRIBUTE, output_dtype)
    _set_half_kept(layer, output_dtype)


def _set_half_kept(layer, returned):
    """Whether `layer`, a float32 probability returning the half dtype
    `returned` (a cast of its own, or a hand-off to its graph's half
    consumers), keeps the half output for its backward pass."""
    object.__setattr__(
        layer,
        _HALF_KEPT_ATTRIBUTE,
        returned in _HALF
        and keras.backend.standardize_dtype(layer.compute_dtype) == "float32"
        and probabilities.keeps_half(layer),
    )


def _install(layer):
    """The wrapper around the layer's `call`, once (no casts until set)."""
    if getattr(layer, _CASTS_ATTRIBUTE, False):
        return
    for attribute in (_ENTRY_DTYPE_ATTRIBUTE, _OUTPUT_DTYPE_ATTRIBUTE):
        if not hasattr(layer, attribute):
            object.__setattr__(layer, attribute, None)
    # A quantized layer (int8, float8) runs `quantized_call`, not `call`:
    # both carry the casts, so quantizing after `apply_amp` keeps them too.
    for method in ("call", "quantized_call"):
        if hasattr(layer, method):
            object.__setattr__(layer, method, _with_boundary_casts(layer, getattr(layer, method)))
    object.__setattr__(layer, _CASTS_ATTRIBUTE, True)


def keeps_half_output(layer):
    """Whether `layer` returns a float32 probability in half and keeps the
    half output for its backward pass (`probabilities.kept_in_half`)."""
    return getattr(layer, _HALF_KEPT_ATTRIBUTE, False)


def _inside_a_model_call():
    return getattr(_MODEL_CALLS, "depth", 0) > 0


def _with_boundary_casts(layer, call):
    model = isinstance(layer, keras.Model)

    @functools.wraps(call)
    def call_with_boundary_casts(*args, **kwargs):
        entry = getattr(layer, _ENTRY_DTYPE_ATTRIBUTE)
        floats = False
        if entry is not None and entry != "float32":
            floats = any(_is_float(x) for x in keras.tree.flatten((args, kwargs)))
            args, kwargs = keras.tree.map_structure(lambda x: _cast_float(x, entry), (args, kwargs))
        target = getattr(layer, _OUTPUT_DTYPE_ATTRIBUTE)
        outside = outside_dtype_of(layer)
        if outside is not None and not _inside_a_model_call():
            target = outside
        if target is None:
            target = handoff.handed_dtype(layer)
        run = call
        if probability_ops.in_users_code(layer):
            # Your code's softmax in float32; returned as it is, in float32
            # where this layer's outputs leave in float32.
            run = probability_ops.own_call(call, target == "float32")
        if (
            target in _HALF
            and args
            and getattr(layer, _HALF_KEPT_ATTRIBUTE, False)
            and keras_internals.call_in_training()
        ):
            # A float32 probability handed to a half consumer: its backward
            # pass keeps the half output.
            return probabilities.kept_in_half(layer, run, target, args, kwargs)
        if entry is not None and model:
            _MODEL_CALLS.depth = getattr(_MODEL_CALLS, "depth", 0) + 1
            try:
                outputs = run(*args, **kwargs)
            finally:
                _MODEL_CALLS.depth -= 1
        elif floats:
            # A layer that does not autocast (a tied embedding's logits):
            # its weights read in its compute dtype too, where its inputs
            # are floats (a lookup of token ids reads the table as it is).
            # Not on a CPU that multiplies half in float32 anyway: there the
            # table is read as stored, float32 (as Keras's TensorFlow and
            # PyTorch policies read it, whatever scope the model's call
            # opened), and the matmul of half inputs runs in float32
            # (`cpu_rates.tables_in_half`).
            read = entry if cpu_rates.tables_in_half(entry) else None
            with keras_internals.AutocastScope(read):
                outputs = run(*args, **kwargs)
        elif recomputed.is_on(layer):
            outputs = recomputed.call(layer, run, args, kwargs)
        else:
            outputs = run(*args, **kwargs)
        if target is None:
            return outputs
        return keras.tree.map_structure(lambda x: _cast_half_or_float32(x, target), outputs)

    return call_with_boundary_casts


def _is_float(x):
    if not (keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor)):
        return False
    return keras.backend.standardize_dtype(x.dtype) in _COMPUTE_FLOATS


def _cast_float(x, dtype):
    """Casts a float32 tensor to `dtype`; anything else passes unchanged."""
    if not (keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor)):
        return x
    if keras.backend.standardize_dtype(x.dtype) != "float32":
        return x
    return keras.ops.cast(x, dtype)


_COMPUTE_FLOATS = ("float16", "bfloat16", "float32")


def _cast_half_or_float32(x, dtype):
    """Casts a float16/bfloat16/float32 tensor to `dtype`, keeping its Keras mask.

    Anything else (integers, booleans, float64, None) passes unchanged.
    """
    current = getattr(x, "dtype", None)
    if current is None or not (keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor)):
        return x
    current = keras.backend.standardize_dtype(current)
    if current == dtype or current not in _COMPUTE_FLOATS:
        return x
    mask = keras_internals.get_keras_mask(x) if keras.ops.is_tensor(x) else None
    y = keras.ops.cast(x, dtype)
    if mask is not None:
        keras_internals.set_keras_mask(y, mask)
    return y


# Keras's categorical and text preprocessing layers: their outputs are
# indices, one-hot vectors, counts and bins, exact in float32. In half, hash
# bins and vocabulary indices above 2048 (float16) or 256 (bfloat16) round
# to their neighbours', bin boundaries move, and TensorFlow's bincount has
# no half kernel. Keras pins most of them to `floatx()` under any global
# policy; keras_mp keeps them in float32 at every level.


def set_boundaries(model, outputs=None, entry_dtype=None, returning=(), own_float32=()):
    """The boundary rule: what a layer returns to the layer that calls it.

    `outputs` None (`to_float` on a layer): only the layers inside `model`
    are set; `model`'s own casts are left as they are.

    - A subclassed model that is the model (or one of its outputs) takes
      float32 inputs, computes inside in the level's `entry_dtype`, and
      returns float32.
    - Inside a layer that runs its own `call` (a composite layer such as
      `TransformerEncoder`, or a subclassed model), a sublayer whose compute
      dtype differs from its caller's returns its floating outputs in the
      caller's dtype: a float32 LayerNormalization inside a float16 block
      (O2) returns float16, a float16 Dense inside a float32 block (O1)
      returns float32. The caller's own arithmetic (`x + residual`) then
      sees one dtype, as it does under one Keras mixed policy.
    - Inside Sequential and functional models nothing is cast on the way
      out: Keras casts each layer's inputs to its own compute dtype.

    - An output layer of the model computing in half returns float32.
    - `returning`: ids of the float32 layers that return float32 to a
      caller computing in half, `own_float32`: of the subclassed models
      whose own arithmetic computes in float32 (`head_returns.py`).

    Returns:
        `(layer, dtype, caller)` for each layer that now returns a dtype
        other than its own compute dtype to its caller (caller None: the
        model's output).
    """
    inner_dtypes = {}
    graphs = {}
    # Layers a layer of its own code holds (a residual block's norm): it
    # may call them while a graph runs.
    held_by_code = {
        id(child)
        for layer, _ in layer_tree.tree(model)
        if not layer_tree.is_graph(layer)
        for child in keras_internals.children(layer)
    }
    returns = []
    for layer, parent in layer_tree.tree(model):
        recomputed.set_recomputed(layer, False)
        if outputs is None and layer is model:
            inner_dtypes[id(layer)] = None if layer_tree.is_graph(layer) else layer.compute_dtype
            continue
        if layer is model and layer_tree.is_graph(model):
            # A feature extractor's outputs that its layers also take in
            # leave in float32, cast here; its layers compute as the level says.
            inner_dtypes[id(layer)] = None
            extractor = layer_tree.intermediate_outputs(model)
            set_boundary_casts(layer, output_dtype="float32" if extractor else None)
            continue
        output = any(layer is o for o in outputs or ())
        if layer_tree.is_subclassed(layer) and (layer is model or output):
            entry = "float32" if id(layer) in own_float32 else entry_dtype
            inner_dtypes[id(layer)] = entry
            set_boundary_casts(layer, entry, "float32")
            continue
        if output and not layer_tree.is_container(layer):
            inner_dtypes[id(layer)] = layer.compute_dtype
            if _set_output_casts(layer):
                returns.append((layer, "float32", None))
            continue
        inner_dtypes[id(layer)] = None if layer_tree.is_graph(layer) else layer.compute_dtype
        caller_dtype = None if parent is None else inner_dtypes[id(parent)]
        # A layer or model held by the (subclassed) model: its own
        # `train_step` or `compute_loss` calls it too (a GAN's generator,
        # DDIM's normalizer), and gets float32, as from the model, whatever
        # the half dtype.
        held = parent is model and layer_tree.is_subclassed(model)
        set_outside_dtype(layer, "float32" if held else None)
        if caller_dtype is not None and id(layer) in returning:
            set_boundary_casts(layer, output_dtype="float32")
            returns.append((layer, "float32", parent))
        elif caller_dtype is not None and computes_in_float32(layer):
            # Its float32 probabilities reach a subclassed model's `call`, on
            # their way to its outputs, in float32 (a cast to half would round
            # the small ones to 0), as torch.autocast's softmax; a composite
            # layer's own arithmetic on them (a gate, `x * sigmoid(g)`) gets
            # them in its own dtype: TensorFlow's raw ops do not promote.
            target = "float32" if held else caller_dtype
            set_boundary_casts(layer, output_dtype=target)
            returns.append((layer, target, parent))
        elif caller_dtype is not None and (
            layer.compute_dtype != caller_dtype or layer_tree.is_container(layer) or held
        ):
            set_boundary_casts(layer, output_dtype=caller_dtype)
            # A float32 norm inside a half block keeps its half inputs.
            recomputed.set_recomputed(layer, caller_dtype in _HALF and recomputed.applies(layer))
            if layer.compute_dtype != caller_dtype:
                returns.append((layer, caller_dtype, parent))
        else:
            set_boundary_casts(layer)
            handed = None
            if layer_tree.is_graph(layer):
                handoff.mark_runs(layer)  # a graph inside calls its own layers
            if parent is not None and layer_tree.is_graph(parent) and id(layer) not in held_by_code:
                if id(parent) not in graphs:
                    graphs[id(parent)] = layer_tree.successors(parent)
                handed = handoff.half_for_consumers(layer, *graphs[id(parent)])
            if entry_dtype in _HALF and recomputed.applies(layer):
                _install(layer)  # a float32 norm of a graph: half inputs where they come
                recomputed.set_recomputed(layer, True)
            if handed is None:
                handoff.clear(layer)
            else:
                _install(layer)
                handoff.record(layer, parent, *handed)
                _set_half_kept(layer, handed[0])
                returns.append((layer, handed[0], parent))
    set_probability_ops(model)
    return returns


def set_probability_ops(model):
    """Keras's probability ops in float32 in `model`'s graphs and in its
    users' layers computing in half (`probability_ops.py`), whose `call`
    then runs in its frame."""
    for layer in probability_ops.set_probability_ops(model, _own_dtype):
        _install(layer)


def _own_dtype(layer):
    """The dtype a layer's own `call` computes in: its inputs' inside a
    subclassed model (whose policy is float32), else its compute dtype."""
    entry = getattr(layer, _ENTRY_DTYPE_ATTRIBUTE, None)
    return entry if entry is not None else layer.compute_dtype


def _set_output_casts(layer):
    """An output layer's casts: float32 out when it computes in half (its
    inputs in half too when it does not cast them itself). Returns whether
    it computes in half."""
    compute = keras.backend.standardize_dtype(layer.compute_dtype)
    if compute == "float32" or compute not in _COMPUTE_FLOATS:
        set_boundary_casts(layer)
        return False
    entry = None if layer.autocast else compute
    set_boundary_casts(layer, entry_dtype=entry, output_dtype="float32")
    return True
