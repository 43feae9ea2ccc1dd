"""benchmarks/race_report.py's summary of several learning races (`learning.py --summarize`), on races kept in the
docs: races against TRL give medians and ratios; races of ours alone (`--sides ours` without `--reuse`) give our
medians and no TRL figures, instead of failing on the missing side."""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from race_report import summarize  # noqa: E402

RESULTS = ROOT / "docs" / "results"


def test_races_of_ours_alone_give_our_medians_and_no_trl_figures(tmp_path):
    folders = [RESULTS / "race-amx5d-early" / f"seed{seed}" for seed in range(5, 10)]
    summary = summarize(folders, tmp_path)
    (medians,) = summary["medians"].values()
    # seconds to 0.9 of seeds 5-9: 158, 283, 159, 102, 167 (race.json of each)
    assert medians[0.9]["ours_runs"] == 5 and round(medians[0.9]["ours_s"]) == 159
    assert medians[0.9]["trl_runs"] == 0 and math.isnan(medians[0.9]["trl_s"])
    assert math.isnan(medians[0.9]["per_race_ratio"])
    assert (tmp_path / "learning_race.json").exists() and (tmp_path / "learning_race.png").exists()


def test_races_against_trl_give_the_ratio_of_the_medians(tmp_path):
    folders = [RESULTS / "race-amx5" / f"seed{seed}" for seed in range(5)]
    summary = summarize(folders, tmp_path)
    (medians,) = summary["medians"].values()
    assert medians[0.9]["ours_runs"] == 5 and medians[0.9]["trl_runs"] >= 1
    assert math.isfinite(medians[0.9]["trl_s"]) and medians[0.9]["trl_s"] > 0
