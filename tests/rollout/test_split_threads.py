"""The worker threads the generator's C kernels split a call between (`split_threads.h`): kept between calls, they
give the one-thread result for any sequence of thread counts, and a process forked after they started runs its
kernels on workers of its own. Run on the small-batch kernel, which every x86 CPU with AVX2 builds."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.nn.functional as F

from lightning_grpo.rollout import small_matmul

needs_kernel = pytest.mark.skipif(not small_matmul.available(), reason=f"{small_matmul.unavailable_reason()}")


def _operands(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 256, generator=generator), torch.randn(1000, 256, generator=generator)


@needs_kernel
@pytest.mark.timeout(60)
def test_any_sequence_of_thread_counts_gives_the_one_thread_result(kernel_threads):
    """Workers started by a wide call sit idle through narrower ones and take shares again when asked: every call
    equals the one-thread product, bit for bit (each output is one column's sum, whoever computes it)."""
    x, weight = _operands(0)
    kernel_threads(1, small_matmul)
    alone = small_matmul.linear(x, weight)
    for threads in (2, 4, 1, 3, 2, 4, 1, 2):
        torch.set_num_threads(threads)
        for _ in range(50):  # calls back to back, as a decode step makes them
            assert torch.equal(small_matmul.linear(x, weight), alone), threads


def _product_in_forked_child(x: torch.Tensor, weight: torch.Tensor, results: mp.Queue) -> None:
    torch.set_num_threads(2)
    results.put(small_matmul.linear(x, weight).tolist())  # a list: a tensor would cross as a shared-memory handle


@needs_kernel
@pytest.mark.timeout(120)
def test_a_process_forked_after_the_workers_started_runs_on_workers_of_its_own(kernel_threads, no_leaked_processes):
    """Threads do not survive a fork: a child that used its parent's workers would wait for them forever. The child
    starts its own and gets the parent's result."""
    x, weight = _operands(1)
    kernel_threads(2, small_matmul)
    expected = small_matmul.linear(x, weight)  # the parent's workers are running now
    context = mp.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_product_in_forked_child, args=(x, weight, results))
    child.start()
    try:
        got = torch.tensor(results.get(timeout=60))
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
    assert torch.equal(got, expected)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-4)
