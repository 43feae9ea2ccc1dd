"""Set-up checks of the vLLM servers a fit generates on: each one answers, and serves the model requests name.

`GRPODataModule.setup` runs `check_vllm_servers` on rank 0 before anything starts, so a server that is not there, or
that serves another model, ends the fit at once with one line naming its URL, instead of a failure in the rollout
child on the first request (or a weight push into the wrong model).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import requests

from ..options import DataModuleOptions
from .server_urls import server_urls


def check_vllm_servers(options: DataModuleOptions, model_name: str | None) -> None:
    """Rank 0, at set-up, with `generator="vllm"`: every server in `vllm_server_url` answers `/health` within
    `vllm_server_timeout` seconds and lists `model_name` (the name requests send) in `/v1/models`.

    Raises:
        RuntimeError: one line naming each server that did not answer or that serves other models, and the fix.
    """
    if options.generation.generator != "vllm" or not model_name:
        return
    urls = server_urls(options.vllm.vllm_server_url)
    timeout = float(options.vllm.vllm_server_timeout)
    with ThreadPoolExecutor(len(urls), thread_name_prefix="grpo-vllm-check") as pool:
        problems = [p for p in pool.map(lambda url: _problem(url, model_name, timeout), urls) if p is not None]
    if problems:
        raise RuntimeError(f"GRPODataModule(generator='vllm'): {'; '.join(problems)}.")


def served_models(url: str, timeout: float = 30.0) -> list[str]:
    """The model names the server at `url` serves (`/v1/models`: the base model and loaded LoRA adapters)."""
    response = requests.get(f"{url}/v1/models", timeout=timeout)
    response.raise_for_status()
    return [model["id"] for model in response.json().get("data", [])]


def _problem(url: str, model_name: str, timeout: float) -> str | None:
    if not _wait_healthy(url, timeout):
        return (
            f"no vLLM server answered {url}/health within vllm_server_timeout={timeout:g} s (start it, e.g. "
            "`lightning-grpo vllm-serve --model ... --port ...`, or fix vllm_server_url)"
        )
    try:
        served = served_models(url)
    except (requests.RequestException, ValueError) as error:
        return f"the vLLM server at {url} did not list its models ({type(error).__name__}: {error})"
    if model_name not in served:
        return (
            f"the vLLM server at {url} serves {_names(served)}, not {model_name!r} (the name requests send as "
            f"'model'): serve this policy there (`--served-model-name {model_name}`) or remove the URL"
        )
    return None


def _wait_healthy(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if requests.get(f"{url}/health", timeout=min(5.0, max(timeout, 0.5))).status_code == 200:
                return True
        except requests.RequestException:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def _names(names: Sequence[str]) -> str:
    return ", ".join(map(repr, names)) or "no model"
