"""Log-probability of each row's label and the row's entropy under `softmax(logits / temperature)`, computed a few
rows at a time: the memory-lean form of `log_softmax(logits.float() / temperature).gather(...)` for the loss.

On a CPU a C kernel (`logprob_rows.c`) computes float32 and bf16 logits in two passes over each row forward and one
backward, on torch's threads, where torch's operations take about a dozen passes over chunks of rows (a cast, the
division, the maximum, the exponentials, the sums, the entropy's product, and the backward's own). Where the kernel
cannot run (not x86 with AVX2 and FMA, no C compiler, a failed build, or `LIGHTNING_GRPO_LOGPROB_KERNEL=0`) the
chunks of torch's operations run instead, and the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from ..rollout import native_build

__all__ = ["CHUNK_ELEMENTS", "ENV_SWITCH", "kernel_unavailable_reason", "selected_logprobs"]

#: Set to "0" to compute with torch's operations instead of the C kernel.
ENV_SWITCH = "LIGHTNING_GRPO_LOGPROB_KERNEL"
_SOURCE = Path(__file__).with_name("logprob_rows.c")
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)

# A chunk of ~4 MB in fp32 (21 rows of a 49k vocabulary): its few passes are served from a CPU's cache rather than
# from memory, and the chunks are few enough that their Python overhead does not count (a small vocabulary gets few,
# large chunks). On an accelerator each chunk costs a few kernel launches instead, so the chunks are large there.
CHUNK_ELEMENTS = 1 << 20
_ACCELERATOR_CHUNK_ROWS = 1024


def selected_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_rows: int | None = None,
    kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprobs, entropy)` of `softmax(logits / temperature)`: each row's label and the whole distribution.

    The same values and gradient as `torch.log_softmax(logits.float() / temperature, -1).gather(1, labels[:, None])`
    with the entropy `-(p * log p).sum(-1)`, without the full-size intermediates: the rows are processed
    `chunk_rows` at a time, only `logits`, `labels` and the per-row log-normaliser are kept for backward, and the
    backward recomputes the probabilities into the one `(M, V)` gradient it returns (in the logits' dtype).

    The entropy is detached (a metric); for an entropy with gradient, or a truncated (top-k/top-p/min-p)
    distribution, use the plain formula. The arithmetic is float32 whatever the logits' dtype (float64 for float64
    logits); a minus-infinite logit gets probability 0 and is left out of the entropy, as the plain formula with
    `where(isfinite(...))` does. torch's chunks take the plain formula's steps, so their values and gradient are
    `gather - logsumexp`'s to the last bit; the C kernel's are within float32 rounding of them (its exponential's
    relative error is about 2e-7, and it sums in another order).

    Args:
        logits: `(M, V)` floating point, with or without grad.
        labels: `(M,)` integer token ids in `[0, V)`.
        temperature: divides the logits (positive).
        chunk_rows: rows per chunk of torch's operations; None: `CHUNK_ELEMENTS // V` (at least 1) on a CPU, 1024
            on an accelerator.
        kernel: None: the C kernel where it can run (CPU float32 or bf16 logits whose rows are contiguous, see the
            module's docstring), else torch's chunks; False: torch's chunks; True: the kernel, or an error saying
            why it cannot run.

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
    use_kernel = _use_kernel(logits, labels, kernel)
    if use_kernel:  # the kernel reads int64 ids in one block; forward and backward share this copy
        labels = labels.to(torch.int64).contiguous()
    if torch.is_grad_enabled() and logits.requires_grad:
        logprobs, entropy = _SelectedLogprobs.apply(logits, labels, float(temperature), chunk_rows, use_kernel)
        return logprobs, entropy
    forward = _kernel_forward if use_kernel else _forward
    logprobs, entropy, _ = forward(logits.detach(), labels, float(temperature), chunk_rows)
    return logprobs, entropy


def kernel_unavailable_reason() -> str | None:
    """Why the C kernel cannot run here, or None when it can (it is built and loaded on the first call)."""
    return _load()[1]


def _use_kernel(logits: torch.Tensor, labels: torch.Tensor, kernel: bool | None) -> bool:
    """Whether the C kernel computes these logits (see `selected_logprobs`' `kernel`)."""
    if kernel is False:
        return False
    why: str | None
    if not (logits.device.type == "cpu" and logits.dtype in _KERNEL_DTYPES):  # checked first: no build on a GPU
        why = f"it takes float32 or bf16 logits on a CPU, not {logits.dtype} on {logits.device}"
    elif logits.shape[1] > 1 and logits.stride(-1) != 1:
        why = f"it takes logits whose rows are contiguous, not strides {tuple(logits.stride())}"
    else:
        why = _load()[1]
    if why is not None and kernel:
        raise RuntimeError(f"selected_logprobs(kernel=True): the C kernel cannot run: {why}. Pass kernel=None.")
    if why is None and labels.numel() and not (int(labels.min()) >= 0 and int(labels.max()) < logits.shape[1]):
        raise ValueError(
            f"labels must be token ids in [0, {logits.shape[1]}), got {int(labels.min())} to {int(labels.max())}"
        )
    return why is None


class _SelectedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_rows, use_kernel):
        forward = _kernel_forward if use_kernel else _forward
        logprobs, entropy, log_norm = forward(logits, labels, temperature, chunk_rows)
        ctx.save_for_backward(logits, labels, log_norm)
        ctx.temperature, ctx.chunk_rows, ctx.use_kernel = temperature, chunk_rows, use_kernel
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, _grad_entropy):
        logits, labels, log_norm = ctx.saved_tensors
        backward = _kernel_backward if ctx.use_kernel else _backward
        grad = backward(logits, labels, log_norm, grad_logprobs, ctx.temperature, ctx.chunk_rows)
        return grad, None, None, None, None


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


# -- the C kernel ------------------------------------------------------------------------------------------------------


def _kernel_forward(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, _chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_forward`'s `(logprobs, entropy, log_norm)` from the C kernel (`labels` contiguous int64)."""
    functions = _kernel()
    rows, vocab = logits.shape
    logprobs, entropy, log_norm = (torch.empty(rows, dtype=torch.float32) for _ in range(3))
    functions["logprob_rows_forward"](
        logits.data_ptr(), rows, vocab, logits.stride(0), int(logits.dtype == torch.bfloat16), temperature,
        labels.data_ptr(), logprobs.data_ptr(), entropy.data_ptr(), log_norm.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return logprobs, entropy, log_norm


def _kernel_backward(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_norm: torch.Tensor,
    grad: torch.Tensor,
    temperature: float,
    _chunk_rows: int,
) -> torch.Tensor:
    """`_backward`'s gradient, like `logits`, from the C kernel (`labels` contiguous int64)."""
    functions = _kernel()
    rows, vocab = logits.shape
    out = torch.empty(rows, vocab, dtype=logits.dtype)
    grad = grad.to(torch.float32).contiguous()
    functions["logprob_rows_backward"](
        logits.data_ptr(), rows, vocab, logits.stride(0), int(logits.dtype == torch.bfloat16), temperature,
        labels.data_ptr(), log_norm.data_ptr(), grad.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def _kernel() -> dict[str, Callable[..., int]]:
    functions, why = _load()
    if functions is None:  # `_use_kernel` chose the kernel, so it loaded
        raise RuntimeError(f"selected_logprobs' C kernel cannot run: {why}")
    return functions


@functools.cache
def _load() -> tuple[dict[str, Callable[..., int]] | None, str | None]:
    """({name: the kernel's function}, None), or (None, why not); the reason is logged once."""
    head = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_float]
    pointers = [ctypes.c_void_p] * 4
    return native_build.load_functions(
        _SOURCE,
        {
            "logprob_rows_forward": [*head, *pointers, ctypes.c_int],
            "logprob_rows_backward": [*head, *pointers, ctypes.c_int],
        },
        switch=ENV_SWITCH,
        kernel="log-probability kernel",
        fallback="torch's operations",
        wide=True,
        owner="trainer",
    )
