"""Built-in trainer scorers: a reward model's score, and EBFT's feature-matching reward.

Both pack each row's sequences as a prefix trie (`packing.collate_sequences`) and run their network with tree
attention, so a prompt shared by a group is forwarded once; `token_budget` bounds one forward's packed size by
splitting a row into chunks. Their networks are frozen and moved to the LightningModule's device on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from ..rollout.records import SCORE_PAYLOAD, RolloutSample
from ..training.attention import tree_model_kwargs, use_tree_attention
from .packing import collate_sequences, unpack_sequences
from .trainer_scorer import TrainerScorer, extra_uid

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..pipeline.planner import ScoredRow

Pooling = Literal["mean", "last"]
_PER_SEQUENCE = ("uids", "starts")


class RewardModelScorer(TrainerScorer):
    """A sequence-classification model's score of each whole sample (prompt + completion) as a reward column.

    The model is an `AutoModelForSequenceClassification`-style transformers model with one label (its `score` head
    reads the last token's hidden state). Without `tokenizer` it scores the policy's token ids as they are, which
    needs a model that shares the policy's vocabulary; with one, each sample's prompt and completion are
    re-tokenized (chat messages through the tokenizer's chat template).

    Args:
        model: the reward model; frozen here (eval mode, no gradients) and switched to tree attention.
        tokenizer: the reward model's tokenizer, when it differs from the policy's.
        name: the reward column's name.
        token_budget: packed tokens per scoring forward; `<= 0` scores a row in one forward.
        share_prefixes: tree-pack common prefixes (a group's prompt is forwarded once).

    Example::

        rm = AutoModelForSequenceClassification.from_pretrained("my-rm", num_labels=1)
        scorer = RewardModelScorer(rm, name="rm")
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        name: str = "reward_model",
        token_budget: int = 0,
        share_prefixes: bool = True,
    ) -> None:
        head = getattr(model, "score", None)
        if not isinstance(head, torch.nn.Module) or not hasattr(model, "base_model"):
            raise TypeError(
                f"`RewardModelScorer(model={type(model).__name__})` needs a transformers sequence-classification model "
                "(a `base_model` and a `score` head), e.g. AutoModelForSequenceClassification(..., num_labels=1)."
            )
        self.model = use_tree_attention(model.eval().requires_grad_(False))
        self.tokenizer = tokenizer
        self.name = name
        self.token_budget = token_budget
        self.share_prefixes = share_prefixes

    def collate(self, rows: list[ScoredRow], index: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, int]]:
        sequences = [[(d["uid"], self._token_ids(d), 0) for d in row.samples] for row in rows]
        return collate_sequences(sequences, token_budget=self.token_budget, share_prefixes=self.share_prefixes)

    def features(self, module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = _on_device(unpack_sequences(inputs, _PER_SEQUENCE), _module_device(module))
        self.model.to(inputs["input_ids"].device)
        hidden = self.model.base_model(**tree_model_kwargs(inputs), use_cache=False).last_hidden_state[0]
        last = inputs["positions"][inputs["offsets"][1:] - 1]
        return inputs["uids"], self.model.score(hidden[last])[:, 0].float()

    def group_rewards(
        self, sample_features: torch.Tensor, extra_features: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return sample_features.reshape(len(sample_features), -1)[:, 0], {}

    def _token_ids(self, d: dict[str, Any]) -> Sequence[int]:
        sample: RolloutSample | None = d.get("sample")
        if self.tokenizer is None or sample is None:
            return d["input_ids"]
        if isinstance(sample.prompt, str) and isinstance(sample.completion, str):
            return self.tokenizer(sample.prompt + sample.completion)["input_ids"]
        messages = _as_messages(sample.prompt, "user") + _as_messages(sample.completion, "assistant")
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True)
        return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids


@dataclass(slots=True, frozen=True)
class ReferenceSequence:
    """A group's reference answer as `FeatureMatchingScorer` scores it: prompt + answer ids, answer from `start`."""

    input_ids: np.ndarray
    start: int


class FeatureMatchingScorer(TrainerScorer):
    """EBFT's feature-matching reward (Jelassi et al., arXiv 2603.12248) against a reference answer.

    A frozen feature network embeds each sample and the group's reference: hidden states at fractional depths
    `layers`, pooled over the completion (`"mean"`) or taken at the last token (`"last"`), each L2-normalised,
    concatenated and normalised again (`phi`, unit norm). Sample j of a group of G gets

        r_j = 2 * alignment_coef * cos(phi(y_j), phi(y_ref))
              - 2 * diversity_coef * mean_{j' != j} phi(y_j) . phi(y_j')

    (with several references, the alignment is averaged over them; a group without one is not scored). Metrics per
    group: `alignment`, `diversity` and `cfm` (`||mean_j phi(y_j) - phi(y_ref)||^2`, the feature-matching loss).

    The reference reaches the trainer in each sample's payload, `sample.extras[SCORE_PAYLOAD]["payload"]`, as
    `FeatureMatchingScorer.payload(prompt_ids, reference_ids)` builds it in the rollout loop's
    `_trainer_score_payload` hook: `{"prompt_length": P, "reference_ids": [...]}`. The reference sequence is the
    sample's first `P` tokens (its prompt) followed by `reference_ids`; every sequence is pooled from position `P`.

    Args:
        feature_model: the feature network, e.g. `copy.deepcopy(policy)` of the initial policy; frozen here and
            switched to tree attention.
        layers: fractional depths in (0, 1] of the hidden states used; 1.0 is the last layer.
        pooling: `"mean"` over the completion tokens, or `"last"` token.
        alignment_coef: weight of the alignment with the reference.
        diversity_coef: weight of the penalty on similarity to the group's other samples.
        name: the reward column's name.
        token_budget: packed tokens per scoring forward; `<= 0` scores a row in one forward.
        share_prefixes: tree-pack common prefixes.

    Example::

        from lightning_grpo import FeatureMatchingScorer, GRPOModule
        from lightning_grpo.models import load_policy

        feature_model = load_policy("tiny-random")  # e.g. a copy of the initial policy
        scorer = FeatureMatchingScorer(feature_model, layers=(0.5, 1.0), diversity_coef=0.5)
        module = GRPOModule("tiny-random", scorers=[scorer])
    """

    def __init__(
        self,
        feature_model: PreTrainedModel,
        *,
        layers: Sequence[float] = (0.25, 0.5, 0.75),
        pooling: Pooling = "mean",
        alignment_coef: float = 1.0,
        diversity_coef: float = 1.0,
        name: str = "feature_matching",
        token_budget: int = 0,
        share_prefixes: bool = True,
    ) -> None:
        problems = [f"layers={list(layers)}"] if not layers or not all(0 < f <= 1 for f in layers) else []
        if pooling not in ("mean", "last"):
            problems.append(f"pooling={pooling!r}")
        if problems:
            raise ValueError(
                f"`FeatureMatchingScorer({', '.join(problems)})`: layers must be fractions of the depth in (0, 1] "
                "(e.g. (0.25, 0.5, 0.75)) and pooling 'mean' or 'last'."
            )
        self.model = use_tree_attention(feature_model.eval().requires_grad_(False))
        num_layers = self.model.config.num_hidden_layers
        # hidden_states[0] is the embeddings, [i] the output of layer i
        self.layer_indices = [min(max(round(f * num_layers), 1), num_layers) for f in layers]
        self.pooling = pooling
        self.alignment_coef = alignment_coef
        self.diversity_coef = diversity_coef
        self.name = name
        self.token_budget = token_budget
        self.share_prefixes = share_prefixes

    @staticmethod
    def payload(prompt_ids: Sequence[int], reference_ids: Sequence[int]) -> dict[str, Any]:
        """The trainer-score payload one group's samples carry: the prompt length and the reference answer's ids."""
        return {"prompt_length": len(prompt_ids), "reference_ids": [int(t) for t in reference_ids]}

    def group_extras(self, samples: list[RolloutSample]) -> list[ReferenceSequence]:
        payload = _payload(samples[0]) if samples else {}
        if "reference_ids" not in payload:
            raise ValueError(
                f"FeatureMatchingScorer(name={self.name!r}) found no reference answer for group "
                f"{samples[0].group_id if samples else '?'}: each sample needs "
                "`extras[SCORE_PAYLOAD]['payload'] = FeatureMatchingScorer.payload(prompt_ids, reference_ids)`; set "
                "it in the rollout loop's `_trainer_score_payload` from the dataset's reference column."
            )
        start = _pool_start(samples[0])
        ids = np.concatenate([samples[0].input_ids[:start], np.asarray(payload["reference_ids"], dtype=np.int64)])
        return [ReferenceSequence(ids, start)]

    def collate(self, rows: list[ScoredRow], index: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, int]]:
        sequences = []
        for row in rows:
            seqs = [(d["uid"], d["input_ids"], _pool_start(d.get("sample"), d)) for d in row.samples]
            for extra in row.extras:
                if extra.scorer == index:
                    ref: ReferenceSequence = extra.value
                    seqs.append((extra_uid(extra.group_id, extra.index), ref.input_ids, ref.start))
            sequences.append(seqs)
        return collate_sequences(sequences, token_budget=self.token_budget, share_prefixes=self.share_prefixes)

    def features(self, module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = _on_device(unpack_sequences(inputs, _PER_SEQUENCE), _module_device(module))
        self.model.to(inputs["input_ids"].device)
        out = self.model.base_model(**tree_model_kwargs(inputs), output_hidden_states=True, use_cache=False)
        pooled = [
            F.normalize(pool_sequences(out.hidden_states[i][0].float(), inputs, self.pooling), dim=-1)
            for i in self.layer_indices
        ]
        return inputs["uids"], F.normalize(torch.cat(pooled, dim=-1), dim=-1)

    def group_rewards(
        self, sample_features: torch.Tensor, extra_features: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        phi = sample_features.double()
        size = len(phi)
        if len(extra_features) == 0:
            return torch.full((size,), float("nan")), {}
        ref = extra_features.double()
        alignment = F.cosine_similarity(phi[:, None], ref[None], dim=-1).mean(1)  # (G,)
        gram = phi @ phi.T
        diversity = (gram.sum(1) - gram.diagonal()) / (size - 1) if size > 1 else torch.zeros(size, dtype=phi.dtype)
        rewards = 2 * self.alignment_coef * alignment - 2 * self.diversity_coef * diversity
        cfm = (phi.mean(0) - ref.mean(0)).square().sum()
        metrics = {"alignment": float(alignment.mean()), "diversity": float(diversity.mean()), "cfm": float(cfm)}
        return rewards, metrics


def pool_sequences(hidden: torch.Tensor, inputs: dict[str, torch.Tensor], pooling: Pooling) -> torch.Tensor:
    """Per-sequence vectors `(R, H)` from packed hidden states `(N, H)` and `collate_sequences` inputs.

    `"last"` takes each sequence's last token; `"mean"` averages its tokens from `starts` on (the last token when
    that part is empty).
    """
    offsets, positions = inputs["offsets"], inputs["positions"]
    last = positions[offsets[1:] - 1]
    if pooling == "last":
        return hidden[last]
    lengths = offsets.diff()
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
    within = torch.arange(len(positions), device=hidden.device) - offsets[:-1][sequence]
    starts = torch.minimum(inputs["starts"], lengths - 1)  # an empty pooled part falls back to the last token
    keep = within >= starts[sequence]
    sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, sequence[keep], hidden[positions[keep]])
    return sums / (lengths - starts)[:, None].to(hidden.dtype)


def _payload(sample: RolloutSample) -> dict[str, Any]:
    return (sample.extras.get(SCORE_PAYLOAD) or {}).get("payload") or {}


def _pool_start(sample: RolloutSample | None, d: dict[str, Any] | None = None) -> int:
    """Where a sample's completion starts: the payload's prompt length, else its first trained token."""
    if sample is not None and "prompt_length" in _payload(sample):
        return int(_payload(sample)["prompt_length"])
    if sample is not None:
        mask = np.asarray(sample.completion_mask)
    elif d is not None:
        mask = np.asarray(d["completion_mask"])
    else:
        raise ValueError("`_pool_start` needs a sample or its collated dict.")
    trained = np.flatnonzero(mask)
    return int(trained[0]) if trained.size else len(mask) - 1


def _as_messages(part: Any, role: str) -> list[dict[str, Any]]:
    return [{"role": role, "content": part}] if isinstance(part, str) else list(part)


def _module_device(module: torch.nn.Module) -> torch.device:
    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(module.parameters()).device


def _on_device(inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) for key, value in inputs.items()}
