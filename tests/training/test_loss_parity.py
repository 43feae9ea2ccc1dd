"""The GRPO family's formulas against TRL 1.16's own `GRPOTrainer._compute_loss` (of a trainer built by its
`__init__`), called on the same given per-token log-probabilities, advantages and masks, spread so that ratios fall
inside and outside every clip and mask (tests/helpers/trl_grpo.py): the per-step loss, the gradient of every
parameter (each token's log-probability and entropy) and every loss metric TRL logs (`LOSS_METRICS`) match to 1e-6 in
fp32 wherever the two normalise alike (one process, one micro-batch); over several micro-batches the difference is
exactly the normaliser. The generator-mismatch weights come from TRL's `_generate_and_score_completions` on the same
log-probabilities. `test_trl_trainer_parity.py` compares a real `GRPOTrainer.train()` step on the tiny model.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.trl_grpo import (
    LOSS_METRICS,
    LogprobsModel,
    generate_and_score,
    grpo_trainer,
    loss_inputs,
    padded,
    trl_loss,
)

from lightning_grpo.training.loss import LossTerms, Normalizers, high_entropy_mask, policy_loss
from lightning_grpo.training.loss_options import LossOptions

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LENGTHS = [3, 6, 2, 5, 4]
ADVANTAGES = [1.2, -0.7, 0.4, -1.5, 0.9]
MAX_COMPLETION_LENGTH = 7
TOLERANCE = {"rtol": 1e-6, "atol": 1e-6}


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """`(B, C)` per-token log-probabilities: the policy's, the generator's, the step's first pass, the reference's,
    and entropies; spread so that ratios fall inside and outside every clip and mask."""
    g = torch.Generator().manual_seed(seed)
    shape = (len(LENGTHS), max(LENGTHS))
    policy = -(torch.rand(shape, generator=g) * 2.5 + 0.5)
    mask = padded([[1.0] * n for n in LENGTHS]).bool()

    def near(scale: float) -> torch.Tensor:
        return torch.where(mask, policy + scale * torch.randn(shape, generator=g), 0.0)

    return {
        "policy": torch.where(mask, policy, 0.0),
        "sampling": near(0.3),
        "proximal": near(0.1),
        "ref": near(0.2),
        "entropy": torch.where(mask, torch.rand(shape, generator=g) * 2.5 + 0.5, 0.0),
    }


def trl_options(**options) -> dict:
    """GRPOConfig arguments for these loss options (TRL's names are ours; our correction default is off)."""
    return {"max_completion_length": MAX_COMPLETION_LENGTH, "vllm_importance_sampling_correction": False, **options}


def our_options(**options) -> LossOptions:
    return LossOptions(**{k: v for k, v in options.items() if k not in ("gradient_accumulation_steps",)})


def flat(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)])
    cols = torch.tensor([t for n in lengths for t in range(n)])
    return rows, cols


def ours(
    model: LogprobsModel,
    data: dict,
    options: LossOptions,
    samples: list[int],
    *,
    tokens: float,
    sequences: float,
    entropy_tokens: float | None = None,
):
    """Our micro-batch loss over `samples` (packed terms: each sample's tokens in a row, `segment_id` = its index)."""
    lengths = [LENGTHS[b] for b in samples]
    local, cols = flat(lengths)
    rows = torch.tensor(samples)[local]
    correction = options.vllm_importance_sampling_correction
    terms = LossTerms(
        logprobs=model.logprobs[rows, cols],
        sampling_logprobs=data["sampling"][rows, cols],
        advantages=torch.tensor(ADVANTAGES)[rows],
        segment_id=local,
        entropy=model.entropy[rows, cols],
        proximal_logprobs=data["proximal"][rows, cols] if correction else None,
        ref_logprobs=data["ref"][rows, cols] if options.beta else None,
    )
    if options.top_entropy_quantile < 1:
        terms.entropy_mask, kept = high_entropy_mask(
            terms.entropy, torch.ones_like(local, dtype=torch.bool), options.top_entropy_quantile
        )
        entropy_tokens = kept
    norms = Normalizers(tokens, sequences, MAX_COMPLETION_LENGTH, entropy_tokens=entropy_tokens)
    return policy_loss(terms, options, norms)


def trl_micro_batch(trainer, data: dict, samples: list[int], **extra) -> dict:
    """TRL's `_compute_loss` inputs for `samples`: our anchor is its old log-probabilities."""
    correction = trainer.vllm_importance_sampling_correction
    rows = torch.tensor(samples)
    width = max(LENGTHS[b] for b in samples)
    sub = {key: value[rows, :width] for key, value in data.items()}
    inputs = loss_inputs(
        [LENGTHS[b] for b in samples],
        [ADVANTAGES[b] for b in samples],
        old=sub["proximal"] if correction else sub["sampling"],
        sampling=sub["sampling"],
        ref=sub["ref"] if trainer.beta else None,
        **extra,
    )
    if correction:
        inputs["importance_sampling_ratio"] = trl_importance_ratio(trainer, sub, samples)
    return inputs


def trl_importance_ratio(trainer, sub: dict, samples: list[int]) -> torch.Tensor:
    """The mismatch weights TRL's `_generate_and_score_completions` computes from the first pass and the generator."""
    lengths = [LENGTHS[b] for b in samples]
    sampling = [sub["sampling"][i, :n].tolist() for i, n in enumerate(lengths)]
    rewards = torch.zeros(len(samples), 1).numpy()
    scorer = grpo_trainer(
        num_generations=len(samples),
        per_device_train_batch_size=len(samples),
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=trainer.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=trainer.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=trainer.vllm_importance_sampling_clip_max,
    )
    return generate_and_score(scorer, rewards, lengths=lengths, sampling=sampling, old=sub["proximal"])[
        "importance_sampling_ratio"
    ]


def compare(options: dict, data: dict | None = None) -> None:
    """One process, one micro-batch: TRL's loss, gradients and metrics against ours."""
    data = data or tensors()
    trainer = grpo_trainer(**trl_options(**options))
    trl_model, our_model = (
        LogprobsModel(data["policy"], data["entropy"]),
        LogprobsModel(data["policy"], data["entropy"]),
    )
    expected = trl_loss(trainer, trl_model, trl_micro_batch(trainer, data, list(range(len(LENGTHS)))))
    expected.backward()
    got, stats = ours(
        our_model, data, our_options(**options), list(range(len(LENGTHS))), tokens=sum(LENGTHS), sequences=len(LENGTHS)
    )
    got.backward()
    torch.testing.assert_close(got, expected, **TOLERANCE)
    for name in ("logprobs", "entropy"):
        torch.testing.assert_close(getattr(our_model, name).grad, getattr(trl_model, name).grad, **TOLERANCE)
    assert_logged_metrics_are_ours(trainer._metrics["train"], stats.metrics(), options)


def assert_logged_metrics_are_ours(logged: dict[str, list[float]], ours: dict[str, float], options: dict) -> None:
    """Every metric TRL's `_compute_loss` logged is ours (`LOSS_METRICS`) and equal; `entropy_coef` is the option
    `GRPOModule` logs."""
    for name, values in logged.items():
        if name == "entropy_coef":
            assert values[-1] == options.get("entropy_coef", 0.0)
            continue
        assert name in LOSS_METRICS, f"TRL logs {name!r}, which LOSS_METRICS (tests/helpers/trl_grpo.py) lacks"
        assert LOSS_METRICS[name] in ours, f"TRL logs {name!r}, ours has no {LOSS_METRICS[name]!r}"
        assert ours[LOSS_METRICS[name]] == pytest.approx(values[-1], rel=1e-6, abs=1e-6, nan_ok=True), name


@pytest.mark.parametrize(
    ("loss_type", "level", "correction", "beta"),
    list(itertools.product(LOSS_TYPES, ["token", "sequence"], [False, True], [0.0, 0.04])),
)
def test_loss_gradients_and_metrics_match_trls_compute_loss(loss_type, level, correction, beta):
    options = {
        "loss_type": loss_type,
        "importance_sampling_level": level,
        "beta": beta,
        "vllm_importance_sampling_correction": correction,
    }
    if loss_type == "vespo" and correction:
        options["vllm_importance_sampling_mode"] = "token_truncate"  # TRL refuses VESPO with a sequence mode
    compare(options)


@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5},
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 1.1},
        {"loss_type": "dapo", "off_policy_mask_threshold": 0.05},
        {"loss_type": "grpo", "off_policy_mask_threshold": 0.05, "vllm_importance_sampling_correction": True},
        {"loss_type": "dapo", "top_entropy_quantile": 0.4},
        {"loss_type": "dapo", "entropy_coef": 0.1},
        {"loss_type": "grpo", "entropy_coef": 0.1, "top_entropy_quantile": 0.5},
        {"loss_type": "cispo", "epsilon_high": 1.1},
        {"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
        {"loss_type": "vespo", "vespo_k_pos": 1.0, "vespo_lambda_neg": 4.0},
        {"loss_type": "dapo", "beta": 0.1, "use_bias_correction_kl": False},
        {
            "loss_type": "dapo",
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_mask",
        },
        {
            "loss_type": "dr_grpo",
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "sequence_truncate",
            "vllm_importance_sampling_clip_min": 0.5,
        },
    ],
    ids=lambda options: "-".join(f"{k}={v}" for k, v in options.items()),
)
def test_each_further_option_matches_trls_compute_loss(options):
    compare(options)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_over_several_micro_batches_the_difference_is_exactly_the_normaliser(loss_type):
    """GRPOTrainer divides each micro-batch by its own sequence or token count (times the accumulation steps), ours
    by the step's: per micro-batch, scaling each by its normaliser makes the two equal (loss and gradients). `dapo`,
    `cispo` and `vespo` already normalise by the whole step in TRL, so they are equal as they are."""
    data = tensors(seed=1)
    trainer = grpo_trainer(**trl_options(loss_type=loss_type, gradient_accumulation_steps=2))
    options = our_options(loss_type=loss_type)
    split = [[0, 1, 2], [3, 4]]  # 3 then 2 sequences, 11 then 9 tokens
    tokens, sequences = sum(LENGTHS), len(LENGTHS)
    for samples in split:
        rows, width = torch.tensor(samples), max(LENGTHS[b] for b in samples)
        trl_model, our_model = LogprobsModel(data["policy"][rows, :width]), LogprobsModel(data["policy"])
        inputs = trl_micro_batch(trainer, data, samples, num_items_in_batch=tokens)
        expected = trl_loss(trainer, trl_model, inputs)
        got, _ = ours(our_model, data, options, samples, tokens=tokens, sequences=sequences)
        ours_scale, trl_scale = _normalisers(loss_type, samples, tokens, sequences, accumulation=2)
        torch.testing.assert_close(got * ours_scale, expected * trl_scale, **TOLERANCE)
        (got * ours_scale).backward()
        (expected * trl_scale).backward()
        torch.testing.assert_close(our_model.logprobs.grad[rows, :width], trl_model.logprobs.grad, **TOLERANCE)


def _normalisers(loss_type: str, samples: list[int], tokens: int, sequences: int, accumulation: int):
    """(ours, TRL's) normaliser of one micro-batch's loss: the step's count vs the micro-batch's times accumulation."""
    if loss_type in ("dapo", "cispo", "vespo"):
        return 1.0, 1.0
    if loss_type == "bnpo":
        return float(tokens), float(sum(LENGTHS[b] for b in samples) * accumulation)
    return float(sequences), float(len(samples) * accumulation)


def test_the_entropy_bonus_is_the_steps_token_mean_where_trls_is_the_micro_batchs():
    data = tensors(seed=2)
    trainer = grpo_trainer(**trl_options(loss_type="dapo", entropy_coef=0.3, gradient_accumulation_steps=2))
    options = our_options(loss_type="dapo", entropy_coef=0.3)
    tokens = sum(LENGTHS)
    for samples in ([0, 1, 2], [3, 4]):
        rows, width = torch.tensor(samples), max(LENGTHS[b] for b in samples)
        trl_model = LogprobsModel(data["policy"][rows, :width], data["entropy"][rows, :width])
        our_model = LogprobsModel(data["policy"], data["entropy"])
        expected = trl_loss(trainer, trl_model, trl_micro_batch(trainer, data, samples, num_items_in_batch=tokens))
        expected.backward()
        got, _ = ours(our_model, data, options, samples, tokens=tokens, sequences=len(LENGTHS))
        got.backward()
        torch.testing.assert_close(our_model.logprobs.grad[rows, :width], trl_model.logprobs.grad, **TOLERANCE)
        micro_batch_tokens = sum(LENGTHS[b] for b in samples)
        # the entropy term: TRL divides by this micro-batch's tokens times the accumulation steps, ours by the step's
        scale = micro_batch_tokens * 2 / tokens
        torch.testing.assert_close(our_model.entropy.grad[rows, :width], trl_model.entropy.grad * scale, **TOLERANCE)
