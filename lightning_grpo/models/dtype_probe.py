"""Which dtype multiplies matrices faster on this CPU, fp32 or bf16: a probe run once per machine and cached.

A bf16 matrix product is ~4x faster than fp32 where the CPU has bf16 instructions (AVX512_BF16, AMX, Arm's BF16) and
~15x slower where it has not (AVX2: torch emulates bf16 through fp32 conversions), so the fast precision depends on
the machine, and on a CPU with AMX tiles the ratio grows with the product's size. `probe_matmul_precision()` reads
the CPU's flags and times, on one thread, fp32 and bf16 products of the two shapes that matter: a decode step of 64
rows through a 576 x 1536 linear layer (SmolLM2's MLP) as the embedded generator runs it (the faster of torch's
`linear`, oneDNN on a pre-packed weight, and the generator's own product when the caller passes it: its AMX tiles or
small-batch kernel, `rollout.decode_linears.decode_product`), and a training micro-batch
of 2,048 tokens through the same layer as the trainer runs it (torch's `linear`), in about half a second. It says
which dtype won at the generator's shape, by how much at each shape and why. The verdict is cached in
`<cache>/precision/` (`$LIGHTNING_GRPO_CACHE`, else `~/.cache/lightning_grpo`) under a key made of the CPU model,
its flags, torch's version and CPU capability, and the caps on instructions set in the environment (`ISA_CAPS`),
so a process on the same machine and torch reads it back in microseconds and a new CPU or torch probes again.

    >>> verdict = probe_matmul_precision()
    >>> verdict.dtype, verdict.reason  # doctest: +SKIP
    ('bfloat16', 'bf16 4.3x faster than fp32 here at decode products, 4.6x at training products (AVX512_BF16)')

`GRPODataModule(generator_dtype="auto")` (the default) runs the embedded generator in the verdict's dtype
(`resolve_generator_dtype`), and `AutoPrecision` (the `lightning-grpo` command's default precision) trains in
bf16-mixed where it says bf16. The learning race (`benchmarks/learning.py`) checks that bf16 learns as well as fp32.

A newer CPU runs as an AVX2-only one under `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (torch's and
oneDNN's AVX2 code, bf16 through fp32 conversions): the probe then chooses fp32, and its reason names the caps.

`LIGHTNING_GRPO_PRECISION=float32` (or `bfloat16`) in the environment sets the verdict without probing: the same
choice on every node of a cluster whose machines differ, or fp32 everywhere for bit-for-bit comparisons.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from .packed_matmul import pack_weight, packed_linear, packing_available
from .smollm2 import default_cache_dir

__all__ = [
    "GENERATOR_DTYPES",
    "PrecisionVerdict",
    "best_matmul_gflops",
    "cpu_signature",
    "isa_caps",
    "matmul_gflops",
    "probe_matmul_precision",
    "resolve_generator_dtype",
]

#: The probe's products, rows x inner -> outer, as `torch.nn.functional.linear`: a decode step of 64 rows through
#: SmolLM2's 576 -> 1536 MLP projection (big enough that the kernel, not call overhead, decides), and a training
#: micro-batch of 2,048 tokens through the same layer.
PROBE_SHAPE = (64, 576, 1536)
TRAIN_SHAPE = (2048, 576, 1536)
#: bf16 must beat fp32 by this factor to be chosen: below it, the precision it loses is not worth the time it saves.
MIN_SPEEDUP = 1.2
#: Bumped when the probe itself changes, so that verdicts of an older probe are not read back.
PROBE_VERSION = 3
#: Environment variables that cap the instructions torch's kernels (ATen) and oneDNN's use below the CPU's best.
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
#: /proc/cpuinfo flags that decide bf16 speed, strongest first, with the name the reason gives them.
_BF16_FLAGS = {"amx_bf16": "AMX_BF16", "avx512_bf16": "AVX512_BF16", "bf16": "BF16"}  # "bf16": Arm's Features
DType = Literal["float32", "bfloat16"]
#: What `GRPODataModule(generator_dtype=...)` takes besides None (the policy's own dtype).
GENERATOR_DTYPES = ("auto", "float32", "bfloat16")
#: The environment variable that sets the verdict without probing ("float32" or "bfloat16").
PRECISION_ENV = "LIGHTNING_GRPO_PRECISION"
#: A product as a generator builds it for a weight: weight -> (x -> x @ weight.T).
DecodeProduct = Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class PrecisionVerdict:
    """The probe's answer: the faster matmul dtype here, by how much, and why in words.

    Attributes:
        dtype: "bfloat16" when bf16 decode products beat fp32 by at least `MIN_SPEEDUP`, else "float32".
        bf16_speedup: at the decode shape (`PROBE_SHAPE`), fp32 time over bf16 time (above 1: bf16 is faster;
            0.06: bf16 is 17x slower).
        fp32_gflops, bf16_gflops: the decode products' speed on one thread, each on its faster path.
        train_fp32_gflops, train_bf16_gflops: the training products' (`TRAIN_SHAPE`) speed on one thread; their
            ratio is `train_bf16_speedup`. 0 in a verdict that was not measured.
        bf16_hardware: the CPU flag that makes bf16 fast ("AVX512_BF16", "AMX_BF16", "BF16"), or "" when none.
        reason: one line for a start-up log, e.g. "bf16 4.4x faster than fp32 here (AVX512_BF16)".
        key: the cache key (CPU model, flags, torch version and capability); a different key probes again.
            "environment" when `LIGHTNING_GRPO_PRECISION` set the verdict.
        from_cache: whether this verdict was read back rather than measured now.
    """

    dtype: DType
    bf16_speedup: float
    fp32_gflops: float
    bf16_gflops: float
    bf16_hardware: str
    reason: str
    key: str
    from_cache: bool = False
    train_fp32_gflops: float = 0.0
    train_bf16_gflops: float = 0.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def train_bf16_speedup(self) -> float:
        """At the training shape, fp32 time over bf16 time (0 when not measured)."""
        return self.train_bf16_gflops / self.train_fp32_gflops if self.train_fp32_gflops else 0.0


def cpu_signature() -> dict[str, str]:
    """What the verdict depends on: the CPU model and flags (from /proc/cpuinfo; elsewhere the platform's processor
    name and no flags), torch's version, the CPU capability its kernels were dispatched to and, where set, the
    environment's caps on the instructions torch and oneDNN use (`isa_caps`)."""
    model, flags = "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "model name" and not model:
                model = value.strip()
            elif name in ("flags", "features") and not flags:  # x86 "flags", Arm "Features"
                flags = " ".join(sorted(value.split()))
    except OSError:  # macOS, Windows: no /proc
        pass
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "flags": flags,
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "probe": str(PROBE_VERSION),
        **({"isa_caps": caps} if (caps := isa_caps()) else {}),
    }


def isa_caps() -> str:
    """The environment's caps on the instructions torch and oneDNN use (`ISA_CAPS`), as `NAME=value` words ("" when
    none is set): `ONEDNN_MAX_CPU_ISA=AVX2` makes a CPU with bf16 instructions multiply bf16 as an AVX2-only one does,
    so a verdict measured under a cap does not hold without it, nor the other way round."""
    return " ".join(f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name))


def matmul_gflops(
    rows: int,
    inner: int,
    outer: int,
    dtype: torch.dtype,
    *,
    min_seconds: float = 0.02,
    min_reps: int = 3,
    packed: bool = False,
    product: DecodeProduct | None = None,
) -> float:
    """GFLOP/s of `linear(x (rows, inner), w (outer, inner))` in `dtype` on the current torch threads: the fastest
    of at least `min_reps` calls timed over at least `min_seconds`, after one warm-up call.

    The fastest call, not the median: another process can only slow a call down, so the fastest is the closest to
    what the hardware allows. With `packed`, the product runs through oneDNN on a weight laid out for it beforehand
    (what the embedded generator does where `packed_matmul.packing_available`; the caller checks that it is); with
    `product`, through what it builds for the weight.
    """
    x = torch.randn(rows, inner).to(dtype)
    w = torch.randn(outer, inner).to(dtype)
    with torch.inference_mode():
        if product is not None:
            call = functools.partial(product(w), x)
        elif packed:
            call = functools.partial(packed_linear, x, pack_weight(w, rows))
        else:
            call = functools.partial(torch.nn.functional.linear, x, w)
        call()
        best, spent, reps = float("inf"), 0.0, 0
        while reps < min_reps or spent < min_seconds:
            started = time.perf_counter()
            call()
            elapsed = time.perf_counter() - started
            best, spent, reps = min(best, elapsed), spent + elapsed, reps + 1
    return 2.0 * rows * inner * outer / best / 1e9


def probe_matmul_precision(
    cache_dir: str | Path | None = None, *, refresh: bool = False, decode_product: DecodeProduct | None = None
) -> PrecisionVerdict:
    """Which dtype multiplies matrices faster on this CPU; measured once per machine and torch, then cached.

    Args:
        cache_dir: where verdicts are kept (one small JSON file per key); default `default_cache_dir()/precision`.
        refresh: probe again even when a verdict for this machine is cached (and replace it).
        decode_product: the generator's own product (`rollout.decode_linears.decode_product`), timed at the decode
            shape beside torch's and oneDNN's; it is part of the cache key.

    Returns:
        The `PrecisionVerdict`. The timing runs on one thread (restored afterwards), as the embedded generator runs;
        an unreadable or stale cache file is probed again, never an error. With `LIGHTNING_GRPO_PRECISION` set, the
        verdict it names, unmeasured (its speeds are 0).

    Raises:
        ValueError: `LIGHTNING_GRPO_PRECISION` is set to something else than "float32" or "bfloat16".
    """
    if (pinned := os.environ.get(PRECISION_ENV)) is not None:
        return _pinned_verdict(pinned)
    signature = cpu_signature()
    if decode_product is not None:
        signature["decode_product"] = f"{decode_product.__module__}.{decode_product.__qualname__}"
    key = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "precision"
    path = path / f"{key}.json"
    if not refresh and (cached := _read(path, key)) is not None:
        return cached
    verdict = _measure(signature, key, decode_product)
    _write(path, verdict)
    return verdict


def _pinned_verdict(value: str) -> PrecisionVerdict:
    if value not in ("float32", "bfloat16"):
        raise ValueError(
            f"{PRECISION_ENV}={value!r}: set it to 'float32' or 'bfloat16', or unset it to let the CPU be probed."
        )
    reason = f"{PRECISION_ENV}={value} in the environment"
    return PrecisionVerdict(value, 1.0, 0.0, 0.0, "", reason, "environment")  # type: ignore[arg-type]


def _measure(signature: dict[str, str], key: str, decode_product: DecodeProduct | None) -> PrecisionVerdict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32, bf16 = (
            best_matmul_gflops(*PROBE_SHAPE, dtype, product=decode_product) for dtype in (torch.float32, torch.bfloat16)
        )
        train_fp32, train_bf16 = (
            matmul_gflops(*TRAIN_SHAPE, dtype, min_seconds=0.1, min_reps=5) for dtype in (torch.float32, torch.bfloat16)
        )
    finally:
        torch.set_num_threads(threads)
    flags = set(signature["flags"].split())
    hardware = next((label for flag, label in _BF16_FLAGS.items() if flag in flags), "")
    speedup = bf16 / fp32
    dtype: DType = "bfloat16" if speedup >= MIN_SPEEDUP else "float32"
    reason = _reason(speedup, hardware, train_bf16 / train_fp32, signature.get("isa_caps", ""))
    return PrecisionVerdict(dtype, speedup, fp32, bf16, hardware, reason, key, False, train_fp32, train_bf16)


def best_matmul_gflops(
    rows: int,
    inner: int,
    outer: int,
    dtype: torch.dtype,
    *,
    min_seconds: float = 0.05,
    product: DecodeProduct | None = None,
) -> float:
    """`matmul_gflops` on the fastest of torch's `linear`, oneDNN on a packed weight (where torch has it for
    `dtype`) and `product` (when given): the speed the embedded generator can reach at that shape."""
    speeds = [matmul_gflops(rows, inner, outer, dtype, min_seconds=min_seconds)]
    if packing_available(dtype):
        speeds.append(matmul_gflops(rows, inner, outer, dtype, min_seconds=min_seconds, packed=True))
    if product is not None:
        speeds.append(matmul_gflops(rows, inner, outer, dtype, min_seconds=min_seconds, product=product))
    return max(speeds)


def _reason(speedup: float, hardware: str, train_speedup: float, caps: str = "") -> str:
    why = (hardware or "no bf16 hardware") + (f", under {caps}" if caps else "")
    training = f"{train_speedup:.1f}x" if train_speedup >= 1.0 else f"{1 / train_speedup:.1f}x slower"
    shapes = f"here at decode products, {training} at training products ({why})"
    if speedup >= MIN_SPEEDUP:
        return f"bf16 {speedup:.1f}x faster than fp32 {shapes}"
    if speedup >= 1.0:
        return f"bf16 only {speedup:.2f}x faster than fp32 {shapes}, under the {MIN_SPEEDUP}x worth its precision"
    return f"bf16 {1 / speedup:.1f}x slower than fp32 {shapes}"


def _read(path: Path, key: str) -> PrecisionVerdict | None:
    try:
        fields = json.loads(path.read_text())
        verdict = PrecisionVerdict(**fields)
    except (OSError, ValueError, TypeError):  # missing, half-written by an old version, or edited by hand
        return None
    if verdict.key != key or verdict.dtype not in ("float32", "bfloat16"):
        return None
    return replace(verdict, from_cache=True)


def _write(path: Path, verdict: PrecisionVerdict) -> None:
    """Atomically (ranks of one machine may probe at once); a read-only cache only loses the caching."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            json.dump(asdict(verdict), file)
    except OSError:
        return
    try:
        os.replace(file.name, path)
    except OSError:
        Path(file.name).unlink(missing_ok=True)


def resolve_generator_dtype(
    choice: str | None, policy_dtype: torch.dtype, decode_product: DecodeProduct | None = None
) -> tuple[str, str]:
    """The embedded generator's dtype for `GRPODataModule(generator_dtype=choice)`, and why, in words for the log.

    None keeps the policy's dtype; "float32" or "bfloat16" is taken as given; "auto" is bf16 where
    `probe_matmul_precision` finds its products faster here (timing `decode_product` too, when given), else the
    policy's dtype.

    Raises:
        ValueError: a `choice` outside `GENERATOR_DTYPES` and None.
    """
    if choice is None:
        name = str(policy_dtype).removeprefix("torch.")
        return name, "the policy's dtype (generator_dtype=None)"
    if choice not in GENERATOR_DTYPES:
        raise ValueError(f"generator_dtype={choice!r} is not one of {GENERATOR_DTYPES} or None (the policy's dtype).")
    if choice != "auto":
        return choice, f"generator_dtype={choice!r}"
    verdict = probe_matmul_precision(decode_product=decode_product)
    dtype = "bfloat16" if verdict.dtype == "bfloat16" else str(policy_dtype).removeprefix("torch.")
    return dtype, f"generator_dtype='auto': {verdict.reason}"
