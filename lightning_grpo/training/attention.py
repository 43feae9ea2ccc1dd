"""Tree attention over a packed prefix trie (TRL's `TreeRow` layout), on any device.

A packed row holds `N` unique tokens laid out as `S` segments; segment `s` is the packed range
`tree_cu_seqlens_q[s]:tree_cu_seqlens_q[s + 1]`, and its root-to-segment path is
`tree_kv_index[tree_cu_seqlens_k[s]:tree_cu_seqlens_k[s + 1]]` (its ancestors' tokens, then its own). Each query
attends to its path causally, aligned bottom-right (`key j <= query i + Lk - Lq`), so every sample sees exactly the
tokens it saw when it was generated.

Two implementations sit behind one attention function:

- SDPA (CPU, or any device): `scaled_dot_product_attention` over the segments padded into a few batches of similar
  length (one call per batch; a group's prompt and its completions make two), or one call over the whole row with a
  dense ancestor mask (`N x N`), whichever scores fewer query-key pairs (`TreeAttentionPlan`). Both match an unpacked
  per-sample forward to float rounding; the padded segments are several times faster on CPU for GRPO rows (a
  per-segment Python loop is slower than either once a row holds more than a few samples).
- Flash (CUDA, fp16/bf16, with the `kernels` package and the hub reachable once): TRL's FA3 varlen call.

A logit softcap (gemma2) and attention sinks (gpt_oss) run on the first, by explicit products (the kernels above
take neither a sink; SDPA takes no softcap), on any device.

Under `torch.compile` (`GRPOModule(torch_compile=True)` compiles each decoder layer) the attention function runs
eagerly between the compiled parts: its plan's shapes (how many segment batches, how many segments each) change from
row to row, and compiling them would compile again for each new layout.

`register_tree_attention()` registers the function with transformers under `"tree"` and under TRL's name
`"tree_fa3"`, so a model loaded by TRL's trainer also runs on CPU. A model switched to it (`use_tree_attention`)
must be called with the `tree_*` keyword arguments (`tree_model_kwargs`); it has no padded-batch mode.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

log = logging.getLogger(__name__)

#: Our registered attention name; TRL's trainer uses `TRL_TREE_ATTENTION`, which we register too.
TREE_ATTENTION = "tree"
TRL_TREE_ATTENTION = "tree_fa3"
_TREE_NAMES = (TREE_ATTENTION, TRL_TREE_ATTENTION)
_TREE_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


@dataclass(slots=True, frozen=True)
class _SegmentBatch:
    """Segments of similar length padded to one batch: packed query and key positions (0 in padding) and the mask."""

    query_index: torch.Tensor  # (B, Lq)
    key_index: torch.Tensor  # (B, Lk)
    mask: torch.Tensor  # (B, 1, Lq, Lk)
    query_depth: torch.Tensor  # (B, Lq) position of each query in its samples (for sliding windows)


@dataclass(slots=True, frozen=True)
class TreeAttentionPlan:
    """How one packed row's attention is computed, once per forward and shared by every layer.

    `layout="segments"` pads segments of similar length (query lengths within a factor of 2) into a few batches, one
    SDPA call each, and `output_index` (N,) picks each packed token's slot out of their concatenated outputs.
    `layout="dense"` makes one SDPA call over the whole row with an (N, N) ancestor mask. `depth` (N,) is each packed
    token's position in its samples. `build` picks the layout that scores fewer query-key pairs.
    """

    layout: str  # "segments" | "dense"
    depth: torch.Tensor
    mask: torch.Tensor | None = None  # dense: (1, 1, N, N)
    batches: tuple[_SegmentBatch, ...] = ()
    output_index: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        tree_kv_index: torch.Tensor,
        tree_cu_seqlens_q: torch.Tensor,
        tree_cu_seqlens_k: torch.Tensor,
        layout: str = "auto",
    ) -> TreeAttentionPlan:
        """Plan a row from its `tree_*` tensors; `layout` is `"auto"`, `"segments"` or `"dense"`."""
        if layout not in ("auto", "segments", "dense"):
            raise ValueError(f"`TreeAttentionPlan.build(layout={layout!r})` must be 'auto', 'segments' or 'dense'.")
        cu_q, cu_k = tree_cu_seqlens_q.long(), tree_cu_seqlens_k.long()
        len_q, len_k = cu_q.diff(), cu_k.diff()
        device = tree_kv_index.device
        # the host needs the lengths anyway (they become shapes); one transfer per forward, not per layer
        lengths_q, lengths_k = len_q.tolist(), len_k.tolist()
        num_tokens, num_segments = sum(lengths_q), len(lengths_q)
        segment = torch.repeat_interleave(torch.arange(num_segments, device=device), len_q, output_size=num_tokens)
        depth = torch.arange(num_tokens, device=device) - cu_q[:-1][segment] + (len_k - len_q)[segment]
        groups = _similar_lengths(lengths_q)
        if layout == "auto":
            padded = sum(len(g) * max(lengths_q[s] for s in g) * max(lengths_k[s] for s in g) for g in groups)
            layout = "dense" if num_tokens * num_tokens < padded else "segments"
        if layout == "dense":
            return cls("dense", depth, mask=_dense_mask(tree_kv_index, len_k, segment)[None, None])
        batches, slots, offset = [], [], 0
        for group in groups:
            index = torch.tensor(group, device=device)
            batch, valid = _segment_batch(tree_kv_index, cu_q[index], cu_k[index], len_q[index], len_k[index])
            batches.append(batch)
            slots.append(valid.flatten().nonzero().squeeze(1) + offset)
            offset += valid.numel()
        # every real slot holds one packed token: invert that map to read the row back out of the batches' outputs
        packed_position = torch.cat([b.query_index.flatten() for b in batches])
        slot = torch.cat(slots)
        output_index = torch.empty(num_tokens, dtype=torch.long, device=device)
        output_index[packed_position[slot]] = slot
        return cls("segments", depth, batches=tuple(batches), output_index=output_index)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention output `(1, N, H, D)` for `query` `(1, H, N, D)` and `key`/`value` `(1, H_kv, N, D)`.

        `softcap` caps the scores at `softcap * tanh(score / softcap)`; `sinks` `(H,)` adds one logit per head to each
        softmax's denominator (a sink that takes probability mass and gives no value), as gpt_oss's eager attention.
        """
        # SDPA, or products (see there)
        attention = functools.partial(_attention, scale=scaling, dropout=dropout, softcap=softcap, sinks=sinks)
        if self.layout == "dense":
            mask = self.mask
            if sliding_window:
                mask = mask & ((self.depth[:, None] - self.depth[None, :]) < sliding_window)
            return attention(query, key, value, attn_mask=mask).transpose(1, 2)
        outs = []
        for batch in self.batches:
            mask = batch.mask
            if sliding_window:
                keys = torch.arange(mask.shape[-1], device=mask.device)
                mask = mask & (batch.query_depth[:, :, None] - keys < sliding_window)[:, None]
                # a padding query the window left without a key would give NaN, and NaN gradients through the gather
                mask = mask | (~mask.any(-1, keepdim=True) & (keys == 0))
            q, k, v = (
                _gather(x, index)
                for x, index in ((query, batch.query_index), (key, batch.key_index), (value, batch.key_index))
            )
            outs.append(attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(0, 1))  # (B * Lq, H, D)
        return torch.cat(outs).index_select(0, self.output_index).unsqueeze(0)


# Most attention scores (batch x heads x queries x keys) one call computes by plain products on a CPU in bf16/fp16: up
# to here SDPA's CPU flash kernel takes about twice as long for GRPO's short segments (its masked backward dominates);
# past it the flash kernel catches up, and the products' scores held for the backward would cost memory.
_PRODUCTS_MAX_SCORES = 1 << 22


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor,
    scale: float | None,
    dropout: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`scaled_dot_product_attention` of `query` (B, H, Lq, D) over `key`/`value` (B, H_kv, Lk, D) where `attn_mask`
    (B or 1, 1, Lq, Lk; True = attend) allows; by `_attention_by_products` on a CPU in half precision for small calls,
    and always with a `softcap` or `sinks`, which SDPA does not take."""
    batch, heads, length_q, _ = query.shape
    small = batch * heads * length_q * key.shape[2] <= _PRODUCTS_MAX_SCORES
    if softcap or sinks is not None or (query.device.type == "cpu" and _half_precision_products(query) and small):
        return _attention_by_products(query, key, value, attn_mask, scale, dropout, softcap, sinks)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout, scale=scale, enable_gqa=heads != key.shape[1]
    )


def _half_precision_products(query: torch.Tensor) -> bool:
    """Whether products of `query` run in bf16/fp16: its dtype, or CPU autocast's (where the rotary embedding leaves
    queries and keys in float32 and SDPA itself is cast down)."""
    half = (torch.bfloat16, torch.float16)
    return query.dtype in half or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in half)


def _attention_by_products(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    dropout: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T x scale, masked) v as two batched products, the softmax in float32; the queries that share a key
    and value head (grouped-query attention, query head h reads kv head h // (H / H_kv)) in one product with it.
    `softcap` and `sinks` as in `TreeAttentionPlan.attend`."""
    batch, heads, length_q, dim = query.shape
    kv_heads, length_k = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(query.reshape(batch, kv_heads, group * length_q, dim), key.transpose(-1, -2))
    scores = scores.view(batch, kv_heads, group, length_q, length_k).mul(dim**-0.5 if scale is None else scale)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    # an additive 0 / -inf bias, built at the mask's size and broadcast over the heads: a broadcast `masked_fill` of
    # the scores is several times slower on CPU, and its backward is another pass (the sum's gradient is the grad)
    bias = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device).masked_fill_(~mask, float("-inf"))
    scores = scores.add_(bias[:, :, None])
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)  # the products' dtype
    else:
        sink = sinks.to(scores.dtype).view(1, kv_heads, group, 1, 1).expand(batch, -1, -1, length_q, 1)
        weights = torch.softmax(torch.cat([scores, sink], -1), dim=-1, dtype=torch.float32)[..., :-1]
        weights = weights.to(scores.dtype)
    if dropout:
        weights = F.dropout(weights, dropout)
    out = torch.matmul(weights.view(batch, kv_heads, group * length_q, length_k), value)
    return out.view(batch, heads, length_q, dim)


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(1, H, N, D) -> (B, H, L, D) at the packed positions `index` (B, L)."""
    # index_select, not fancy indexing: its backward is an index_add, much faster on CPU than index_put
    return x[0].index_select(1, index.flatten()).unflatten(1, index.shape).transpose(0, 1)


def _similar_lengths(lengths: list[int]) -> list[list[int]]:
    """Segment indices grouped by query length within a factor of 2, so padding at most doubles a group's work."""
    groups: dict[int, list[int]] = {}
    for segment, length in enumerate(lengths):
        groups.setdefault(max(length - 1, 0).bit_length(), []).append(segment)
    return [groups[key] for key in sorted(groups)]


def _segment_batch(
    tree_kv_index: torch.Tensor, start_q: torch.Tensor, start_k: torch.Tensor, len_q: torch.Tensor, len_k: torch.Tensor
) -> tuple[_SegmentBatch, torch.Tensor]:
    """Pad segments to one batch; also returns which query slots are real tokens, (B, Lq)."""
    device = tree_kv_index.device
    i = torch.arange(int(len_q.max()), device=device)
    j = torch.arange(int(len_k.max()), device=device)
    query_valid = i < len_q[:, None]
    key_valid = j < len_k[:, None]
    query_depth = i + (len_k - len_q)[:, None]
    mask = key_valid[:, None, :] & (j <= query_depth[:, :, None]) & query_valid[:, :, None]
    # a padding query that sees no key would give NaN, and NaN gradients through the gather
    mask |= ~query_valid[:, :, None] & (j == 0)
    batch = _SegmentBatch(
        query_index=torch.where(query_valid, start_q[:, None] + i, 0),
        key_index=tree_kv_index[torch.where(key_valid, start_k[:, None] + j, 0)],
        mask=mask[:, None],
        query_depth=query_depth,
    )
    return batch, query_valid


@torch.compiler.disable  # compiled layers call it eagerly (see the module docstring)
def tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    tree_kv_index: torch.Tensor | None = None,
    tree_cu_seqlens_q: torch.Tensor | None = None,
    tree_cu_seqlens_k: torch.Tensor | None = None,
    tree_max_seqlen_q: int | None = None,
    tree_max_seqlen_k: int | None = None,
    tree_plan: TreeAttentionPlan | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of one packed row over its prefix trie (transformers' attention-function signature).

    Runs TRL's FA3 varlen kernel when `_use_flash` says it can (and the module has no attention sinks, which it does
    not take), else SDPA with `tree_plan` (built here when the caller did not pass one; `tree_model_kwargs` builds it
    once per forward instead of once per layer).

    Raises:
        ValueError: when called without the `tree_*` arguments (a plain padded batch, or a model whose layers do not
            pass their keyword arguments on to the attention function), or with a batch of more than one row.
    """
    if tree_kv_index is None or tree_cu_seqlens_q is None or tree_cu_seqlens_k is None:
        raise ValueError(
            f"Tree attention in {type(module).__name__} got no `tree_kv_index`, `tree_cu_seqlens_q` and "
            "`tree_cu_seqlens_k`: pass `**tree_model_kwargs(inputs)` to the model, or switch it back with "
            "`model.set_attn_implementation('sdpa')` for a padded batch. A model whose layers drop these arguments "
            "trains with `GRPOModule(packing='padded')`."
        )
    if query.shape[0] != 1:
        raise ValueError(f"Tree attention runs one packed row (batch size 1), got batch size {query.shape[0]}.")
    sinks = getattr(module, "sinks", None)
    if sinks is None and _use_flash(query):
        from .._trl import flash_tree_attention

        return flash_tree_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            tree_kv_index=tree_kv_index,
            tree_cu_seqlens_q=tree_cu_seqlens_q,
            tree_cu_seqlens_k=tree_cu_seqlens_k,
            tree_max_seqlen_q=tree_max_seqlen_q,
            tree_max_seqlen_k=tree_max_seqlen_k,
            scaling=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
        )
    if tree_plan is None:
        tree_plan = TreeAttentionPlan.build(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k)
    out = tree_plan.attend(
        query, key, value, scaling=scaling, dropout=dropout, sliding_window=sliding_window, softcap=softcap, sinks=sinks
    )
    return out, None


def register_tree_attention() -> None:
    """Register `tree_attention` with transformers as `"tree"` and `"tree_fa3"`, with a mask function that builds
    nothing (the trie is the mask). Idempotent."""
    for name in _TREE_NAMES:
        AttentionInterface.register(name, tree_attention)
        AttentionMaskInterface.register(name, _no_mask)


def use_tree_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switch `model` (in place) to tree attention, registering it first; returns the model.

    A model already on `"tree"` or `"tree_fa3"` is left as it is.
    """
    register_tree_attention()
    if model.config._attn_implementation not in _TREE_NAMES:
        model.set_attn_implementation(TREE_ATTENTION)
    return model


def tree_model_kwargs(inputs: dict[str, torch.Tensor], *, layout: str | None = "auto") -> dict[str, Any]:
    """The packed row's model inputs: `input_ids` and `position_ids` as `(1, N)`, and the `tree_*` arguments.

    `inputs` holds `TreeRow.pack()`'s (or `pack_sequences`') unpadded tensors. The SDPA plan is built here once, in
    `layout` (see `TreeAttentionPlan.build`), so the layers share it; `layout=None` leaves it to each layer.
    """
    kwargs: dict[str, Any] = {
        "input_ids": inputs["input_ids"][None],
        "position_ids": inputs["position_ids"][None],
        **{key: inputs[key] for key in _TREE_KEYS},
    }
    max_q, max_k = (int(x) for x in inputs["tree_max_seqlens"].tolist())
    kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"] = max_q, max_k
    if layout is not None and not _use_flash(inputs["input_ids"]):
        kv_index, cu_q, cu_k = (inputs[key] for key in _TREE_KEYS)
        kwargs["tree_plan"] = TreeAttentionPlan.build(kv_index, cu_q, cu_k, layout=layout)
    return kwargs


def _dense_mask(tree_kv_index: torch.Tensor, len_k: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """(N, N) ancestor mask: a token sees the tokens of its path's other segments, and causally its own segment's."""
    num_segments, num_tokens = len_k.numel(), segment.numel()
    path_owner = torch.repeat_interleave(torch.arange(num_segments, device=segment.device), len_k)
    on_path = torch.zeros(num_segments, num_segments, dtype=torch.bool, device=segment.device)
    on_path[path_owner, segment[tree_kv_index]] = True  # on_path[s, t]: segment t is on segment s's path
    positions = torch.arange(num_tokens, device=segment.device)
    same = segment[:, None] == segment[None, :]
    return on_path[segment][:, segment] & (~same | (positions[None, :] <= positions[:, None]))


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _use_flash(tensor: torch.Tensor) -> bool:
    """Whether TRL's FA3 kernel can run: CUDA, half precision for activations, and the kernel loads."""
    if not tensor.is_cuda or (tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.bfloat16)):
        return False
    return _flash_kernel_loads()


@functools.cache
def _flash_kernel_loads() -> bool:
    if importlib.util.find_spec("kernels") is None:
        return False
    try:
        from .._trl import flash_attention_kernel

        flash_attention_kernel()
    except Exception as err:  # no hub access, no wheel for this GPU, ...
        log.warning("Tree attention falls back to SDPA: the flash kernel did not load (%s).", err)
        return False
    return True
