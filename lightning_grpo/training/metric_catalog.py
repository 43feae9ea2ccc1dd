"""Every metric a fit logs, by its full name, with what it means: the one list the metrics reference is generated from.

A name is the logged key itself; a part in angle brackets is named by the run (`rewards/<name>`: one entry per reward
column). `describe` finds the entry of a logged name. `tests/docs/test_metrics_reference.py` records every key a real
fit logs and fails on one that has no entry here, and docs/_gen/metrics.py writes the reference page from `SECTIONS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["SECTIONS", "MetricDoc", "describe", "documented_names"]

EVERY_STEP = "every step"


@dataclass(frozen=True, slots=True)
class MetricDoc:
    """One logged metric: its name, what it measures, and when a row has a value for it."""

    name: str  # the logged key; `<part>` is a part the run names (a reward column, a tool, k of pass@k)
    meaning: str
    logged: str = EVERY_STEP  # the option or event that makes it appear; counters then have a value in every row

    def matches(self, key: str) -> bool:
        """Whether the logged `key` is this metric (each `<part>` stands for one or more characters)."""
        pattern = "".join(
            ".+" if part.startswith("<") else re.escape(part) for part in re.split(r"(<[^>]+>)", self.name)
        )
        return re.fullmatch(pattern, key) is not None


def _metrics(*entries: tuple[str, str] | tuple[str, str, str]) -> tuple[MetricDoc, ...]:
    return tuple(MetricDoc(*entry) for entry in entries)


_PACING = "the generator is ahead of the trainer by more than `max_staleness` allows"
_TOOLS = "with `tools` or an `environment_factory`"
_ENV = "with an `environment_factory`"
_MULTI_TURN = "multi-turn rollouts (tools or environments)"
_VLLM = '`generator="vllm"`'
_IS_CORRECTION = "`vllm_importance_sampling_correction`"
_SCORERS = "with trainer `scorers`"
_VALIDATION = "each validation"

#: (section title, its metrics), in the reference page's order.
SECTIONS: tuple[tuple[str, tuple[MetricDoc, ...]], ...] = (
    (
        "Loss and policy",
        _metrics(
            (
                "loss",
                "The step's loss, averaged over its `num_iterations` updates (with `entropy_coef`, after the bonus).",
            ),
            ("policy_loss", "The loss before the entropy bonus.", "`entropy_coef` != 0"),
            ("entropy_coef", "The entropy bonus's coefficient.", "`entropy_coef` != 0"),
            ("entropy", "Mean entropy of the policy's next-token distribution over the step's trained tokens."),
            (
                "ratio",
                "Mean policy/old-policy probability ratio of the trained tokens (per sequence with "
                '`importance_sampling_level="sequence"`).',
            ),
            ("kl", "Mean k3 estimate of KL(policy ‖ reference) over the trained tokens.", "`beta` > 0"),
            (
                "aux_loss",
                "A Mixture-of-Experts policy's load-balancing loss, mean over micro-batches (weighted into `loss`).",
                "an MoE policy with `router_aux_loss_coef` != 0",
            ),
            ("clip_ratio/low_mean", "Fraction of trained tokens with a negative advantage clipped at `1 - epsilon`."),
            ("clip_ratio/low_min", "The smallest per-sequence fraction of tokens clipped low."),
            (
                "clip_ratio/high_mean",
                "Fraction of trained tokens with a positive advantage clipped at `1 + epsilon_high`.",
            ),
            ("clip_ratio/high_max", "The largest per-sequence fraction of tokens clipped high."),
            ("clip_ratio/region_mean", "Fraction of trained tokens clipped either way."),
            ("cispo_clip_ratio", "Fraction of trained tokens whose ratio CISPO capped.", '`loss_type="cispo"`'),
            ("vespo/phi_seq_mean", "Mean VESPO sequence weight.", '`loss_type="vespo"`'),
            ("lr", "The learning rate the step trained with."),
            ("epoch", "The trainer's epoch (`trainer.current_epoch`)."),
        ),
    ),
    (
        "Generator mismatch",
        _metrics(
            (
                "sampling/sampling_logp_difference/mean",
                "Mean absolute difference between the trainer's and the generator's log-probability of the trained "
                "tokens, at the step's first pass.",
            ),
            ("sampling/sampling_logp_difference/max", "The largest such difference."),
            (
                "sampling/importance_sampling_ratio/min",
                "Smallest generator-mismatch weight `exp(trainer logp - generator logp)` after truncation.",
                _IS_CORRECTION,
            ),
            ("sampling/importance_sampling_ratio/mean", "Mean generator-mismatch weight.", _IS_CORRECTION),
            ("sampling/importance_sampling_ratio/max", "Largest generator-mismatch weight.", _IS_CORRECTION),
            (
                "sampling/is_masked_frac",
                "Fraction of trained tokens masked for a weight outside the clip bounds.",
                "a `*_mask` `vllm_importance_sampling_mode`",
            ),
            (
                "off_policy/masked_frac",
                "Fraction of trained tokens in negative-advantage sequences masked as too far off-policy.",
                "`off_policy_mask_threshold`",
            ),
            (
                "entropy/masked_frac",
                "Fraction of trained tokens left out for low entropy.",
                "`top_entropy_quantile` < 1",
            ),
        ),
    ),
    (
        "Rewards",
        _metrics(
            ("reward", "Mean weighted reward of the step's samples (a sample no column scored is left out)."),
            ("reward_std", "Mean over the step's samples of their group's reward standard deviation."),
            (
                "rewards/<name>",
                "Mean of reward column `<name>` over the step's samples it scored. `<name>` is a reward function's "
                "`__name__`, a trainer scorer's `name` or an environment's class name.",
            ),
            (
                "scoring/<scorer>/<metric>",
                "A trainer scorer's own metric, averaged over the step's groups (the feature-matching scorer logs "
                "`alignment`, `diversity`, `cfm`).",
                _SCORERS,
            ),
            ("scoring/groups_total", "Groups scored on the trainer.", _SCORERS),
            ("scoring/excluded_groups_total", "Trainer-scored groups left untrained (no learning signal).", _SCORERS),
            ("scoring/masked_samples_total", "Trainer-scored samples that train nothing.", _SCORERS),
            ("scoring/masked_tokens_total", "The completion tokens of those samples.", _SCORERS),
        ),
    ),
    (
        "Samples and batches",
        _metrics(
            ("sample/staleness_mean", "Mean policy versions between generating a step's samples and training them."),
            ("sample/staleness_max", "The largest staleness among the step's samples."),
            ("sample/time_in_queue_s", "Mean seconds a sample waited between the rollout process and the trainer."),
            ("sample/forwarded_tokens_mean", "Mean tokens per sample (prompt and completion)."),
            ("sample/forwarded_tokens_max", "Most tokens in one sample."),
            ("sample/trained_tokens_mean", "Mean trained (completion) tokens per sample."),
            (
                "batch/masked_token_frac",
                "Fraction of the step's forwarded tokens that train nothing (prompts, tool output).",
            ),
            ("batch/groups_per_step", "Prompt groups in the step."),
            (
                "batch/empty_places_per_step",
                "Groups dropped while the step was planned whose places stayed empty (`replace_dropped_groups=False`).",
            ),
            ("batch/samples_per_row", "Mean samples per packed row."),
            ("batch/row_tokens_mean", "Mean tokens per packed row."),
            ("batch/row_tokens_max", "Most tokens in one packed row."),
            ("batch/row_fill_frac", "How full the rows are: of `token_budget`, else of `samples_per_row`."),
            (
                "batch/row_imbalance",
                "Largest rank's row cost over the mean, averaged over micro-batches (1 = balanced).",
            ),
            ("batch/packing_ratio", "Tokens before packing over tokens after (shared prompts packed once)."),
            ("batch/spread_samples_total", "Samples moved into rows that would otherwise be empty."),
            ("batch/filler_rows_total", "Rows given a filler copy that trains nothing, so no rank has an empty row."),
        ),
    ),
    (
        "Progress",
        _metrics(
            ("progress/groups_consumed", "Prompt groups consumed so far: trained in a finished step, or dropped."),
            ("progress/dropped_no_signal_total", "Groups dropped because every completion scored alike."),
            ("progress/dropped_stale_total", "Groups dropped for arriving more than `max_staleness` versions behind."),
            ("progress/dropped_truncated_total", "Groups dropped because every completion was truncated and masked."),
            ("progress/dropped_oversize_total", "Groups dropped for a sample longer than `token_budget`."),
            ("progress/duplicate_total", "Samples of an already consumed group, skipped (never expected)."),
        ),
    ),
    (
        "Timing",
        _metrics(
            ("perf/step_s", "Seconds from the previous step's end to this step's end.", "from the second step"),
            ("perf/fwd_bwd_s", "Seconds of the step's forward and backward passes and optimizer updates."),
            ("perf/rollout_wait_s", "Seconds the trainer waited for the step's rollouts."),
            ("perf/weight_sync_s", "Seconds the weight push after the step took.", "each weight push"),
            ("weights/version", "The policy version after the step's weight push.", "each weight push"),
        ),
    ),
    (
        "Rollout process",
        _metrics(
            ("rollout/generated_tok_s", "Completion tokens generated per second since the previous step."),
            ("rollout/duration_s", "Mean seconds to generate one rollout (all its turns)."),
            ("rollout/inflight", "Rollouts being generated, at the last group scored."),
            ("rollout/samples_per_rollout", "Mean training samples per rollout."),
            ("rollout/turns_mean", "Mean policy turns per rollout."),
            ("rollout/turns_max", "Most policy turns in one rollout."),
            ("rollout/drift_tokens_max", "Most re-tokenization drift tokens in one rollout's turn changes."),
            ("rollout/drift_tokens_mean", "Mean drift tokens per turn change.", _MULTI_TURN),
            ("rollout/fork_frac", "Fraction of turn changes that start a new training sample.", _MULTI_TURN),
            ("rollout/realign_frac", "Fraction of turn changes whose tokens were realigned.", _MULTI_TURN),
            ("rollout/score_s", "Mean seconds to score one group's reward columns."),
            ("rollout/score_wait_s", "Mean seconds a generated group waited to be scored."),
            ("rollout/score_queue_size", "Generated groups waiting to be scored."),
            (
                "rollout/score_block_s",
                "Seconds generation was held back because the scoring queue was full.",
                "scoring falls behind",
            ),
            (
                "rollout/backpressure_s",
                "Seconds scored samples waited because the queue to the trainer was full.",
                "the trainer falls behind",
            ),
            ("rollout/pacing_wait_s", "Mean seconds a group waited to be admitted by staleness pacing.", _PACING),
            ("completions/mean_length", "Mean completion length in tokens."),
            ("completions/min_length", "Shortest completion in tokens."),
            ("completions/max_length", "Longest completion in tokens."),
            (
                "completions/clipped_ratio",
                "Fraction of completions the generator cut at `max_completion_length` (one a `stop` string ended is "
                "not clipped).",
            ),
        ),
    ),
    (
        "Reward functions",
        _metrics(
            ("reward_pool/calls_total", "Reward function calls."),
            ("reward_pool/errors_total", "Calls that raised, or whose worker died: that call scores NaN."),
            ("reward_pool/timeouts_total", "Calls over `reward_timeout`: that call scores NaN."),
            ("reward_pool/restarts_total", "Reward worker processes restarted after a timeout or a crash."),
            ("reward_pool/busy_s", "Seconds spent in reward function calls since the previous step."),
        ),
    ),
    (
        "Tools and environments",
        _metrics(
            (
                "tools/call_frequency",
                "Mean tool calls per rollout, over the step's samples of groups that called one.",
                _TOOLS,
            ),
            ("tools/failure_frequency", "Fraction of those calls that failed.", _TOOLS),
            ("tools/loop_exhausted_frac", "Fraction of rollouts cut off at `max_tool_calling_iterations`.", _TOOLS),
            ("tools/parallel_calls_mean", "Mean tool calls per policy turn that called tools.", _TOOLS),
            ("tools/latency_s", "Mean seconds of one tool call.", _TOOLS),
            ("tools/timeout_total", "Tool calls over `tool_timeout`.", _TOOLS),
            ("tools/unknown_name_total", "Calls of a tool that does not exist.", _TOOLS),
            ("tools/<tool>/call_total", "Calls of tool `<tool>`.", _TOOLS),
            ("tools/<tool>/failure_total", "Failed calls of tool `<tool>` (raised, timed out, bad arguments).", _TOOLS),
            ("tools/<tool>/latency_s", "Mean seconds of one call of tool `<tool>`.", _TOOLS),
            ("env/reset_s", "Mean seconds of an environment's `reset`.", _ENV),
            ("env/reward_s", "Mean seconds of an environment's `get_reward`.", _ENV),
            ("env/reset_errors_total", "`reset` calls that raised or hung: that rollout scores NaN.", _ENV),
            ("env/reward_errors_total", "`get_reward` calls that failed: that column is NaN.", _ENV),
        ),
    ),
    (
        "vLLM servers",
        _metrics(
            ("rollout/vllm_retry_total", "Requests to a vLLM server retried after a connection error.", _VLLM),
            ("vllm/servers_lost_total", "vLLM servers lost during the run.", "`vllm_failover=True`"),
            ("vllm/requests_resent_total", "Requests sent again to another server.", "`vllm_failover=True`"),
        ),
    ),
    (
        "Validation",
        _metrics(
            ("val/reward", "Mean weighted reward over the scored held-out completions.", _VALIDATION),
            (
                "val/rewards/<name>",
                "Mean of reward column `<name>` over the held-out completions it scored.",
                _VALIDATION,
            ),
            ("val/unscored_frac", "Fraction of held-out completions no column scored.", _VALIDATION),
            (
                "val/pass@<k>",
                "Fraction of prompts (with a scored completion) where one of the k = `num_generations_eval` "
                "completions reached `val_pass_threshold`.",
                _VALIDATION,
            ),
            (
                "val/mean@<k>",
                "Mean over those prompts of the fraction of their completions that reached it.",
                _VALIDATION,
            ),
            ("val/tools/call_frequency", "Tool calls per held-out conversation.", f"{_VALIDATION}, {_TOOLS}"),
            ("val/tools/failure_frequency", "Fraction of those calls that failed.", f"{_VALIDATION}, {_TOOLS}"),
            ("val/tools/loop_exhausted_frac", "Fraction of conversations cut off.", f"{_VALIDATION}, {_TOOLS}"),
            ("val/turns_mean", "Mean policy turns per held-out conversation.", f"{_VALIDATION}, {_TOOLS}"),
        ),
    ),
)


def documented_names() -> list[str]:
    """Every documented name, placeholders included, in the page's order."""
    return [metric.name for _, metrics in SECTIONS for metric in metrics]


def describe(key: str) -> MetricDoc | None:
    """The entry of the logged `key` (an exact name before a pattern with placeholders); None when it has none."""
    metrics = [metric for _, section in SECTIONS for metric in section]
    exact = next((metric for metric in metrics if metric.name == key), None)
    return exact or next((metric for metric in metrics if "<" in metric.name and metric.matches(key)), None)
