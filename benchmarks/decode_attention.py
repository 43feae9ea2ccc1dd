"""The embedded generator's decode attention (`rollout/decode_attention.py`) against the memory it reads, side by side.

A decode step attends once per layer: every row's query heads against its slot of the key/value cache, the
positions its prompt shares with its group read once for the group. This times the kernel over `--layers` caches of
their own (as a step reads them, none warm in the cache from the layer before), with the generator's cache layout
(slots x key/value heads x capacity x head_dim) and SmolLM2's shapes by default, at each `--own` count of positions
a row has past its group's shared prompt. Reported per case, as GB/s of cache read (keys and values, the shared
prompt once per group):

- `kernel`: the attention kernel with slots of `--capacity` positions, the generator's layout;
- `tight slots`: the same kernel with slots just long enough for what they hold, so the rows' positions lie close
  together (what the spacing between slots costs);
- `contiguous read`: torch summing a contiguous bf16 tensor of the same bytes once per layer (the rate this core
  reads memory at, the bound the kernel is held to).

Each case first checks the kernel's output, in both slot layouts, against a float64 attention on the same cache (it times what it checks).

    python benchmarks/decode_attention.py                          # SmolLM2's shapes, 64 rows, groups of 8 and 64
    python benchmarks/decode_attention.py --own 32 --groups 8 --reps 40
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import torch  # noqa: E402

from lightning_grpo.rollout import decode_attention  # noqa: E402

#: The largest |kernel - float64| a bf16 output may show (a few of its rounding steps at |values| up to ~4).
TOLERANCE = 0.05


def caches(args: argparse.Namespace, group: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's key and value cache, bf16, each group's slots starting with the same `--prefix` positions."""
    shape = (args.rows, args.kv_heads, capacity, args.head_dim)
    made = []
    for _ in range(args.layers):
        pair = (torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16())
        for cache in pair:
            leaders = cache[::group, :, : args.prefix]
            cache[:, :, : args.prefix] = leaders.repeat_interleave(group, dim=0)[: args.rows]
        made.append(pair)
    return made


def reference(q, k, v, keys, values, length: int, scale: float) -> torch.Tensor:
    """float64 attention of each row over its first `length` cached positions and its new key and value."""
    keys = torch.cat([keys[:, :, :length], k[:, :, None]], dim=2).double()
    values = torch.cat([values[:, :, :length], v[:, :, None]], dim=2).double()
    repeat = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("rhd,rhjd->rhj", q.double(), keys) * scale
    return torch.einsum("rhj,rhjd->rhd", scores.softmax(-1), values)


def kernel_case(args: argparse.Namespace, own: int, group: int, capacity: int) -> tuple[float, float]:
    """(seconds a step, worst |kernel - float64|) of the kernel over every layer's cache."""
    length = args.prefix + own
    layers = caches(args, group, capacity)
    q = torch.randn(args.rows, args.heads, args.head_dim).bfloat16()
    k, v = (torch.randn(args.rows, args.kv_heads, args.head_dim).bfloat16() for _ in range(2))
    lengths = torch.full((args.rows,), length, dtype=torch.long)
    ids = torch.arange(args.rows) // group + 1
    groups = decode_attention.spread(
        decode_attention.row_groups(ids, torch.full((args.rows,), args.prefix), lengths), args.kv_heads
    )
    scale = args.head_dim**-0.5
    keys, values = layers[0]
    expected = reference(q, k, v, keys, values, length, scale)
    out = decode_attention.attend(q, k, v, keys, values, lengths, scale=scale, groups=groups)
    error = float((out.double() - expected).abs().max())

    def step() -> None:
        for keys, values in layers:
            decode_attention.attend(q, k, v, keys, values, lengths, scale=scale, groups=groups)

    return common.median_seconds(step, warmup=1, reps=args.reps), error


def contiguous_s(args: argparse.Namespace, nbytes: int) -> float:
    """Seconds to sum, once per layer, a contiguous bf16 tensor of `nbytes` (each layer its own)."""
    tensors = [torch.randn(nbytes // 2).bfloat16() for _ in range(args.layers)]
    return common.median_seconds(lambda: [t.sum() for t in tensors], warmup=1, reps=args.reps)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    if not decode_attention.available():
        raise SystemExit(f"decode_attention.py: the kernel cannot run here: {decode_attention.unavailable_reason()}")
    print(f"# decode_attention: commit {common.git_commit()}, {common.machine()}, {args.threads} thread(s)")
    print(
        f"{args.rows} rows, {args.heads} query / {args.kv_heads} key-value heads of {args.head_dim}, "
        f"{args.prefix}-position shared prompt, slots of {args.capacity}, {args.layers} layers; GB/s of cache read"
    )
    print(
        f"{'own':>5}{'group':>7}{'ms a step':>11}{'kernel':>9}{'tight slots':>13}{'contiguous read':>17}{'error':>10}"
    )
    cases = []
    for own in args.own:
        for group in args.groups:
            positions = -(-args.rows // group) * args.prefix + args.rows * (own + 1)  # each group's prompt once
            nbytes = args.layers * 2 * args.kv_heads * args.head_dim * 2 * positions
            spaced, spaced_error = kernel_case(args, own, group, args.capacity)
            tight, tight_error = kernel_case(args, own, group, args.prefix + own + 1)
            error = max(spaced_error, tight_error)
            read = contiguous_s(args, nbytes // args.layers)
            case = {
                "own": own, "group": group, "bytes": nbytes, "kernel_s": spaced, "tight_slots_s": tight,
                "contiguous_read_s": read, "max_abs_error": error,
            }  # fmt: skip
            cases.append(case)
            gbs = [nbytes / s / 1e9 for s in (spaced, tight, read)]
            print(f"{own:>5}{group:>7}{spaced * 1e3:>11.2f}{gbs[0]:>9.2f}{gbs[1]:>13.2f}{gbs[2]:>17.2f}{error:>10.1e}")
            if error > TOLERANCE:
                raise SystemExit(f"decode_attention.py: the kernel is {error:.2e} from float64 (> {TOLERANCE})")
    report = {"provenance": common.provenance("python benchmarks/decode_attention.py"), "cases": cases}
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64, help="rows decoding at once")
    p.add_argument("--groups", type=int, nargs="+", default=[8, 64], help="rows sharing one prompt")
    p.add_argument("--prefix", type=int, default=49, help="positions of the shared prompt")
    p.add_argument("--own", type=int, nargs="+", default=[8, 32, 64], help="positions a row has past its prompt")
    p.add_argument("--capacity", type=int, default=160, help="positions a slot holds (the generator's layout)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="write the cases as JSON here")
    return p


if __name__ == "__main__":
    run(parser().parse_args())
