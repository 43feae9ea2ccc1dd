"""The embedded generator's decoder for every decoder-only causal LM: the model's own forward over its own cache.

`GenericDecoder` keeps the contract `ContinuousBatch` drives on `SlotDecoder` (`reserve`, `load`, `move`, `step`,
`repack`), but each step is a call of the Hugging Face model itself, `model(input_ids, attention_mask, position_ids,
cache=..., use_cache=True)`, over the cache the model builds (a `DynamicCache` of attention, sliding-window,
linear-attention, convolution or state-space layers). So it runs what transformers runs: fused projections, MoE
blocks, ALiBi or learned positions, logit scaling, Mamba and Gated DeltaNet layers, with no table of families.

The rows are aligned on the right, as in `generate` with left padding: every row of the running cache has the same
length, a row with a shorter history is padded on the left (attention mask 0 there, its own positions passed
explicitly). A prompt is prefilled alone (batch 1), so no padding ever enters a recurrent layer, and its cache is
the `GenericPrefix` the caller loads into the slot of each of its samples. Loading pads a prefix's keys and values to
the running length (or the running rows to the prefix's) and stacks recurrent states along the batch; rows that
left are dropped, and the pad columns every remaining row has are cut. A decode step is one forward over all running
rows, so the weights are read once per step whatever the number of rows.

Weights copied into the model in place are used at the next step (nothing is packed); a cached prefix expires with
its weights' version (`ContinuousBatch`).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True, slots=True)
class GenericPrefix:
    """A prompt's cache after its prefill (batch 1; never run a forward over: it is copied into the batch) and the
    logits after its last token."""

    cache: Any  # the model's own cache object
    logits: torch.Tensor  # (vocab,) raw logits of the first completion token
    length: int


class GenericDecoder:
    """Runs `model`'s own forward one step at a time over decoding rows in slots `0..rows-1` and prompts to prefill.

    Slots are bookkeeping: `load` and `move` only record which cache row (or which prefix) each slot holds; the
    running cache is rebuilt to match at the next `step`, in one pass per layer.

    Args:
        model: a decoder-only causal LM whose forward takes `cache=` and returns its cache (transformers 5), in eval
            mode.

    Raises:
        ValueError: when the model's cache holds a layer kind this decoder cannot pad and stack (named).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        parameters = inspect.signature(model.forward).parameters
        # only the last position's logits; no MoE router logits (their auxiliary loss is for training)
        self._options = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
        if "output_router_logits" in parameters:
            self._options["output_router_logits"] = False
        self._vocab_size = model.get_output_embeddings().weight.shape[0]
        self._cache: Any = None  # the running rows' cache, every row `self._length` positions long
        self._mask = torch.zeros(0, 0, dtype=torch.long)  # (rows, length): 1 where a row has a token
        self._slots: list[int | GenericPrefix] = []  # per slot: its row in `self._cache`, or a prefix to load
        check_cache_layers(_empty_cache(model))

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def capacity(self) -> int:
        """Positions every running row spans (its own tokens plus its left padding)."""
        return self._mask.shape[1]

    def reserve(self, slots: int, capacity: int) -> None:
        """Nothing to reserve: the model's cache grows as it runs."""

    def repack(self) -> None:
        """Nothing is packed: the model's modules read their weights at each forward."""

    def load(self, prefix: GenericPrefix, slots: list[int]) -> None:
        """Fill `slots` with `prefix` (their sequences restart as that prompt) from the next step on."""
        for slot in slots:
            if slot >= len(self._slots):
                self._slots += [0] * (slot + 1 - len(self._slots))
            self._slots[slot] = prefix

    def move(self, source: int, target: int) -> None:
        """Slot `target` takes slot `source`'s sequence (to keep the rows compact)."""
        self._slots[target] = self._slots[source]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, prompts: list[list[int]]) -> tuple[torch.Tensor, list[GenericPrefix]]:
        """One forward over the rows in slots `0..len(tokens)-1`, each consuming its token, then one prefill per prompt.

        Returns:
            the logits after each row's token (rows, vocab), float32, and each prompt's `GenericPrefix`.
        """
        try:
            logits = self._decode(tokens.long())
        except BaseException:
            self._cache, self._mask, self._slots = None, self._mask[:0, :0], []  # the caller aborts every row
            raise
        return logits, [self._prefill(prompt) for prompt in prompts]

    def _decode(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = tokens.numel()
        self._arrange(self._slots[:rows])
        self._slots = list(range(rows))
        if not rows:
            return torch.empty(0, self._vocab_size)
        positions = self._mask.sum(dim=1, keepdim=True)  # each row's own position: its tokens so far
        self._mask = torch.cat([self._mask, self._mask.new_ones(rows, 1)], dim=1)
        output = self._model(
            input_ids=tokens[:, None],
            attention_mask=self._mask,
            position_ids=positions,
            cache=self._cache,
            use_cache=True,
            **self._options,
        )
        self._cache = output.cache
        return output.logits[:, -1].float()

    def _prefill(self, prompt: list[int]) -> GenericPrefix:
        ids = torch.tensor([prompt], dtype=torch.long)
        output = self._model(input_ids=ids, use_cache=True, **self._options)
        check_cache_layers(output.cache)
        return GenericPrefix(output.cache, output.logits[0, -1].float(), len(prompt))

    def _arrange(self, slots: list[int | GenericPrefix]) -> None:
        """Make the running cache hold `slots` in order: drop rows that left, append the prefixes loaded since the
        last step, pad every row on the left to one length and cut the columns that are padding in every row."""
        if not slots:
            self._cache, self._mask = None, self._mask[:0, :0]
            return
        if all(isinstance(s, int) for s in slots) and slots == list(range(self._mask.shape[0])):
            return  # the rows of the last step, unchanged
        masks = [self._mask[s] if isinstance(s, int) else torch.ones(s.length, dtype=torch.long) for s in slots]
        length = max(int(mask.sum()) for mask in masks)  # the longest row's tokens: no column is padding in every row
        self._mask = torch.stack([_left_fit(mask, length, dim=0) for mask in masks])
        sources = [(self._cache, s) if isinstance(s, int) else (s.cache, 0) for s in slots]
        self._cache = _stack_caches(sources[0][0], sources, length)


def check_cache_layers(cache: Any) -> None:
    """Raise a `ValueError` naming a cache layer kind `GenericDecoder` cannot pad and stack."""
    from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin

    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(
            f"The embedded generator cannot batch a `{type(cache).__name__}` cache (it needs a transformers "
            "`DynamicCache`). Generate on a vLLM server instead: `GRPODataModule(generator='vllm', ...)`."
        )
    for layer in layers:
        if not isinstance(layer, (DynamicLayer, LinearAttentionCacheLayerMixin, DummyLayer)) or _extra_state(layer):
            raise ValueError(
                f"The embedded generator cannot batch a cache layer of type `{type(layer).__name__}`. Generate on a "
                "vLLM server instead: `GRPODataModule(generator='vllm', ...)`."
            )


def _extra_state(layer: Any) -> bool:
    """Whether a layer holds per-row state other than keys, values and linear-attention states (an indexer cache)."""
    return hasattr(layer, "indexer_keys")


def _empty_cache(model: PreTrainedModel) -> Any:
    """The cache the model's forward builds for itself (its layer kinds, still empty)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _stack_caches(template: Any, sources: list[tuple[Any, int]], length: int) -> Any:
    """A new cache shaped like `template` whose row `i` is row `sources[i][1]` of cache `sources[i][0]`, every row
    `length` positions long (padded or cut on the left). Never writes into a source (a prefix serves many rows)."""
    stacked = copy.copy(template)
    stacked.layers = [
        _stack_layer(layer, [(cache.layers[index], row) for cache, row in sources], length)
        for index, layer in enumerate(template.layers)
    ]
    return stacked


def _stack_layer(template: Any, sources: list[tuple[Any, int]], length: int) -> Any:
    """One layer of `_stack_caches`: keys and values fitted to the layer's stored width, recurrent states stacked."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

    layer = copy.copy(template)
    if isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None:
        width = length
        if isinstance(layer, DynamicSlidingWindowLayer):  # keeps only the last `sliding_window - 1` positions
            width = min(length, layer.sliding_window - 1)
            layer.cumulative_length = length
        layer.keys = torch.cat([_left_fit(source.keys[row : row + 1], width, dim=-2) for source, row in sources])
        layer.values = torch.cat([_left_fit(source.values[row : row + 1], width, dim=-2) for source, row in sources])
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for name in ("conv_states", "recurrent_states"):
            states = dict(getattr(layer, name))  # a new dict: the template's may be a prefix's
            for key, state in states.items():
                if state is not None:
                    states[key] = torch.cat([getattr(source, name)[key][row : row + 1] for source, row in sources])
            setattr(layer, name, states)
        layer.has_previous_state = dict(layer.has_previous_state)
        layer.cumulative_length_linear = torch.tensor(length)  # updated in place by the forward
    return layer


def _left_fit(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` padded with zeros on the left of `dim`, or cut there, to `width` entries."""
    size = tensor.shape[dim]
    if size >= width:
        return tensor.narrow(dim, size - width, width)
    shape = list(tensor.shape)
    shape[dim] = width - size
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
