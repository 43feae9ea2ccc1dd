"""The main job's published result: run `./scripts/main.sh`'s job (or take a finished run) and write what every page
that quotes it reads, then refresh those pages.

    python benchmarks/main_job.py                                    # run the main job here, then publish it
    python benchmarks/main_job.py --publish runs/arithmetic/version_3  # publish a finished run's folder

Writes `docs/results/main_job.json` (held-out accuracy before and after, the accuracy at each validation, optimizer
steps, fit minutes, peak memory, and the command, commit, machine and date) and copies the run's `reward.png` to
`docs/results/main_job.png`, then rewrites the figures between `<!-- results: main_job.json ... -->` markers in the
README and the docs (`docs/_gen/results.py`). Publish on the machine that ran the job, from the checkout it ran:
the commit, machine and date are read when publishing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import common  # noqa: I001  (first: sets the offline environment before torch and TRL load)

COMMAND = "./scripts/main.sh"
ACCURACY = "val/rewards/accuracy"
RESULTS = common.ROOT / "docs" / "results"


def validations(metrics_csv: Path) -> list[dict[str, Any]]:
    """Each validation's (optimizer step, held-out accuracy) from the run's `metrics.csv`, in step order; steps
    numbered as the log, the plot and `summary.json` number them (`cli.main_job.optimizer_steps`)."""
    import pandas as pd

    from lightning_grpo.cli.main_job import optimizer_steps

    metrics = pd.read_csv(metrics_csv)
    metrics["optimizer_step"] = optimizer_steps(metrics)
    rows = metrics[["optimizer_step", ACCURACY]].dropna()
    points = {
        int(step): round(float(value), 4) for step, value in zip(rows["optimizer_step"], rows[ACCURACY], strict=True)
    }
    return [{"step": step, "accuracy": accuracy} for step, accuracy in sorted(points.items())]


def held_out_problems(config: Path) -> int:
    """The held-out problems the job validates on (`data.val_size` of its config)."""
    import yaml

    return int(yaml.safe_load(config.read_text())["data"]["val_size"])


def publish(run: Path, command: str) -> dict[str, Any]:
    """Write `main_job.json` and `main_job.png` from the run folder `run` (the one holding `summary.json`)."""
    summary_path = run / "summary.json"
    if not summary_path.exists():
        raise SystemExit(f"{summary_path} not found: pass the main job's log folder (runs/arithmetic/version_N)")
    summary = json.loads(summary_path.read_text())
    result = {
        "provenance": common.provenance(command),
        "model": "SmolLM2-135M-Instruct",
        "held_out_problems": held_out_problems(common.ROOT / "lightning_grpo" / "configs" / "arithmetic.yaml"),
        "accuracy_before": round(summary["accuracy_before"], 4),
        "accuracy_after": round(summary["accuracy_after"], 4),
        "optimizer_steps": summary["optimizer_steps"],
        "groups_consumed": summary["groups_consumed"],
        "fit_minutes": summary["fit_minutes"],
        "peak_rss_gb": summary["peak_rss_gb"],
        "validations": validations(run / "metrics.csv") if (run / "metrics.csv").exists() else [],
        "plot": "main_job.png",
    }
    (RESULTS / "main_job.json").write_text(json.dumps(result, indent=2) + "\n")
    shutil.copyfile(run / "reward.png", RESULTS / "main_job.png")
    print(f"wrote {RESULTS / 'main_job.json'} and {RESULTS / 'main_job.png'}")
    return result


def run_main_job(argv: list[str]) -> Path:
    """Run the main job as `./scripts/main.sh` does; returns its log folder."""
    from lightning_grpo.cli.main_job import main

    summary = main(argv)
    return Path(summary["metrics_csv"]).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--publish", type=Path, default=None, help="a finished run's folder (runs/arithmetic/...)")
    args, job_arguments = parser.parse_known_args()
    if args.publish is not None and job_arguments:
        parser.error(f"--publish takes no main-job arguments, got {job_arguments}")
    command = " ".join([COMMAND, *job_arguments])
    publish(args.publish or run_main_job(job_arguments), command)
    subprocess.run([sys.executable, str(common.ROOT / "docs" / "_gen" / "results.py")], check=True)


if __name__ == "__main__":
    main()
