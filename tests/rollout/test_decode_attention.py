"""The decode step's attention kernel (`rollout/decode_attention.c`): against float64 attention for every shape's
leftovers (head dims not a multiple of 8, query groups wider than it serves at once, blocks of positions cut short),
sliding windows, softcaps and threads; the cache writes; the inputs it refuses; and the fallbacks."""

from __future__ import annotations

import contextlib
import platform
import shutil

import pytest
import torch

from lightning_grpo.models.tiny import tiny_llama_config
from lightning_grpo.rollout import decode_attention, native_build
from lightning_grpo.rollout.decoder import SlotDecoder

needs_kernel = pytest.mark.skipif(not decode_attention.available(), reason=f"{decode_attention.unavailable_reason()}")
x86_with_avx2 = platform.machine().lower() in {"x86_64", "amd64"} and torch.backends.cpu.get_cpu_capability() in {
    "AVX2",
    "AVX512",
}


#: How close the kernel's output is to float64 attention: half a bf16 ulp of values below 4; float32's sums.
TOLERANCE = {torch.bfloat16: 2**-7, torch.float32: 2e-6}


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's thread count (which the kernel splits its work by) set to `threads`, and restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def reference(q, k, v, keys, values, lengths, scale, window=None, softcap=None):
    """float64 attention of each row to its slot after writing its key and value; (out, keys, values)."""
    keys, values = keys.clone(), values.clone()
    rows, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(rows):
        position = int(lengths[row])
        keys[row, :, position], values[row, :, position] = k[row], v[row]
        start = max(0, position + 1 - window) if window else 0
        for head in range(heads):
            seen = keys[row, head // group, start : position + 1].double()
            scores = seen @ q[row, head].double() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[row, head] = scores.softmax(-1) @ values[row, head // group, start : position + 1].double()
    return out, keys, values


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "dim", "window", "softcap", "threads"),
    [
        (5, 4, 2, 16, None, None, 1),
        (7, 9, 3, 64, 4, None, 1),  # a sliding window shorter than most rows
        (3, 6, 6, 20, None, 30.0, 1),  # a head dim with a leftover of 4, softcapped scores, one query per kv head
        (6, 8, 2, 48, None, None, 1),  # a head dim of three 16-lane vectors: a pair of them, then one
        (4, 14, 2, 8, 9, 50.0, 1),  # 7 queries per kv head: more than the kernel sums at once
        (33, 8, 1, 96, None, None, 2),  # one kv head shared by 8 queries, split between two threads
        (64, 9, 3, 64, None, None, 2),
    ],
)
def test_the_kernel_is_float64_attention_within_the_outputs_rounding_and_writes_the_new_key_and_value(
    dtype, rows, heads, kv_heads, dim, window, softcap, threads, vector_build
):
    generator = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    keys, values = (torch.randn(rows + 2, kv_heads, 40, dim, generator=generator).to(dtype) for _ in range(2))
    lengths = torch.randint(0, 40, (rows,), generator=generator)
    lengths[0], lengths[-1] = 0, 39  # a first token and a full slot's last position
    expected, expected_keys, expected_values = reference(q, k, v, keys, values, lengths, 0.3, window, softcap)
    with torch_threads(threads):
        out = decode_attention.attend(q, k, v, keys, values, lengths, scale=0.3, window=window, softcap=softcap)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)  # written in place, only there


@needs_kernel
def test_the_kernel_refuses_inputs_it_cannot_read_naming_them():
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    keys = torch.zeros(2, 2, 10, 8)
    with pytest.raises(ValueError, match=r"dtypes .*bfloat16.*Use the decoder's torch path"):
        decode_attention.attend(q, k, k, keys.bfloat16(), keys.bfloat16(), torch.tensor([1, 2]), scale=1.0)
    with pytest.raises(ValueError, match="a slot is full: position 10 of capacity 10"):
        decode_attention.attend(q, k, k, keys, keys.clone(), torch.tensor([1, 10]), scale=1.0)
    with pytest.raises(ValueError, match="not contiguous"):
        decode_attention.attend(
            q, k, k, keys.transpose(2, 3).contiguous().transpose(2, 3), keys, torch.tensor([1, 2]), scale=1.0
        )
    with pytest.raises(ValueError, match=r"lengths torch.int32"):
        decode_attention.attend(q, k, k, keys, keys.clone(), torch.tensor([1, 2], dtype=torch.int32), scale=1.0)


def test_the_kernel_runs_on_an_x86_cpu_with_avx2_and_a_c_compiler():
    if not (x86_with_avx2 and (shutil.which("cc") or shutil.which("gcc"))):
        pytest.skip("not an x86 CPU with AVX2 and a C compiler: the kernel is not expected here")
    assert decode_attention.available(), decode_attention.unavailable_reason()


def test_the_kernel_is_built_for_avx512_where_torch_runs_avx512_and_the_matmul_kernel_for_avx2():
    wide, narrow = native_build.flags(wide=True), native_build.flags()
    assert "-mavx2" in wide and "-mavx512f" not in narrow
    assert ("-mavx512f" in wide) == (native_build.vector_isa() == "AVX512")


def test_switched_off_or_unbuildable_the_decoder_runs_torchs_attention(fresh_kernel_state, tmp_path, caplog):
    fresh_kernel_state.setenv(decode_attention.ENV_SWITCH, "0")
    assert decode_attention.unavailable_reason() == f"{decode_attention.ENV_SWITCH}=0"
    with pytest.raises(RuntimeError, match="cannot run here: LIGHTNING_GRPO_DECODE_ATTENTION=0"):
        decode_attention.attend(torch.randn(1, 2, 8), *[torch.randn(1, 1, 8)] * 2, *[torch.zeros(1, 1, 4, 8)] * 2,
                                torch.tensor([0]), scale=1.0)  # fmt: skip
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config()).eval()
    assert not SlotDecoder(model)._attention_kernel
    if not x86_with_avx2:
        return
    decode_attention._load.cache_clear()
    fresh_kernel_state.delenv(decode_attention.ENV_SWITCH)
    fresh_kernel_state.setenv("LIGHTNING_GRPO_CACHE", str(tmp_path))
    fresh_kernel_state.setenv("CC", shutil.which("false"))
    assert not decode_attention.available() and "exited 1" in decode_attention.unavailable_reason()
    assert "attention kernel is off" in caplog.text
    assert not SlotDecoder(model)._attention_kernel


def test_rows_group_by_their_prefix_id_and_a_row_without_one_stays_alone():
    ids, prefix_lengths = torch.tensor([0, 5, 5, 0, 7, 5]), torch.tensor([3, 4, 4, 9, 2, 4])
    groups = decode_attention.row_groups(ids, prefix_lengths, torch.tensor([3, 6, 4, 9, 2, 10]))
    members = [groups.order[a:b].tolist() for a, b in zip(groups.starts[:-1], groups.starts[1:], strict=True)]
    assert members == [[0], [3], [1, 2, 5], [4]] and groups.prefix.tolist() == [0, 0, 4, 2]
    with pytest.raises(ValueError, match="different prefix lengths, or a prefix longer"):
        decode_attention.row_groups(ids, torch.tensor([3, 4, 5, 9, 2, 4]), torch.tensor([3, 6, 6, 9, 2, 10]))
    with pytest.raises(ValueError, match="a prefix longer than a row's filled positions"):
        decode_attention.row_groups(ids, prefix_lengths, torch.tensor([3, 6, 3, 9, 2, 10]))


def test_threads_follow_the_rows_and_spread_cuts_few_large_groups_into_parts_of_two_rows_or_more():
    """64 completions of one prompt with 3 key/value heads are 3 units of work; on 2 threads `spread` cuts the group
    in two (6 units), each part keeping the prefix. A group of 3 rows is not cut (a part of one row would not share),
    rows alone stay alone, and on 1 thread, or where the units already suffice, the groups come back unchanged."""
    one_prompt = decode_attention.row_groups(
        torch.ones(64, dtype=torch.long), torch.full((64,), 47), torch.full((64,), 50)
    )
    with torch_threads(1):
        assert decode_attention.spread(one_prompt, 3) is one_prompt
        assert decode_attention.threads_for(one_prompt, 3) == 1
    with torch_threads(2):
        assert decode_attention.threads_for(one_prompt, 3) == 2  # 64 rows x 3 heads, though only 3 units
        parts = decode_attention.spread(one_prompt, 3)
        assert parts.starts.tolist() == [0, 32, 64] and parts.prefix.tolist() == [47, 47]
        assert torch.equal(parts.order, one_prompt.order)
        ids = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0])  # a group of 3 and 8 rows alone: 10 units on 3 heads
        mixed = decode_attention.row_groups(ids, torch.where(ids > 0, 5, 0), torch.full((11,), 9))
        assert decode_attention.spread(mixed, 3) is mixed
        few = decode_attention.row_groups(torch.tensor([1, 1, 1, 2, 2, 2]), torch.full((6,), 5), torch.full((6,), 9))
        assert decode_attention.spread(few, 3) is few  # 18 row-head pairs: one thread
        assert decode_attention.threads_for(few, 3) == 1


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_group_cut_by_spread_attends_bit_for_bit_as_the_whole_group_on_one_thread_or_two(dtype, vector_build):
    """The parts of a group read the prefix once each instead of once for all, and each row's sums run in the same
    order, so the output equals the whole group's bit for bit, on 1 thread and on 2 (where the parts are shared out)."""
    rows, heads, kv_heads, dim, prefix = 24, 6, 2, 32, 13
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    keys, values = (torch.randn(rows, kv_heads, 48, dim, generator=generator).to(dtype) for _ in range(2))
    for cache in (keys, values):
        cache[1:, :, :prefix] = cache[0, :, :prefix]
    lengths = prefix + torch.randint(1, 30, (rows,), generator=generator)
    whole = decode_attention.row_groups(torch.ones(rows, dtype=torch.long), torch.full((rows,), prefix), lengths)
    with torch_threads(2):
        parts = decode_attention.spread(whole, kv_heads)
    assert parts.count == 2, "24 rows x 2 heads on 2 threads: the group should be cut in two"

    def attend(groups: decode_attention.RowGroups, threads: int) -> torch.Tensor:
        with torch_threads(threads):
            return decode_attention.attend(q, k, v, keys.clone(), values.clone(), lengths, scale=0.3, groups=groups)

    expected = attend(whole, 1)
    assert torch.equal(attend(parts, 1), expected) and torch.equal(attend(parts, 2), expected)
    reference_out, *_ = reference(q, k, v, keys, values, lengths, 0.3)
    torch.testing.assert_close(expected.double(), reference_out, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("window", "threads"), [(None, 1), (None, 2), (12, 1)], ids=["all", "two_threads", "window"])
def test_a_group_reads_its_shared_prefix_once_from_its_first_rows_slot(dtype, window, threads, vector_build):
    """Rows 0, 2, 3 and 5 were loaded with one prefix of 10 positions, 1 and 4 with another of 6, and then decoded on
    (different lengths). The group's prefix is read from its first row's slot only: the other members' copies are
    overwritten with NaN and the result is still float64 attention over the intact copies. Under a window of 12 that
    cuts into the prefix of the longer rows, each row reads its own slot (its copies then stay intact)."""
    rows, heads, kv_heads, dim = 6, 6, 2, 24
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    keys, values = (torch.randn(rows, kv_heads, 40, dim, generator=generator).to(dtype) for _ in range(2))
    serials, prefix_lengths = torch.tensor([3, 8, 3, 3, 8, 3]), torch.tensor([10, 6, 10, 10, 6, 10])
    for cache in (keys, values):
        cache[[2, 3, 5], :, :10] = cache[0, :, :10]
        cache[4, :, :6] = cache[1, :, :6]
    lengths = torch.tensor([10, 6, 17, 25, 9, 11])
    expected, *_ = reference(q, k, v, keys, values, lengths, 0.2, window)
    if window is None:
        for cache in (keys, values):
            cache[[2, 3, 5], :, :10] = float("nan")
            cache[4, :, :6] = float("nan")
    groups = decode_attention.row_groups(serials, prefix_lengths, lengths)
    with torch_threads(threads):
        out = decode_attention.attend(q, k, v, keys, values, lengths, scale=0.2, window=window, groups=groups)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
