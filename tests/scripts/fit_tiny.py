"""A real `Trainer.fit` of the tiny model, run as its own process by the tests (DDP ranks re-run this script).

Each rank records with the suite's step recorder (`helpers.fit_probe.StepRecorder`) in `<out>/rank<r>.json`: the
steps it trained (group ids per step), its global step, a digest of its full weights, rank 0's ledger and the error it
ended with, if any. Scenarios:

- `normal`: every group trains; the run ends by itself.
- `stall`: a constant reward; every group is dropped for no signal and the run must fail with the stall error.
- `empty_places`: the even prompts score alike and are dropped without replacement (`replace_dropped_groups=False`).
- `kill_child`: rank 0 SIGKILLs the rollout child after the first step; every rank must fail with its error.
- `stop_child`: rank 0 SIGSTOPs the rollout child after the first step (recording its pid and the time as
  `stopped_child`); every rank must fail once its heartbeat is `--heartbeat-timeout` s old.
- `stop_child_kill_self`: rank 0 SIGSTOPs the rollout child after the first step, then SIGKILLs its own process: no
  handler runs and the stopped child can act on nothing, yet nothing of the run may be left.
- `kill_self`: rank 0 SIGKILLs its own process at the start of step `--kill-at + 1` (checkpoints every step).
- `checkpoint`: as `normal`, with a checkpoint every step.
- `resume`: resume from `--ckpt` (checkpoints every step).
- `ctrl_c`: at the start of step `--kill-at + 1`, SIGINT to the whole process group, as Ctrl-C in a terminal sends it
  (the rollout child and its reward workers get it too).
- `tools`: multi-turn rollouts: the policy taught to call `lookup` (`--policy`, see `tests/tool_policy.py`) with
  `LookupEnv`, whose reward joins `char_sum_reward`; `--validate` validates the same conversations. Each rank also
  records how many of its step samples' conversations called the tool (`tool_samples`, rank 0).

`--beta` adds the KL to a reference model (sharded like the policy under FSDP2) and `--ref-sync-steps n` mixes the
policy into it every n steps (it is then in the checkpoints). `--lora` trains LoRA adapters (PEFT) instead of the whole policy.

`--strategy fsdp1` trains under Lightning's `FSDPStrategy` on CPU with gloo (a subclass: Lightning refuses the class
itself without a GPU), `fsdp2` under `ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)` (FSDP2 on
CPU with gloo), `fsdp2_tp` under its default mesh (tensor-parallel over every device, which must be refused). With
`--record`, each rank also saves `<out>/steps_rank<r>.pt` (its micro-batches of every step), `<out>/final_rank<r>.pt`
(the full, gathered weights after the fit) and, on rank 0, the largest difference between the generator's
logprobs of each step's samples and a teacher-forced forward of the trained full weights at that step.
`--save-final` saves each rank's final policy state dict as `<out>/policy_rank<r>.pt`; `--only-validate` runs
`Trainer.validate` (on `--policy`, tools scenario) instead of the fit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the helpers (also on PYTHONPATH in the tests' sessions)

from helpers.fit_probe import StepRecorder  # noqa: E402
from helpers.fit_rewards import char_sum_reward, constant_reward, signal_on_odd_prompts  # noqa: E402


def full_weights(policy) -> dict:
    """The policy's full parameters (gathered on every rank: call it on all of them)."""
    from lightning_grpo.weights.parameters import generator_parameters

    return {name: tensor.clone() for name, tensor in generator_parameters(policy)}


def logprob_error(trainer, pl_module, batch) -> float | None:
    """Rank 0: the largest |generator logprob - teacher-forced logprob| over the step's samples, under the trained
    full weights now (every rank joins the gather); None on other ranks."""
    from lightning_grpo.models import tiny_llama
    from lightning_grpo.rollout.sampling import teacher_forced_logprobs

    weights = full_weights(pl_module.policy)
    if not trainer.is_global_zero:
        return None
    model = tiny_llama()
    model.load_state_dict(weights, strict=False)
    errors = []
    for sample in batch.samples:
        start = int(sample.completion_mask.argmax())
        expected = teacher_forced_logprobs(model, sample.input_ids[:start].tolist(), sample.input_ids[start:].tolist())
        errors.append(float((expected - torch.from_numpy(sample.old_log_probs[start:])).abs().max()))
    return max(errors)


def reference_options(beta: float, sync_steps: int) -> dict:
    """GRPOModule's reference-model options for `--beta` and `--ref-sync-steps`."""
    if not beta:
        return {}
    return {"beta": beta, "sync_ref_model": sync_steps > 0, "ref_model_sync_steps": max(1, sync_steps)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", default="normal")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=2)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp1", "fsdp2", "fsdp2_tp"])
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--validate", action="store_true", help="validate on 4 held-out prompts when the fit ends")
    parser.add_argument("--beta", type=float, default=0.0, help="KL to a reference model")
    parser.add_argument("--ref-sync-steps", type=int, default=0, help="TR-DPO mixes every n steps (0: never)")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (r=8 on q_proj, v_proj)")
    parser.add_argument("--policy", default=None, help="state dict of the tiny policy to train (tools scenario)")
    parser.add_argument("--heartbeat-timeout", type=float, default=60.0)
    parser.add_argument("--save-final", action="store_true", help="save each rank's final policy state dict")
    parser.add_argument("--only-validate", action="store_true", help="`Trainer.validate` instead of `fit`")
    args = parser.parse_args()

    import lightning.pytorch as pl
    from datasets import Dataset
    from helpers.tiny import tiny_prompts
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        """FSDP1 on CPU with gloo: Lightning refuses `FSDPStrategy` itself without a GPU, not a subclass."""

    from lightning_grpo.datamodule import GRPODataModule
    from lightning_grpo.module import GRPOModule

    timeout = timedelta(seconds=60)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    class Recorder(StepRecorder):
        """The suite's step recorder, plus the first samples' versions, the weights at the start, logprob errors and
        tool calls; kills on cue."""

        def __init__(self) -> None:
            super().__init__(str(out), kill_at=args.kill_at if args.scenario == "kill_self" else None)
            self.first_versions: list[int] | None = None
            self.weights_at_fit_start: float | None = None
            self.batches: list = []
            self.logprob_errors: list = []
            self.tool_samples = 0
            self.stopped_child: dict | None = None

        def on_fit_start(self, trainer, pl_module):
            self.weights_at_fit_start = float(sum(p.double().sum() for p in pl_module.policy.parameters()))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if args.scenario == "ctrl_c" and trainer.is_global_zero and trainer.global_step == args.kill_at:
                self.dump(trainer)
                os.killpg(os.getpgid(0), signal.SIGINT)
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            if self.first_versions is None and batch.samples:
                self.first_versions = sorted({s.model_version for s in batch.samples})
            if args.record:
                self.logprob_errors.append(logprob_error(trainer, pl_module, batch))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if args.record:
                self.batches.append(batch.micro_batches)
            self.tool_samples += sum(any(m["role"] == "tool" for m in s.completion) for s in batch.samples)
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            weights = float(sum(p.double().sum() for p in pl_module.policy.parameters()))
            (out / f"weights_step{trainer.global_step}.json").write_text(json.dumps(weights))
            if args.scenario == "kill_child" and trainer.is_global_zero and len(self.steps) == 1:
                os.kill(trainer.datamodule.rollout_worker.pid, signal.SIGKILL)
            if args.scenario == "stop_child" and trainer.is_global_zero and len(self.steps) == 1:
                self.stopped_child = {"pid": trainer.datamodule.rollout_worker.pid, "at": time.time()}
                os.kill(self.stopped_child["pid"], signal.SIGSTOP)
                self.dump(trainer)
            if args.scenario == "stop_child_kill_self" and trainer.is_global_zero and len(self.steps) == 1:
                self.stopped_child = {"pid": trainer.datamodule.rollout_worker.pid, "at": time.time()}
                os.kill(self.stopped_child["pid"], signal.SIGSTOP)
                self.dump(trainer)
                os.kill(os.getpid(), signal.SIGKILL)

        def extra(self, trainer):
            metrics = trainer.callback_metrics
            return {
                "first_versions": self.first_versions,
                "weights_at_fit_start": self.weights_at_fit_start,
                "logprob_errors": self.logprob_errors,
                "tool_samples": self.tool_samples,
                "val_reward": float(metrics["val/reward"]) if "val/reward" in metrics else None,
                "stopped_child": self.stopped_child,
            }

    rewards = {"stall": constant_reward, "empty_places": signal_on_odd_prompts}
    reward = rewards.get(args.scenario, char_sum_reward)

    prompts = tiny_prompts(args.prompts)
    conversation = {}
    policy = "tiny-random"
    if args.scenario == "tools":
        from helpers.tool_policy import PROMPT, LookupEnv, load_tool_policy

        prompts = Dataset.from_dict({"prompt": [PROMPT] * args.prompts})
        conversation = dict(environment_factory=LookupEnv, max_completion_length=80, max_tool_calling_iterations=2)
        policy = load_tool_policy(args.policy)
    options = dict(
        model="tiny-random",
        dataset=prompts,
        reward_funcs=[reward],
        num_generations=4,
        max_completion_length=8,
        gradient_accumulation_steps=1,
        samples_per_row=4,
        max_staleness=args.max_staleness,
        heartbeat_timeout=args.heartbeat_timeout,
        val_dataset=prompts.select(range(min(4, len(prompts)))) if args.validate else None,
        val_batch_size=2,
        replace_dropped_groups=args.scenario != "empty_places",
    )
    datamodule = GRPODataModule(**(options | conversation))
    lora = None
    if args.lora:
        from peft import LoraConfig

        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    module = GRPOModule(
        policy,
        learning_rate=1e-2 if args.lora else 1e-3,
        peft_config=lora,
        **reference_options(args.beta, args.ref_sync_steps),
    )
    recorder = Recorder()
    callbacks = [recorder]
    if args.scenario in ("kill_self", "resume", "checkpoint"):
        callbacks.append(ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_top_k=-1))
    if args.strategy == "fsdp1":
        strategy = CPUFSDPStrategy(timeout=timeout, process_group_backend="gloo")
    elif args.strategy == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1, timeout=timeout)
    elif args.strategy == "fsdp2_tp":
        strategy = ModelParallelStrategy(timeout=timeout)
    else:
        strategy = DDPStrategy(timeout=timeout, process_group_backend="gloo") if args.devices > 1 else "auto"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=-1,
        max_steps=args.max_steps,
        logger=CSVLogger(out, name="logs"),
        enable_checkpointing=args.scenario in ("kill_self", "resume", "checkpoint"),
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        limit_val_batches=None if args.validate else 0,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    torch.manual_seed(0)
    error = None
    try:
        if args.only_validate:
            trainer.validate(module, datamodule=datamodule)
        else:
            trainer.fit(module, datamodule=datamodule, ckpt_path=args.ckpt)
    except Exception as exc:  # recorded per rank, then re-raised for the exit code
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    recorder.dump(trainer, ended=error is None, error=error)  # after the end-of-fit validation
    if args.save_final and error is None:
        torch.save(module.policy.state_dict(), out / f"policy_rank{trainer.global_rank}.pt")
    if args.record and error is None:
        torch.save(recorder.batches, out / f"steps_rank{trainer.global_rank}.pt")
        torch.save(full_weights(module.policy), out / f"final_rank{trainer.global_rank}.pt")
    sys.exit(1 if error else 0)


if __name__ == "__main__":
    # As in a terminal: Ctrl-C raises KeyboardInterrupt. A process that a non-interactive shell started in the
    # background (`cmd &`, as CI runners and nohup'd suites do) inherits SIGINT ignored, and Python then keeps it so.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
