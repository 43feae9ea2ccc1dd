"""Fixtures of the rollout tests: the generator's C kernels loaded afresh, and in each build this CPU can run."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.vector_builds import BUILDS
from helpers.vector_builds import vector_build as each_build

from lightning_grpo.rollout import (
    cdf_draw,
    decode_attention,
    fused_decode,
    layer_ops,
    small_matmul,
    tile_matmul,
)


def _clear_kernels() -> None:
    for kernel in (cdf_draw, decode_attention, fused_decode, layer_ops, small_matmul, tile_matmul):
        kernel._load.cache_clear()


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """Lets a test load the kernels again under its own environment (the monkeypatch it yields), and restores the
    suite's afterwards."""
    _clear_kernels()
    yield monkeypatch
    monkeypatch.undo()
    _clear_kernels()


@pytest.fixture(params=BUILDS)
def vector_build(request, monkeypatch):
    """The kernels as built for this CPU (AVX-512's 16 lanes where torch runs AVX-512), then their AVX2 build: both
    paths are checked on an AVX-512 machine."""
    with each_build(request.param, monkeypatch, _clear_kernels):
        yield request.param


@pytest.fixture
def kernel_threads(monkeypatch):
    """`kernel_threads(threads, kernel, ...)` runs the rest of the test on `threads` torch threads with every weight
    of those kernel modules split between them (`SPLIT_MIN_NUMEL` 0); the thread count is restored afterwards."""
    previous = torch.get_num_threads()

    def split(threads: int, *kernels) -> None:
        for kernel in kernels:
            monkeypatch.setattr(kernel, "SPLIT_MIN_NUMEL", 0)
        torch.set_num_threads(threads)

    yield split
    torch.set_num_threads(previous)


@pytest.fixture
def two_threads(kernel_threads):
    """`two_threads(kernel, ...)`: `kernel_threads` on 2 threads."""
    return functools.partial(kernel_threads, 2)
