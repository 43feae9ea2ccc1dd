"""Log-probability of each row's label and the row's entropy under `softmax(logits / temperature)`, computed a few
rows at a time: the memory-lean form of `log_softmax(logits.float() / temperature).gather(...)` for the loss."""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

__all__ = ["CHUNK_ELEMENTS", "selected_logprobs"]

# A chunk of ~4 MB in fp32 (21 rows of a 49k vocabulary): its few passes are served from a CPU's cache rather than
# from memory, and the chunks are few enough that their Python overhead does not count (a small vocabulary gets few,
# large chunks). On an accelerator each chunk costs a few kernel launches instead, so the chunks are large there.
CHUNK_ELEMENTS = 1 << 20
_ACCELERATOR_CHUNK_ROWS = 1024


def selected_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *, chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprobs, entropy)` of `softmax(logits / temperature)`: each row's label and the whole distribution.

    The same values and gradient as `torch.log_softmax(logits.float() / temperature, -1).gather(1, labels[:, None])`
    with the entropy `-(p * log p).sum(-1)`, without the full-size intermediates: the rows are processed
    `chunk_rows` at a time, only `logits`, `labels` and the per-row log-normaliser are kept for backward, and the
    backward recomputes the probabilities into the one `(M, V)` gradient it returns (in the logits' dtype).

    The entropy is detached (a metric); for an entropy with gradient, or a truncated (top-k/top-p/min-p)
    distribution, use the plain formula. The arithmetic is float32 whatever the logits' dtype (float64 for float64
    logits); a minus-infinite logit gets probability 0 and is left out of the entropy, as the plain formula with
    `where(isfinite(...))` does.

    Args:
        logits: `(M, V)` floating point, with or without grad.
        labels: `(M,)` integer token ids in `[0, V)`.
        temperature: divides the logits (positive).
        chunk_rows: rows per chunk; None: `CHUNK_ELEMENTS // V` (at least 1) on a CPU, 1024 on an accelerator.

    Returns:
        `(logprobs, entropy)`, each `(M,)` float32 (float64 for float64 logits); `entropy` never requires grad.
    """
    if temperature <= 0:
        raise ValueError(f"`temperature={temperature}` must be positive (it divides the logits).")
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"expected logits (M, V) and labels (M,), got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if chunk_rows is None:
        cpu = logits.device.type == "cpu"
        chunk_rows = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1])) if cpu else _ACCELERATOR_CHUNK_ROWS
    if chunk_rows < 1:
        raise ValueError(f"`chunk_rows={chunk_rows}` must be at least 1.")
    if torch.is_grad_enabled() and logits.requires_grad:
        logprobs, entropy = _SelectedLogprobs.apply(logits, labels, float(temperature), chunk_rows)
        return logprobs, entropy
    logprobs, entropy, _ = _forward(logits.detach(), labels, float(temperature), chunk_rows)
    return logprobs, entropy


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_rows):
        logprobs, entropy, log_norm = _forward(logits, labels, temperature, chunk_rows)
        ctx.save_for_backward(logits, labels, log_norm)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, _grad_entropy):
        logits, labels, log_norm = ctx.saved_tensors
        return _backward(logits, labels, log_norm, grad_logprobs, ctx.temperature, ctx.chunk_rows), None, None, None


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled(chunk: torch.Tensor, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """`chunk.float() / temperature` into `out`: cast first, then divide in the compute dtype (the plain formula's
    rounding; dividing with a narrower `chunk` would divide in its dtype)."""
    if chunk.dtype == out.dtype:
        return torch.div(chunk, temperature, out=out)
    return out.copy_(chunk).div_(temperature)


def _without_autocast(compute):
    """Runs `compute` with autocast off: under `precision="bf16-mixed"` the entropy's batched product would otherwise
    run in bf16, and the arithmetic stays in the compute dtype, as without autocast."""

    @functools.wraps(compute)
    def wrapped(logits: torch.Tensor, *args):
        with torch.autocast(logits.device.type, enabled=False):
            return compute(logits, *args)

    return wrapped


@_without_autocast
def _forward(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logprobs, entropy, log_norm)`, each `(M,)`, a chunk of rows at a time (two chunk-sized buffers, reused)."""
    dtype = _compute_dtype(logits)
    rows, vocab = logits.shape
    logprobs = torch.empty(rows, dtype=dtype, device=logits.device)
    entropy, log_norm = torch.empty_like(logprobs), torch.empty_like(logprobs)
    scaled = torch.empty(min(chunk_rows, rows), vocab, dtype=dtype, device=logits.device)
    exp = torch.empty_like(scaled)
    labels = labels.long()
    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        s, e = _scaled(logits[start:end], temperature, scaled[: end - start]), exp[: end - start]
        label_logit = s.gather(1, labels[start:end, None]).squeeze(1)
        # torch.logsumexp's own steps (max, exp of the shifted logits, sum, log, add), so the log-normaliser is the
        # plain formula's; the shifted logits stay for the entropy
        top = s.amax(1, keepdim=True)
        s.sub_(top)
        torch.exp(s, out=e)
        total = e.sum(1)
        lse = total.log().add_(top.squeeze(1))
        # entropy = log Z - sum(e * (s - max)) / Z with Z = sum(e): the shifted form, free of the cancellation of
        # lse - sum(p * s) at large logits; one dot product per row (`vecdot`: a batched (1, V) x (V, 1) product
        # is several times slower on CPU)
        weighted = torch.linalg.vecdot(e, s)
        if weighted.isnan().any():  # 0 * -inf at a minus-infinite logit: leave that token out of the sum
            bad = weighted.isnan()
            weighted[bad] = (e[bad] * torch.where(torch.isfinite(s[bad]), s[bad], 0.0)).sum(1)
        log_norm[start:end] = lse
        logprobs[start:end] = label_logit - lse
        entropy[start:end] = total.log() - weighted / total
    return logprobs, entropy, log_norm


@_without_autocast
def _backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_norm: torch.Tensor,
    grad: torch.Tensor,
    temperature: float,
    chunk_rows: int,
) -> torch.Tensor:
    """`(onehot(label) - p) * grad / temperature`, written chunk by chunk into one new tensor like `logits`."""
    dtype = _compute_dtype(logits)
    rows, vocab = logits.shape
    out = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if rows == 0:
        return out
    direct = out.dtype == dtype  # compute in `out`'s rows themselves; otherwise in a buffer, then cast into them
    buffer = None if direct else torch.empty(min(chunk_rows, rows), vocab, dtype=dtype, device=logits.device)
    grad = grad.to(dtype)
    labels = labels.long()
    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        p = _scaled(logits[start:end], temperature, out[start:end] if buffer is None else buffer[: end - start])
        g = grad[start:end, None]
        # autograd's steps for the plain formula (logsumexp's, then gather's, then the division's backward), so the
        # gradient is the plain formula's to the last bit; dividing by 1 changes nothing
        p.sub_(log_norm[start:end, None]).exp_().mul_(-g)
        p.scatter_add_(1, labels[start:end, None], g)
        if temperature != 1.0:
            p.div_(temperature)
        if not direct:
            out[start:end].copy_(p)
    return out
