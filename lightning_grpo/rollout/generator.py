"""The embedded generator: the policy on CPU inside the rollout child, serving the rollout loop's generate contract.

`EmbeddedGenerator.generate(prompt_ids)` is what TRL's `_generate_one_turn` needs from a vLLM server: prompt ids in;
the sampled ids and the logprob of each, under the distribution it was sampled from, out. Concurrent calls are
batched continuously on a worker thread (`batching.py`): a request joins the running batch at the next step, a
finished one leaves it at once, and the samples of one prompt share one prefill. Each caller gets its result on its
own event loop, which never blocks. Between steps the worker applies the newest weights the trainer published
(`weight_receiver`); each output lists the version that sampled each token and is tagged with the oldest.

Runs every decoder-only causal LM: the families of `architectures.ARCHITECTURES` on the fast slot decoder, every other
one through the model's own forward and cache (`generic_decoder`); `decoder_choice.choose_decoder` picks.
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

from .batching import ContinuousBatch, GenerationOutput, SamplingOptions
from .decode_linears import QUANTIZATIONS, Quantization
from .decoder_choice import DecoderName, check_decoder_name, choose_decoder
from .generic_decoder import GenericDecoder
from .stop_strings import StopStrings, check_stop

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .core_sharing import CoreSharing
    from .weight_receiver import SharedMemoryWeightReceiver

log = logging.getLogger(__name__)

#: Seconds between polls for the trainer's first weight sync, when the model was built without weights.
WEIGHT_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """What the rollout child builds its policy from; pickles in microseconds (a name or a config dict, no weights).

    With `name` the weights come with it (`lightning_grpo.models.load_policy`). With `config` the model is built
    with random weights and the generator waits for the trainer's first weight sync before it samples, so the child
    never needs a checkpoint on disk.

    Example::

        from lightning_grpo import PolicySpec
        from lightning_grpo.models import load_policy

        by_name = PolicySpec(name="tiny-random")
        # from a model: its config travels, not its weights
        from_a_model = PolicySpec.from_model(load_policy("tiny-random"))
    """

    name: str | None = None  # a `load_policy` name ("tiny-random", "gemma-3-270m", ...), a local folder, a Hub id
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
    def from_model(cls, model: PreTrainedModel, dtype: str | None = None) -> PolicySpec:
        """The architecture of `model` (its config, and its dtype unless `dtype` names another), without its
        weights. In another dtype the generator casts each weight sync into it as it copies it in."""
        return cls(config=model.config.to_dict(), dtype=dtype or str(model.dtype).removeprefix("torch."))

    @property
    def has_weights(self) -> bool:
        """Whether `build()` returns trained weights (False: they come from the first weight sync)."""
        return self.name is not None

    def build(self) -> PreTrainedModel:
        """The model, on CPU, in eval mode."""
        dtype = getattr(torch, self.dtype)
        if self.name is not None:
            from ..models.loading import load_policy

            return load_policy(self.name, dtype=dtype).eval()
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.config is None:
            raise ValueError("A `PolicySpec` needs a `name` or a `config` (see `PolicySpec.from_model`).")
        config = AutoConfig.for_model(**self.config)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@dataclass(slots=True)
class _Request:
    prompt_ids: list[int]
    key: tuple[int, ...]  # the prompt, as the key of its shared prefill
    max_tokens: int
    seed: int | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class EmbeddedGenerator:
    """Samples completions from a policy on CPU, batching concurrent requests continuously; the rollout child's generator.

    It owns its model (eval mode, no autograd) and runs it on one worker thread, one step at a time: every running
    completion samples one token per step, a request made meanwhile joins at the next step (up to `max_batch_size`
    running), and a completion leaves as soon as it samples an EOS id (included), completes a stop string (its last
    token included) or reaches its `max_tokens`. Requests with the same prompt (a GRPO group) share one prefill.
    Between steps the worker applies weights the trainer published through `weight_receiver`: `applied_version`
    changes and the next tokens of every running completion are sampled by them. An output's `token_versions` say
    which version sampled each token and its `model_version` is the oldest (the one that prefilled its prompt). A
    model built without weights (`PolicySpec(config=...)`) waits for the first sync.

    Sampling follows vLLM's order and its `processed_logprobs`: repetition penalty, temperature, min-p, top-k, top-p
    (`process_logits`); each logprob is that of the distribution its token was drawn from.

    Runs every decoder-only causal LM (`AutoModelForCausalLM`): the families of `architectures.ARCHITECTURES` on the
    fast decoder (`decoder.SlotDecoder`: its own attention over a slot cache, packed weights), every other one
    (Phi-3, GPT-2, Mixtral, Gemma 2, hybrids of attention with Mamba, convolution or Gated DeltaNet layers, ...)
    through the model's own forward and cache (`generic_decoder.GenericDecoder`). It logs which one at start-up, and
    why. An encoder or an encoder-decoder is refused.

    Call `generate` from one event loop at a time. `close()` (or the context manager) stops the thread.

    Args:
        model: a model (the generator takes it over; pass a copy of a model you also train), a `PolicySpec`, or a
            `load_policy` name.
        eos_token_ids: ids that end a completion; default: the model's `generation_config`/`config` EOS ids.
        temperature: sampling temperature; 0 means greedy (its logprobs are then those of `log_softmax(logits)`).
        top_p: nucleus mass kept, in (0, 1].
        top_k: tokens kept by rank; 0 or -1 keep all.
        min_p: drop tokens less likely than `min_p` times the most likely one, in [0, 1]; None keeps all.
        repetition_penalty: > 0; above 1 discourages tokens already in the prompt or the completion (1 is off).
        stop: strings that end a completion when its text contains one (the completion keeps the token that
            completed it and is not truncated).
        tokenizer: the policy's tokenizer (or its `load_tokenizer` name), to find stop strings; default: that of a
            named policy.
        max_tokens: default cap on sampled tokens per call.
        max_batch_size: most completions decoding at once.
        weight_receiver: the generator side of a `SharedMemoryWeightTransfer` (`transfer.receiver()`).
        model_version: version of the weights the model starts with (ignored until a sync, for a config-only model).
        seed: seeds the sampling of requests that pass no seed of their own; None draws a random seed.
        num_threads: if set, `torch.set_num_threads(num_threads)`, which applies to the whole process.
        decoder: "auto" (the fast decoder for the families it runs, else the generic one), or "fast" / "generic"
            to force one (`decoder_choice.choose_decoder`).
        quantization: "int8" to hold the decoder layers' linear weights as int8 with a float32 scale per output
            feature (weight-only: activations, sums, the KV cache, the embeddings and the LM head stay in the model's
            dtype), read at half the bytes per step, on AMX-INT8 tiles. It runs where the fast decoder runs a bf16
            model on a CPU with AMX-INT8 (Intel Xeon from Sapphire Rapids on); elsewhere the weights stay as they
            are and the start-up log says why. Sampling then differs from the trained policy by the rounding: weight
            it with `GRPOModule(vllm_importance_sampling_correction=True)`. None (the default): the model's weights.
        core_sharing: the trainer's `CoreSharing` (the rollout child gets it from the data module with
            `trainer_threads="auto"`): the generator then marks itself idle while it waits for requests and, before
            each decode step, runs on its own threads plus the trainer's while the trainer waits for rollouts.

    Raises:
        ValueError: a sampling option out of range (all problems in one message), a model without weights and no
            `weight_receiver`, stop strings without a tokenizer, a model that is not a decoder-only causal LM, or
            `decoder="fast"` for a model the fast decoder does not run.

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
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        stop: Sequence[str] | None = None,
        tokenizer: Any = None,
        max_tokens: int = 256,
        max_batch_size: int = 64,
        weight_receiver: SharedMemoryWeightReceiver | None = None,
        model_version: int = 0,
        seed: int | None = None,
        num_threads: int | None = None,
        decoder: DecoderName = "auto",
        quantization: Quantization | None = None,
        core_sharing: CoreSharing | None = None,
    ) -> None:
        _check_options(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            stop=stop,
            max_tokens=max_tokens,
            max_batch_size=max_batch_size,
            num_threads=num_threads,
            quantization=quantization,
        )
        if isinstance(model, PolicySpec) and model.config is not None:
            choose_decoder(model.config, decoder)  # before building a model it would refuse
        if isinstance(model, str):
            model = PolicySpec(name=model)
        has_weights = model.has_weights if isinstance(model, PolicySpec) else True
        if not has_weights and weight_receiver is None:
            raise ValueError(
                "`EmbeddedGenerator(model=PolicySpec(config=...))` has no weights and no `weight_receiver` to get "
                "them from. Pass `weight_receiver=transfer.receiver()`, or a `PolicySpec(name=...)`."
            )
        stops = _stop_strings(stop, tokenizer, model)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self._model = (model.build() if isinstance(model, PolicySpec) else model).eval()
        choice = choose_decoder(self._model.config, decoder)
        log.info("EmbeddedGenerator decodes on the %s path: %s", choice.path, choice.reason)
        self._vocab_size = self._model.get_input_embeddings().num_embeddings
        self._eos = frozenset(_default_eos(self._model) if eos_token_ids is None else _as_ids(eos_token_ids))
        self.sampling = SamplingOptions(float(temperature), int(top_k), float(top_p), min_p, float(repetition_penalty))
        self.max_tokens, self.max_batch_size = max_tokens, max_batch_size
        self._receiver = weight_receiver
        self._has_weights = has_weights
        self._applied_version = model_version
        rng = torch.Generator()
        if seed is None:
            rng.seed()
        else:
            rng.manual_seed(seed)
        self._batch = ContinuousBatch(
            self._model,
            sampling=self.sampling,
            eos_token_ids=self._eos,
            stop=stops,
            max_rows=max_batch_size,
            rng=rng,
            packed=True,  # where oneDNN has packed products for the model's dtype (`SlotDecoder`)
            decoder=GenericDecoder(self._model) if choice.path == "generic" else None,
            int8_weights=quantization == "int8",
        )
        _log_quantization(quantization, self._batch.int8_refusal)
        self._weight_syncs = 0
        self._cores = core_sharing
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
        """Version of the weights in the model now; the next step samples with them (or with newer ones)."""
        return self._applied_version

    def metrics(self) -> dict[str, float]:
        """Counters since start: steps run, requests served, tokens sampled, prompts prefilled and their tokens,
        weight syncs applied."""
        counters = {**self._batch.counters, "weight_syncs": self._weight_syncs}
        return {f"generation/{key}_total": float(value) for key, value in counters.items()}

    async def generate(
        self, prompt_ids: list[int], max_tokens: int | None = None, *, seed: int | None = None
    ) -> GenerationOutput:
        """Sample one completion of `prompt_ids`; waits without blocking the event loop.

        Args:
            prompt_ids: the prompt's token ids (non-empty, inside the vocabulary).
            max_tokens: cap on sampled tokens for this call; default the generator's `max_tokens`.
            seed: makes this request's samples reproducible, whatever else is in the batch.

        Raises:
            ValueError: an empty prompt, an id outside the vocabulary, or `max_tokens` < 1.
            RuntimeError: the generator is closed (also raised to callers waiting when it closes).
        """
        max_tokens = self.max_tokens if max_tokens is None else int(max_tokens)
        self._check_prompt(prompt_ids, max_tokens)
        if self._closed:
            raise RuntimeError("`EmbeddedGenerator.generate()` called after `close()`.")
        loop = asyncio.get_running_loop()
        ids = [int(i) for i in prompt_ids]
        request = _Request(ids, tuple(ids), max_tokens, seed, loop.create_future(), loop)
        # Requests made in this loop iteration are handed over together, so they join the same step.
        self._staged.append(request)
        if len(self._staged) == 1:
            loop.call_soon(self._hand_over)
        return await request.future

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker thread (at its next step); waiting and running callers get RuntimeError."""
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
        waiting: deque[_Request] = deque()
        while True:
            with self._cond:
                while not (self._queue or waiting or self._batch.rows or self._closed):
                    if self._cores is not None:
                        self._cores.generator_idle()
                    self._cond.wait()
                if self._closed:
                    break
                waiting.extend(self._queue)
                self._queue.clear()
            if any(request.future.done() for request in waiting):  # callers that gave up
                waiting = deque(request for request in waiting if not request.future.done())
            self._batch.discard(lambda request: request.future.done())
            if not (waiting or self._batch.rows):
                continue
            try:
                self._apply_weights()
                if self._cores is not None:
                    self._cores.generator_busy()
                finished = self._batch.step(waiting, self._applied_version)
            except BaseException as error:  # noqa: BLE001 -- handed to every caller in the batch
                for request in self._batch.abort():
                    _resolve(request, error=error)
                continue
            for request, output in finished:
                _resolve(request, output)
        with self._cond:
            left = [*self._batch.abort(), *waiting, *self._queue]
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
                self._batch.weights_changed()
                self._applied_version = version
                self._has_weights = True
                self._weight_syncs += 1
                log.debug("EmbeddedGenerator applied the weights of version %d", version)
                return
            if self._has_weights:
                return
            with self._cond:
                if self._closed:
                    raise RuntimeError("EmbeddedGenerator was closed before the trainer's first weight sync arrived.")
                self._cond.wait(WEIGHT_POLL_S)


class GeneratorSpec:
    """How to build an `EmbeddedGenerator` in the rollout child: its arguments, without the model's weights.

    Takes exactly `EmbeddedGenerator`'s arguments (the policy as a `PolicySpec` or a `load_policy` name, then its
    keyword options) and checks them here, against its signature and ranges (and that a config-only policy is a
    causal LM), so a bad value fails in the trainer before the child is spawned. It pickles in microseconds (plus
    the tokenizer, when stop strings need one); `build()` runs in the child.

    Raises:
        TypeError: an argument `EmbeddedGenerator` does not take.
        ValueError: an option out of range (all problems in one message), or a config-only policy that is not a
            decoder-only causal LM.

    Example::

        spec = GeneratorSpec(
            PolicySpec.from_model(policy),
            temperature=0.7,
            weight_receiver=transfer.receiver(),
        )
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
        decoder = options.get("decoder", "auto")
        if self.policy.config is not None:
            choose_decoder(self.policy.config, decoder)
        else:
            check_decoder_name(decoder)
        self.options = options

    def build(self, core_sharing: CoreSharing | None = None) -> EmbeddedGenerator:
        """Load the policy and start the generator's worker thread (`core_sharing`: see `EmbeddedGenerator`)."""
        options = self.options if core_sharing is None else {**self.options, "core_sharing": core_sharing}
        return EmbeddedGenerator(self.policy, **options)

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in self.options.items())
        return f"GeneratorSpec({self.policy!r}, {options})"


_CHECKED = (
    "quantization",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop",
    "max_tokens",
    "max_batch_size",
    "num_threads",
)


def _check_options(
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float | None,
    repetition_penalty: float,
    stop: Sequence[str] | None,
    max_tokens: int,
    max_batch_size: int,
    num_threads: int | None,
    quantization: str | None = None,
) -> None:
    problems = []
    if not temperature >= 0:
        problems.append(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        problems.append(f"top_p={top_p} must be in (0, 1]")
    if top_k < -1:
        problems.append(f"top_k={top_k} must be >= 0 (0 or -1 = no top-k)")
    if min_p is not None and not 0 <= min_p <= 1:
        problems.append(f"min_p={min_p} must be in [0, 1] (or None)")
    if not repetition_penalty > 0:
        problems.append(f"repetition_penalty={repetition_penalty} must be > 0 (1 = off)")
    try:
        check_stop(stop)
    except ValueError as error:
        problems.append(str(error))
    if max_tokens < 1:
        problems.append(f"max_tokens={max_tokens} must be >= 1")
    if max_batch_size < 1:
        problems.append(f"max_batch_size={max_batch_size} must be >= 1")
    if num_threads is not None and num_threads < 1:
        problems.append(f"num_threads={num_threads} must be >= 1")
    if quantization is not None and quantization not in QUANTIZATIONS:
        problems.append(f"quantization={quantization!r} must be one of {QUANTIZATIONS} or None (the model's weights)")
    if problems:
        raise ValueError(f"`EmbeddedGenerator(...)`: {'; '.join(problems)}.")


def _log_quantization(quantization: Quantization | None, refusal: str | None) -> None:
    """Say at start-up whether the asked-for quantization runs, and why not where it does not."""
    if quantization is None:
        return
    if refusal is None:
        log.info(
            "EmbeddedGenerator holds the decoder layers' weights as %s (weight-only, a scale per row).", quantization
        )
    else:
        log.warning("EmbeddedGenerator runs the model's own weights, not quantization=%r: %s.", quantization, refusal)


def _stop_strings(stop: Sequence[str] | None, tokenizer: Any, model: Any) -> StopStrings | None:
    """The stop-string finder, with the tokenizer given, named, or that of a named policy."""
    if not stop:
        return None
    if tokenizer is None and isinstance(model, PolicySpec) and model.name is not None:
        tokenizer = model.name
    if tokenizer is None:
        raise ValueError(
            "`EmbeddedGenerator(stop=...)` needs the policy's tokenizer to find stop strings: pass `tokenizer=`."
        )
    if isinstance(tokenizer, str):
        from ..models.loading import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    return StopStrings(stop, tokenizer)


def _as_ids(ids: int | Sequence[int] | None) -> list[int]:
    if ids is None:
        return []
    return [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def _default_eos(model: PreTrainedModel) -> list[int]:
    generation_config = getattr(model, "generation_config", None)
    ids = _as_ids(getattr(generation_config, "eos_token_id", None))
    return ids or _as_ids(getattr(model.config, "eos_token_id", None))


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
