"""The results' figures, from the JSON the benchmarks write, into the pages that quote them.

A page (or the README) marks a figure with `<!-- results: VIEW -->` ... `<!-- /results -->`; VIEW names one of
`VIEWS` below (`provenance FILE` takes a JSON file under docs/results/). Between the markers goes what the view
renders from the JSON: a table (the markers on their own lines) or a phrase inside a sentence.

- As a MkDocs hook (`hooks:` in mkdocs.yml) it fills every page's markers when the site is built, so the site shows
  the JSON's figures whatever the Markdown holds.
- As a script, `python docs/_gen/results.py` rewrites the README and the docs' Markdown in place (`--check` only
  lists the files that differ and exits 1), so the files read on GitHub show the same figures;
  tests/docs/test_results_pages.py checks that they do.

A view that names a file or key the JSON lacks fails with the marker and the file in the message.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
MAIN_JOB = "main_job.json"
RACE = "race-staleness/learning_race.json"
#: One learning race per CPU kind measured (each names its machine): Intel Xeon with AMX, AMD EPYC Zen 4, and an AMD
#: EPYC with full-width AVX-512 BF16.
RACES = ("race-amx7/learning_race.json", "race-zen4/learning_race.json", RACE)
ROOFLINE = "roofline.json"
#: One roofline per CPU kind measured (each names its machine): Intel Xeon with AMX, AMD EPYC Zen 4, an AMD EPYC
#: with full-width AVX-512 BF16, and the Zen 4 run as an AVX2-only CPU (its torch and oneDNN capped to AVX2 code).
ROOFLINES = ("roofline-amx.json", "roofline-zen4.json", ROOFLINE, "roofline-avx2.json")
SCALING = "scaling.json"
GENERIC = "generic_generation.json"
#: A marker pair and what it holds; the opening marker's argument is the view and its optional file.
MARKER = re.compile(r"(<!-- results: ([\w.]+)(?: ([\w./-]+))? -->)(.*?)(<!-- /results -->)", re.DOTALL)


def load(name: str) -> Any:
    """The JSON file `name` under docs/results/."""
    path = RESULTS / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: a results marker names it; write it with its benchmark")
    return json.loads(path.read_text())


def _num(value: float, digits: int = 3) -> str:
    """`value` with `digits` decimals and thousands separators."""
    return f"{value:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


# -- provenance -------------------------------------------------------------------------------------------------------


def cpu_numbers(machine: dict[str, Any]) -> list[str]:
    """`["family 25, model 17"]` where the run recorded the CPU's family and model numbers (a VM names AMD hosts of
    different generations alike), else `[]`."""
    return [f"family {machine['family']}, model {machine['model_number']}"] if "family" in machine else []


def cpu_name(machine: dict[str, Any]) -> str:
    """`AMD EPYC (family 25, model 17)`: the CPU's model name and its numbers where the run recorded them."""
    return " ".join([machine["model"], *(f"({numbers})" for numbers in cpu_numbers(machine))])


def machine_text(machine: dict[str, Any]) -> str:
    """`AMD EPYC (family 25, model 17), 2 cores (avx2, avx512_bf16)`: the CPU, its cores, its kernel-deciding flags,
    and the caps on the instructions torch and oneDNN used, where the run set them (`run under ONEDNN_MAX_CPU_ISA=...`)."""
    flags = ", ".join(machine.get("flags", [])) or "no AVX2"
    caps = f", run under {machine['isa_caps']}" if machine.get("isa_caps") else ""
    return f"{cpu_name(machine)}, {machine['cores']} cores ({flags}){caps}"


def _provenances(data: dict[str, Any]) -> list[dict[str, Any]]:
    found = data.get("provenance")
    if not found:
        raise KeyError("the JSON has no `provenance` (command, commit, date, machine): rerun its benchmark")
    return found if isinstance(found, list) else [found]


def provenance(data: dict[str, Any]) -> str:
    """One line: the command, the commit(s), the date(s) and the machine(s) that produced `data`."""
    runs = _provenances(data)

    def distinct(key: Callable[[dict[str, Any]], str]) -> str:
        return ", ".join(dict.fromkeys(key(run) for run in runs))

    commands = distinct(lambda run: f"`{run['command']}`")
    commits = distinct(lambda run: f"`{run['commit']}`")
    dates = distinct(lambda run: run["date"])
    machines = distinct(lambda run: machine_text(run["machine"]))
    return f"**Command** {commands}; **commit** {commits}; **date** {dates}; **machine** {machines}, no GPU."


def short_machine(data: dict[str, Any]) -> str:
    """The first run's machine in a few words: `2-core AMD EPYC (family 25, model 17; avx512_bf16)`; where the run
    capped the instructions, the caps instead of the flags (`...; under ONEDNN_MAX_CPU_ISA=AVX2`)."""
    machine = _provenances(data)[0]["machine"]
    flags = [flag for flag in machine.get("flags", []) if "bf16" in flag] or machine.get("flags", [])[:1]
    if machine.get("isa_caps"):
        flags = [f"under {machine['isa_caps']}"]
    return f"{machine['cores']}-core {machine['model']} ({'; '.join([*cpu_numbers(machine), ', '.join(flags)])})"


# -- the main job -----------------------------------------------------------------------------------------------------


def main_job_sentence(job: dict[str, Any]) -> str:
    """`0.438 → **1.000** in 38 optimizer steps, fit 4.4 min`."""
    return (
        f"{job['accuracy_before']:.3f} → **{job['accuracy_after']:.3f}** in {job['optimizer_steps']} optimizer steps, "
        f"fit {job['fit_minutes']:.1f} min"
    )


def main_job_table(job: dict[str, Any]) -> str:
    """Held-out accuracy before, at each validation and after; steps, minutes, peak memory."""
    during = [point for point in job["validations"] if 0 < point["step"] < job["optimizer_steps"]]
    rows = [
        ["held-out accuracy before training", f"{job['accuracy_before']:.3f}"],
        *([f"held-out accuracy at step {p['step']}", f"{p['accuracy']:.3f}"] for p in during),
        ["held-out accuracy after training", f"**{job['accuracy_after']:.3f}**"],
        ["optimizer steps (prompt groups consumed)", f"{job['optimizer_steps']} ({job['groups_consumed']})"],
        ["fit, its validations included", f"{job['fit_minutes']:.1f} min"],
        ["peak memory, all processes", f"{job['peak_rss_gb']} GB"],
    ]
    return _table(["", "this run"], rows)


# -- the learning race ------------------------------------------------------------------------------------------------


def _first(curve: list[dict[str, Any]], threshold: float) -> dict[str, Any] | None:
    return next((point for point in curve if point["accuracy"] >= threshold), None)


def _reached(point: dict[str, Any] | None) -> str:
    return "never" if point is None else f"{point['training_s']:.0f} s (step {point['step']})"


def race_rows(race: dict[str, Any]) -> list[dict[str, Any]]:
    """Per race: our seed, steps, s per step, time to 0.9, TRL's seed and time to 0.9, their ratio."""
    rows = []
    for sides in race["runs"].values():
        ours, trl = sides["ours"], sides["trl"]
        mine, theirs = _first(ours["curve"], 0.9), _first(trl["curve"], 0.9)
        ratio = None if mine is None or theirs is None else mine["training_s"] / theirs["training_s"]
        rows.append({"ours": ours, "trl": trl, "mine": mine, "theirs": theirs, "ratio": ratio})
    return rows


def race_medians(race: dict[str, Any]) -> dict[str, float]:
    """The medians the race reports at 0.9: ours, TRL's distinct runs, their ratio, the per-race ratios' median."""
    (by_threshold,) = race["medians"].values()
    median = by_threshold["0.9"]
    return {**median, "ratio": median["ours_s"] / median["trl_s"]}


def race_table(race: dict[str, Any]) -> str:
    """One row per race, then the medians."""
    rows = []
    for row in race_rows(race):
        ours, trl = row["ours"], row["trl"]
        ratio = "–" if row["ratio"] is None else f"{row['ratio']:.2f}"
        rows.append(
            [
                f"{ours['seed']} / {trl.get('seed') or 0}",
                f"{ours['optimizer_steps']}, {ours['training_s'] / ours['optimizer_steps']:.1f} s",
                _reached(row["mine"]),
                f"{trl['optimizer_steps']}, {trl['training_s'] / trl['optimizer_steps']:.1f} s",
                _reached(row["theirs"]),
                ratio,
            ]
        )
    m = race_medians(race)
    rows.append(
        [
            "**median**",
            "",
            f"**{m['ours_s']:.0f} s** ({m['ours_runs']} runs)",
            "",
            f"**{m['trl_s']:.0f} s** ({m['trl_runs']} runs)",
            f"**{m['ratio']:.2f}** (per race {m['per_race_ratio']:.2f})",
        ]
    )
    header = ["seed: ours / TRL", "ours: steps, s/step", "ours: 0.9 at", "TRL: steps, s/step", "TRL: 0.9 at"]
    return _table([*header, "ours / TRL"], rows)


def race_sentence(race: dict[str, Any]) -> str:
    """`**0.18** of TRL's seconds to 0.9 held-out (median 71 s against 399 s)`."""
    m = race_medians(race)
    return (
        f"**{m['ratio']:.2f}** of TRL's seconds to 0.9 held-out (median {m['ours_s']:.0f} s against {m['trl_s']:.0f} s)"
    )


def race_steps(race: dict[str, Any]) -> str:
    """`s per step 4.1–4.8 against TRL's 20.4–27.8`."""
    rows = race_rows(race)

    def span(side: str) -> str:
        each = [row[side]["training_s"] / row[side]["optimizer_steps"] for row in rows]
        return f"{min(each):.1f}–{max(each):.1f}"

    return f"s per step {span('ours')} against TRL's {span('trl')}"


def race_waiting(race: dict[str, Any]) -> str:
    """`35–50 s of each run's 122–148 training seconds`: how long our trainer waited for rollouts."""
    ours = [row["ours"] for row in race_rows(race)]
    waits = [side["breakdown"]["waiting_for_rollouts_s"] for side in ours]
    totals = [side["training_s"] for side in ours]
    return f"{min(waits):.0f}–{max(waits):.0f} s of each run's {min(totals):.0f}–{max(totals):.0f} training seconds"


# -- the roofline -----------------------------------------------------------------------------------------------------


def _rows(roofline: dict[str, Any], group: str) -> list[dict[str, Any]]:
    return [row for row in roofline["rows"] if row["group"] == group]


def _split(stage: str) -> tuple[str, str]:
    """`decode, batch 8, fp32` -> (`decode, batch 8`, `fp32`)."""
    base, _, precision = stage.rpartition(", ")
    return base, precision


def _find(rows: list[dict[str, Any]], base: str, precision: str, kind: str) -> dict[str, Any] | None:
    return next((r for r in rows if _split(r["stage"]) == (base, precision) and r["bound_kind"].startswith(kind)), None)


def roofline_peaks(roofline: dict[str, Any]) -> str:
    """The compute peaks (the faster product) and the memory bandwidths this run measured."""
    peaks = roofline["peaks"]
    rows = [
        ["fp32, best product", f"**{_num(peaks['peak_gflops']['fp32'], 1)} GFLOP/s**"],
        ["bf16, best product", f"**{_num(peaks['peak_gflops']['bf16'], 1)} GFLOP/s**"],
        ["memory read / copy", f"{peaks['read_gbs']:.1f} / {peaks['copy_gbs']:.1f} GB/s"],
        ['the precision probe (`AutoPrecision`, `generator_dtype="auto"`)', f'"{roofline["precision_probe"]}"'],
    ]
    return _table(["peak", "this run"], rows)


def roofline_generator(roofline: dict[str, Any]) -> str:
    """Decode and prefill in fp32 and bf16: tokens/s and the fraction of each precision's compute peak."""
    rows = _rows(roofline, "generator")
    bases = list(dict.fromkeys(_split(r["stage"])[0] for r in rows))
    table = []
    for base in bases:
        fp32 = _find(rows, base, "fp32", "compute, fp32")
        bf16 = _find(rows, base, "bf16", "compute, bf16")
        if fp32 is None or bf16 is None:
            continue
        table.append(
            [
                base,
                _num(fp32["measured"], 1),
                f"{fp32['fraction']:.2f}",
                _num(bf16["measured"], 1),
                f"{bf16['fraction']:.2f}",
                f"{bf16['measured'] / fp32['measured']:.2f}×",
            ]
        )
    header = ["stage", "fp32 tok/s", "of fp32 peak", "bf16 tok/s", "of bf16 peak", "bf16 / fp32"]
    return _table(header, table)


def roofline_train(roofline: dict[str, Any]) -> str:
    """The train step and the reference forward in fp32 and bf16-mixed, over each precision's peak."""
    rows = _rows(roofline, "train") + _rows(roofline, "reference")
    table = []
    for base in dict.fromkeys(_split(r["stage"])[0] for r in rows):
        fp32 = _find(rows, base, "32-true", "compute, fp32")
        bf16 = _find(rows, base, "bf16-mixed", "compute, bf16")
        if fp32 is None or bf16 is None:
            continue
        table.append(
            [
                base,
                f"{fp32['measured']:.1f} GFLOP/s",
                f"{fp32['fraction']:.2f}",
                f"{bf16['measured']:.1f} GFLOP/s",
                f"**{bf16['fraction']:.2f}**",
                f"{bf16['measured'] / fp32['measured']:.2f}×",
            ]
        )
    header = ["stage", "32-true", "of fp32 peak", "bf16-mixed", "of bf16 peak", "bf16-mixed / 32-true"]
    return _table(header, table)


def roofline_other(roofline: dict[str, Any]) -> str:
    """The weight push and reward scoring against their bounds."""
    rows = _rows(roofline, "push") + _rows(roofline, "reward")
    table = [
        [r["stage"], f"{_num(r['measured'], 2)} {r['unit']}", f"{_num(r['bound'], 2)} {r['unit']} ({r['bound_kind']})"]
        + [f"{r['fraction']:.2f}"]
        for r in rows
    ]
    return _table(["stage", "measured", "bound", "fraction"], table)


def roofline_async_step(roofline: dict[str, Any]) -> str:
    """Where one asynchronous optimizer step's seconds go."""
    rows = _rows(roofline, "async step")
    table = [[r["stage"].removeprefix("async step: "), f"{r['measured']:.3f}", f"{r['fraction']:.3f}"] for r in rows]
    return _table(["part", "seconds", "share of the step"], table)


def roofline_headline(roofline: dict[str, Any]) -> str:
    """`train step 0.51 of the bf16 peak; bf16 decode at batch 64 0.40`, in the dtype of the run's best peak (the one
    the library picks there: fp32 where bf16 products are slower, as on an AVX2-only CPU)."""
    rows = roofline["rows"]
    best = roofline["peaks"]["best_dtype"]
    train = next(r for r in rows if r["group"] == "train" and r["bound_kind"].startswith(f"compute, {best}"))
    decode = next(
        r for r in rows if r["stage"] == f"decode, batch 64, {best}" and r["bound_kind"].startswith("compute")
    )
    return (
        f"train step **{train['fraction']:.2f}** of the {best} peak; {best} decode at batch 64 "
        f"**{decode['fraction']:.2f}**"
    )


# -- scaling ----------------------------------------------------------------------------------------------------------


_POLICY_NAMES = {"smollm2-135m": "SmolLM2-135M", "smollm2-360m": "SmolLM2-360M"}
_MODE_NAMES = {"full + ckpt": "full + checkpointing", "LoRA + ckpt": "LoRA + checkpointing"}


def policy_name(policy: str) -> str:
    """`qwen2.5-0.5b` -> `Qwen2.5-0.5B`, `smollm2-135m` -> `SmolLM2-135M`."""
    return _POLICY_NAMES.get(policy) or policy.replace("qwen", "Qwen").upper().replace("QWEN", "Qwen")


def _fits(side: dict[str, Any], value: str) -> str:
    return value if side.get("fits") else "does not fit"


def _scaling_cells(row: dict[str, Any]) -> list[str]:
    trainer, rollout = row["trainer"], row["rollout"]
    seconds = f"{trainer['seconds']:.1f}" if trainer.get("seconds") is not None else "does not fit"
    both = trainer["peak_gib"] + rollout["peak_gib"]
    return [
        f"{_fits(trainer, seconds)}, {trainer['peak_gib']:.1f}",
        f"{rollout['seconds']:.1f}, {rollout['peak_gib']:.1f}",
        f"{both:.1f}",
    ]


_SCALING_COLUMNS = ["trainer: s/step, GiB", "rollout: s/step, GiB", "both GiB"]


def _sweep(scaling: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The policy × mode rows (the first `len(policies) × len(modes)` rows) and the run's arguments."""
    args = scaling["args"]
    count = len(args["policies"]) * len(args["modes"])
    return scaling["rows"][:count], args


def scaling_policies(scaling: dict[str, Any]) -> str:
    """Policy × mode at the run's group size and completion length."""
    rows, _ = _sweep(scaling)
    table = [
        [policy_name(row["policy"]), _MODE_NAMES.get(row["mode"], row["mode"]), *_scaling_cells(row)]
        + ["yes" if row["fits"] else "**no**"]
        for row in rows
    ]
    return _table(["policy", "mode", *_SCALING_COLUMNS, "fits"], table)


def scaling_largest(scaling: dict[str, Any]) -> str:
    """Per mode, the largest policy whose trainer and rollout process fit together."""
    rows, _ = _sweep(scaling)
    table = []
    for mode, policy in scaling["largest"].items():
        row = next(r for r in rows if r["policy"] == policy and r["mode"] == mode)
        both = row["trainer"]["peak_gib"] + row["rollout"]["peak_gib"]
        table.append([_MODE_NAMES.get(mode, mode), f"**{policy_name(policy)}** ({both:.1f} GiB)"])
    return _table(["mode", "largest that fits"], table)


def _sweep_rows(scaling: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """The sweep policy's full fine-tuning rows varying `key` (`length` or `group_size`), the others at the base."""
    args = scaling["args"]
    base = {"length": args["length"], "group_size": args["group_size"]}
    other = "group_size" if key == "length" else "length"
    rows = scaling["rows"][len(args["policies"]) * len(args["modes"]) :]
    found = {r[key]: r for r in rows if r["policy"] == args["sweep_policy"] and r[other] == base[other]}
    return [found[value] for value in sorted(found)]


def scaling_lengths(scaling: dict[str, Any]) -> str:
    """The sweep policy at each completion length."""
    table = [[_num(r["length"], 0), *_scaling_cells(r)] for r in _sweep_rows(scaling, "length")]
    return _table(["completion tokens", *_SCALING_COLUMNS], table)


def scaling_group_sizes(scaling: dict[str, Any]) -> str:
    """The sweep policy at each group size."""
    table = [[str(r["group_size"]), *_scaling_cells(r)] for r in _sweep_rows(scaling, "group_size")]
    return _table(["completions per prompt", *_SCALING_COLUMNS], table)


def scaling_headline(scaling: dict[str, Any]) -> str:
    """`Qwen2.5-0.5B in full fine-tuning, Qwen2.5-1.5B with LoRA + gradient checkpointing`."""
    largest = scaling["largest"]
    full, lora = policy_name(largest["full"]), policy_name(largest["LoRA + ckpt"])
    return f"**{full}** in full fine-tuning, **{lora}** with LoRA + gradient checkpointing"


# -- the headline table (README and home page) ------------------------------------------------------------------------


def headline(_: Any) -> str:
    """The main job, the race, the roofline on each CPU kind and scaling in one table, each with its machine."""
    job, scaling = load(MAIN_JOB), load(SCALING)
    rows = [
        [
            f"the main job: SmolLM2-135M-Instruct, {job['held_out_problems']} held-out arithmetic problems",
            f"held-out accuracy {main_job_sentence(job)}",
            short_machine(job),
        ],
        *(
            [
                "the learning race: seconds to 0.9 held-out accuracy against TRL's `GRPOTrainer`, same settings",
                f"{race_sentence(race)}; {race_steps(race)}",
                short_machine(race),
            ]
            for race in map(load, RACES)
        ),
        *(
            [
                "roofline: each stage over a peak measured in the same run",
                roofline_headline(roofline),
                short_machine(roofline),
            ]
            for roofline in map(load, ROOFLINES)
        ),
        ["scaling: the largest policy the machine trains", scaling_headline(scaling), short_machine(scaling)],
    ]
    return _table(["what", "result", "machine (no GPU)"], rows)


#: view name -> (its default JSON file under docs/results/, the function rendering it).
# -- the generic decoder against HF generate --------------------------------------------------------------------------


def generic_generation_table(bench: dict[str, Any]) -> str:
    """Per family: useful tokens/s of the generic decoder and of HF `generate` (with the generic decoder's ratio
    over it); the fast decoder's beside the family where it runs it."""
    table = []
    for row in bench["rows"]:
        speed, ratio = row["tokens_per_s"], row["generic_over"]
        family = row["family"] + (f" (fast decoder: {speed['fast']:,.0f})" if speed.get("fast") else "")
        hf = [f"{speed[kind]:,.0f} (**{ratio[kind]:.2f}×**)" for kind in ("hf-per-group", "hf-all")]
        table.append([family, f"{speed['generic']:,.0f}", *hf])
    return _table(["family", "generic decoder", "HF, per group (×)", "HF, all (×)"], table)


VIEWS: dict[str, tuple[str | None, Callable[[Any], str]]] = {
    "generic_generation.table": (GENERIC, generic_generation_table),
    "generic_generation.provenance": (GENERIC, provenance),
    "provenance": (None, provenance),
    "main_job.sentence": (MAIN_JOB, main_job_sentence),
    "main_job.table": (MAIN_JOB, main_job_table),
    "main_job.provenance": (MAIN_JOB, provenance),
    "race.table": (RACE, race_table),
    "race.sentence": (RACE, race_sentence),
    "race.steps": (RACE, race_steps),
    "race.waiting": (RACE, race_waiting),
    "roofline.peaks": (ROOFLINE, roofline_peaks),
    "roofline.generator": (ROOFLINE, roofline_generator),
    "roofline.train": (ROOFLINE, roofline_train),
    "roofline.other": (ROOFLINE, roofline_other),
    "roofline.async_step": (ROOFLINE, roofline_async_step),
    "roofline.headline": (ROOFLINE, roofline_headline),
    "scaling.policies": (SCALING, scaling_policies),
    "scaling.largest": (SCALING, scaling_largest),
    "scaling.lengths": (SCALING, scaling_lengths),
    "scaling.group_sizes": (SCALING, scaling_group_sizes),
    "scaling.headline": (SCALING, scaling_headline),
    "headline": (None, headline),
}


def render_view(view: str, file: str | None) -> str:
    """What the marker `<!-- results: view file -->` holds."""
    if view not in VIEWS:
        raise KeyError(f"unknown results view {view!r}; the views: {', '.join(VIEWS)}")
    default, function = VIEWS[view]
    name = file or default
    if view == "provenance" and name is None:
        raise KeyError("`<!-- results: provenance FILE -->` needs the JSON file it describes")
    return function(load(name) if name else None)


def render(markdown: str, strip: bool = False) -> str:
    """`markdown` with every marker's content rendered from its JSON; `strip` drops the markers themselves."""

    def fill(match: re.Match[str]) -> str:
        opening, view, file, old, closing = match.groups()
        try:
            text = render_view(view, file)
        except (KeyError, FileNotFoundError, StopIteration, ValueError) as error:
            raise ValueError(f"{opening}: {error}") from error
        block = old.startswith("\n")  # a table: the markers on their own lines, blank lines around the content
        body = f"\n\n{text}\n\n" if block else text
        return body if strip else f"{opening}{body}{closing}"

    return MARKER.sub(fill, markdown)


def pages() -> list[Path]:
    """The files whose markers the script keeps current: the README and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def stale_pages() -> list[Path]:
    """The pages whose figures differ from what their JSON renders."""
    return [path for path in pages() if MARKER.search(text := path.read_text()) and render(text) != text]


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """MkDocs hook: fill the page's results markers from the JSON."""
    return render(markdown, strip=True)


def main(argv: list[str]) -> int:
    """Rewrite the stale pages (`--check`: list them and return 1 instead)."""
    stale = stale_pages()
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(ROOT)}: figures differ from the JSON; run python docs/_gen/results.py")
        return 1 if stale else 0
    for path in stale:
        path.write_text(render(path.read_text()))
        print(f"rewrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
