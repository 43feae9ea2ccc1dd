"""The vLLM request path of the rollout loop: fail fast on a 4xx, bounded retries, a dead server fails the child,
stop strings, and whether a completion was truncated.

TRL retries every failed request (4xx included) about 90 times over ~8 minutes and then reports a bare transport
error. Here a 4xx fails at once with the server's answer; a 5xx, timeout or connection error is retried for at most
`vllm_retry_timeout_s`; and when a server that `VLLMServer` started on this machine has died, the child fails at once
with the server's last log lines (the trainer sees them in `check_health`).

TRL's `/v1/completions` payload carries temperature, top-p, top-k, min-p and the repetition penalty; `vllm_stop` adds
vLLM's `stop`, and `_vllm_turn` returns with each turn whether vLLM stopped it at `max_tokens` (`finish_reason`
`"length"`): a turn that ends at a stop string ends without an EOS id and is not truncated.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp

log = logging.getLogger(__name__)

# The finish reasons of the completions requested by the current asyncio task, while `_vllm_turn` collects them.
_finish_reasons: contextvars.ContextVar[list[str | None] | None] = contextvars.ContextVar(
    "vllm_finish_reasons", default=None
)


class VLLMRequests:
    """Overrides of TRL's `_AsyncRolloutLoop._post` and `_retry`; mix it in before `_AsyncRolloutLoop`.

    Reads the loop's `session`, `vllm_server_url` and `_counters` (TRL's attributes, pinned by
    `tests/test_trl_names.py`).
    """

    #: Seconds a request failing with a 5xx, a timeout or a connection error is retried before the child fails.
    vllm_retry_timeout_s: float = 120.0
    #: Stop strings sent with every completion request (vLLM's `stop`).
    vllm_stop: tuple[str, ...] = ()

    async def _vllm_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float], bool | None]:
        """TRL's request for one turn: its token ids, their logprobs, and whether it stopped at `max_tokens` (None
        when the server did not say)."""
        reasons: list[str | None] = []
        token = _finish_reasons.set(reasons)
        try:
            ids, logprobs = await super()._generate_one_turn(prompt_ids)
        finally:
            _finish_reasons.reset(token)
        reason = reasons[-1] if reasons else None
        return ids, logprobs, None if reason is None else reason == "length"

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        url = f"{self.vllm_server_url}{path}"
        completion = path == "/v1/completions"
        if completion and self.vllm_stop:
            payload = {**payload, "stop": list(self.vllm_stop)}
        client_timeout = aiohttp.ClientTimeout(total=timeout)

        async def once() -> dict:
            async with self.session.post(url, json=payload, timeout=client_timeout) as response:
                if response.status >= 400:
                    body = (await response.text())[:2000]
                    if response.status < 500:
                        raise RuntimeError(
                            f"vLLM rejected POST {url} with {response.status}: {body}. A 4xx means the request "
                            "itself is wrong (a prompt plus max_completion_length over the server's max_model_len, "
                            "a model name the server does not serve, a bad sampling option), so it is not retried."
                        )
                    raise aiohttp.ClientResponseError(
                        response.request_info, response.history, status=response.status, message=body
                    )
                return (await response.json()) or {}

        result = await self._retry(once, label=f"POST {path}")
        reasons = _finish_reasons.get()
        if completion and reasons is not None:
            choices = result.get("choices") or [{}]
            reasons.append(choices[0].get("finish_reason"))
        return result

    async def _retry(self, coro_factory: Callable[[], Any], *, label: str, max_attempts: int = 1) -> Any:
        """Retry transport errors and 5xx until `vllm_retry_timeout_s` passed (`max_attempts` is ignored)."""
        from ..serving.vllm_server import server_log_tail, server_process_alive

        deadline = time.monotonic() + self.vllm_retry_timeout_s
        attempt = 0
        while True:
            try:
                return await coro_factory()
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as error:
                dead = server_process_alive(self.vllm_server_url) is False
                if dead or time.monotonic() >= deadline:
                    why = "the vLLM server process has exited" if dead else f"retried for {self.vllm_retry_timeout_s} s"
                    tail = server_log_tail(self.vllm_server_url)
                    logs = f" The server's last log lines:\n{tail}" if tail else ""
                    raise RuntimeError(
                        f"{label} to the vLLM server at {self.vllm_server_url} failed ({type(error).__name__}: "
                        f"{error}); {why}.{logs}"
                    ) from error
                attempt += 1
                self._counters["rollout/vllm_retry_total"] += 1
                sleep = min(2.0 ** min(attempt - 1, 4), max(0.1, deadline - time.monotonic()))
                log.warning(
                    "%s failed (%s: %s); retry %d in %.1f s", label, type(error).__name__, error, attempt, sleep
                )
                await asyncio.sleep(sleep)
