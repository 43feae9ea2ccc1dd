"""The padded forward: a packed micro-batch's loss terms through the model's own forward, for the models that cannot
take tree attention (linear attention, convolutions, state-space layers; see `lightning_grpo.training.packing_choice`).

The packed row (TRL's `TreeRow` layout, `lightning_grpo.pipeline.batch`) is cut back into token sequences: for each
sample with a loss term, the root-to-node path of its deepest term, which holds every token its terms condition on
(the tokens after its last trained one change none of its log-probabilities and are left out). A sequence that is a
prefix of another one is not run again: its terms read the longer one's positions. The sequences, sorted by length,
are right-padded into batches of at most `token_budget` padded tokens, each run through the model's own forward with
an attention mask. Right padding changes no real token's computation in any causal layer, attention or recurrent: the
padding comes after it. Only the loss terms' positions are projected to the vocabulary.

Each forward's activations are kept for the backward, so a micro-batch holds its samples' raw tokens (a shared prompt
once per sequence that reaches it), where the tree forward holds each unique token once.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .packing_choice import base_model
from .sharding import is_fsdp2

__all__ = ["PaddedRows", "padded_forward", "padded_rows"]


@dataclass(frozen=True, slots=True)
class PaddedRows:
    """A packed row's sequences, as the padded forward runs them.

    Attributes:
        sequences: each sequence's packed positions, root first (position `k` of a sequence has depth `k`).
        term_row: `(M,)` the sequence each loss term is read from.
        term_column: `(M,)` the term's position in that sequence (its depth in the trie).
    """

    sequences: list[torch.Tensor]
    term_row: torch.Tensor
    term_column: torch.Tensor


def padded_rows(micro_batch: dict[str, torch.Tensor]) -> PaddedRows:
    """The sequences the padded forward runs for `micro_batch` and where each loss term reads its logits.

    Needs the packed row's `position_ids` (each token's depth), `tree_kv_index`, `tree_cu_seqlens_q`,
    `tree_cu_seqlens_k`, `token_index` and `segment_id`; a sample with no loss term (a filler copy) gets no sequence.
    """
    token_index, segment_id = micro_batch["token_index"].long(), micro_batch["segment_id"].long()
    depth = micro_batch["position_ids"].long()
    num_tokens = depth.numel()
    if token_index.numel() == 0:
        empty = token_index.new_zeros(0)
        return PaddedRows([], empty, empty)
    # each sample's deepest term: the largest depth * N + position of its terms (positions < N, so it decodes)
    key = depth[token_index] * num_tokens + token_index
    deepest = key.new_full((int(segment_id.max()) + 1,), -1).scatter_reduce(0, segment_id, key, "amax")
    ends = sorted({int(k) % num_tokens for k in deepest.tolist() if k >= 0}, key=lambda p: -int(depth[p]))
    cu_q = micro_batch["tree_cu_seqlens_q"].long()
    starts_k = micro_batch["tree_cu_seqlens_k"].long()[:-1].tolist()
    segment_of_end = (torch.searchsorted(cu_q, torch.tensor(ends, device=cu_q.device), right=True) - 1).tolist()
    depths = depth.tolist()
    row_of = [-1] * num_tokens
    sequences: list[torch.Tensor] = []
    for end, segment in zip(ends, segment_of_end, strict=True):
        if row_of[end] >= 0:  # on the path of a longer sequence already taken
            continue
        start = starts_k[segment]
        path = micro_batch["tree_kv_index"][start : start + depths[end] + 1]
        for position in path.tolist():
            if row_of[position] < 0:
                row_of[position] = len(sequences)
        sequences.append(path)
    term_row = torch.tensor(row_of, device=token_index.device)[token_index]
    return PaddedRows(sequences, term_row, depth[token_index])


def padded_forward(
    model: torch.nn.Module,
    micro_batch: dict[str, torch.Tensor],
    *,
    token_budget: int | None = None,
    pad_token_id: int = 0,
    **model_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits of `micro_batch`'s loss terms from right-padded forwards of its sequences (see the module doc).

    Args:
        model: a causal LM (a transformers model, possibly inside PEFT, DDP or FSDP2), on the batch's device.
        micro_batch: one rank's unpadded packed row (`padded_rows` lists the keys it reads).
        token_budget: padded tokens (sequences times the longest one) per forward; None: the packed row's token
            count or the longest sequence, whichever is larger, so no forward holds more tokens than the tree one.
        pad_token_id: the id put in the padding (any valid id: nothing real attends to it).
        **model_kwargs: more arguments of every forward (e.g. `output_router_logits=True`).

    Returns:
        `(logits, aux_loss)`: `(M, V)` logits in the order of `token_index`, and the mean over the forwards of the
        model's `aux_loss` (None when it returns none).
    """
    rows = padded_rows(micro_batch)
    input_ids = micro_batch["input_ids"]
    if not rows.sequences:
        raise ValueError("The padded forward got a micro-batch without loss terms (`token_index` is empty).")
    lengths = [seq.numel() for seq in rows.sequences]
    budget = token_budget or max(input_ids.numel(), max(lengths))
    chunks = _chunks_of_similar_length(lengths, budget, _equal_count_needed(model))
    keeps_positions = _takes_logits_to_keep(model)
    picked, order, aux_losses, anchor = [], [], [], None
    for chunk in chunks:
        if not chunk:  # a forward that only keeps this rank in step with the others (FSDP2); it adds 0 to the logits
            out = model(input_ids=input_ids[:1][None], use_cache=False, **model_kwargs)
            anchor = out.logits.sum() * 0
            continue
        ids, mask = _right_padded([rows.sequences[i] for i in chunk], input_ids, pad_token_id)
        local = torch.full((len(rows.sequences),), -1, dtype=torch.long, device=ids.device)
        local[torch.tensor(chunk, device=ids.device)] = torch.arange(len(chunk), device=ids.device)
        terms = (local[rows.term_row] >= 0).nonzero().squeeze(1)
        columns = rows.term_column[terms]
        kept = torch.unique(columns)  # sorted: only these positions are projected to the vocabulary
        kwargs = {"logits_to_keep": kept} if keeps_positions else {}
        out = model(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs, **model_kwargs)
        logits = out.logits if keeps_positions else out.logits[:, kept]
        picked.append(logits[local[rows.term_row[terms]], torch.searchsorted(kept, columns)])
        order.append(terms)
        if getattr(out, "aux_loss", None) is not None:
            aux_losses.append(out.aux_loss)
    logits = torch.cat(picked).index_select(0, torch.argsort(torch.cat(order)))
    if anchor is not None:
        logits = logits + anchor
    return logits, torch.stack(aux_losses).mean() if aux_losses else None


def _chunks_of_similar_length(lengths: list[int], budget: int, equal_count: bool) -> list[list[int]]:
    """Sequence indices in batches, shortest first, each at most `budget` padded tokens (a longer sequence alone);
    with `equal_count`, as many batches on every rank (FSDP2 gathers the shards in each forward)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    chunks: list[list[int]] = []
    for index in order:
        if chunks and (len(chunks[-1]) + 1) * lengths[index] <= budget:
            chunks[-1].append(index)
        else:
            chunks.append([index])
    if not equal_count:
        return chunks
    count = torch.tensor([len(chunks)], device=_collective_device())
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    target = int(count.item())
    while len(chunks) < target and max(map(len, chunks)) > 1:  # split the largest batch until there are enough
        largest = max(range(len(chunks)), key=lambda c: len(chunks[c]))
        half = len(chunks[largest]) // 2
        chunks[largest : largest + 1] = [chunks[largest][:half], chunks[largest][half:]]
    return chunks + [[] for _ in range(target - len(chunks))]  # too few sequences: forwards of one token
    return chunks


def _equal_count_needed(model: torch.nn.Module) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and is_fsdp2(model)


def _collective_device() -> torch.device:
    backend = dist.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _right_padded(
    sequences: list[torch.Tensor], input_ids: torch.Tensor, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, attention_mask)`, each `(B, L)`: the sequences' tokens, then `pad_token_id` (mask 0)."""
    longest = max(seq.numel() for seq in sequences)
    ids = input_ids.new_full((len(sequences), longest), pad_token_id)
    mask = torch.zeros(len(sequences), longest, dtype=torch.long, device=input_ids.device)
    for row, positions in enumerate(sequences):
        ids[row, : positions.numel()] = input_ids[positions]
        mask[row, : positions.numel()] = 1
    return ids, mask


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the transformers model inside `model` takes `logits_to_keep` (its decoder models do)."""
    return "logits_to_keep" in inspect.signature(base_model(model).forward).parameters
