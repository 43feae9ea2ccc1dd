"""pack/unpack/chunk helpers for scoring forwards: layout properties, padding round trip, budgets, chunk keys."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_grpo.models import tiny_llama
from lightning_grpo.scoring.packing import (
    chunk_inputs,
    chunk_sequences,
    collate_sequences,
    pack_sequences,
    unpack_sequences,
)
from lightning_grpo.training.attention import tree_model_kwargs, use_tree_attention

# sequences that often share prefixes: a few stems, each extended by a short tail
_stem = st.lists(st.integers(0, 5), min_size=0, max_size=6)
sequence_sets = st.lists(st.tuples(_stem, st.lists(st.integers(0, 5), min_size=1, max_size=5)), min_size=1, max_size=7)


def as_sequences(drawn) -> list[list[int]]:
    stems = [stem for stem, _ in drawn]
    return [stems[len(tail) % len(stems)] + tail for _, tail in drawn]


@settings(max_examples=60, deadline=None)
@given(drawn=sequence_sets, share=st.booleans())
def test_each_sequence_is_a_root_to_leaf_path_of_the_packed_row(drawn, share):
    sequences = as_sequences(drawn)
    packed = pack_sequences(sequences, share_prefixes=share)
    offsets, positions = packed["offsets"].tolist(), packed["positions"]
    cu_q, cu_k = packed["tree_cu_seqlens_q"].tolist(), packed["tree_cu_seqlens_k"].tolist()
    total = sum(map(len, sequences))
    assert packed["input_ids"].numel() <= total and (share or packed["input_ids"].numel() == total)
    assert packed["sizes"].tolist() == [
        packed["input_ids"].numel(),
        packed["tree_kv_index"].numel(),
        len(cu_q),
        len(offsets),
    ]
    for i, seq in enumerate(sequences):
        pos = positions[offsets[i] : offsets[i + 1]]
        assert packed["input_ids"][pos].tolist() == seq
        assert packed["position_ids"][pos].tolist() == list(range(len(seq)))
        # the segment holding the last token ends there, and its attention path is exactly the sequence
        segment = max(s for s in range(len(cu_q) - 1) if cu_q[s] <= pos[-1])
        assert cu_q[segment + 1] == pos[-1] + 1
        assert packed["tree_kv_index"][cu_k[segment] : cu_k[segment + 1]].tolist() == pos.tolist()


def test_shared_prompt_is_forwarded_once():
    prompt = list(range(10, 30))
    packed = pack_sequences([prompt + [1, 2], prompt + [3], prompt + [4, 5, 6]])
    # TreeRow forks one token early (a node is keyed on its token and the next): the last prompt token is per branch
    assert packed["input_ids"].numel() == 19 + (1 + 2) + (1 + 1) + (1 + 3)


def test_packed_hidden_states_equal_per_sequence_forward():
    sequences = [[5, 6, 7, 8, 9], [5, 6, 7, 10], [5, 6], [11, 12, 13]]
    packed = pack_sequences(sequences)
    model = use_tree_attention(tiny_llama(0))
    reference = tiny_llama(0)
    with torch.no_grad():
        hidden = model.base_model(**tree_model_kwargs(packed)).last_hidden_state[0]
        offsets = packed["offsets"].tolist()
        for i, seq in enumerate(sequences):
            expected = reference.base_model(input_ids=torch.tensor([seq])).last_hidden_state[0]
            got = hidden[packed["positions"][offsets[i] : offsets[i + 1]]]
            assert (got - expected).abs().max().item() < 1e-5


def test_unpack_cuts_a_padded_copy_back():
    packed = pack_sequences([[1, 2, 3], [1, 2, 4, 5]])
    packed["uids"] = torch.tensor([7, 9])
    padded = {key: torch.cat([value, torch.full((5,), -1, dtype=value.dtype)]) for key, value in packed.items()}
    padded["sizes"] = packed["sizes"]  # `sizes` itself is never padded: every row has four
    out = unpack_sequences(padded, per_sequence=("uids",))
    for key, value in packed.items():
        if key != "tree_max_seqlens":
            assert torch.equal(out[key], value), key


@settings(max_examples=60, deadline=None)
@given(drawn=sequence_sets, budget=st.integers(1, 14), share=st.booleans())
def test_chunks_cover_every_sequence_in_order_within_the_budget(drawn, budget, share):
    sequences = as_sequences(drawn)
    chunks = chunk_sequences(sequences, budget, share)
    assert [i for chunk in chunks for i in chunk] == list(range(len(sequences)))
    for chunk in chunks:
        size = pack_sequences([sequences[i] for i in chunk], share)["input_ids"].numel()
        assert size <= budget or len(chunk) == 1  # only a sequence over the budget packs past it, alone


def test_chunk_sequences_without_budget_is_one_chunk():
    assert chunk_sequences([[1], [2, 3]], 0) == [[0, 1]]
    assert chunk_sequences([], 8) == []


def test_chunk_inputs_splits_by_prefix_in_order_and_shares_plain_keys():
    a, b, c, shared = (torch.tensor([i]) for i in range(4))
    chunks = chunk_inputs({"c1_ids": b, "c0_ids": a, "c0_uids": c, "scale": shared})
    assert chunks == [{"scale": shared, "ids": a, "uids": c}, {"scale": shared, "ids": b}]
    plain = {"ids": a}
    assert chunk_inputs(plain) == [plain]


def test_chunk_inputs_rejects_a_gap_in_chunk_numbers():
    with pytest.raises(ValueError, match=r"got chunks \[0, 2\]"):
        chunk_inputs({"c0_ids": torch.tensor([1]), "c2_ids": torch.tensor([2])})


def test_collate_sequences_gives_every_row_the_same_number_of_chunks():
    rows = [
        [(0, [1, 2, 3, 4], 2), (1, [5, 6, 7, 8], 1), (2, [9, 9, 9], 0)],  # three chunks of budget 4
        [(3, [1, 2], 0)],  # one chunk: gets two filler chunks
        [],  # a row with nothing: a filler sequence
    ]
    inputs, pad_values = collate_sequences(rows, token_budget=4, share_prefixes=False)
    assert set(pad_values) == set(inputs[0])
    per_row = [chunk_inputs(row) for row in inputs]
    assert [len(chunks) for chunks in per_row] == [3, 3, 3]
    assert [c["uids"].tolist() for c in per_row[0]] == [[0], [1], [2]]
    assert [c["starts"].tolist() for c in per_row[0]] == [[2], [1], [0]]
    assert [c["uids"].tolist() for c in per_row[1]] == [[3], [-1], [-1]]
    assert [c["uids"].tolist() for c in per_row[2]] == [[-1], [-1], [-1]]


def test_pack_sequences_rejects_empty_input():
    with pytest.raises(ValueError, match="empty at indices \\[1\\]"):
        pack_sequences([[1], []])
    with pytest.raises(ValueError, match="got 0 sequences"):
        pack_sequences([])
