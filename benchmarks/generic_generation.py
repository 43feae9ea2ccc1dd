"""The embedded generator's generic decoder (the model's own forward and cache) against HF `generate` in static
batches, side by side on a GRPO-shaped load; on Llama also against the fast slot decoder.

The load: `--groups` groups of `--group-size` requests sharing a prompt (prompts of different lengths), each request
with its own cap on new tokens between `--min-tokens` and `--max-tokens` (EOS ignored, so every backend samples
exactly the capped tokens: the same useful work), temperature 1, every request sent at once. Models: random-weight
models of each family built from a config of `--hidden` width, `--layers` layers and a `--vocab`-token vocabulary, so
that a step is not pure Python overhead.

- `generic`: `EmbeddedGenerator(decoder="generic")`, continuous batching (one prefill per prompt, a row leaves when
  it reaches its cap, all requests in one batch);
- `fast` (Llama only): `EmbeddedGenerator(decoder="fast")`, the slot decoder;
- `hf-per-group`: one `model.generate` per group (`num_return_sequences=group size`), run to the group's largest cap;
- `hf-all`: one `model.generate` over all requests left-padded, run to the largest cap.

Reported: useful tokens/s (the sum of the caps over the wall time), the median of `--reps` runs after a warm-up, the
backends alternating so a change in the machine's load hits all alike; and `generic / hf-*`, the generic decoder's
speed over HF generate's (above 1: faster). Written as JSON to `--out`.

    python benchmarks/generic_generation.py
    python benchmarks/generic_generation.py --families llama gpt2 --reps 1 --groups 2    # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lightning_grpo.rollout.generator import EmbeddedGenerator  # noqa: E402

DEFAULT_OUT = common.ROOT / "docs" / "results" / "generic_generation.json"  # the benchmarks page reads it


def family_config(family: str, hidden: int, layers: int, vocab: int) -> Any:
    """A config of `family` at the given size: heads of 64, half as many key-value heads, an MLP twice as wide."""
    heads = hidden // 64
    common_options = dict(vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    attention = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        max_position_embeddings=1024,
    )
    hybrid_layers = ["full_attention" if (i + 1) % 4 == 0 else None for i in range(layers)]
    options = {
        "llama": attention,
        "phi3": attention,
        "gpt2": dict(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024),
        "qwen3_5_text": dict(
            attention,
            layer_types=[kind or "linear_attention" for kind in hybrid_layers],
            linear_num_key_heads=max(1, heads // 2),
            linear_num_value_heads=heads,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
        ),
        "lfm2": dict(attention, layer_types=[kind or "conv" for kind in hybrid_layers], block_ff_dim=2 * hidden),
    }[family]
    return AutoConfig.for_model(family, **common_options, **options)


@dataclass(frozen=True)
class Load:
    """The requests: each group's prompt and the cap of each of its requests."""

    groups: list[tuple[list[int], list[int]]]

    @property
    def useful_tokens(self) -> int:
        return sum(sum(caps) for _, caps in self.groups)


def make_load(groups: int, group_size: int, min_tokens: int, max_tokens: int, vocab: int, seed: int = 0) -> Load:
    """Prompts of 16 to 128 tokens; caps spread evenly over [min_tokens, max_tokens] in each group, shuffled."""
    rng = np.random.default_rng(seed)
    load = []
    for _ in range(groups):
        prompt = [1, *rng.integers(3, vocab, int(rng.integers(15, 128))).tolist()]
        caps = np.linspace(min_tokens, max_tokens, group_size).round().astype(int).tolist()
        load.append((prompt, [int(c) for c in rng.permutation(caps)]))
    return Load(load)


# A backend turns a model and a load into (run, close): `run()` generates the whole load once; returns tokens kept.
Backend = Callable[[torch.nn.Module, Load], tuple[Callable[[], int], Callable[[], None]]]


def embedded(decoder: str) -> Backend:
    def backend(model: torch.nn.Module, load: Load) -> tuple[Callable[[], int], Callable[[], None]]:
        rows = sum(len(caps) for _, caps in load.groups)
        generator = EmbeddedGenerator(copy.deepcopy(model), eos_token_ids=[], max_batch_size=rows, decoder=decoder)

        async def everything() -> int:
            calls = [generator.generate(prompt, n) for prompt, caps in load.groups for n in caps]
            return sum(len(output.token_ids) for output in await asyncio.gather(*calls))

        return (lambda: asyncio.run(everything())), generator.close

    return backend


def hf_per_group(model: torch.nn.Module, load: Load) -> tuple[Callable[[], int], Callable[[], None]]:
    def run() -> int:
        for prompt, caps in load.groups:  # a row past its own cap computes for nothing
            common.hf_generate_left_padded(model, [prompt], max(caps), copies=len(caps))
        return load.useful_tokens

    return run, lambda: None


def hf_all(model: torch.nn.Module, load: Load) -> tuple[Callable[[], int], Callable[[], None]]:
    prompts = [prompt for prompt, caps in load.groups for _ in caps]
    longest = max(max(caps) for _, caps in load.groups)

    def run() -> int:
        common.hf_generate_left_padded(model, prompts, longest)
        return load.useful_tokens

    return run, lambda: None


def backends_of(family: str) -> dict[str, Backend]:
    fast = {"fast": embedded("fast")} if family == "llama" else {}
    return {"generic": embedded("generic"), **fast, "hf-per-group": hf_per_group, "hf-all": hf_all}


def measure(runs: dict[str, Callable[[], int]], reps: int, useful: int) -> dict[str, float]:
    """Name -> median seconds of `reps` runs, the runs alternating."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            started = time.perf_counter()
            kept = run()
            times[name].append(time.perf_counter() - started)
            if kept != useful:
                raise RuntimeError(f"{name} kept {kept} tokens, not the load's {useful}")
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def bench_family(family: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    config = family_config(family, args.hidden, args.layers, args.vocab)
    model = AutoModelForCausalLM.from_config(config).eval()
    load = make_load(args.groups, args.group_size, args.min_tokens, args.max_tokens, args.vocab)
    warm = make_load(2, 2, 4, 8, args.vocab, seed=1)
    opened = {}
    try:
        for name, backend in backends_of(family).items():
            warm_run, warm_close = backend(model, warm)
            warm_run()
            warm_close()
            opened[name] = backend(model, load)
        seconds = measure({name: run for name, (run, _) in opened.items()}, args.reps, load.useful_tokens)
    finally:
        for _, close in opened.values():
            close()
    rates = {name: load.useful_tokens / s for name, s in seconds.items()}
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "family": family,
        "parameters": parameters,
        "useful_tokens": load.useful_tokens,
        "seconds": seconds,
        "tokens_per_s": rates,
        "generic_over": {name: rates["generic"] / rate for name, rate in rates.items() if name != "generic"},
    }


def print_row(row: dict[str, Any], names: list[str]) -> None:
    rates, ratios = row["tokens_per_s"], row["generic_over"]
    cells = "".join(f"{rates[n]:>14.1f}" if n in rates else f"{'-':>14}" for n in names)
    ratio_cells = "".join(f"{ratios[n]:>21.2f}x" if n in ratios else f"{'-':>22}" for n in names[1:])
    print(
        f"{row['family']:<14}{row['parameters'] / 1e6:>7.1f}M{row['useful_tokens']:>8}{cells}{ratio_cells}", flush=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["llama", "gpt2", "qwen3_5_text", "lfm2"])
    parser.add_argument("--groups", type=int, default=8, help="prompt groups in the load")
    parser.add_argument("--group-size", type=int, default=8, help="requests per prompt (num_generations)")
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = ["generic", "fast", "hf-per-group", "hf-all"]
    print(
        f"{args.groups} groups of {args.group_size} sharing a prompt, caps {args.min_tokens}-{args.max_tokens} tokens, "
        f"hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, {torch.get_num_threads()} thread(s); "
        f"useful tokens/s, median of {args.reps}"
    )
    print(
        f"{'family':<14}{'params':>8}{'tokens':>8}"
        + "".join(f"{n:>14}" for n in names)
        + "".join(f"{'generic/' + n:>22}" for n in names[1:])
    )
    rows = []
    for family in args.families:
        rows.append(bench_family(family, args))
        print_row(rows[-1], names)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {key: value for key, value in vars(args).items() if key != "out"}
    result = {"provenance": common.provenance("python benchmarks/generic_generation.py"), "settings": settings}
    result["rows"] = rows
    result["threads"] = torch.get_num_threads()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
