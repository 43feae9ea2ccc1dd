"""The embedded generator: the policy on CPU inside the rollout child, serving the rollout loop's generate contract.

`EmbeddedGenerator.generate(prompt_ids)` is what TRL's `_generate_one_turn` needs from a vLLM server: prompt ids in;
the sampled ids and the logprob of each, under the distribution it was sampled from, out. Concurrent calls are
batched: a worker thread takes every waiting request (up to `max_batch_size`), runs one batched sampling loop (left
padding, a KV cache) and hands each caller its result on its event loop, which never blocks. Between batches the
worker applies the newest weights the trainer published (`weight_receiver`), so a completion is never sampled with
two policies, and each output carries the version of the weights that sampled it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .sampling import process_logits, sample_from_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..weights.shared_memory import SharedMemoryWeightReceiver

log = logging.getLogger(__name__)

#: Seconds between polls for the trainer's first weight sync, when the model was built without weights.
WEIGHT_POLL_S = 0.05
# Drop finished rows from the batch (and its KV cache) once this fraction of the rows still running has finished:
# each drop copies the cache, so it is done in bulk, not once per finished row.
_COMPACT_FRAC = 0.25


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """What the rollout child builds its policy from; pickles in microseconds (a name or a config dict, no weights).

    With `name` the weights come with it (`lightning_grpo.models.load_policy`). With `config` the model is built
    with random weights and the generator waits for the trainer's first weight sync before it samples, so the child
    never needs a checkpoint on disk.
    """

    name: str | None = None  # a `load_policy` name: "tiny-random", "smollm2-135m-instruct", a local folder, a Hub id
    config: dict[str, Any] | None = None  # `model.config.to_dict()`
    dtype: str = "float32"  # torch dtype name

    def __post_init__(self) -> None:
        if (self.name is None) == (self.config is None):
            raise ValueError(
                f"`PolicySpec(name={self.name!r}, config=...)` needs exactly one of `name` and `config`."
                " Use `PolicySpec.from_model(model)` for a config."
            )
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"`PolicySpec(dtype={self.dtype!r})` is not a torch dtype. Use e.g. 'float32'.")

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> PolicySpec:
        """The architecture of `model` (its config and dtype), without its weights."""
        return cls(config=model.config.to_dict(), dtype=str(model.dtype).removeprefix("torch."))

    @property
    def has_weights(self) -> bool:
        """Whether `build()` returns trained weights (False: they come from the first weight sync)."""
        return self.name is not None

    def build(self) -> PreTrainedModel:
        """The model, on CPU, in eval mode."""
        dtype = getattr(torch, self.dtype)
        if self.name is not None:
            from ..models import load_policy

            return load_policy(self.name, dtype=dtype).eval()
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(**self.config)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """One sampled completion of one prompt."""

    token_ids: list[int]  # sampled ids; ends with the EOS id when one was sampled (as vLLM returns it)
    logprobs: list[float]  # logprob of each sampled id under the processed distribution it was sampled from
    truncated: bool  # stopped at max_tokens without sampling an EOS
    model_version: int  # version of the weights that sampled every token


@dataclass(slots=True)
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    seed: int | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class EmbeddedGenerator:
    """Samples completions from a policy on CPU, batching concurrent requests; the rollout child's generator.

    It owns its model (eval mode, no autograd) and runs it on one worker thread: concurrent `generate` calls made in
    the same event-loop iteration form one batch, and calls made while a batch runs form the next. Each completion
    stops at its first EOS id (included) or at its `max_tokens`. Before each batch the worker applies weights the
    trainer published through `weight_receiver`; `applied_version` then changes, and outputs carry the version
    that sampled them. A model built without weights (`PolicySpec(config=...)`) waits for the first sync.

    Call `generate` from one event loop at a time. `close()` (or the context manager) stops the thread.

    Args:
        model: a model (the generator takes it over; pass a copy of a model you also train), a `PolicySpec`, or a
            `load_policy` name.
        eos_token_ids: ids that end a completion; default: the model's `generation_config`/`config` EOS ids.
        temperature: sampling temperature; 0 means greedy (its logprobs are then those of `log_softmax(logits)`).
        top_p: nucleus mass kept, in (0, 1].
        top_k: tokens kept by rank; 0 or -1 keep all.
        max_tokens: default cap on sampled tokens per call.
        max_batch_size: most requests in one batch.
        weight_receiver: the generator side of a `SharedMemoryWeightTransfer` (`transfer.receiver()`).
        model_version: version of the weights the model starts with (ignored until a sync, for a config-only model).
        seed: seeds the sampling of requests that pass no seed of their own; None draws a random seed.
        num_threads: if set, `torch.set_num_threads(num_threads)`, which applies to the whole process.

    Raises:
        ValueError: a sampling option out of range (all problems in one message), or a model without weights and
            no `weight_receiver`.

    Example::

        generator = EmbeddedGenerator("tiny-random", temperature=0.7, max_tokens=64)
        output = asyncio.run(generator.generate(tokenizer.encode("7+5=")))
        output.token_ids, output.logprobs, output.truncated, output.model_version
        generator.close()
    """

    def __init__(
        self,
        model: PreTrainedModel | PolicySpec | str,
        *,
        eos_token_ids: int | Sequence[int] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        max_tokens: int = 256,
        max_batch_size: int = 64,
        weight_receiver: SharedMemoryWeightReceiver | None = None,
        model_version: int = 0,
        seed: int | None = None,
        num_threads: int | None = None,
    ) -> None:
        _check_options(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=max_tokens,
            max_batch_size=max_batch_size,
            num_threads=num_threads,
        )
        if isinstance(model, str):
            model = PolicySpec(name=model)
        has_weights = model.has_weights if isinstance(model, PolicySpec) else True
        if not has_weights and weight_receiver is None:
            raise ValueError(
                "`EmbeddedGenerator(model=PolicySpec(config=...))` has no weights and no `weight_receiver` to get "
                "them from. Pass `weight_receiver=transfer.receiver()`, or a `PolicySpec(name=...)`."
            )
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self._model = (model.build() if isinstance(model, PolicySpec) else model).eval()
        self._vocab_size = self._model.get_input_embeddings().num_embeddings
        self._eos = frozenset(_default_eos(self._model) if eos_token_ids is None else _as_ids(eos_token_ids))
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self._model.forward).parameters else "past_key_values"
        )
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)
        self.max_tokens, self.max_batch_size = max_tokens, max_batch_size
        self._receiver = weight_receiver
        self._has_weights = has_weights
        self._applied_version = model_version
        self._rng = torch.Generator()
        if seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(seed)
        self._counters = dict.fromkeys(("batches", "requests", "tokens", "weight_syncs"), 0)
        self._staged: list[_Request] = []
        self._queue: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="embedded-generator", daemon=True)
        self._thread.start()

    @property
    def model(self) -> PreTrainedModel:
        return self._model

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def applied_version(self) -> int:
        """Version of the weights in the model now; the next batch samples with them (or with newer ones)."""
        return self._applied_version

    def metrics(self) -> dict[str, float]:
        """Counters since start: batches run, requests served, tokens sampled, weight syncs applied."""
        return {f"generation/{key}_total": float(value) for key, value in self._counters.items()}

    async def generate(
        self, prompt_ids: list[int], max_tokens: int | None = None, *, seed: int | None = None
    ) -> GenerationOutput:
        """Sample one completion of `prompt_ids`; waits without blocking the event loop.

        Args:
            prompt_ids: the prompt's token ids (non-empty, inside the vocabulary).
            max_tokens: cap on sampled tokens for this call; default the generator's `max_tokens`.
            seed: makes this request's samples reproducible, whatever else is in its batch.

        Raises:
            ValueError: an empty prompt, an id outside the vocabulary, or `max_tokens` < 1.
            RuntimeError: the generator is closed (also raised to callers waiting when it closes).
        """
        max_tokens = self.max_tokens if max_tokens is None else int(max_tokens)
        self._check_prompt(prompt_ids, max_tokens)
        if self._closed:
            raise RuntimeError("`EmbeddedGenerator.generate()` called after `close()`.")
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_ids), max_tokens, seed, loop.create_future(), loop)
        # Requests made in this loop iteration are handed over together, so they share one batch.
        self._staged.append(request)
        if len(self._staged) == 1:
            loop.call_soon(self._hand_over)
        return await request.future

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker thread (a running batch stops at its next token); waiting callers get RuntimeError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._hand_over()
        if self._receiver is not None:
            self._receiver.close()

    def __enter__(self) -> EmbeddedGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_prompt(self, prompt_ids: list[int], max_tokens: int) -> None:
        if len(prompt_ids) == 0:
            raise ValueError("`EmbeddedGenerator.generate(prompt_ids=[])`: the prompt needs at least one token.")
        low, high = min(prompt_ids), max(prompt_ids)
        if low < 0 or high >= self._vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"`EmbeddedGenerator.generate(prompt_ids=...)` has token id {bad}, outside the model's vocabulary "
                f"(size {self._vocab_size}). Tokenize with the policy's tokenizer."
            )
        if max_tokens < 1:
            raise ValueError(f"`EmbeddedGenerator.generate(max_tokens={max_tokens})` must be at least 1.")

    def _hand_over(self) -> None:
        staged, self._staged = self._staged, []
        with self._cond:
            if not self._closed:
                self._queue.extend(staged)
                self._cond.notify()
                return
        for request in staged:  # closed since they were staged: the worker is gone
            _resolve(request, error=RuntimeError("EmbeddedGenerator was closed."))

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch_size))]
            batch = [request for request in batch if not request.future.done()]  # skip callers that gave up
            if not batch:
                continue
            try:
                self._apply_weights()
                outputs = self._sample_batch(batch)
            except BaseException as error:  # noqa: BLE001 -- handed to every caller of the batch
                for request in batch:
                    _resolve(request, error=error)
                continue
            for request, output in zip(batch, outputs, strict=True):
                _resolve(request, output)
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
        for request in left:
            _resolve(request, error=RuntimeError("EmbeddedGenerator was closed."))

    def _apply_weights(self) -> None:
        """Copy in the newest published weights; a model without weights waits for the first sync."""
        if self._receiver is None:
            return
        while True:
            version = self._receiver.poll(self._model)
            if version is not None:
                self._applied_version = version
                self._has_weights = True
                self._counters["weight_syncs"] += 1
                log.debug("EmbeddedGenerator applied the weights of version %d", version)
                return
            if self._has_weights:
                return
            with self._cond:
                if self._closed:
                    raise RuntimeError("EmbeddedGenerator was closed before the trainer's first weight sync arrived.")
                self._cond.wait(WEIGHT_POLL_S)

    @torch.inference_mode()
    def _sample_batch(self, batch: list[_Request]) -> list[GenerationOutput]:
        """Sample every request of `batch` to its EOS or its max_tokens in one batched loop over a KV cache."""
        from transformers import DynamicCache

        limits = [request.max_tokens for request in batch]
        input_ids, prompt_mask = _left_pad([request.prompt_ids for request in batch])
        width = prompt_mask.shape[1]
        # the mask of every step, allocated once: step t attends to the first width + t columns
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(len(batch), max(limits))], dim=1)
        positions = (prompt_mask.cumsum(-1) - 1).clamp_(min=0)
        cache = DynamicCache(config=self._model.config)
        logits = self._forward(input_ids, prompt_mask, positions, cache, logits_to_keep=1)
        next_position = positions[:, -1]
        generators = [_seeded(request.seed) for request in batch]
        tokens: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[float]] = [[] for _ in batch]
        rows = list(range(len(batch)))  # request index of each row still in the batch
        done = [False] * len(batch)
        while True:
            if self._closed:
                raise RuntimeError("EmbeddedGenerator was closed during generation.")
            token, token_logprob = self._sample_step(logits, [generators[r] for r in rows])
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
        self._counters["batches"] += 1
        self._counters["requests"] += len(batch)
        self._counters["tokens"] += sum(map(len, tokens))
        return [
            GenerationOutput(ids, lps, truncated=ids[-1] not in self._eos, model_version=self._applied_version)
            for ids, lps in zip(tokens, logprobs, strict=True)
        ]

    def _forward(self, input_ids, mask, positions, cache, logits_to_keep: int = 0) -> torch.Tensor:
        kwargs = {self._cache_kwarg: cache}
        out = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        return out.logits[:, -1]

    def _sample_step(
        self, logits: torch.Tensor, generators: list[torch.Generator | None]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, vocab) logits -> the sampled token of each row and its logprob."""
        if self.temperature == 0.0:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            token = logprobs.argmax(dim=-1)
        else:
            logprobs = process_logits(logits, self.temperature, self.top_k, self.top_p)
            uniform = torch.rand(len(generators), generator=self._rng)
            for row, generator in enumerate(generators):
                if generator is not None:
                    uniform[row] = torch.rand((), generator=generator)
            token = sample_from_logprobs(logprobs, uniform)
        return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


class GeneratorSpec:
    """How to build an `EmbeddedGenerator` in the rollout child: its arguments, without the model's weights.

    Takes exactly `EmbeddedGenerator`'s arguments (the policy as a `PolicySpec` or a `load_policy` name, then its
    keyword options) and checks them here, against its signature and ranges, so a bad value fails in the trainer
    before the child is spawned. It pickles in microseconds; `build()` runs in the child.

    Raises:
        TypeError: an argument `EmbeddedGenerator` does not take.
        ValueError: an option out of range (all problems in one message).

    Example::

        spec = GeneratorSpec(PolicySpec.from_model(policy), temperature=0.7, weight_receiver=transfer.receiver())
        generator = spec.build()  # in the rollout child
    """

    __slots__ = ("options", "policy")

    def __init__(self, policy: PolicySpec | str, **options: Any) -> None:
        try:
            bound = inspect.signature(EmbeddedGenerator).bind(policy, **options)
        except TypeError as error:
            raise TypeError(f"`GeneratorSpec(...)`: {error}; it takes EmbeddedGenerator's arguments.") from None
        bound.apply_defaults()
        _check_options(**{name: bound.arguments[name] for name in _CHECKED})
        self.policy = PolicySpec(name=policy) if isinstance(policy, str) else policy
        self.options = options

    def build(self) -> EmbeddedGenerator:
        """Load the policy and start the generator's worker thread."""
        return EmbeddedGenerator(self.policy, **self.options)

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in self.options.items())
        return f"GeneratorSpec({self.policy!r}, {options})"


_CHECKED = ("temperature", "top_p", "top_k", "max_tokens", "max_batch_size", "num_threads")


def _check_options(
    *, temperature: float, top_p: float, top_k: int, max_tokens: int, max_batch_size: int, num_threads: int | None
) -> None:
    problems = []
    if not temperature >= 0:
        problems.append(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        problems.append(f"top_p={top_p} must be in (0, 1]")
    if top_k < -1:
        problems.append(f"top_k={top_k} must be >= 0 (0 or -1 = no top-k)")
    if max_tokens < 1:
        problems.append(f"max_tokens={max_tokens} must be >= 1")
    if max_batch_size < 1:
        problems.append(f"max_batch_size={max_batch_size} must be >= 1")
    if num_threads is not None and num_threads < 1:
        problems.append(f"num_threads={num_threads} must be >= 1")
    if problems:
        raise ValueError(f"`EmbeddedGenerator(...)`: {'; '.join(problems)}.")


def _as_ids(ids: int | Sequence[int] | None) -> list[int]:
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def _default_eos(model: PreTrainedModel) -> list[int]:
    generation_config = getattr(model, "generation_config", None)
    ids = _as_ids(getattr(generation_config, "eos_token_id", None))
    return ids or _as_ids(getattr(model.config, "eos_token_id", None))


def _left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, width) ids and attention mask, prompts aligned right; the pad id is 0 (masked, never attended)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    return ids, mask


def _seeded(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def _resolve(request: _Request, output: GenerationOutput | None = None, error: BaseException | None = None) -> None:
    """Complete `request`'s future on its event loop (from any thread); a closed loop or a cancelled call is skipped."""

    def complete() -> None:
        if request.future.done():
            return
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(output)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed
        request.loop.call_soon_threadsafe(complete)
