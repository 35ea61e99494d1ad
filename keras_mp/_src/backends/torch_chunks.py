"""PyTorch: a loss computed over chunks of tokens, with a gradient that
computes each chunk again (`precision/lm_loss.py` gives the arithmetic).

One `torch.autograd.Function`: its forward runs the chunks one after the
other, recording nothing, and saves the hidden states, the labels, the
weights (inputs all three) and a float32 log-sum-exp per token; its
backward runs them again, adding the weights' gradients in float32. One
chunk's logits are alive at a time.
"""


def chunked_token_losses(chunks, hidden, labels, weights, chunk):
    """`(losses, correct)`, one each per row of `hidden` (`[tokens, hidden
    size]`; `labels`: `[tokens]`), `chunk` rows at a time."""
    return _function().apply(chunks, int(chunk), hidden, labels, *weights)


def matmul32(equation, a, b):
    """A half matmul with a float32 result, added across chunks in float32.
    On a GPU the half GEMM's (it accumulates in float32, then rounds to
    half once per chunk, as Liger-Kernel's); on a CPU a float32 GEMM of the
    half operands, exact products, no rounding to half (its half GEMMs
    convert to float32 anyway, unless it has AMX)."""
    import torch

    if a.device.type == "cpu":
        return torch.einsum(equation, a.float(), b.float())
    return torch.einsum(equation, a, b).float()


def rounded(x):
    """PyTorch's half ops round each result (eager): nothing to add."""
    return x


_Function = None


def _function():
    global _Function
    if _Function is not None:
        return _Function
    import torch

    class ChunkedTokenLosses(torch.autograd.Function):
        @staticmethod
        def forward(ctx, chunks, chunk, hidden, labels, *weights):
            ready = chunks.prepare(weights)
            parts = [
                chunks.forward(hidden[i : i + chunk], labels[i : i + chunk], ready, rounded)
                for i in range(0, hidden.shape[0], chunk)
            ]
            losses, lse, correct = (torch.cat(p) for p in zip(*parts))
            ctx.chunks, ctx.chunk = chunks, chunk
            ctx.save_for_backward(hidden, labels, lse, *weights)
            ctx.mark_non_differentiable(correct)
            return losses, correct

        @staticmethod
        def backward(ctx, upstream, _):
            hidden, labels, lse, *weights = ctx.saved_tensors
            chunks, chunk = ctx.chunks, ctx.chunk
            ready = chunks.prepare(weights)
            total = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in weights]
            dh = torch.empty_like(hidden)
            if upstream is None:
                upstream = torch.zeros_like(lse)
            for i in range(0, hidden.shape[0], chunk):
                rows = slice(i, i + chunk)
                dh[rows], grads = chunks.backward(
                    hidden[rows], labels[rows], lse[rows], upstream[rows], ready, matmul32, rounded
                )
                for t, g in zip(total, grads):
                    t.add_(g)
            grads = [t.to(w.dtype) if w.requires_grad else None for t, w in zip(total, weights)]
            return (None, None, dh if hidden.requires_grad else None, None, *grads)

    _Function = ChunkedTokenLosses
    return _Function
