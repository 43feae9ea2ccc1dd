"""The C kernels: the embedded generator's (`small_matmul.c`, `tile_matmul.c`, `decode_attention.c`, `layer_ops.c`,
`cdf_draw.c`, `fused_decode.c`) and the trainer's (`training/logprob_rows.c`), sharing this folder's `simd.h` and
`split_threads.h`: compiled on first use and loaded.

Each kernel is compiled with the system's C compiler (`$CC`, else `cc`, else `gcc`) into `<cache>/kernels/`
(`$LIGHTNING_GRPO_CACHE`, default `~/.cache/lightning_grpo`), once per source (with the headers beside it), flags and
compiler; a build takes about a second. They need an x86-64 CPU with AVX2 and FMA. Where a kernel cannot run, `load`
says why, and its caller runs torch's own operations instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

#: The folder of the headers every kernel may include (`simd.h`, `split_threads.h`), wherever its source is.
HEADERS = Path(__file__).parent

#: The compiler flags of every kernel (no fused multiply-adds but those written out: rounding as written).
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared", "-fPIC", "-pthread")
#: What a `wide` kernel's build adds where torch runs its AVX-512 code: the source's 16-lane paths.
AVX512_FLAGS = ("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl")
#: What a kernel built for AMX tiles adds to the AVX-512 flags (`tile_matmul.c`).
AMX_FLAGS = AVX512_FLAGS + ("-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8")


def vector_isa() -> str:
    """torch's vector level on this CPU ("AVX512", "AVX2", ...; `ATEN_CPU_CAPABILITY` lowers it)."""
    return torch.backends.cpu.get_cpu_capability()


def flags(wide: bool = False, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The compiler flags of a kernel: AVX2 and FMA, AVX-512 for a `wide` one where `vector_isa` is "AVX512", and
    `extra` (a kernel that runs only where its instructions exist, such as `AMX_FLAGS`)."""
    return FLAGS + (AVX512_FLAGS if wide and vector_isa() == "AVX512" else ()) + extra


def refusal(switch: str) -> str | None:
    """Why no kernel can run here, or None when one can; `switch` is the kernel's environment switch ("0" is off)."""
    if os.environ.get(switch, "1") == "0":
        return f"{switch}=0"
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"the CPU is {platform.machine()}, not x86-64"
    capability = vector_isa()
    if capability not in {"AVX2", "AVX512"}:  # torch's AVX2 level requires FMA too
        return f"the CPU has no AVX2 and FMA (torch reports {capability})"
    if compiler() is None:
        return "no C compiler found: set $CC or install gcc"
    return None


def load_function(
    source: Path,
    name: str,
    argtypes: list[Any],
    *,
    switch: str,
    kernel: str,
    fallback: str,
    wide: bool = False,
    extra: tuple[str, ...] = (),
    owner: str = "embedded generator",
) -> tuple[Callable[..., int] | None, str | None]:
    """(the function `name` of `source`'s library, typed with `argtypes` and an int result, None), or (None, why it
    cannot run here). See `load_functions`."""
    functions, reason = load_functions(
        source, {name: argtypes}, switch=switch, kernel=kernel, fallback=fallback, wide=wide, extra=extra, owner=owner
    )
    return (None, reason) if functions is None else (functions[name], None)


def load_functions(
    source: Path,
    signatures: dict[str, list[Any]],
    *,
    switch: str,
    kernel: str,
    fallback: str,
    wide: bool = False,
    extra: tuple[str, ...] = (),
    owner: str = "embedded generator",
) -> tuple[dict[str, Callable[..., int]] | None, str | None]:
    """({name: the function of `source`'s library, typed with its argtypes and an int result}, None) for the names
    of `signatures`, or (None, why they cannot run here). The reason is logged, naming the `owner`'s `kernel` ("the
    embedded generator's small-batch kernel") and what runs instead (`fallback`); callers cache the answer, so it is
    logged once. `wide`: built with AVX-512 where torch runs it, plus `extra` flags (see `flags`)."""
    reason = refusal(switch)
    if reason is None:
        try:
            library = load(source, wide, extra)
            functions = {name: getattr(library, name) for name in signatures}
        except (OSError, subprocess.SubprocessError, AttributeError) as error:
            reason = f"building or loading {source.name} failed: {error}"
            log.warning("The %s's %s is off (%s); %s run instead.", owner, kernel, reason, fallback)
            return None, reason
        for name, function in functions.items():
            function.argtypes = signatures[name]
            function.restype = ctypes.c_int
        return functions, None
    log.info("The %s's %s is off (%s); %s run instead.", owner, kernel, reason, fallback)
    return None, reason


def address(function: Any) -> int:
    """Where a loaded C function is, as an int: what a C caller that is handed it (a struct's function pointer)
    calls."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def load(source: Path, wide: bool = False, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The shared library of `source`, built first (with `flags(wide, extra)`) unless a build of the same source, flags and
    compiler is cached.

    Raises:
        OSError: no compiler, the build failed (with the compiler's message), or the library does not load.
        subprocess.SubprocessError: the compiler did not answer.
    """
    return ctypes.CDLL(str(build(source, wide, extra)))


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")


def build(source: Path, wide: bool = False, extra: tuple[str, ...] = ()) -> Path:
    """The shared library of `source`, compiled with `flags(wide, extra)` into the cache folder unless a build of the same
    source, flags and compiler is there. Concurrent builds (several processes starting at once) each write their own
    file and rename it into place."""
    from ..models.smollm2 import default_cache_dir

    cc = compiler()
    if cc is None:
        raise OSError("no C compiler found: set $CC or install gcc")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    options = flags(wide, extra)
    # what a source may include: the headers beside it and the shared ones
    headers = [header.read_bytes() for header in sorted({*source.parent.glob("*.h"), *HEADERS.glob("*.h")})]
    digest = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join(options).encode(), version.encode()]))
    folder = default_cache_dir() / "kernels"
    target = folder / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{source.stem}-", suffix=".so")
    os.close(handle)
    try:
        done = subprocess.run(
            [cc, *options, f"-I{HEADERS}", str(source), "-o", partial, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise OSError(f"{cc} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target
