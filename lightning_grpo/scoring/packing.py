"""Packing token sequences for a no-grad scoring forward, and splitting scorer inputs into chunks.

`pack_sequences` lays sequences out as TRL's `TreeRow.pack` does (a prefix trie, one forward per unique token) and
records where each sequence's tokens landed, so a scorer can read per-sequence hidden states back. A scorer's
`collate` packs on rank 0; the collator pads the result per rank; `unpack_sequences` cuts the padding off again on
the rank that runs the forward. `chunk_sequences` bounds one forward's size, `chunk_inputs` splits the `c{j}_` keys.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

from .._trl import TreeRow

TokenSequence: TypeAlias = Sequence[int] | np.ndarray | torch.Tensor

#: Keys `pack_sequences` returns, and the length in `sizes` each one is cut to by `unpack_sequences`.
_SIZED_KEYS = {
    "input_ids": 0,
    "position_ids": 0,
    "tree_kv_index": 1,
    "tree_cu_seqlens_q": 2,
    "tree_cu_seqlens_k": 2,
    "offsets": 3,
}
_CHUNK_KEY = re.compile(r"c(\d+)_(.+)")


def pack_sequences(sequences: Sequence[TokenSequence], share_prefixes: bool = True) -> dict[str, torch.Tensor]:
    """Tree-pack token sequences for a no-grad forward, as `TreeRow.pack` would.

    Args:
        sequences: token id sequences, each at least one token long.
        share_prefixes: fold common prefixes into a trie (a token shared by several sequences is forwarded once);
            False packs each sequence as its own chain (plain padding-free packing).

    Returns:
        The model inputs `input_ids`, `position_ids` (N), `tree_kv_index` (K), `tree_cu_seqlens_q`,
        `tree_cu_seqlens_k` (S + 1), `tree_max_seqlens` (2), and:

        `positions` (sum of lengths), the packed position of every sequence's tokens, sequences laid end to end, so
        `input_ids[positions[offsets[i]:offsets[i + 1]]]` is sequence `i`; `offsets` (R + 1), where each sequence
        starts in `positions`; `sizes` (4), the lengths of `input_ids`, `tree_kv_index`, `tree_cu_seqlens_q` and
        `offsets`, so a padded copy can be cut back with `unpack_sequences`.

    Raises:
        ValueError: on no sequences or an empty one.
    """
    ids = [np.asarray(torch.as_tensor(seq).cpu(), dtype=np.int64).reshape(-1) for seq in sequences]
    empty = [i for i, seq in enumerate(ids) if seq.size == 0]
    if not ids or empty:
        raise ValueError(
            f"`pack_sequences` needs at least one sequence and no empty ones; got {len(ids)} sequences, empty at "
            f"indices {empty}."
        )
    packed = _tree_pack(ids) if share_prefixes else _chain_pack(ids)
    lengths = [seq.size for seq in ids]
    packed["offsets"] = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long)
    packed["sizes"] = torch.tensor(
        [packed[key].numel() for key in ("input_ids", "tree_kv_index", "tree_cu_seqlens_q", "offsets")]
    )
    if not torch.equal(packed["input_ids"][packed["positions"]], torch.from_numpy(np.concatenate(ids))):
        raise RuntimeError("TreeRow.pack no longer lays the trie out in DFS pre-order; update `pack_sequences`.")
    return packed


def unpack_sequences(inputs: dict[str, torch.Tensor], per_sequence: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Cut one rank's padded `pack_sequences` output back to model inputs.

    Keys named in `per_sequence` (one value per sequence, e.g. `uids`) are cut to the number of sequences; other
    extra keys pass through unchanged.
    """
    sizes = [int(x) for x in inputs["sizes"].tolist()]
    out = dict(inputs)
    for key, size_index in _SIZED_KEYS.items():
        out[key] = inputs[key][: sizes[size_index]]
    out["positions"] = inputs["positions"][: int(out["offsets"][-1])]
    for key in per_sequence:
        out[key] = inputs[key][: sizes[3] - 1]
    return out


def collate_sequences(
    rows: Sequence[Sequence[tuple[int, TokenSequence, int]]], *, token_budget: int = 0, share_prefixes: bool = True
) -> tuple[list[dict[str, torch.Tensor]], dict[str, int]]:
    """A scorer's `collate` output for token sequences: each row packed, chunked and aligned across rows.

    Args:
        rows: per row (rank), its sequences as `(uid, token ids, start)`: the uid `features` reports, and where in the
            sequence the part to pool starts (e.g. the completion), kept as the `starts` key.
        token_budget: packed tokens per chunk (`chunk_sequences`); `<= 0` packs a row in one chunk.
        share_prefixes: tree-pack common prefixes.

    Returns:
        `(inputs, pad_values)` as `TrainerScorer.collate` returns them: per row, `pack_sequences` keys plus `uids`
        and `starts`; with several chunks, under `c{j}_` prefixes. Rows with fewer chunks than the micro-batch's most
        get filler chunks (one token, uid -1), and an empty row gets a filler sequence, so every rank makes the same
        number of `features` calls.
    """
    filler: tuple[int, TokenSequence, int] = (-1, [0], 0)
    per_row: list[list[list[tuple[int, TokenSequence, int]]]] = []
    for sequences in rows:
        sequences = list(sequences) or [filler]
        chunks = chunk_sequences([seq for _, seq, _ in sequences], token_budget, share_prefixes)
        per_row.append([[sequences[i] for i in chunk] for chunk in chunks])
    num_chunks = max(len(chunks) for chunks in per_row)
    inputs = []
    for row_chunks in per_row:
        padded = row_chunks + [[filler]] * (num_chunks - len(row_chunks))
        packed = [_pack_chunk(chunk, share_prefixes) for chunk in padded]
        if num_chunks == 1:
            inputs.append(packed[0])
        else:
            inputs.append({f"c{j}_{key}": value for j, chunk in enumerate(packed) for key, value in chunk.items()})
    pad_values = {key: 0 for key in inputs[0]}
    return inputs, pad_values


def _pack_chunk(sequences: list[tuple[int, TokenSequence, int]], share_prefixes: bool) -> dict[str, torch.Tensor]:
    packed = pack_sequences([seq for _, seq, _ in sequences], share_prefixes)
    packed["uids"] = torch.tensor([uid for uid, _, _ in sequences], dtype=torch.long)
    packed["starts"] = torch.tensor([start for _, _, start in sequences], dtype=torch.long)
    return packed


def chunk_sequences(
    sequences: Sequence[TokenSequence], token_budget: int, share_prefixes: bool = True
) -> list[list[int]]:
    """Indices of `sequences` split into chunks that pack to `token_budget` tokens.

    Bounds the memory of a scoring forward, whose sequences (references, whole conversations) the planner's budget
    for trained tokens does not cover. Sequences are taken in order; a chunk closes when the next sequence would push
    its packed size (unique tokens when `share_prefixes`) over the budget. A sequence longer than the budget is scored
    alone. `token_budget <= 0` puts every sequence in one chunk; no sequences give no chunks.
    """
    if token_budget <= 0:
        return [list(range(len(sequences)))] if len(sequences) else []
    chunks: list[list[int]] = []
    row, size = TreeRow(), 0
    for index, seq in enumerate(sequences):
        sample = _trie_sample(np.asarray(torch.as_tensor(seq).cpu(), dtype=np.int64).reshape(-1))
        fits = row.fits(sample, token_budget) if share_prefixes else size + sample["input_ids"].size <= token_budget
        if not chunks or not fits:
            chunks.append([])
            row, size = TreeRow(), 0
        chunks[-1].append(index)
        row.add(sample)
        size += sample["input_ids"].size
    return chunks


def chunk_inputs(inputs: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """One scorer's micro-batch inputs, split into its `c{j}_` chunks in order.

    Keys `c{j}_<name>` go to chunk `j` as `<name>`; keys without a chunk prefix are shared by every chunk. Without any
    chunk key, returns `[inputs]`.

    Raises:
        ValueError: when the chunk numbers are not 0, 1, ..., n-1.
    """
    chunks: dict[int, dict[str, torch.Tensor]] = {}
    shared = {}
    for key, value in inputs.items():
        match = _CHUNK_KEY.fullmatch(key)
        if match:
            chunks.setdefault(int(match.group(1)), {})[match.group(2)] = value
        else:
            shared[key] = value
    if not chunks:
        return [inputs]
    if sorted(chunks) != list(range(len(chunks))):
        raise ValueError(f"Chunk keys must be numbered c0_, c1_, ... without gaps; got chunks {sorted(chunks)}.")
    return [{**shared, **chunks[j]} for j in range(len(chunks))]


def _trie_sample(input_ids: np.ndarray) -> dict[str, Any]:
    """A sequence as the sample dict `TreeRow` takes: nothing trained, one shared group."""
    zeros = np.zeros_like(input_ids)
    return {"input_ids": input_ids, "completion_mask": zeros, "old_log_probs": zeros, "advantage": 0.0, "group_id": 0}


def _tree_pack(ids: list[np.ndarray]) -> dict[str, torch.Tensor]:
    row = TreeRow()
    for seq in ids:
        row.add(_trie_sample(seq))
    packed = row.pack()
    out = {key: packed[key] for key in ("input_ids", "position_ids", "tree_kv_index", "tree_cu_seqlens_q")}
    out.update(tree_cu_seqlens_k=packed["tree_cu_seqlens_k"], tree_max_seqlens=packed["tree_max_seqlens"])
    # TreeRow.pack lays nodes out in DFS pre-order, children in insertion order; replay that order to find each node
    position = [0] * len(row.tokens)
    stack = list(reversed(row.roots.values()))
    for index in range(len(row.tokens)):
        node = stack.pop()
        position[node] = index
        stack.extend(reversed(row.children[node].values()))
    out["positions"] = torch.tensor([position[node] for nodes in row.sample_nodes for node in nodes], dtype=torch.long)
    return out


def _chain_pack(ids: list[np.ndarray]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([seq.size for seq in ids])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    total = int(cu[-1])
    return {
        "input_ids": torch.from_numpy(np.concatenate(ids)),
        "position_ids": torch.cat([torch.arange(n) for n in lengths.tolist()]),
        "tree_kv_index": torch.arange(total, dtype=torch.long),
        "tree_cu_seqlens_q": cu,
        "tree_cu_seqlens_k": cu.clone(),
        "tree_max_seqlens": torch.stack([lengths.max(), lengths.max()]),
        "positions": torch.arange(total, dtype=torch.long),
    }
