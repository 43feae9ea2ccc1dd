"""The learning race's report: the seconds each side first reaches a held-out threshold, one race's table and plot,
and `--summarize`'s medians over several races (`learning.py` runs the races; this module only reads their
`race.json`).

A race folder's `race.json` holds both sides, `ours` and `trl`, each with its `curve` (step, training seconds,
held-out accuracy) and its precision; a side reused from an earlier race (`--reuse`) says so in `reused_from`, so
`summarize` counts each distinct TRL run once.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

THRESHOLDS = (0.9, 0.95)


def first_point(curve: list[dict[str, Any]], threshold: float) -> dict[str, Any] | None:
    """The first snapshot at or above `threshold` (None: never)."""
    return next((point for point in curve if point["accuracy"] >= threshold), None)


def first_reaching(curve: list[dict[str, Any]], threshold: float) -> float | None:
    """Training seconds of the first snapshot at or above `threshold` (None: never)."""
    point = first_point(curve, threshold)
    return None if point is None else point["training_s"]


def precision_label(side: dict[str, Any]) -> str:
    """A side's training precision, our generator's dtype where it was set (runs before either was recorded were
    fp32), and the options a run of ours changed (`--ours-data`, `--ours-model`)."""
    label = side.get("precision", "32-true")
    label += f", generator {side['generator_dtype']}" if side.get("generator_dtype") else ""
    overrides = side.get("overrides") or {}
    return label + "".join(f", {key}={value}" for key, value in overrides.items())


def report(sides: dict[str, dict[str, Any]], out: Path) -> None:
    """One race: both curves, the seconds to each threshold and their ratio, where the time went; writes
    `race.json` and `race.png` under `out`."""
    print("\nHeld-out greedy accuracy against training seconds")
    for name, side in sides.items():
        points = ", ".join(f"{p['training_s']:.0f}s:{p['accuracy']:.3f}" for p in side["curve"])
        print(f"  {name} (step: seconds:accuracy): {points}")
    print("\n| | ours | TRL GRPOTrainer | ours / TRL |\n|---|---|---|---|")
    for threshold in THRESHOLDS:
        ours, trl = (first_reaching(sides[n]["curve"], threshold) for n in ("ours", "trl"))
        ratio = f"{ours / trl:.2f}" if ours is not None and trl is not None else "-"
        print(f"| first at >= {threshold} held-out (s) | {_fmt(ours)} | {_fmt(trl)} | {ratio} |")
    for key, label in [("training_s", "training seconds in all"), ("optimizer_steps", "optimizer steps")]:
        ours, trl = sides["ours"][key], sides["trl"][key]
        print(f"| {label} | {ours:.0f} | {trl:.0f} | {ours / trl:.2f} |")
    ours_final, trl_final = sides["ours"]["curve"][-1]["accuracy"], sides["trl"]["curve"][-1]["accuracy"]
    print(f"| final held-out accuracy | {ours_final:.3f} | {trl_final:.3f} | |")
    print("\nWhere the training seconds went")
    for name, side in sides.items():
        parts = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f} s" for k, v in side["breakdown"].items())
        print(f"  {name}: {parts} (snapshots paused the clock for {side['snapshot_pause_s']:.0f} s)")
    (out / "race.json").write_text(json.dumps(sides, indent=2))
    plot(sides, out / "race.png")
    print(f"\nwrote {out / 'race.json'} and {out / 'race.png'}")


# -- several races ----------------------------------------------------------------------------------------------------


def summarize(folders: list[Path], out: Path) -> dict[str, Any]:
    """Each race's times to every threshold, then per precision of ours: the median of our runs' seconds over the
    median of the distinct TRL runs' seconds (a run that never reached a threshold counts as infinitely slow), and
    the median of the per-race ratios. Races of ours alone (`--sides ours` without `--reuse`) have no TRL figures
    ("-"). Writes `learning_race.json` and `learning_race.png` under `out`."""
    runs = [(folder, json.loads((folder / "race.json").read_text())) for folder in folders]
    print("| race | ours' precision | TRL's | steps | s per step | " + " | ".join(f"to {t}" for t in THRESHOLDS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(THRESHOLDS))
    for folder, sides in runs:
        ours, trl = sides["ours"], sides.get("trl")
        cells = [_race_cell(ours, trl, threshold) for threshold in THRESHOLDS]
        per_step = ours["training_s"] / ours["optimizer_steps"]
        print(
            f"| {folder.name} | {precision_label(ours)} | {precision_label(trl) if trl else '-'} | "
            f"{ours['optimizer_steps']} | "
            f"{per_step:.1f} | " + " | ".join(cells) + " |"
        )
    medians = {label: _medians(group) for label, group in _by_our_precision(runs).items()}
    for label, by_threshold in medians.items():
        for threshold, m in by_threshold.items():
            if not m["trl_runs"]:
                print(f"ours ({label}) to {threshold}: median {_fmt(m['ours_s'])} s over {m['ours_runs']} runs")
                continue
            print(
                f"ours ({label}) to {threshold}: median {_fmt(m['ours_s'])} s over {m['ours_runs']} runs / TRL median "
                f"{_fmt(m['trl_s'])} s over {m['trl_runs']} = {_ratio(m['ours_s'], m['trl_s'])} "
                f"(median of per-race ratios {_ratio(m['per_race_ratio'], 1.0)})"
            )
    out.mkdir(parents=True, exist_ok=True)
    # each race's command, commit, machine and date (`learning.py` writes them beside `race.json`)
    provenance = [json.loads(p.read_text()) for p in (f / "provenance.json" for f, _ in runs) if p.exists()]
    summary = {"provenance": provenance, "runs": {str(folder): sides for folder, sides in runs}, "medians": medians}
    (out / "learning_race.json").write_text(json.dumps(summary, indent=2))
    plot_runs(runs, out / "learning_race.png")
    print(f"wrote {out / 'learning_race.json'} and {out / 'learning_race.png'}")
    return summary


def _race_cell(ours: dict[str, Any], trl: dict[str, Any] | None, threshold: float) -> str:
    """'ours / TRL = ratio (our step)' seconds to `threshold` in one race ('ours (our step)' without TRL)."""
    mine = first_reaching(ours["curve"], threshold)
    if trl is None:
        return _fmt(mine) if mine is None else f"{mine:.0f} ({first_point(ours['curve'], threshold)['step']})"
    theirs = first_reaching(trl["curve"], threshold)
    if mine is None or theirs is None:
        return f"{_fmt(mine)} / {_fmt(theirs)}"
    step = first_point(ours["curve"], threshold)["step"]
    return f"{mine:.0f} / {theirs:.0f} = {mine / theirs:.2f} ({step})"


def _by_our_precision(runs: list[tuple[Path, dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for _, sides in runs:
        groups.setdefault(precision_label(sides["ours"]), []).append(sides)
    return groups


def _medians(races: list[dict[str, Any]]) -> dict[float, dict[str, Any]]:
    """Per threshold: our runs' median seconds, the distinct TRL runs' median seconds, the median per-race ratio."""
    trl_runs = {json.dumps(race["trl"]["curve"]): race["trl"] for race in races if "trl" in race}.values()
    medians = {}
    for threshold in THRESHOLDS:
        ours = [_or_inf(first_reaching(race["ours"]["curve"], threshold)) for race in races]
        trl = [_or_inf(first_reaching(run["curve"], threshold)) for run in trl_runs]
        pairs = [
            tuple(first_reaching(race[side]["curve"], threshold) for side in ("ours", "trl"))
            for race in races
            if "trl" in race
        ]
        ratios = [mine / theirs for mine, theirs in pairs if mine is not None and theirs is not None]
        medians[threshold] = {
            "ours_s": statistics.median(ours),
            "ours_runs": len(ours),
            "trl_s": statistics.median(trl) if trl else math.nan,
            "trl_runs": len(trl),
            "per_race_ratio": statistics.median(ratios) if ratios else math.nan,
        }
    return medians


def _or_inf(seconds: float | None) -> float:
    return math.inf if seconds is None else seconds


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if math.isfinite(a) and math.isfinite(b) and b else "-"


def _fmt(seconds: float | None) -> str:
    return "never" if seconds is None or not math.isfinite(seconds) else f"{seconds:.0f}"


# -- plots ------------------------------------------------------------------------------------------------------------


def plot(sides: dict[str, dict[str, Any]], path: Path) -> None:
    """One race's two curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"ours": "lightning_grpo (async, embedded generator)", "trl": "TRL GRPOTrainer (sync, HF generate)"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, side in sides.items():
        curve = side["curve"]
        label = f"{labels[name]}, {precision_label(side)}"
        ax.plot([p["training_s"] for p in curve], [p["accuracy"] for p in curve], "o-", label=label)
    _finish(fig, ax, path)


def plot_runs(runs: list[tuple[Path, dict[str, Any]]], path: Path) -> None:
    """Every race's curve of ours, and each distinct TRL curve once."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5 + 0.22 * len(runs)))
    drawn_trl: list[list] = []
    for index, (folder, sides) in enumerate(runs):
        curve = sides["ours"]["curve"]
        label = f"lightning_grpo {_short(precision_label(sides['ours']))} ({folder.name})"
        ax.plot([p["training_s"] for p in curve], [p["accuracy"] for p in curve], "o-", color=f"C{index}", label=label)
        trl = sides["trl"]["curve"] if "trl" in sides else None
        if trl is not None and trl not in drawn_trl:
            drawn_trl.append(trl)
            xs, ys = [p["training_s"] for p in trl], [p["accuracy"] for p in trl]
            ax.plot(xs, ys, "s--", color="black", alpha=0.4 + 0.6 / len(drawn_trl),
                    label=f"TRL GRPOTrainer {_short(precision_label(sides['trl']))} ({folder.name})")  # fmt: skip
    _finish(fig, ax, path, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)


def _short(label: str) -> str:
    """A legend's label: GRPOModule's importance-sampling options as "TIS <mode>"."""
    return label.replace("vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=", "TIS ")


def _finish(fig: Any, ax: Any, path: Path, **legend: Any) -> None:
    """The thresholds, axes and legend of a race plot; saves and closes it."""
    import matplotlib.pyplot as plt

    for threshold in THRESHOLDS:
        ax.axhline(threshold, color="grey", lw=0.6, ls="--")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(**({"loc": "lower right"} | legend))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
