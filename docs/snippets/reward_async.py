"""An async reward: it awaits a slow check for every completion at once."""

import asyncio

from lightning_grpo.rewards import completion_text


async def verify(text: str, answer: str) -> float:
    """The place to await a service: an HTTP verifier, a code sandbox, a remote judge.

    Use an async client (aiohttp, httpx.AsyncClient); a blocking call here would stop
    the rollout process's event loop, and generation with it.
    """
    await asyncio.sleep(0.01)  # stands for the request
    return 1.0 if text.split()[-1:] == [str(answer)] else 0.0  # the last word


async def verified(completions, answer, **columns):
    """The verifier's verdict on each completion, the calls made concurrently."""
    texts = [completion_text(completion) for completion in completions]
    return list(await asyncio.gather(*map(verify, texts, answer)))
