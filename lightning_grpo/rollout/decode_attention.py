"""A decode step's attention over the embedded generator's slot cache, in one C call (`decode_attention.c`).

Each running row appends its new key and value to its slot, then its query heads attend to the slot's filled
positions (the last `window` of them in a sliding-window layer), softcapped where the family caps its scores. torch
would run this as several operations per layer: an indexed write into the cache, a batched product that copies the
slot's keys and values first, a mask, a softmax and a second product, each over bf16 values rounded between steps.
The kernel reads every cached key and value once, in place, for all the query heads that share it, computes in
float32, and rounds the output once. Rows whose slots start with the same prompt (`RowGroups`: the completions of
a GRPO group) read that prompt's keys and values once for all of them.

It needs an x86-64 CPU with AVX2 and FMA and a C compiler (`native_build`; 16-lane AVX-512 code where torch runs
AVX-512); `available()` says whether it runs here and `unavailable_reason()` why not
(`LIGHTNING_GRPO_DECODE_ATTENTION=0` turns it off). The decoder then runs torch's operations instead.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import native_build

#: Set to "0" to run torch's operations instead.
ENV_SWITCH = "LIGHTNING_GRPO_DECODE_ATTENTION"
#: The dtypes the kernel takes.
DTYPES = (torch.float32, torch.bfloat16)
#: The fewest (row, key/value head) pairs per thread worth starting a thread for.
PAIRS_PER_THREAD = 16
#: The units of work (a group's rows against one key/value head) `spread` aims for per thread, so that unequal units
#: still leave the threads about equal shares.
UNITS_PER_THREAD = 2

_SOURCE = Path(__file__).with_name("decode_attention.c")


@dataclass(frozen=True)
class RowGroups:
    """The rows of a step in groups whose slots start with the same prefix: `order` lists the rows group after
    group, group `g` being `order[starts[g]:starts[g + 1]]`, whose first `prefix[g]` positions hold the same keys and
    values in every member's slot (0: nothing shared). All int64. Make it with `row_groups` or `single_rows`, which
    check what the kernel relies on."""

    order: torch.Tensor
    starts: torch.Tensor
    prefix: torch.Tensor

    @property
    def count(self) -> int:
        return self.prefix.numel()


def row_groups(prefix_ids: torch.Tensor, prefix_lengths: torch.Tensor, lengths: torch.Tensor) -> RowGroups:
    """Group the rows by `prefix_ids` (rows, int64): rows with the same id > 0 share their slots' first
    `prefix_lengths` positions (the same for all of them); an id of 0 is a row alone.

    Raises:
        ValueError: rows of one id with different prefix lengths, or a prefix longer than a member's `lengths`.
    """
    rows = prefix_ids.numel()
    order = torch.argsort(prefix_ids, stable=True)
    ids, shared = prefix_ids[order], torch.where(prefix_ids > 0, prefix_lengths, 0)[order]
    new = torch.ones(rows, dtype=torch.bool)
    new[1:] = (ids[1:] != ids[:-1]) | (ids[1:] == 0)
    firsts = new.nonzero().squeeze(1)
    starts = torch.cat([firsts, torch.tensor([rows])])
    prefix = shared[firsts]
    if bool((shared != prefix.repeat_interleave(starts.diff())).any() or (shared > lengths[order]).any()):
        raise ValueError(
            f"row_groups: rows of one prefix id with different prefix lengths, or a prefix longer than a row's "
            f"filled positions (ids {prefix_ids.tolist()}, prefix lengths {prefix_lengths.tolist()}, lengths "
            f"{lengths.tolist()})."
        )
    return RowGroups(order, starts, prefix)


def single_rows(rows: int) -> RowGroups:
    """Every row alone: nothing shared."""
    return RowGroups(torch.arange(rows), torch.arange(rows + 1), torch.zeros(rows, dtype=torch.long))


def available() -> bool:
    """Whether `attend` can run here (the kernel is built and loaded on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    return _load()[1]


def c_function() -> int:
    """The address of the kernel's `decode_attention` in C, for a caller in C (`fused_decode`); 0 where it cannot
    run."""
    kernel = _load()[0]
    return 0 if kernel is None else native_build.address(kernel)


def threads_for(groups: RowGroups, kv_heads: int) -> int:
    """The threads `attend` runs on: torch's, at most one per `PAIRS_PER_THREAD` (row, key/value head) pairs, and
    no more than the units of work, a (group, key/value head) pair each (`spread` cuts large groups for more)."""
    return max(1, min(_row_threads(groups, kv_heads), groups.count * kv_heads))


def spread(groups: RowGroups, kv_heads: int) -> RowGroups:
    """`groups` with large groups cut into parts of at least two rows each (every part keeps the group's shared
    prefix), where the threads `threads_for` would give these rows have fewer than `UNITS_PER_THREAD` units each.

    A thread attends for whole (group, key/value head) pairs, so 64 completions of one prompt with 3 key/value heads
    are 3 units, too few to share between threads. A part reads the prefix's keys and values once for its rows
    instead of once for the group, and every row's arithmetic is the same as in the whole group (a part of one row
    would not share, and would sum in another order, so there is none).
    """
    threads = _row_threads(groups, kv_heads)
    wanted = threads * UNITS_PER_THREAD
    if threads <= 1 or groups.count * kv_heads >= wanted:
        return groups
    cuts = -(-wanted // (groups.count * kv_heads))  # parts per group, where it has the rows for them
    starts, prefix = [0], []
    bounds_of_groups = zip(groups.starts[:-1].tolist(), groups.starts[1:].tolist(), groups.prefix.tolist(), strict=True)
    for begin, end, shared in bounds_of_groups:
        parts = max(1, min(cuts, (end - begin) // 2)) if shared > 0 else 1
        bounds = [begin + (end - begin) * i // parts for i in range(1, parts + 1)]
        starts.extend(bounds)
        prefix.extend([shared] * parts)
    return RowGroups(groups.order, torch.tensor(starts), torch.tensor(prefix))


def _row_threads(groups: RowGroups, kv_heads: int) -> int:
    """torch's threads, at most one per `PAIRS_PER_THREAD` (row, key/value head) pairs (may be 0)."""
    return min(torch.get_num_threads(), groups.order.numel() * kv_heads // PAIRS_PER_THREAD)


def full_slot(lengths: torch.Tensor, capacity: int) -> str | None:
    """What is wrong where a row's new position (`lengths`) is past its slot's `capacity`, or None: the kernels would
    write outside the cache."""
    if lengths.numel() and int(lengths.max()) >= capacity:
        return f"a slot is full: position {int(lengths.max())} of capacity {capacity}"
    return None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    groups: RowGroups | None = None,
) -> torch.Tensor:
    """Append each row's key and value to its slot and attend; the attention output, shaped like `q`.

    Args:
        q: (rows, heads, dim), the rows' queries (rotated).
        k: (rows, kv_heads, dim), the rows' new keys (rotated); `v` the same for values.
        key_cache: (slots >= rows, kv_heads, capacity, dim), contiguous; row `r` lives in slot `r`. `value_cache`
            the same for values. Written at position `lengths[r]` of each row's slot.
        lengths: (rows,) int64, the positions each slot holds before this step (the new key's position).
        scale: the scores' factor (the model's `attention.scaling`).
        window: a sliding-window layer's window: position `p` sees keys `j` with `p - j < window`.
        softcap: scores capped as `softcap * tanh(scores / softcap)`.
        groups: rows whose slots start with the same keys and values (`row_groups`); default: every row alone.

    Raises:
        RuntimeError: the kernel is not available here (with the reason), or it could not get scratch memory.
        ValueError: tensors of other dtypes, shapes or layouts than those above, or a full slot.
    """
    kernel, reason = _load()
    if kernel is None:
        raise RuntimeError(f"decode_attention.attend cannot run here: {reason}")
    groups = single_rows(q.shape[0]) if groups is None else groups
    _check(q, k, v, key_cache, value_cache, lengths, groups)
    rows, heads, dim = q.shape
    kv_heads, capacity = key_cache.shape[1], key_cache.shape[2]
    q, k, v, lengths = q.contiguous(), k.contiguous(), v.contiguous(), lengths.contiguous()
    out = torch.empty_like(q)
    threads = threads_for(groups, kv_heads)
    tensors = (q, k, v, key_cache, value_cache, lengths, groups.order, groups.starts, groups.prefix, out)
    code = kernel(
        *[t.data_ptr() for t in tensors], rows, groups.count, heads, kv_heads, dim, capacity, window or 0, scale,
        softcap or 0.0, int(q.dtype == torch.bfloat16), threads,
    )  # fmt: skip
    if code != 0:
        raise RuntimeError("decode_attention.attend could not allocate its scratch memory.")
    return out


def _check(q, k, v, key_cache, value_cache, lengths, groups: RowGroups) -> None:
    rows, heads, dim = q.shape
    problems = []
    if q.dtype not in DTYPES or len({t.dtype for t in (q, k, v, key_cache, value_cache)}) != 1:
        problems.append(f"dtypes {[str(t.dtype) for t in (q, k, v, key_cache, value_cache)]} (one of {DTYPES})")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.shape[3] != dim:
        problems.append(f"caches {tuple(key_cache.shape)} and {tuple(value_cache.shape)} for dim {dim}")
    elif key_cache.shape[0] < rows or not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        problems.append("caches with fewer slots than rows, or not contiguous")
    elif k.shape != (rows, key_cache.shape[1], dim) or v.shape != k.shape or heads % key_cache.shape[1]:
        problems.append(f"k {tuple(k.shape)} / v {tuple(v.shape)} for q {tuple(q.shape)}")
    if lengths.dtype != torch.int64 or lengths.shape != (rows,):
        problems.append(f"lengths {lengths.dtype} {tuple(lengths.shape)} (int64, one per row)")
    elif not problems and (full := full_slot(lengths, key_cache.shape[2])) is not None:
        problems.append(full)
    if groups.order.numel() != rows:
        problems.append(f"groups of {groups.order.numel()} rows for {rows} rows")
    if problems:
        raise ValueError(f"decode_attention.attend got {'; '.join(problems)}. Use the decoder's torch path.")


@functools.cache
def _load() -> tuple[Callable[..., int] | None, str | None]:
    """(the kernel's function, None), or (None, why not); the reason is logged once."""
    argtypes = [ctypes.c_void_p] * 10 + [ctypes.c_int64] * 7 + [ctypes.c_float] * 2 + [ctypes.c_int] * 2
    return native_build.load_function(
        _SOURCE,
        "decode_attention",
        argtypes,
        switch=ENV_SWITCH,
        kernel="attention kernel",
        fallback="torch's operations",
        wide=True,
    )
