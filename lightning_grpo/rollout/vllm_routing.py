"""The vLLM servers one rollout loop generates on: each group on the least-loaded live server, and lost servers.

`GRPODataModule(vllm_server_url=[...])` gives the loop several servers (a server started with vLLM's data parallelism
is one URL: it balances its own engines). `VLLMServers` is the rollout child's view of them:

- **Balancing, one server per group**: a group's first request goes to the live server with the fewest requests in
  flight (on a tie, the one given the fewest groups), and every later request of that group (its other completions,
  the later turns of its conversations) goes to the same server, so a group sees one server's sequence of weights, as
  with a single server (`balancing.GroupRouter`, which the embedded generator's replicas share).
- **Lost servers**: a server is lost when its process has exited (a server `VLLMServer` started on this machine), when
  it has not answered `/health` for `stale_after_s`, when a request to it kept failing past the retry limit, or when
  the trainer could not push weights to it (it then sets the server's flag in `lost`, shared memory both sides see,
  before it publishes the next version). Without failover a lost server fails the rollout child with an error naming
  its URL; with failover its requests in flight are sent again to a live server (a group whose server was lost
  finishes on another one) and `vllm/servers_lost_total` counts it; with no live server left the child fails.
- **Versions**: the loop reads the version it tags a request with before it picks the server, and the trainer marks a
  server lost before it publishes a version that server did not receive; so a request tagged with version `v` never
  goes to a server without the weights of `v`, and an answer from a server lost meanwhile is discarded and the request
  sent again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from .balancing import GroupRouter

log = logging.getLogger(__name__)

#: Seconds between two `/health` probes of each server.
PROBE_INTERVAL_S = 1.0
#: Seconds one `/health` probe may take.
PROBE_TIMEOUT_S = 5.0


class ServerLost(Exception):
    """A request's server was lost while it was in flight; with failover it is sent again to another server."""


class VLLMServers:
    """The rollout child's servers: routing by load with one server per group, and which servers are lost.

    Args:
        urls: the servers, as `lightning_grpo.serving.server_urls.server_urls` returns them.
        failover: go on with the other servers when one is lost (counted), instead of failing.
        lost: shared flags, one per server (an `mp.Array` of bytes), that the trainer sets for a server it could not
            push weights to; None when nothing outside this process marks servers lost.
        counters: the loop's counters (TRL's `_counters`), where `vllm/servers_lost_total` is counted.
        stale_after_s: seconds without an answer to `/health` after which a server is lost.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        failover: bool = False,
        lost: Any = None,
        counters: Any = None,
        stale_after_s: float = 150.0,
    ) -> None:
        self.urls = tuple(urls)
        self.failover = failover
        self.stale_after_s = stale_after_s
        self._router = GroupRouter(len(self.urls))
        self.inflight = self._router.inflight  # requests in flight per server, counted by `guard`
        self._shared = lost
        self._counters = counters if counters is not None else {}
        self._lost: dict[int, str] = {}  # server -> why it was lost
        self._events = [asyncio.Event() for _ in self.urls]
        self._last_ok = [time.monotonic()] * len(self.urls)

    @property
    def live(self) -> list[int]:
        """The servers not lost, in order."""
        self.refresh()
        return [i for i in range(len(self.urls)) if i not in self._lost]

    def route(self, group_id: int | None) -> int:
        """The server for the next request of `group_id`: the group's server while it is live, else the live server
        with the fewest requests in flight (which becomes the group's).

        Raises:
            RuntimeError: a server was lost without failover, or none is left (the message names them).
        """
        live = self.live
        if self._lost and (not self.failover or not live):
            raise RuntimeError(self._failure())
        return self._router.route(group_id, live)

    def is_lost(self, server: int) -> bool:
        self.refresh()
        return server in self._lost

    def lose(self, server: int, why: str) -> None:
        """Mark `server` lost because of `why` (a sentence naming it); wake its requests in flight; counted once."""
        if server in self._lost:
            return
        self._lost[server] = why
        if self._shared is not None:
            self._shared[server] = 1  # the trainer's next push leaves it out
        self._events[server].set()
        self._counters["vllm/servers_lost_total"] = self._counters.get("vllm/servers_lost_total", 0) + 1
        left = len(self.urls) - len(self._lost)
        if self.failover and left:
            log.error("%s Failover: going on with the %d other vLLM server(s).", why, left)

    def refresh(self) -> None:
        """Take in the servers the trainer marked lost."""
        if self._shared is None:
            return
        for server in range(len(self.urls)):
            if self._shared[server] and server not in self._lost:
                self.lose(server, f"The vLLM server at {self.urls[server]} did not take a weight push.")

    async def guard(self, server: int, request: Any) -> Any:
        """Await `request` (a coroutine) to `server`, counted in flight; if the server is lost first, or was lost by the
        time it answers, the answer is discarded.

        Raises:
            ServerLost: the server was lost (with failover: send the request again).
            RuntimeError: the server was lost without failover (the message names it).
        """
        self.inflight[server] += 1
        task = asyncio.ensure_future(request)
        lost = asyncio.ensure_future(self._events[server].wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.inflight[server] -= 1
            lost.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.done() and not task.cancelled() and not self.is_lost(server):
            return task.result()  # raises what the request raised
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: an error from a lost server is not reported twice
        if self.failover and self.live:
            self._counters["vllm/requests_resent_total"] = self._counters.get("vllm/requests_resent_total", 0) + 1
            raise ServerLost(self.urls[server])
        raise RuntimeError(self._failure())

    async def watch(self, session: Any) -> None:
        """Probe every live server's `/health` until cancelled; lose one whose process exited (a local `VLLMServer`)
        or that has not answered for `stale_after_s`. Runs as a task of the rollout child's event loop."""
        from ..serving.vllm_launcher import server_process_alive

        while True:
            live = self.live
            answers = await asyncio.gather(*(self._healthy(session, self.urls[i]) for i in live))
            now = time.monotonic()
            for server, healthy in zip(live, answers, strict=True):
                url = self.urls[server]
                if healthy:
                    self._last_ok[server] = now
                elif server_process_alive(url) is False:
                    self.lose(server, f"The vLLM server at {url} has exited.{_log_tail(url)}")
                elif now - self._last_ok[server] > self.stale_after_s:
                    self.lose(
                        server,
                        f"The vLLM server at {url} has not answered /health for {now - self._last_ok[server]:.0f} s "
                        f"(limit {self.stale_after_s:.0f} s: half of GRPODataModule's heartbeat_timeout).",
                    )
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def _healthy(self, session: Any, url: str) -> bool:
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            async with session.get(f"{url}/health", timeout=timeout) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, ConnectionError, OSError):
            return False

    def _failure(self) -> str:
        whys = " ".join(self._lost.values())
        if self.failover:
            return f"Every vLLM server is lost: {whys}"
        return (
            f"{whys} The run fails (GRPODataModule(vllm_failover=True) would go on with the other servers)."
            if len(self.urls) > 1
            else whys
        )


def _log_tail(url: str) -> str:
    from ..serving.vllm_launcher import server_log_tail

    tail = server_log_tail(url)
    return f" The server's last log lines:\n{tail}" if tail else ""
