"""Continuous batching for the embedded generator: requests join at the next step, finished ones leave at once, and
the samples of one prompt share one prefill.

`ContinuousBatch.step` runs one forward of a `SlotDecoder` over every running row plus the prompts of the requests
that join in this step, then samples one token for every row. A prompt is prefilled once: its `Prefix` (keys, values,
logits after it) is copied into the cache slot of each of its samples (a GRPO group's 8 completions), including
samples that join later, for as long as a waiting request still needs it and the weights have not changed. A row
that samples an EOS id, completes a stop string or reaches its `max_tokens` leaves the batch in the same step, and
the last row moves into its slot, so the running rows always fill slots `0..rows-1`.

Weights may change between steps (the generator applies them there) under rows that are running: later tokens are
sampled by the new weights over a cache the older ones computed. Each token's logprob is that of the distribution it
was sampled from, each output lists the version that sampled each token, and its `model_version` is the oldest of
them (the one that prefilled its prompt), so staleness is never under-counted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from . import cdf_draw
from .decoder import Prefix, SlotDecoder
from .sampling import draw, sampling_scores

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .generic_decoder import GenericPrefix
    from .stop_strings import StopStrings

# Most prompt tokens prefilled in one step (a longer prompt is prefilled alone).
_MAX_PREFILL_TOKENS = 4096


class StepDecoder(Protocol):
    """What `ContinuousBatch` drives: `decoder.SlotDecoder` (the fast one) or `generic_decoder.GenericDecoder`."""

    def reserve(self, slots: int, capacity: int) -> None:
        """Before a step: room for `slots` rows of up to `capacity` positions."""

    def load(self, prefix: Any, slots: list[int]) -> None:
        """After a step: `slots` restart as the prompt of `prefix` (one the decoder's `step` returned)."""

    def move(self, source: int, target: int) -> None:
        """After a step: slot `target` takes slot `source`'s sequence (rows stay in slots `0..rows-1`)."""

    def step(self, tokens: torch.Tensor, prompts: list[list[int]]) -> tuple[torch.Tensor, list[Any]]:
        """One forward: each row's token in, its logits out; a prefix (with `.logits`) per prompt."""
        ...

    def repack(self) -> None:
        """After the model's weights changed in place."""


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """One sampled completion of one prompt."""

    token_ids: list[int]  # sampled ids; ends with the EOS id when one was sampled (as vLLM returns it)
    logprobs: list[float]  # logprob of each sampled id under the processed distribution it was sampled from
    truncated: bool  # stopped at max_tokens, without an EOS id or a stop string
    model_version: int  # the oldest weights that sampled any token (they prefilled the prompt)
    token_versions: tuple[int, ...] = ()  # the version of the weights that sampled each token
    stop_string: str | None = None  # the stop string the completion ended with (its last token completes it)


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """How every row's next token is drawn (see `process_logits`)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    @property
    def temperature_only(self) -> bool:
        """Sampling from `softmax(logits / temperature)` itself: no filter, no penalty, not greedy."""
        return (
            self.temperature > 0
            and self.top_k in (0, -1)
            and self.top_p == 1.0
            and not self.min_p
            and self.repetition_penalty == 1.0
        )


@dataclass(slots=True, eq=False)
class _Row:
    request: Any  # the generator's request: prompt_ids, key, max_tokens, seed
    generator: torch.Generator | None  # the request's own seeded generator
    seen: torch.Tensor | None  # (vocab,) bool, tokens of the prompt and the completion (repetition penalty only)
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_string: str | None = None


@dataclass(slots=True)
class _CachedPrefix:
    prefix: Prefix | GenericPrefix
    version: int


class ContinuousBatch:
    """The running rows of the embedded generator and the cache they live in; driven one `step` at a time.

    Args:
        model: the policy (a `SlotDecoder`-supported causal LM, eval mode).
        sampling: the sampling options.
        eos_token_ids: ids that end a completion (included in it).
        stop: stop strings, or None.
        max_rows: most rows decoding at once.
        rng: draws for requests without a seed of their own.
        packed: run a large LM head on pre-packed weights (see `SlotDecoder`).
        decoder: the decoder to drive instead of a `SlotDecoder` of `model` (a `GenericDecoder` runs every causal LM
            through its own forward; `decoder_choice.choose_decoder` picks).
        int8_weights: a `SlotDecoder`'s layers on int8 weights where they can be (see `SlotDecoder`; `int8_refusal`
            says why not).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        sampling: SamplingOptions,
        eos_token_ids: frozenset[int],
        stop: StopStrings | None,
        max_rows: int,
        rng: torch.Generator,
        packed: bool = False,
        decoder: StepDecoder | None = None,
        int8_weights: bool = False,
    ) -> None:
        if decoder is None:
            decoder = SlotDecoder(model, packed=packed, int8_weights=int8_weights)
            #: why the layers' weights are not int8 although asked (None: they are, or were not asked)
            self.int8_refusal = decoder.int8_refusal
        else:
            self.int8_refusal = "int8 weights run on the fast decoder" if int8_weights else None
        self._decoder: StepDecoder = decoder
        self._vocab = model.get_output_embeddings().weight.shape[0]
        self.sampling = sampling
        self._eos, self._stop = eos_token_ids, stop
        self._max_rows = max_rows
        self._rng = rng
        self._rows: list[_Row] = []
        self._joining: list[Any] = []
        self._prefixes: dict[tuple[int, ...], _CachedPrefix] = {}
        self.counters = dict.fromkeys(("steps", "requests", "tokens", "prefills", "prefill_tokens"), 0)

    @property
    def rows(self) -> int:
        """Rows decoding now."""
        return len(self._rows)

    def step(self, waiting: deque, version: int) -> list[tuple[Any, GenerationOutput]]:
        """Admit waiting requests while rows are free, run one forward, sample one token per row.

        Args:
            waiting: requests in arrival order; those admitted are taken from it.
            version: the version of the weights in the model now (they sample this step's tokens).

        Returns:
            the requests that finished in this step, with their outputs.
        """
        self._prefixes = {key: c for key, c in self._prefixes.items() if c.version == version}
        self._joining = self._admit(waiting)
        if not self._rows and not self._joining:
            return []
        prompts = list(dict.fromkeys(r.key for r in self._joining if r.key not in self._prefixes))
        self._reserve()
        tokens = torch.tensor([row.tokens[-1] for row in self._rows], dtype=torch.long)
        logits, prefixes = self._decoder.step(tokens, [list(key) for key in prompts])
        for key, prefix in zip(prompts, prefixes, strict=True):
            self._prefixes[key] = _CachedPrefix(prefix, version)
        self.counters["prefills"] += len(prompts)
        self.counters["prefill_tokens"] += sum(map(len, prompts))
        first = self._join(version)
        logits = torch.cat([logits, *(p.logits[None] for p in first)]) if first else logits
        finished = self._sample(logits, version)
        done = [self._rows[i] for i in finished]
        self._compact(set(finished))
        needed = {request.key for request in waiting}
        self._prefixes = {key: c for key, c in self._prefixes.items() if key in needed}
        self.counters["steps"] += 1
        return [(row.request, self._output(row)) for row in done]

    def weights_changed(self) -> None:
        """The model's weights were replaced in place: re-pack them (cached prefixes expire by their version)."""
        self._decoder.repack()

    def discard(self, drop: Any) -> list[Any]:
        """Remove the rows whose request `drop(request)` is true (callers that gave up); returns their requests."""
        gone = [i for i, row in enumerate(self._rows) if drop(row.request)]
        requests = [self._rows[i].request for i in gone]
        self._compact(set(gone))
        return requests

    def abort(self) -> list[Any]:
        """Empty the batch after a failed step; returns every request it held (running and joining)."""
        requests = [row.request for row in self._rows] + self._joining
        self._rows, self._joining, self._prefixes = [], [], {}
        return requests

    # -- one step ------------------------------------------------------------------------------------------------------

    def _admit(self, waiting: deque) -> list[Any]:
        """Requests that join now: while rows are free, and while the prompts to prefill stay under a token budget
        (at least one prompt a step), so that a burst of long prompts cannot make one step's activations huge."""
        joining: list[Any] = []
        new: set[tuple[int, ...]] = set()
        prefill = 0
        while waiting and len(self._rows) + len(joining) < self._max_rows:
            key = waiting[0].key
            if key not in self._prefixes and key not in new:
                if new and prefill + len(key) > _MAX_PREFILL_TOKENS:
                    break
                new.add(key)
                prefill += len(key)
            joining.append(waiting.popleft())
        return joining

    def _reserve(self) -> None:
        """Room for this step: a slot per row, and each row's positions up to the token it feeds now (the cache
        grows with the longest sequence, not to every request's `max_tokens` at once)."""
        needed = [len(r.prompt_ids) for r in self._joining]
        needed += [len(row.request.prompt_ids) + len(row.tokens) for row in self._rows]
        if needed:
            self._decoder.reserve(len(self._rows) + len(self._joining), max(needed))

    def _join(self, version: int) -> list[Prefix | GenericPrefix]:
        """Load each joining request's prefix into the next free slot; returns their prefixes in slot order."""
        first: list[Prefix | GenericPrefix] = []
        rows: list[_Row] = []
        for request in self._joining:
            prefix = self._prefixes[request.key].prefix
            self._decoder.load(prefix, [len(self._rows) + len(rows)])
            seen = None
            if self.sampling.repetition_penalty != 1.0:
                seen = torch.zeros(self._vocab, dtype=torch.bool)
                seen[torch.tensor(request.prompt_ids, dtype=torch.long)] = True
            generator = None if request.seed is None else torch.Generator().manual_seed(request.seed)
            rows.append(_Row(request, generator, seen, [], [], []))
            first.append(prefix)
        self._rows += rows
        self.counters["requests"] += len(rows)
        self._joining = []
        return first

    @torch.inference_mode()  # the decoder's logits are inference tensors, overwritten here
    def _sample(self, logits: torch.Tensor, version: int) -> list[int]:
        """Draw one token for every row from `logits` (rows, vocab); returns the rows that finished."""
        fused = self.sampling.temperature_only and logits.dtype in cdf_draw.DTYPES and cdf_draw.available()
        if fused:  # two passes over the logits as they are, no float32 copy
            token, token_logprob = cdf_draw.draw(logits, self._uniforms(), self.sampling.temperature)
        else:
            token, token_logprob = self._sample_filtered(logits)
        finished = []
        for i, (row, t, lp) in enumerate(zip(self._rows, token.tolist(), token_logprob.tolist(), strict=True)):
            row.tokens.append(t)
            row.logprobs.append(lp)
            row.versions.append(version)
            if row.seen is not None:
                row.seen[t] = True
            if self._stop is not None and t not in self._eos:
                row.stop_string = self._stop.found(row.tokens)
            if t in self._eos or row.stop_string is not None or len(row.tokens) >= row.request.max_tokens:
                finished.append(i)
        self.counters["tokens"] += len(self._rows)
        return finished

    def _sample_filtered(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their log-probabilities under any sampling options, through `sampling` (overwriting `logits`
        where they are float32)."""
        options = self.sampling
        seen = torch.stack([row.seen for row in self._rows]) if options.repetition_penalty != 1.0 else None
        scores = sampling_scores(
            logits,
            options.temperature,
            options.top_k,
            options.top_p,
            min_p=options.min_p,
            repetition_penalty=options.repetition_penalty,
            seen=seen,
            overwrite=True,  # this step's logits, not needed after sampling
        )
        if options.temperature == 0.0:
            token = scores.argmax(dim=-1)
            return token, scores.gather(-1, token[:, None]).squeeze(-1) - scores.logsumexp(dim=-1)
        return draw(scores, self._uniforms(), overwrite=True)

    def _uniforms(self) -> torch.Tensor:
        """One uniform number per row: from the row's own seeded generator where its request has one."""
        uniform = torch.rand(len(self._rows), generator=self._rng)
        for i, row in enumerate(self._rows):
            if row.generator is not None:
                uniform[i] = torch.rand((), generator=row.generator)
        return uniform

    def _compact(self, gone: set[int]) -> None:
        """Drop rows `gone`, moving the last running rows into their slots."""
        if not gone:
            return
        keep = len(self._rows) - len(gone)
        holes = [i for i in range(keep) if i in gone]
        movers = [i for i in range(keep, len(self._rows)) if i not in gone]
        for hole, mover in zip(holes, movers, strict=True):
            self._decoder.move(mover, hole)
            self._rows[hole] = self._rows[mover]
        del self._rows[keep:]

    def _output(self, row: _Row) -> GenerationOutput:
        ended = row.tokens[-1] in self._eos or row.stop_string is not None
        return GenerationOutput(
            token_ids=row.tokens,
            logprobs=row.logprobs,
            truncated=not ended,
            model_version=row.versions[0],
            token_versions=tuple(row.versions),
            stop_string=row.stop_string,
        )
