"""GRPOModule's loss options: TRL's names, defaults and meanings; a bad value or a combination TRL refuses fails at
construction, naming the options and the fix."""

from __future__ import annotations

import pytest

from lightning_grpo.module import GRPOModule


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"epsilon_high": -0.1}, "epsilon_high=-0.1"),
        ({"epsilon": 0.2, "epsilon_high": 0.1}, "epsilon_high=0.1"),
    ],
)
def test_an_epsilon_high_below_epsilon_or_negative_is_refused(options, named):
    with pytest.raises(ValueError, match=named):
        GRPOModule("tiny-random", **options)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"sync_ref_model": True}, r"`sync_ref_model=True` with `beta=0.0`"),
        (
            {"vllm_importance_sampling_clip_min": 3.0, "vllm_importance_sampling_clip_max": 2.0},
            r"`vllm_importance_sampling_clip_min=3.0` must be less than `vllm_importance_sampling_clip_max=2.0`",
        ),
        (
            {
                "vllm_importance_sampling_correction": True,
                "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_max": None,
            },
            r"`vllm_importance_sampling_mode='token_truncate'` needs `vllm_importance_sampling_clip_min`",
        ),
        (
            {"loss_type": "vespo", "vllm_importance_sampling_correction": True},
            r"`loss_type='vespo'` takes token-level importance weights: `vllm_importance_sampling_mode='sequence_mask'`",
        ),
        ({"loss_type": "ppo"}, r"`loss_type='ppo'` is not one of"),
        ({"delta": 0.9}, r"`delta=0.9`"),
        ({"beta": -0.1}, r"`beta=-0.1`"),
        ({"top_entropy_quantile": 1.5}, r"`top_entropy_quantile=1.5`"),
        ({"num_iterations": 0}, r"`num_iterations=0`"),
        ({"beta": 0.1, "ref_model_mixup_alpha": 2.0}, r"`ref_model_mixup_alpha=2.0`"),
    ],
)
def test_what_grpo_trainer_refuses_and_out_of_range_values_fail_at_construction(options, named):
    with pytest.raises(ValueError, match=named):
        GRPOModule("tiny-random", **options)


def test_every_problem_is_listed_in_one_error():
    with pytest.raises(ValueError) as error:
        GRPOModule("tiny-random", epsilon_high=0.1, sync_ref_model=True, num_iterations=0)
    assert all(name in str(error.value) for name in ("epsilon_high=0.1", "sync_ref_model=True", "num_iterations=0"))


@pytest.mark.parametrize(
    ("options", "warned"),
    [
        ({"loss_type": "luspo"}, "importance_sampling_level='sequence'"),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "leave `importance_sampling_level='token'`"),
        ({"loss_type": "dapo", "importance_sampling_level": "sequence"}, "weights each sequence by its length"),
        ({"loss_type": "cispo"}, "ScaleRL recommends `epsilon_high=5.0`"),
        ({"loss_type": "sapo", "delta": 2.0}, "`delta=2.0` has no effect"),
    ],
)
def test_what_grpo_trainer_warns_about_is_warned(options, warned):
    with pytest.warns(UserWarning, match=warned):
        GRPOModule("tiny-random", **options)


def test_defaults_are_grpo_trainers_but_the_three_the_readme_explains():
    """The README's "Where the GRPO family differs" says why these three differ."""
    import inspect

    from trl import GRPOConfig

    from lightning_grpo.training.loss_options import LossOptions

    trl = GRPOConfig(output_dir="unused", report_to=[], bf16=False, use_cpu=True)
    ours = inspect.signature(GRPOModule).parameters
    names = [n for n in ours if hasattr(trl, n) and n not in ("model", "learning_rate", "vllm_importance_sampling_cap")]
    assert set(LossOptions.__dataclass_fields__) <= set(names) | {"epsilon"}
    differ = {name for name in names if ours[name].default != getattr(trl, name)}
    assert differ == {"vllm_importance_sampling_correction", "gradient_checkpointing", "num_generations_eval"}, differ


def test_the_deprecated_cap_is_the_upper_clip_bound_as_in_trl():
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_clip_max"):
        module = GRPOModule("tiny-random", vllm_importance_sampling_cap=2.5)
    assert module.loss_options.vllm_importance_sampling_clip_max == 2.5
