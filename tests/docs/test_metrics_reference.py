"""The metrics reference is generated from `lightning_grpo.training.metric_catalog`; a real fit's every logged name
has an entry there, and every entry names a metric the code (ours or TRL's rollout worker) logs."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest
from helpers.tiny import cpu_trainer, tiny_datamodule, tiny_prompts, tiny_reward_model
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

from lightning_grpo import GRPOModule, RewardModelScorer
from lightning_grpo.pipeline.ledger import DROP_HINTS
from lightning_grpo.training.metric_catalog import SECTIONS, describe, documented_names

ROOT = Path(__file__).resolve().parents[2]


class KeyRecorder(Logger):
    """A logger that keeps every metric name it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[str] = set()

    @property
    def name(self) -> str:
        return "keys"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.keys.update(metrics)


def test_a_placeholder_stands_for_a_name_and_an_exact_entry_wins():
    assert describe("rewards/accuracy").name == "rewards/<name>"
    assert describe("val/rewards/accuracy").name == "val/rewards/<name>"
    assert describe("val/pass@8").name == "val/pass@<k>"
    assert describe("tools/lookup/call_total").name == "tools/<tool>/call_total"
    assert describe("tools/timeout_total").name == "tools/timeout_total"  # not tools/<tool>/...
    assert describe("rewards/") is None and describe("reward_pool/made_up_total") is None


def test_every_entry_is_documented_once_and_means_something():
    names = documented_names()
    assert len(names) == len(set(names)), "a metric is listed twice"
    for _, metrics in SECTIONS:
        for metric in metrics:
            assert metric.meaning.endswith(".") and metric.logged, metric


def test_every_entry_names_a_metric_the_code_logs():
    """Each literal part of each name is in the source that logs it, so the list names no metric that does not
    exist (`progress/dropped_<reason>_total` is written with the reason, one of the ledger's drop reasons)."""
    import trl.experimental.async_grpo.async_rollout_worker as trl_worker

    files = [*(ROOT / "lightning_grpo").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")]
    files = [path for path in files if path.name != "metric_catalog.py"]
    source = "\n".join(path.read_text() for path in files) + inspect.getsource(trl_worker)
    for name in documented_names():
        if match := re.fullmatch(r"progress/dropped_(\w+)_total", name):
            assert match.group(1) in DROP_HINTS, f"{name}: no such drop reason"
            continue
        for part in filter(None, re.split(r"<[^>]+>", name)):
            assert part in source, f"{name!r}: {part!r} appears nowhere in the code that logs metrics"


def test_the_page_lists_every_entry():
    sys.path.insert(0, str(ROOT / "docs" / "_gen"))
    try:
        page = importlib.import_module("metrics_table").markdown()
    finally:
        sys.path.remove(str(ROOT / "docs" / "_gen"))
    for name in documented_names():
        assert f'<code class="lg-name">{name.replace("<", "&lt;")}</code>' in page, name
    assert "<!-- metrics -->" in (ROOT / "docs" / "reference" / "metrics.md").read_text()


@pytest.mark.timeout(300)
def test_every_metric_a_fit_logs_is_documented(tmp_path, monkeypatch, no_leaked_processes):
    """One fit with the options that add metrics (KL, the entropy bonus and mask, the mismatch correction, the
    off-policy mask, a trainer scorer, validation); a logged name without an entry fails it."""
    monkeypatch.chdir(tmp_path)
    recorder = KeyRecorder()
    module = GRPOModule(
        "tiny-random",
        learning_rate=1e-3,
        beta=0.04,
        entropy_coef=0.01,
        top_entropy_quantile=0.5,
        vllm_importance_sampling_correction=True,
        off_policy_mask_threshold=0.5,
        scorers=[RewardModelScorer(tiny_reward_model(), name="rm")],
        scorer_weights=[0.5],
        num_generations_eval=2,
        val_temperature=1.0,
    )
    data = tiny_datamodule(8, val_dataset=tiny_prompts(2), val_size=2)
    trainer = cpu_trainer(logger=recorder, log_every_n_steps=1, limit_val_batches=None)
    trainer.fit(module, datamodule=data)

    assert trainer.global_step >= 1
    undocumented = sorted(key for key in recorder.keys if describe(key) is None)
    assert not undocumented, (
        f"logged but not in lightning_grpo/training/metric_catalog.py: {undocumented}; add each with its meaning"
    )
    # the options above did add their metrics, so the check covered them
    for key in ("kl", "policy_loss", "entropy/masked_frac", "sampling/importance_sampling_ratio/mean"):
        assert key in recorder.keys, key
    for key in ("off_policy/masked_frac", "scoring/groups_total", "rewards/rm", "val/reward", "val/pass@2"):
        assert key in recorder.keys, key
