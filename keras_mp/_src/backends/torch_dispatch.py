"""Matmuls and convolutions PyTorch dispatches in one train step, with their
dtypes and FLOPs, seen by a `TorchDispatchMode` (below autograd: the
backward's matmuls are there too). The step runs; every variable of the
model, its optimizer and its metrics is put back as it was.

FLOPs from the operands' shapes: `mm`/`addmm` 2MNK, `bmm`/`baddbmm` 2BMNK,
`convolution` 2 x its output's elements x the taps each sums, and
`convolution_backward` the same for each gradient it computes; fused
attention (`scaled_dot_product_*`) 4 x batch x heads x queries x keys x
head size forward, twice that backward. An FP8 GEMM (`_scaled_mm`), and a
matmul of two values cast from FP8 and back (Keras's float8 layers:
scaled, viewed, transposed), is "float8".
"""

import gc
import math
import weakref

from keras_mp._src import keras_internals


def matmuls_of_one_step(model, data, fp8_operands=None):
    """`(kind, dtype, flops)` of each matmul and convolution of one
    `train_on_batch` of `data` (`(x, y)`); the two operands' dtypes of each
    FP8 GEMM (`_scaled_mm`, sorted) appended to `fp8_operands` if given."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    found = []
    # The storages of tensors cast from FP8 (scaled, moved): a view, and the
    # tensor autograd saves for the backward pass, share their tensor's.
    dequantized = set()

    def marked(tensor):
        return storage_of(tensor) in dequantized

    def mark(tensor):
        pointer = storage_of(tensor)
        if pointer is not None and pointer not in dequantized:
            dequantized.add(pointer)
            # Unmarked when the memory is freed (PyTorch keeps one Python
            # object per storage while it lives), not when this tensor is.
            weakref.finalize(tensor.untyped_storage(), dequantized.discard, pointer)

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if isinstance(out, torch.Tensor) and (
                (name == "_to_copy" and tensors and "float8" in _dtype(tensors[0]))
                or (name in _CARRIES and any(marked(t) for t in tensors))
            ):
                mark(out)
            entry = _census(name, args, out)
            if name == "_scaled_mm" and fp8_operands is not None:
                fp8_operands.append(tuple(sorted(_dtype(t) for t in tensors[:2])))
            if entry is not None and entry[0] == "dot":
                operands = tensors[-2:]
                if len(operands) == 2 and all(marked(t) for t in operands):
                    entry = ("dot", "float8", entry[2])
            if entry is not None:
                found.append(entry)
            return out

    keras_internals.build_for_training(model, data)
    variables = _state(model)
    before = [torch.clone(v.value.detach()) for v in variables]
    try:
        with Census():
            model.train_on_batch(*data)
    finally:
        for variable, value in zip(variables, before):
            variable.assign(value)
    return found


def memory_of_one_step(model, data):
    """`(held, saved)` of one `train_on_batch` of `data`: the most bytes of
    storages the step creates alive at once (seen by a `TorchDispatchMode`,
    each freed when PyTorch frees it), and `{dtype: bytes}` of the tensors
    autograd saves for the backward pass (each storage once; the variables'
    own storages aside)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    keras_internals.build_for_training(model, data)
    variables = _state(model)
    before = [torch.clone(v.value.detach()) for v in variables]
    own = {storage_of(v.value) for v in variables}
    live = {"now": 0, "peak": 0}
    alive = set()
    saved, seen = {}, set()

    def freed(pointer, size):
        alive.discard(pointer)
        live["now"] -= size

    def pack(tensor):
        pointer = storage_of(tensor)
        if pointer is not None and pointer not in own and (pointer, tensor.dtype) not in seen:
            seen.add((pointer, tensor.dtype))
            dtype = _dtype(tensor)
            saved[dtype] = saved.get(dtype, 0) + tensor.untyped_storage().nbytes()
        return tensor

    class Peak(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                pointer = storage_of(tensor) if isinstance(tensor, torch.Tensor) else None
                if pointer is None or pointer in alive or pointer in own:
                    continue
                size = tensor.untyped_storage().nbytes()
                alive.add(pointer)
                live["now"] += size
                live["peak"] = max(live["peak"], live["now"])
                weakref.finalize(tensor.untyped_storage(), freed, pointer, size)
            return out

    # Python's cyclic collector would free some tensors (a cycle through
    # the autograd graph) at a moment that depends on the process's history:
    # not during the step, the same count in any process.
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with Peak(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.train_on_batch(*data)
    finally:
        if collecting:
            gc.enable()
        for variable, value in zip(variables, before):
            variable.assign(value)
    return live["peak"], saved


def largest_of_one_step(model, data):
    """The elements of the largest floating-point tensor an op of one
    `train_on_batch` of `data` makes (forward, backward, update)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    largest = [0]

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                    largest[0] = max(largest[0], tensor.numel())
            return out

    keras_internals.build_for_training(model, data)
    variables = _state(model)
    before = [torch.clone(v.value.detach()) for v in variables]
    try:
        with Largest():
            model.train_on_batch(*data)
    finally:
        for variable, value in zip(variables, before):
            variable.assign(value)
    return largest[0]


def storage_of(tensor):
    """The address of a tensor's storage, or None (a tensor without one)."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return pointer or None


_CARRIES = {"mul", "t", "transpose", "permute", "view", "_unsafe_view", "reshape", "expand"}
_CARRIES |= {"clone", "contiguous", "alias", "detach"}


def _state(model):
    variables = list(model.variables)
    if model.optimizer is not None:
        variables += list(model.optimizer.variables)
    variables += list(model.metrics_variables)
    seen, unique = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            unique.append(v)
    return unique


def _dtype(tensor):
    return str(tensor.dtype).replace("torch.", "")


def _census(name, args, out):
    if name in ("mm", "bmm"):
        a = args[0]
        return "dot", _dtype(a), 2 * math.prod(out.shape) * a.shape[-1]
    if name == "_scaled_mm":
        a = args[0]
        return "dot", "float8", 2 * math.prod(out.shape) * a.shape[-1]
    if name in ("addmm", "baddbmm"):
        a = args[1]
        return "dot", _dtype(a), 2 * math.prod(out.shape) * a.shape[-1]
    if name == "convolution":
        weight = args[1]
        return (
            "convolution",
            _dtype(args[0]),
            2 * math.prod(out.shape) * math.prod(weight.shape[1:]),
        )
    if name == "convolution_backward":
        grad_output, weight, mask = args[0], args[2], args[-1]
        each = 2 * math.prod(grad_output.shape) * math.prod(weight.shape[1:])
        return "convolution", _dtype(grad_output), each * sum(bool(m) for m in mask[:2])
    if name.startswith("_scaled_dot_product"):
        # (query, key, ...) forward; (grad_out, query, key, ...) backward.
        backward = name.endswith("backward")
        query, key = args[1:3] if backward else args[:2]
        flops = 4 * math.prod(query.shape[:-1]) * key.shape[-2] * query.shape[-1]
        return "attention", _dtype(query), 2 * flops if backward else flops
    return None
