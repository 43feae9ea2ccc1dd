"""The embedded generator's static batching as it was before continuous batching: the baseline of generation.py.

A worker thread takes every waiting request (up to `max_batch_size`) as one batch, prefills all of its prompts
left-padded (a group's 8 samples prefill the same prompt 8 times) and decodes over a Hugging Face `DynamicCache`
until the batch's last completion ends; finished rows are dropped from the cache in bulk (once a quarter of the
running rows finished), and requests that arrive meanwhile wait for the next batch. Kept here, out of the package,
only to be measured against.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from lightning_grpo.rollout.sampling import process_logits, sample_from_logprobs

_COMPACT_FRAC = 0.25


@dataclass(slots=True)
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class StaticBatcher:
    """`generate(prompt_ids, max_tokens) -> (token_ids, logprobs)`, batching concurrent calls statically."""

    def __init__(self, model, *, eos_token_ids=(), temperature: float = 1.0, max_batch_size: int = 64, seed: int = 0):
        self._model = model.eval()
        self._eos = frozenset(eos_token_ids)
        self.temperature, self.max_batch_size = temperature, max_batch_size
        self._rng = torch.Generator().manual_seed(seed)
        self._queue: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_ids), max_tokens, loop.create_future(), loop)
        with self._cond:
            self._queue.append(request)
            self._cond.notify()
        return await request.future

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(10)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch_size))]
            for request, output in zip(batch, self._sample_batch(batch), strict=True):
                request.loop.call_soon_threadsafe(request.future.set_result, output)

    @torch.inference_mode()
    def _sample_batch(self, batch: list[_Request]) -> list[tuple[list[int], list[float]]]:
        limits = [request.max_tokens for request in batch]
        prompts = [request.prompt_ids for request in batch]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(len(batch), max(limits))], dim=1)
        positions = (prompt_mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self._model.config)
        logits = self._forward(input_ids, prompt_mask, positions, cache, logits_to_keep=1)
        next_position = positions[:, -1]
        tokens: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[float]] = [[] for _ in batch]
        rows = list(range(len(batch)))
        done = [False] * len(batch)
        while True:
            token, token_logprob = self._sample_step(logits)
            for r, t, lp in zip(rows, token.tolist(), token_logprob.tolist(), strict=True):
                if done[r]:
                    continue
                tokens[r].append(t)
                logprobs[r].append(lp)
                done[r] = t in self._eos or len(tokens[r]) >= limits[r]
            live = [i for i, r in enumerate(rows) if not done[r]]
            if not live:
                break
            if len(rows) - len(live) >= _COMPACT_FRAC * len(rows):
                keep = torch.tensor(live)
                cache.batch_select_indices(keep)
                mask, next_position, token = mask[keep], next_position[keep], token[keep]
                rows = [rows[i] for i in live]
            next_position = next_position + 1
            width += 1
            logits = self._forward(token[:, None], mask[:, :width], next_position[:, None], cache)
        return list(zip(tokens, logprobs, strict=True))

    def _forward(self, input_ids, mask, positions, cache, logits_to_keep: int = 0) -> torch.Tensor:
        out = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            cache=cache,
        )
        return out.logits[:, -1]

    def _sample_step(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.temperature == 0.0:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            token = logprobs.argmax(dim=-1)
        else:
            logprobs = process_logits(logits, self.temperature)
            token = sample_from_logprobs(logprobs, torch.rand(logits.shape[0], generator=self._rng))
        return token, logprobs.gather(-1, token[:, None]).squeeze(-1)
