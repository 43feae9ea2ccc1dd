"""A LoRA policy under a real `Trainer.fit` (tiny model, real rollout child, real PEFT): a bf16-mixed fit with gradient
checkpointing and a KL to the adapters-disabled reference ends by itself with finite metrics and trains only the adapters; its checkpoints hold the adapters,
a small fraction of the model, and resume to the exact adapter weights; `lightning-grpo export` writes folders that
plain transformers (merged) and peft (adapter) load with the trained policy's log-probabilities.

One fit (module-scoped) serves the tests; the resume is a second, short fit.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pandas as pd
import pytest
import torch
from helpers.processes import describe, live_children, wait_no_children
from helpers.tiny import cpu_trainer, tiny_datamodule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from peft import LoraConfig, PeftModel

from lightning_grpo.cli import main as cli_main
from lightning_grpo.cli.export import export_policy
from lightning_grpo.models import load_policy, tiny_llama
from lightning_grpo.module import GRPOModule
from lightning_grpo.rollout.sampling import teacher_forced_logprobs
from lightning_grpo.training.policy import CHECKPOINT_KEY

PROMPTS = 4  # one group per optimizer step: 4 steps
# One worker runs this module (under pytest-xdist, `PYTEST_WORKERS=2 ./scripts/test.sh`), so its tests share one fit.
pytestmark = pytest.mark.xdist_group("lora_fit")
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
IDS = [2, 40, 41, 42, 3, 2, 50, 51, 52, 53, 54]


class AdapterSnapshots(pl.Callback):
    """The adapter tensors after each optimizer step, and when training starts (after a checkpoint is restored)."""

    def __init__(self) -> None:
        self.after_step: dict[int, dict[str, torch.Tensor]] = {}
        self.at_start: dict[str, torch.Tensor] | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.at_start = adapters(pl_module.policy)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after_step[trainer.global_step] = adapters(pl_module.policy)


def adapters(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in policy.named_parameters() if param.requires_grad}


def lora_module() -> GRPOModule:
    """LoRA with a KL term: the reference is the policy with its adapters disabled."""
    return GRPOModule(
        "tiny-random", learning_rate=1e-2, peft_config=LoraConfig(**LORA), gradient_checkpointing=True, beta=0.04
    )


def fit(folder: Path, *, ckpt_path: str | None = None) -> tuple[GRPOModule, pl.Trainer, AdapterSnapshots]:
    snapshots = AdapterSnapshots()
    checkpoints = ModelCheckpoint(dirpath=folder / "ckpt", every_n_train_steps=1, save_top_k=-1)
    trainer = cpu_trainer(
        precision="bf16-mixed",
        logger=CSVLogger(folder),
        log_every_n_steps=1,
        enable_checkpointing=True,
        callbacks=[snapshots, checkpoints],
    )
    module = lora_module()
    before = {p.pid for p in live_children()}  # e.g. another module's vLLM server on the same xdist worker
    # the tests count one step per prompt: no group may be dropped as stale, whatever the machine's load does to the
    # generator's lead (a group started before a weight push arrived would be 3 versions old at the last step)
    trainer.fit(module, datamodule=tiny_datamodule(PROMPTS, max_staleness=PROMPTS), ckpt_path=ckpt_path)
    leaked = wait_no_children(ignore=before)
    assert not leaked, f"processes left behind: {[describe(p) for p in leaked]}"
    return module, trainer, snapshots


@pytest.fixture(scope="module")
def lora_fit(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_fit")
    module, trainer, snapshots = fit(folder)
    return folder, module, trainer, snapshots


def checkpoint(folder: Path, step: int) -> Path:
    return next((folder / "ckpt").glob(f"*step={step}.ckpt"))


@pytest.mark.timeout(300)
def test_bf16_mixed_lora_fit_with_checkpointing_ends_by_itself_with_finite_metrics_and_trains_only_adapters(lora_fit):
    folder, module, trainer, snapshots = lora_fit
    metrics = pd.read_csv(next(folder.rglob("metrics.csv"))).dropna(subset=["loss"])
    dropped = {name: metrics[name].iloc[-1] for name in metrics if name.startswith("progress/dropped_")}
    assert trainer.global_step == PROMPTS, dropped
    assert len(metrics) == PROMPTS
    for name in ("loss", "ratio", "kl", "entropy", "reward"):
        assert all(math.isfinite(v) for v in metrics[name]), (name, list(metrics[name]))
    kl = list(metrics["kl"])  # zero while the adapters are zero, then the trained adapters move away from the base
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 1e-6, kl
    base = dict(tiny_llama(0).named_parameters())
    for name, param in module.policy.named_parameters():
        if param.requires_grad:
            assert ".lora_" in name
        else:  # the base weights are bit for bit those loaded
            assert torch.equal(param, base[name.removeprefix("base_model.model.").replace(".base_layer", "")]), name
    trained_b = [t for name, t in snapshots.after_step[PROMPTS].items() if ".lora_B." in name]
    assert trained_b and all(t.abs().sum() > 0 for t in trained_b)  # B starts at zero: the adapters trained


@pytest.mark.timeout(300)
def test_lora_checkpoints_hold_the_adapters_only_and_resume_them_exactly(lora_fit, tmp_path):
    folder, module, _, snapshots = lora_fit
    path = checkpoint(folder, 2)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert set(saved["state_dict"]) == {f"policy.{name}" for name in snapshots.after_step[2]}
    assert saved[CHECKPOINT_KEY]["model"] == "tiny-random" and saved[CHECKPOINT_KEY]["peft_config"]["r"] == 8
    model_bytes = sum(p.numel() * p.element_size() for p in tiny_llama(0).parameters())
    assert path.stat().st_size < 0.15 * model_bytes  # adapters + their AdamW state + run state, no base weights

    resumed, trainer, resumed_snapshots = fit(tmp_path, ckpt_path=str(path))
    assert resumed_snapshots.at_start.keys() == snapshots.after_step[2].keys()
    for name, tensor in snapshots.after_step[2].items():
        assert torch.equal(resumed_snapshots.at_start[name], tensor), name
    assert trainer.global_step == PROMPTS  # the two groups not consumed before the checkpoint trained

    other = GRPOModule("tiny-random", peft_config=LoraConfig(r=8, target_modules=["k_proj"]))
    other.configure_model()
    with pytest.raises(ValueError, match=r"no \['policy\.base_model\.model\.model\.layers\.0\.self_attn\.k_proj"):
        other.on_load_checkpoint(saved)


@pytest.mark.timeout(300)
def test_export_writes_an_adapter_peft_loads_and_a_merged_model_transformers_loads_with_the_same_logprobs(
    lora_fit, tmp_path
):
    from transformers import AutoModelForCausalLM

    folder, module, _, _ = lora_fit
    path = checkpoint(folder, PROMPTS)
    trained = module.policy.eval()
    trained.set_attn_implementation("sdpa")  # training switched it to tree attention over packed rows
    expected = teacher_forced_logprobs(trained, IDS[:5], IDS[5:])
    assert (expected - teacher_forced_logprobs(tiny_llama(0), IDS[:5], IDS[5:])).abs().max() > 1e-3

    with pytest.raises(SystemExit) as exit_code:
        cli_main(["export", str(path), str(tmp_path / "merged"), "--merged"])
    assert exit_code.value.code == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert (teacher_forced_logprobs(merged, IDS[:5], IDS[5:]) - expected).abs().max() <= 1e-5

    export_policy(path, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file() and (
        tmp_path / "adapter" / "tokenizer.json"
    ).is_file()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size < 0.1 * (
        (tmp_path / "merged" / "model.safetensors").stat().st_size
    )
    adapted = PeftModel.from_pretrained(load_policy("tiny-random"), tmp_path / "adapter")
    assert (teacher_forced_logprobs(adapted, IDS[:5], IDS[5:]) - expected).abs().max() <= 1e-5

    with pytest.raises(SystemExit) as bad:
        cli_main(["export", str(tmp_path / "missing.ckpt"), str(tmp_path / "x")])
    assert bad.value.code == 2
