"""The C kernels in each vector build this CPU can run: the native one (AVX-512's 16 lanes where torch runs AVX-512),
then the AVX2 one, so that an AVX-512 machine checks both paths."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from lightning_grpo.rollout import native_build

#: A fixture's params: the builds `vector_build` knows.
BUILDS = ["native", "avx2"]


@contextlib.contextmanager
def vector_build(build: str, monkeypatch: pytest.MonkeyPatch, clear: Callable[[], None]) -> Iterator[None]:
    """Kernels loaded afresh (`clear` empties their caches) in `build`, and the suite's own restored afterwards; the
    AVX2 build is skipped where it is the native one."""
    if build == "avx2":
        if native_build.vector_isa() != "AVX512":
            pytest.skip("the native build is the AVX2 one here")
        monkeypatch.setattr(native_build, "vector_isa", lambda: "AVX2")
    clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        clear()
