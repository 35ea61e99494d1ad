"""PyTorch: a loss computed over chunks of tokens (`precision/lm_loss.py`
gives the arithmetic).

`torch.autograd.Function`s whose forward runs the chunks one after the
other, recording nothing; one chunk's logits are alive at a time. A reduced
loss (`chunked_loss`): the forward computes each chunk's gradients with
its loss (the weights' added in float32) and saves them; the backward
multiplies them by its scalar. Each token's loss (`chunked_token_losses`,
`reduction="none"`): the forward saves the hidden states, the labels, the
weights (inputs all three) and a float32 log-sum-exp per token; the
backward runs the chunks again.
"""

import functools


def chunked_token_losses(chunks, hidden, labels, weights, chunk):
    """`(losses, correct)`, one each per row of `hidden` (`[tokens, hidden
    size]`; `labels`: `[tokens]`), `chunk` rows at a time."""
    return _function().apply(chunks, int(chunk), hidden, labels, *weights)


def chunked_loss(chunks, hidden, labels, share, prescale, weights, chunk):
    """`(loss, losses, correct)`: `sum(share * losses)` over the rows of
    `hidden`, each row's loss and argmax hit, `chunk` rows at a time."""
    return _loss_function().apply(chunks, int(chunk), hidden, labels, share, prescale, *weights)


def matmul32(equation, a, b):
    """A matmul with a float32 result (the chunks' gradients are added in
    float32). Half operands on a GPU: the half GEMM accumulating in float32,
    its result not rounded to half (`torch.mm`'s `out_dtype`); on a CPU the
    operands come in float32 (`lm_loss.gemm_dtype`)."""
    import torch

    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return torch.einsum(equation, a, b)
    if a.device.type == "cpu":
        return torch.einsum(equation, a.float(), b.float())
    return _mm32(equation, a, b)


def _mm32(equation, a, b):
    """A two-dimensional einsum (one index summed) as `torch.mm` with a
    float32 result."""
    import torch

    inputs, out = equation.split("->")
    left, right = inputs.split(",")
    (k,) = set(left) & set(right)
    a = a if left[1] == k else a.t()
    b = b if right[0] == k else b.t()
    result = torch.mm(a, b, out_dtype=torch.float32)
    first = left.replace(k, "")
    return result if out[0] == first else result.t()


def rounded(x):
    """PyTorch's half ops round each result (eager): nothing to add."""
    return x


@functools.cache
def _function():
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

    return ChunkedTokenLosses


@functools.cache
def _loss_function():
    import torch

    class ChunkedLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, chunks, chunk, hidden, labels, share, prescale, *weights):
            ready = chunks.prepare(weights)
            wanted = ctx.needs_input_grad[2] or any(ctx.needs_input_grad[6:])
            total = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in weights]
            dh = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            losses, correct = [], []
            for i in range(0, hidden.shape[0], chunk):
                rows = slice(i, i + chunk)
                if wanted:
                    part, token_losses, hits, dh[rows], grads = chunks.with_gradients(
                        hidden[rows], labels[rows], share[rows], prescale, ready, matmul32, rounded
                    )
                    for t, g in zip(total, grads):
                        t.add_(g)
                else:
                    token_losses, _, hits = chunks.forward(
                        hidden[rows], labels[rows], ready, rounded
                    )
                    part = torch.sum(token_losses * share[rows])
                loss = loss + part
                losses.append(token_losses)
                correct.append(hits)
            losses, correct = torch.cat(losses), torch.cat(correct)
            ctx.save_for_backward(dh, prescale, *total)
            ctx.dtypes = (hidden.dtype,) + tuple(w.dtype for w in weights)
            ctx.wanted = (ctx.needs_input_grad[2],) + tuple(ctx.needs_input_grad[6:])
            ctx.mark_non_differentiable(losses, correct)
            return loss, losses, correct

        @staticmethod
        def backward(ctx, upstream, *_):
            dh, prescale, *total = ctx.saved_tensors
            factor = torch.where(prescale > 0, upstream / torch.where(prescale > 0, prescale, 1), 0)
            grads = [
                (g * factor).to(d) if wanted else None
                for g, d, wanted in zip([dh] + total, ctx.dtypes, ctx.wanted)
            ]
            return (None, None, grads[0], None, None, None, *grads[1:])

    return ChunkedLoss
