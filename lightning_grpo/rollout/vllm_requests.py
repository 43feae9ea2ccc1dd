"""The vLLM request path of the rollout loop: one or several servers, fail fast on a 4xx, bounded retries, a dead or
silent server fails the child (or, with failover, is left out), stop strings, and whether a completion was truncated.

TRL retries every failed request (4xx included) about 90 times over ~8 minutes and then reports a bare transport
error. Here a 4xx fails at once with the server's answer; a 5xx, timeout or connection error is retried for at most
`vllm_retry_timeout_s`; and when a server that `VLLMServer` started on this machine has died, the child fails at once
with the server's last log lines (the trainer sees them in `check_health`).

TRL's `/v1/completions` payload carries temperature, top-p, top-k, min-p and the repetition penalty; `vllm_stop` adds
vLLM's `stop`, and `_vllm_turn` returns with each turn whether vLLM stopped it at `max_tokens` (`finish_reason`
`"length"`): a turn that ends at a stop string ends without an EOS id and is not truncated.

With several servers (`vllm_server_url=[...]`), each group's requests go to one server, picked by load, and a server
that is lost fails the child with its URL or, with `vllm_failover`, is left out (see `rollout/vllm_routing.py`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp

from ..serving.server_urls import server_urls
from .balancing import current_group
from .vllm_routing import ServerLost, VLLMServers

if TYPE_CHECKING:  # the class this one is mixed into, so that its attributes and `super()` calls are checked
    from .._trl import _AsyncRolloutLoop as _Loop
else:
    _Loop = object

log = logging.getLogger(__name__)

#: Seconds an idle connection to a vLLM server is kept for the next request: under the server's own keep-alive
#: (vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s). aiohttp's default, 15 s, reuses a connection the server has closed
#: whenever the event loop was too busy to see the close (a loaded machine), and the request fails with
#: `ServerDisconnectedError`.
KEEPALIVE_S = 4.0


def vllm_request_session(limit: int) -> aiohttp.ClientSession:
    """The connection pool for completion requests: at most `limit` connections, none reused after `KEEPALIVE_S`
    idle (aiohttp checks a pooled connection's age when it hands it out, whether or not the loop saw it close)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=KEEPALIVE_S))


# The finish reasons of the completions requested by the current asyncio task, while `_vllm_turn` collects them.
_finish_reasons: contextvars.ContextVar[list[str | None] | None] = contextvars.ContextVar(
    "vllm_finish_reasons", default=None
)


class VLLMRequests(_Loop):
    """Overrides of TRL's `_AsyncRolloutLoop._post`, `_retry` and `_run_loops`; mix it in before `_AsyncRolloutLoop`.

    Reads the loop's `_counters` and `max_inflight_tasks` (TRL's attributes, pinned by `tests/test_trl_names.py`);
    TRL's `vllm_server_url` is the first server. Requests go over a connection pool of its own, which drops idle
    connections before the server does (`KEEPALIVE_S`).

    Args:
        vllm_server_url: one server's URL or a list of them.
        vllm_failover: go on with the other servers when one is lost (`vllm/servers_lost_total`), instead of failing.
        vllm_lost: the trainer's shared flags of servers it could not push weights to (see `VLLMServers`).
        vllm_stale_after_s: seconds without an answer to `/health` after which a server is lost.
        **kwargs: the loop's other arguments.
    """

    #: Seconds a request failing with a 5xx, a timeout or a connection error is retried before the child fails.
    vllm_retry_timeout_s: float = 120.0
    #: Stop strings sent with every completion request (vLLM's `stop`).
    vllm_stop: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        vllm_server_url: str | Sequence[str] = "http://localhost:8000",
        vllm_failover: bool = False,
        vllm_lost: Any = None,
        vllm_stale_after_s: float = 150.0,
        **kwargs: Any,
    ) -> None:
        urls = server_urls(vllm_server_url)
        super().__init__(vllm_server_url=urls[0], **kwargs)
        self.vllm_servers = VLLMServers(
            urls, failover=vllm_failover, lost=vllm_lost, counters=self._counters, stale_after_s=vllm_stale_after_s
        )

    def _route_group(self, group_id: int) -> None:
        """Send the requests of the current asyncio task (one rollout) to `group_id`'s server (or generator replica)."""
        current_group.set(group_id)

    async def _run_loops(self, stop_event: asyncio.Event) -> None:
        """TRL's loops, and beside them (on the vLLM path) the watch over the servers' health."""
        if getattr(self, "_generator", None) is not None:
            return await super()._run_loops(stop_event)
        async with (
            aiohttp.ClientSession() as probes,  # its own connections: requests in flight cannot starve it
            vllm_request_session(self.max_inflight_tasks) as self._requests,
        ):
            watch = asyncio.create_task(self.vllm_servers.watch(probes))
            try:
                await super()._run_loops(stop_event)
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

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
        completion = path == "/v1/completions"
        if completion and self.vllm_stop:
            payload = {**payload, "stop": list(self.vllm_stop)}
        servers = self.vllm_servers
        while True:
            server = servers.route(current_group.get())  # after the caller read the version it tags the turn with
            once = functools.partial(self._post_once, f"{servers.urls[server]}{path}", payload, timeout)
            try:
                result = await servers.guard(server, self._retry(once, label=f"POST {path}", server=server))
            except ServerLost:
                continue  # failover: the same request to a live server
            break
        reasons = _finish_reasons.get()
        if completion and reasons is not None:
            choices = result.get("choices") or [{}]
            reasons.append(choices[0].get("finish_reason"))
        return result

    async def _post_once(self, url: str, payload: dict, timeout: float) -> dict:
        async with self._requests.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
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

    async def _retry(
        self, coro_factory: Callable[[], Any], *, label: str, max_attempts: int = 1, server: int | None = None
    ) -> Any:
        """Retry transport errors and 5xx until `vllm_retry_timeout_s` passed (`max_attempts` is ignored); then (or
        at once, when its process has exited) `server` is lost (`VLLMServers.lose`)."""
        from ..serving.vllm_launcher import server_log_tail, server_process_alive

        url = self.vllm_servers.urls[server] if server is not None else self.vllm_server_url
        deadline = time.monotonic() + self.vllm_retry_timeout_s
        attempt = 0
        while True:
            try:
                return await coro_factory()
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as error:
                dead = server_process_alive(url) is False
                if dead or time.monotonic() >= deadline:
                    why = "the vLLM server process has exited" if dead else f"retried for {self.vllm_retry_timeout_s} s"
                    tail = server_log_tail(url)
                    logs = f" The server's last log lines:\n{tail}" if tail else ""
                    message = f"{label} to the vLLM server at {url} failed ({type(error).__name__}: {error}); {why}."
                    if server is not None:
                        self.vllm_servers.lose(server, message + logs)
                        raise ServerLost(url) from error
                    raise RuntimeError(message + logs) from error
                attempt += 1
                self._counters["rollout/vllm_retry_total"] += 1
                sleep = min(2.0 ** min(attempt - 1, 4), max(0.1, deadline - time.monotonic()))
                if attempt == 1 and isinstance(error, aiohttp.ServerDisconnectedError):
                    sleep = 0.0  # most likely a pooled connection the server had closed: a new one is at hand
                log.warning(
                    "%s failed (%s: %s); retry %d in %.1f s", label, type(error).__name__, error, attempt, sleep
                )
                await asyncio.sleep(sleep)
