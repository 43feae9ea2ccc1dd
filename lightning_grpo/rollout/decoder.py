"""One forward of a decoder-only causal LM over a continuous batch: running rows decode one token each while new
prompts are prefilled, all in the same pass, over a KV cache laid out in slots.

The embedded generator's engine (see `batching.py`). Every linear layer sees all tokens of the step at once, so the
weights are read from memory once per step whatever the mix of decoding rows and prompts; only attention is split:
each decoding row attends to its own slot of the cache (a row of fixed capacity, lengths masked), each prompt
attends causally to itself. A prompt's keys and values come back as a `Prefix`, which the caller writes into the
slot of every sample of that prompt (one prefill per distinct prompt, whatever the group size).

The modules are the Hugging Face model's own (embeddings, norms, projections, MLP, rotary embedding, LM head), so
weights copied into the model in place are used at the next step; the cache and the attention over it are ours, and
the linear layers run as `decode_linears` picks (same weights, the same products summed in another order): through
the small-batch kernel for a float32 step of up to `small_matmul.MAX_ROWS` tokens, and for a bf16 model on weights
laid out once, on AMX tiles where the CPU has them (`tile_matmul`), else through oneDNN; q, k and v are stacked into
one product and gate and up into another (fewer, wider products; each output the same sum), and a fused projection
(Phi-3's `qkv_proj`, `gate_up_proj`) is one product cut into its parts. Supported: the families of
`architectures.ARCHITECTURES` (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3, OLMo 2, OLMo 3, Granite,
SmolLM3, Cohere, Qwen3-MoE, Mixtral), whose differences (norm placement, rotary embedding per layer type or none, sliding-window layers, q/k
norms, parallel branches, softcapping, scalar multipliers) that table holds, resolved per layer when the decoder is
built; a mixture-of-experts block is the model's own module, called on the step's tokens. A sliding-window layer
masks the cache positions outside its window; the cache itself keeps every position. Softcapped attention scores
are computed without SDPA, which has no cap. A step without prompts runs all its layers in one C call where
`fused_decode` takes them (Llama-like layers on AMX tiles; `fused_refusal` says why not), with the same results.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..models.packed_matmul import packing_available
from . import decode_attention, fused_decode, layer_ops
from .architectures import ARCHITECTURES, LayerPlan, Scalars, architecture_of, layer_plans, scalars_of
from .decode_linears import PACK_MIN_NUMEL, Linear, Separate, Split, Stacked, int8_refusal, projections

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

#: `config.model_type`s the decoder runs (see `architectures.ARCHITECTURES`).
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)
# Cache slots and positions grow in these steps: each growth copies the whole cache once.
_SLOT_STEP = 8
_POSITION_STEP = 64
# Serial numbers of the prefixes a decoder computes (0 is a slot holding none): rows loaded from the same one share
# their slots' first positions, which the attention kernel reads once for all of them.
_PREFIX_SERIALS = itertools.count(1)


class _Scaled:
    """A module's output times a constant (Granite's embedding and residual multipliers)."""

    def __init__(self, module: Callable[[torch.Tensor], torch.Tensor], multiplier: float) -> None:
        self.module, self.multiplier = module, multiplier

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x) * self.multiplier


class _Layer:
    """One decoder layer's modules: its linear layers wrapped as `Linear` (pre-packed with `packed`, as int8 with
    `int8`; q, k and v,
    and gate and up, stacked where `Stacked` applies, split from one product where the family fuses them), its
    norms as its plan names them (a residual multiplier folded into the branch outputs), and the rest of its `plan`.
    `widths` are q's, k's and v's (to split a fused projection). An MLP without gate, up and down projections (a
    mixture of experts) is the model's module, called as is."""

    def __init__(
        self, layer: torch.nn.Module, plan: LayerPlan, widths: list[int], packed: bool = False, int8: bool = False
    ) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.attention = attention
        width, dtype = attention.o_proj.out_features, attention.o_proj.weight.dtype
        norms = [_fused_norm(getattr(layer, name), width, dtype) if name else _identity for name in plan.norms]
        if plan.residual_multiplier is not None:
            for index in (1, 3):
                norms[index] = _Scaled(norms[index], plan.residual_multiplier)
        self.pre_attention, self.post_attention, self.pre_mlp, self.post_mlp = norms
        self.qkv = projections(attention, ("q_proj", "k_proj", "v_proj"), "qkv_proj", widths, packed, int8)
        self.o = Linear(attention.o_proj, packed, int8)
        self.linears: list[Linear | Stacked | Separate | Split] = [self.qkv, self.o]
        if hasattr(mlp, "down_proj"):
            widths = [mlp.down_proj.in_features] * 2
            self.gate_up = projections(mlp, ("gate_proj", "up_proj"), "gate_up_proj", widths, packed, int8)
            self.down = Linear(mlp.down_proj, packed, int8)
            self.linears += [self.gate_up, self.down]
            self.act = getattr(mlp, "act_fn", None) or mlp.activation_fn
            self.mlp = self._gated_mlp
        else:
            self._block = mlp
            self.mlp = self._block_mlp
        has_qk_norm = hasattr(attention, "q_norm")
        self.projection_qk_norm = has_qk_norm and plan.qk_norm_over_projection
        self.head_qk_norm = has_qk_norm and not plan.qk_norm_over_projection
        self.window, self.rotary_type, self.rotates = plan.window, plan.rotary_type, plan.rotates
        self.softcap = plan.attention_softcap

    def fused_parts(self) -> fused_decode.LayerParts | str:
        """This layer's parts for `fused_decode`, or why its plan keeps it out (the parts' kernels are checked
        there)."""
        if not hasattr(self, "gate_up"):
            return "an MLP without gate, up and down projections"
        if self.post_attention is not _identity or self.post_mlp is not _identity:
            return "norms after the branches, or a residual multiplier"
        if self.projection_qk_norm or self.head_qk_norm or self.window is not None or self.softcap is not None:
            return "q/k norms, a sliding window or softcapped scores"
        if not self.rotates or self.rotary_type is not None:
            return "a layer without rotation, or rotations per layer type"
        return fused_decode.LayerParts(
            self.pre_attention, self.pre_mlp, self.qkv, self.o, self.gate_up, self.down, self.act
        )

    def _gated_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The model's MLP branch: `down(act(gate(x)) * up(x))` between the layer's norms."""
        gate, up = self.gate_up(self.pre_mlp(x))
        return self.post_mlp(self.down(self.act(gate) * up))

    def _block_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The model's MLP module on the step's tokens, as one sequence (its router picks experts per token)."""
        return self.post_mlp(self._block(self.pre_mlp(x)[None])[0])


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _fused_norm(norm: torch.nn.Module, width: int, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """The norm as one fused pass (`layer_ops.norm_for`) where that matches it, else the module."""
    return layer_ops.norm_for(norm, width, dtype) or norm


@dataclass(frozen=True, slots=True)
class Prefix:
    """A prompt's keys and values in every layer and the logits after its last token, computed once."""

    keys: tuple[torch.Tensor, ...]  # per layer (kv_heads, prompt_len, head_dim)
    values: tuple[torch.Tensor, ...]
    logits: torch.Tensor  # (vocab,) raw logits of the first completion token, in the model's dtype
    length: int
    serial: int = 0  # unique per prefix a decoder computed (0: none given)


def check_supported(model: PreTrainedModel | dict) -> None:
    """Raise a `ValueError` naming the model type when `SlotDecoder` cannot run `model` (a model or its config dict);
    see `architectures.architecture_of`."""
    architecture_of(model if isinstance(model, dict) else model.config)


class SlotDecoder:
    """Runs `model` one step at a time over decoding rows in cache slots `0..rows-1` and prompts to prefill.

    Slots hold one sequence each (prompt, then sampled tokens) up to a capacity that grows on demand; `lengths[s]` is
    how many positions of slot `s` are filled. The caller keeps its rows compact in slots `0..rows-1` (`move` fills a
    hole) and reserves room before a step (`reserve`).

    Args:
        model: a causal LM of a supported type (`check_supported`), in eval mode.
        packed: run linear layers on weights laid out once (`decode_linears.packed_product`) where
            `models.packed_matmul.packing_available(dtype)` (else as False: a CPU without bf16 kernels, such as an
            AVX2-only one, has no packed bf16 products): in fp32 a large LM head (the small-batch kernel takes
            the layers' few rows), in bf16 every linear layer (AMX tiles or oneDNN's packed bf16 products beat the
            plain ones at every row count), the projections that read the same input stacked; call `repack()` after
            the model's weights change.
        int8_weights: with `packed`, hold the decoder layers' linear weights as int8 with a float32 scale per output
            feature (`decode_linears.packed_product`), on AMX-INT8 tiles: half the bytes of each step's read. Where
            `decode_linears.int8_refusal` names a reason (a model not in bf16, a CPU without AMX-INT8) the layers
            stay as they are, and `int8_refusal` says why. The embeddings and the LM head stay in the model's dtype.
    """

    def __init__(self, model: PreTrainedModel, packed: bool = False, int8_weights: bool = False) -> None:
        config = model.config
        packed = packed and packing_available(model.dtype)
        scalars = scalars_of(config)
        base = model.model
        self._norm, self._rotary = base.norm, base.rotary_emb
        self._embed = base.embed_tokens
        if scalars.embedding_multiplier is not None:
            self._embed = _Scaled(base.embed_tokens, scalars.embedding_multiplier)
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = base.layers[0].self_attn.head_dim
        widths = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        layers = list(base.layers)[: config.num_hidden_layers]
        # bf16 has no small-batch kernel, and packed bf16 products are faster than plain ones
        pack_layers = packed and model.dtype == torch.bfloat16
        #: why the layers' weights are not int8 although asked (None: they are, or were not asked)
        self.int8_refusal = None
        if int8_weights:
            self.int8_refusal = int8_refusal(model.dtype) if packed else "int8 weights run as packed products"
        int8 = int8_weights and self.int8_refusal is None
        self._layers = [
            _Layer(layer, plan, widths, pack_layers, int8)
            for layer, plan in zip(layers, layer_plans(config), strict=True)
        ]
        parallel = architecture_of(config).parallel_branches
        self._run_layer = self._parallel_layer if parallel else self._sequential_layer
        head = model.lm_head
        self._head = Linear(head, packed and (pack_layers or head.weight.numel() >= PACK_MIN_NUMEL))
        self._logit_steps = _logit_steps(scalars)
        self._vocab_size = head.weight.shape[0]
        attention = self._layers[0].attention
        self._rope = sys.modules[type(attention).__module__].apply_rotary_pos_emb  # the model's own rotation
        self._rotate = self._fused_rotation(config.hidden_size) or self._model_rotation
        self._scale = attention.scaling
        self._dtype = base.embed_tokens.weight.dtype
        # the rows' attention in one C call over a position-major cache, where it runs (else torch's operations)
        self._attention_kernel = decode_attention.available() and self._dtype in decode_attention.DTYPES
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long)
        # per slot: the serial of the prefix it was loaded with, and that prefix's length (see `Prefix.serial`)
        self._prefix_serials = torch.zeros(0, dtype=torch.long)
        self._prefix_lengths = torch.zeros(0, dtype=torch.long)
        self._groups: decode_attention.RowGroups | None = None
        #: the steps without prompts in one C call (`fused_decode`), or None; `fused_refusal` says why not
        self.fused: fused_decode.FusedLayers | None = None
        self.fused_refusal = self._fuse(parallel)
        if self.fused_refusal is not None:
            log.info("The embedded generator runs a decode step's layers one call at a time: %s.", self.fused_refusal)

    def _fuse(self, parallel: bool) -> str | None:
        """Set `fused` where every layer can run in `fused_decode`; else return why not."""
        found = [layer.fused_parts() for layer in self._layers]
        parts = [part for part in found if isinstance(part, fused_decode.LayerParts)]
        reasons = [part for part in found if isinstance(part, str)]
        if parallel or reasons or self._rotate is not layer_ops.rotate or not self._attention_kernel:
            return reasons[0] if reasons else "parallel branches, or the model's own rotation or attention"
        reason = fused_decode.refusal(parts, self._dtype)
        if reason is None:
            self.fused = fused_decode.FusedLayers(parts, self.heads, self.kv_heads, self.head_dim, self._scale)
        return reason

    def repack(self) -> None:
        """Re-pack the packed weights after they were changed in place (a weight sync)."""
        self._head.pack()
        for layer in self._layers:
            for linear in layer.linears:
                linear.pack()
        if self.fused is not None:
            self.fused.invalidate()

    @property
    def slots(self) -> int:
        return self.lengths.numel()

    @property
    def capacity(self) -> int:
        return self._values[0].shape[2] if self._values else 0

    @torch.inference_mode()
    def reserve(self, slots: int, capacity: int) -> None:
        """Make room for `slots` sequences of up to `capacity` positions (keeps what the slots hold)."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        slots = max(self.slots, -(-slots // _SLOT_STEP) * _SLOT_STEP)
        capacity = max(self.capacity, -(-capacity // _POSITION_STEP) * _POSITION_STEP)
        old_slots, old_capacity = self.slots, self.capacity
        for cache, positions_last in ((self._keys, True), (self._values, False)):
            for layer in range(len(self._layers)):
                grown = self._empty_cache(slots, capacity, positions_last)
                if cache and old_slots:
                    grown[:old_slots, :, :old_capacity] = cache[layer]
                if len(cache) > layer:
                    cache[layer] = grown
                else:
                    cache.append(grown)
        if self.fused is not None:
            self.fused.invalidate()
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(slots - old_slots)])
        self._prefix_serials = torch.cat([self._prefix_serials, self.lengths.new_zeros(slots - old_slots)])
        self._prefix_lengths = torch.cat([self._prefix_lengths, self.lengths.new_zeros(slots - old_slots)])

    def _empty_cache(self, slots: int, capacity: int, positions_last: bool) -> torch.Tensor:
        """A layer's zeroed key or value cache, (slots, kv_heads, capacity, head_dim); keys are that shape's
        transposed view of a (slots, kv_heads, head_dim, capacity) tensor, so that a row's first `width` keys, as
        the scores' product reads them (transposed), are a matrix in place: torch copies a slice along the middle
        axis before a bf16 product, and the copy cost more than the product (the result is the same). The attention
        kernel reads both in their own layout, each position's vector contiguous."""
        if positions_last and not self._attention_kernel:
            return torch.zeros(slots, self.kv_heads, self.head_dim, capacity, dtype=self._dtype).transpose(2, 3)
        return torch.zeros(slots, self.kv_heads, capacity, self.head_dim, dtype=self._dtype)

    @torch.inference_mode()
    def load(self, prefix: Prefix, slots: list[int]) -> None:
        """Fill `slots` with `prefix` (their sequences restart as that prompt)."""
        index = torch.tensor(slots, dtype=torch.long)
        for layer in range(len(self._layers)):
            self._keys[layer][index, :, : prefix.length] = prefix.keys[layer]
            self._values[layer][index, :, : prefix.length] = prefix.values[layer]
        self.lengths[index] = prefix.length
        self._prefix_serials[index], self._prefix_lengths[index] = prefix.serial, prefix.length

    @torch.inference_mode()
    def move(self, source: int, target: int) -> None:
        """Copy slot `source`'s sequence into slot `target` (to keep the rows compact)."""
        length = int(self.lengths[source])
        for cache in (self._keys, self._values):
            for layer_cache in cache:
                layer_cache[target, :, :length] = layer_cache[source, :, :length]
        self.lengths[target] = length
        self._prefix_serials[target] = self._prefix_serials[source]
        self._prefix_lengths[target] = self._prefix_lengths[source]

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, prompts: list[list[int]]) -> tuple[torch.Tensor, list[Prefix]]:
        """One forward: slot `i < len(tokens)` consumes `tokens[i]`; each prompt is prefilled.

        Args:
            tokens: (rows,) the last sampled token of the rows in slots `0..rows-1`, whose keys and values are
                appended to their slots.
            prompts: token ids of prompts to prefill (not written to any slot; see `load`).

        Returns:
            the logits after each row's token (rows, vocab) in the model's dtype, and each prompt's `Prefix`.
        """
        rows = tokens.numel()
        if not rows and not prompts:  # every row just finished and the joining ones start from cached prompts
            return torch.empty(0, self._vocab_size), []
        lengths = self.lengths[:rows]
        prompt_ids = [torch.tensor(p, dtype=torch.long) for p in prompts]
        ids = torch.cat([tokens.long(), *prompt_ids])
        positions = torch.cat([lengths, *(torch.arange(len(p)) for p in prompts)])
        spans, start = [], rows
        for prompt in prompts:
            spans.append((start, start + len(prompt)))
            start += len(prompt)
        hidden = self._embed(ids)  # (tokens, hidden)
        rotations = self._rotations(hidden, positions)
        windows = {layer.window for layer in self._layers}
        masks = {window: None if self._attention_kernel else self._row_mask(lengths, window) for window in windows}
        if self._attention_kernel:  # once a step: which rows share their slots' prompt
            shared = decode_attention.row_groups(self._prefix_serials[:rows], self._prefix_lengths[:rows], lengths)
            self._groups = decode_attention.spread(shared, self.kv_heads)
        prompt_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
        if self.fused is not None and self._groups is not None and not prompts:  # groups: set above, as fused needs
            cos, sin = rotations[None]
            hidden = self.fused.run(hidden, cos, sin, lengths, self._groups, self._keys, self._values)
        else:
            for index, layer in enumerate(self._layers):
                cos, sin = rotations[layer.rotary_type]
                hidden = self._run_layer(index, layer, hidden, cos, sin, masks[layer.window], spans, prompt_kv)
        last = torch.tensor([*range(rows), *(end - 1 for _, end in spans)], dtype=torch.long)
        logits = self._head(self._norm(hidden[last]))
        for logit_step in self._logit_steps:
            logits = logit_step(logits)
        self.lengths[:rows] += 1
        prefixes = [
            Prefix(
                keys=tuple(k for k, _ in layers),
                values=tuple(v for _, v in layers),
                logits=logits[rows + i].clone(),  # the rows before it are sampled from in place
                length=len(prompts[i]),
                serial=next(_PREFIX_SERIALS),
            )
            for i, layers in enumerate(prompt_kv)
        ]
        return logits[:rows], prefixes

    def _rotations(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple]:
        """(cos, sin), each (tokens, head_dim), per rotary layer type the layers use (None: the model's only one)."""
        rotations = {}
        for rotary_type in {layer.rotary_type for layer in self._layers}:
            extra = () if rotary_type is None else (rotary_type,)
            cos, sin = self._rotary(hidden, positions[None], *extra)
            rotations[rotary_type] = cos[0], sin[0]
        return rotations

    def _fused_rotation(self, hidden_size: int) -> layer_ops.Rotation | None:
        """`layer_ops.rotate` where it matches the model's rotation on a probe at a few positions."""
        rotating = [layer for layer in self._layers if layer.rotates]
        if not rotating:
            return None
        probe = torch.zeros(1, 3, hidden_size, dtype=self._layers[0].attention.o_proj.weight.dtype)
        extra = () if rotating[0].rotary_type is None else (rotating[0].rotary_type,)
        with torch.inference_mode():
            cos, sin = self._rotary(probe, torch.arange(3)[None] + 17, *extra)
        return layer_ops.rotation_for(self._rope, cos[0], sin[0], self.heads, self.kv_heads, self.head_dim)

    def _model_rotation(self, q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rope(q, k, cos, sin, unsqueeze_dim=1)

    def _row_mask(self, lengths: torch.Tensor, window: int | None) -> torch.Tensor | None:
        """(rows, 1, 1, width) additive mask over the slot positions each row attends to: its length + 1, or the
        last `window` of them (a sliding-window layer: key `j` is seen from position `p` when `p - j < window`)."""
        if lengths.numel() == 0:
            return None
        width = int(lengths.max()) + 1
        keys = torch.arange(width)[None, :]
        hidden = keys > lengths[:, None]
        if window is not None:
            hidden |= keys <= lengths[:, None] - window
        return torch.zeros(hidden.shape, dtype=self._dtype).masked_fill_(hidden, float("-inf"))[:, None, None]

    def _sequential_layer(
        self, index: int, layer: _Layer, hidden: torch.Tensor, *attention_inputs: Any
    ) -> torch.Tensor:
        """A layer whose MLP reads the attention branch's residual sum (every family but Cohere)."""
        hidden = hidden + self._attention(index, layer, layer.pre_attention(hidden), *attention_inputs)
        return hidden + layer.mlp(hidden)

    def _parallel_layer(self, index: int, layer: _Layer, hidden: torch.Tensor, *attention_inputs: Any) -> torch.Tensor:
        """A layer whose attention and MLP both read its one pre-norm's output (Cohere)."""
        x = layer.pre_attention(hidden)
        return hidden + self._attention(index, layer, x, *attention_inputs) + layer.mlp(x)

    def _attention(self, index, layer, x, cos, sin, mask, spans, prompt_kv) -> torch.Tensor:
        """The attention branch on the normed hidden states `x`, the keys and values of its rows appended to their
        slots and those of each prompt to `prompt_kv`."""
        attention = layer.attention
        count = x.shape[0]
        q, k, v = layer.qkv(x)
        if layer.projection_qk_norm:
            q, k = attention.q_norm(q), attention.k_norm(k)
        q = q.view(count, self.heads, self.head_dim)
        k = k.view(count, self.kv_heads, self.head_dim)
        v = v.view(count, self.kv_heads, self.head_dim)
        if layer.head_qk_norm:
            q, k = attention.q_norm(q), attention.k_norm(k)
        if layer.rotates:
            q, k = self._rotate(q, k, cos, sin)
        out = torch.empty_like(q)
        rows = spans[0][0] if spans else count  # the prompts' tokens follow the rows'
        if rows:
            out[:rows] = self._decode_attention(index, q[:rows], k[:rows], v[:rows], mask, layer)
        for i, (start, end) in enumerate(spans):
            keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)  # (kv_heads, len, head_dim)
            prompt_kv[i].append((keys.contiguous(), values.contiguous()))
            out[start:end] = self._prompt_attention(q[start:end].transpose(0, 1), keys, values, layer).transpose(0, 1)
        return layer.post_attention(layer.o(out.view(count, -1)))

    def _prompt_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: _Layer
    ) -> torch.Tensor:
        """A prompt's causal attention to itself: (heads, len, head_dim) from its queries, keys and values (SDPA;
        written out where the scores are softcapped, which SDPA does not do)."""
        length = q.shape[1]
        if layer.softcap is None:
            attended = F.scaled_dot_product_attention(
                q[None],
                keys[None],
                values[None],
                **_prompt_mask(length, layer.window),
                scale=self._scale,
                enable_gqa=self.heads != self.kv_heads,
            )
            return attended[0]
        group = self.heads // self.kv_heads
        grouped = q.reshape(self.kv_heads, group, length, self.head_dim)
        scores = torch.matmul(grouped, keys.transpose(1, 2)[:, None]).mul_(self._scale)
        scores = scores.div_(layer.softcap).tanh_().mul_(layer.softcap)
        scores = scores.masked_fill_(~_visible(length, layer.window), float("-inf"))
        return torch.matmul(scores.softmax(dim=-1), values[:, None]).view(self.heads, length, self.head_dim)

    def _decode_attention(self, index, q, k, v, mask, layer: _Layer) -> torch.Tensor:
        """Each row's query against its slot: (rows, heads, head_dim) after appending its key and value; the scores
        capped at the layer's softcap (`cap * tanh(scores / cap)`) when set, its window masked by `mask`."""
        if self._attention_kernel:
            keys, values, lengths = self._keys[index], self._values[index], self.lengths[: q.shape[0]]
            return decode_attention.attend(
                q, k, v, keys, values, lengths, scale=self._scale, window=layer.window, softcap=layer.softcap,
                groups=self._groups,
            )  # fmt: skip
        softcap = layer.softcap
        rows, width = q.shape[0], mask.shape[-1]
        slot, position = torch.arange(rows), self.lengths[:rows]
        keys, values = self._keys[index], self._values[index]
        keys[slot, :, position] = k
        values[slot, :, position] = v
        # one product per (row, kv head) of the queries sharing that head: (rows * kv_heads, heads per kv head, dim)
        # against the slot's first `width` positions, read from the cache in place (see `_empty_cache`)
        batches, group = rows * self.kv_heads, self.heads // self.kv_heads
        grouped = q.reshape(batches, group, self.head_dim)
        keys = keys[:rows, :, :width].view(batches, width, self.head_dim)
        values = values[:rows, :, :width].view(batches, width, self.head_dim)
        scores = torch.bmm(grouped, keys.transpose(1, 2)).view(rows, self.kv_heads, group, width).mul_(self._scale)
        if softcap is not None:
            scores = scores.div_(softcap).tanh_().mul_(softcap)
        weights = scores.add_(mask).softmax(dim=-1).view(batches, group, width)
        return torch.bmm(weights, values).view(rows, self.heads, self.head_dim)


def _prompt_mask(length: int, window: int | None) -> dict:
    """SDPA's mask arguments for a prompt's causal attention to itself, within `window` positions when set."""
    if window is None or length <= window:
        return {"is_causal": True}
    return {"attn_mask": _visible(length, window)}


def _visible(length: int, window: int | None) -> torch.Tensor:
    """(length, length): whether query `i` of a prompt sees key `j` (causal, within `window` positions when set)."""
    gap = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    return (gap >= 0) & (gap < window) if window is not None else gap >= 0


def _logit_steps(scalars: Scalars) -> tuple[Callable[[torch.Tensor], torch.Tensor], ...]:
    """The operations a family applies to the LM head's output, in its order (in the model's dtype)."""
    steps = []
    if scalars.logits_divisor is not None:
        steps.append(lambda logits: logits / scalars.logits_divisor)
    if scalars.logits_multiplier is not None:
        steps.append(lambda logits: logits * scalars.logits_multiplier)
    if scalars.logits_softcap is not None:
        cap = scalars.logits_softcap
        steps.append(lambda logits: torch.tanh(logits / cap) * cap)
    return tuple(steps)
