"""The vLLM servers `GRPODataModule(vllm_server_url=...)` names, and how long one may stay silent before it is lost.

Both the trainer (set-up checks, weight pushes) and the rollout child (requests) read them, so they live here, below
both; nothing here imports more than the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..options import GeneratorOptions


def server_stale_after_s(generation: GeneratorOptions) -> float:
    """Seconds a server may leave `/health` or a control request unanswered before it is lost: half of
    `GRPODataModule(heartbeat_timeout=...)`, so that a silent server fails the run within the heartbeat limit."""
    return float(generation.heartbeat_timeout) / 2


def server_urls(vllm_server_url: str | Sequence[str]) -> tuple[str, ...]:
    """The servers `vllm_server_url` names, without trailing slashes, in order.

    Raises:
        ValueError: an empty list, a URL that is not `http(s)://host:port`, or the same server twice.
    """
    urls = [vllm_server_url] if isinstance(vllm_server_url, str) else list(vllm_server_url)
    bad = [url for url in urls if not isinstance(url, str) or not url.startswith(("http://", "https://"))]
    if not urls or bad:
        raise ValueError(
            f"`vllm_server_url={vllm_server_url!r}`: pass one URL or a list of them, each like "
            f"'http://127.0.0.1:8000'{f' (not {bad})' if bad else ''}."
        )
    urls = [url.rstrip("/") for url in urls]
    if len(set(urls)) != len(urls):
        raise ValueError(
            f"`vllm_server_url={vllm_server_url!r}` names a server twice: list each server once (a server with "
            "data parallelism is one URL)."
        )
    return tuple(urls)
