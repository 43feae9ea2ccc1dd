"""Calling tools and environment methods so that nothing they do can stop a rollout.

A tool that raises, hangs past its timeout or returns something `str()` cannot print becomes an error message the
policy reads as the tool result (`{'error': '...'}`, TRL's format), and is counted. Synchronous calls run on daemon
threads: a hung one is abandoned at its timeout and never keeps the rollout process from exiting.

Metric names are TRL's (`tools/<name>/call_total`, `tools/<name>/failure_total`, `tools/unknown_name_total`,
`tools/latency_s`, `tools/<name>/latency_s`, `tools/parallel_calls_mean`) plus `tools/timeout_total`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

Counters = dict[str, float]  # a defaultdict(float): `*_total` counters
Rates = dict[str, list[float]]  # a defaultdict of [numerator, denominator]: rates and means


class CallTimeout(Exception):
    """A call did not return within its timeout."""


async def call_with_timeout(function: Callable, kwargs: dict[str, Any], timeout: float | None, what: str) -> Any:
    """`function(**kwargs)` awaited (async) or on a daemon thread (sync), abandoned after `timeout` seconds.

    Raises:
        CallTimeout: it did not return in time (a sync call keeps running on its thread, detached).
        Exception: whatever `function` raised.
    """
    asynchronous = inspect.iscoroutinefunction(function)
    call = function(**kwargs) if asynchronous else _on_daemon_thread(function, kwargs, what)
    try:
        return await asyncio.wait_for(call, timeout)
    except TimeoutError:
        raise CallTimeout(f"{what} did not return within {timeout} s") from None


def _on_daemon_thread(function: Callable, kwargs: dict[str, Any], what: str) -> asyncio.Future:
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def run() -> None:
        try:
            outcome = (True, function(**kwargs))
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting rollout, which reports it
            outcome = (False, error)
        with contextlib.suppress(RuntimeError):  # the event loop closed while the call hung
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=f"grpo-call:{what}"[:60], daemon=True).start()
    return future


def printable(result: Any, name: str) -> str:
    """`str(result)`, or a `ValueError` saying the tool's result cannot be printed."""
    try:
        text = str(result)
    except Exception as error:
        raise ValueError(f"tool {name} returned a {type(result).__name__} that cannot be printed ({error})") from None
    if not isinstance(text, str):
        raise ValueError(f"tool {name} returned a {type(result).__name__} whose __str__ is not a string")
    return text


def error_text(error: BaseException) -> str:
    """`str(error)`, or its type's name when even that fails."""
    try:
        return str(error) or type(error).__name__
    except Exception:
        return type(error).__name__


class ToolCaller:
    """Runs one turn's tool calls in order and returns the tool messages; counts calls, failures and latencies.

    Args:
        timeout: seconds a tool call may take before it fails (None: no limit, as TRL).
        counters: where `*_total` counters are added (TRL's `_counters`).
        rates: where `(numerator, denominator)` rates are added (TRL's `_rates`).
    """

    def __init__(self, timeout: float | None, counters: Counters, rates: Rates) -> None:
        self.timeout = timeout
        self.counters = counters
        self.rates = rates

    async def run(
        self, calls: list[dict[str, Any]], tools: dict[str, Callable]
    ) -> tuple[list[dict[str, str]], int, int]:
        """`(tool messages, calls made, calls failed)` for the parsed `calls` of one assistant turn."""
        messages, failures = [], 0
        for call in calls:
            function = call.get("function", call)
            name = str(function.get("name"))
            content, failed = await self._call(name, tools.get(name), function.get("arguments", {}))
            failures += failed
            messages.append({"role": "tool", "name": name, "content": content})
        self.rates["tools/parallel_calls_mean"][0] += len(calls)
        self.rates["tools/parallel_calls_mean"][1] += 1
        return messages, len(calls), failures

    async def _call(self, name: str, tool: Callable | None, arguments: Any) -> tuple[str, bool]:
        self.counters[f"tools/{name}/call_total"] += 1
        if tool is None:
            # A hallucinated tool name is the policy's error, which should fade with training: counted apart.
            self.counters["tools/unknown_name_total"] += 1
            self.counters[f"tools/{name}/failure_total"] += 1
            return str({"error": f"unknown tool {name}"}), True
        started = time.monotonic()
        failed = False
        try:
            if not isinstance(arguments, dict):
                raise TypeError(f"arguments must be a JSON object, got {arguments!r:.100}")
            content = printable(await call_with_timeout(tool, arguments, self.timeout, f"tool {name}"), name)
        except CallTimeout as error:
            self.counters["tools/timeout_total"] += 1
            content, failed = str({"error": error_text(error)}), True
        except Exception as error:
            content, failed = str({"error": error_text(error)}), True
        if failed:
            self.counters[f"tools/{name}/failure_total"] += 1
        elapsed = time.monotonic() - started
        for key in ("tools/latency_s", f"tools/{name}/latency_s"):
            self.rates[key][0] += elapsed
            self.rates[key][1] += 1
        return content, failed
