"""compute_group_advantages: the rules of the rollout seed doc, and properties over generated groups."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lightning_grpo.rollout.advantages import STD_EPSILON, compute_group_advantages

NAN = float("nan")


def test_sum_then_normalize_matches_grpo_trainer_formula():
    rewards_per_func = np.array([[1.0, 0.0, 1.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    weights = np.array([1.0, 2.0])
    rewards, advantages = compute_group_advantages(rewards_per_func, weights)
    expected = np.array([2.0, 1.0, 1.0, 0.0])
    np.testing.assert_allclose(rewards, expected)
    np.testing.assert_allclose(advantages, (expected - expected.mean()) / (expected.std(ddof=1) + STD_EPSILON))


def test_scale_none_only_centres():
    _, advantages = compute_group_advantages(np.array([[3.0, 1.0, 2.0]]), np.ones(1), scale_rewards="none")
    np.testing.assert_allclose(advantages, [1.0, -1.0, 0.0])


def test_scale_batch_divides_by_given_std():
    _, advantages = compute_group_advantages(np.array([[3.0, 1.0]]), np.ones(1), scale_rewards="batch", batch_std=4.0)
    np.testing.assert_allclose(advantages, np.array([1.0, -1.0]) / (4.0 + STD_EPSILON))


def test_scale_batch_without_std_is_an_error():
    with pytest.raises(ValueError, match="batch_std"):
        compute_group_advantages(np.array([[3.0, 1.0]]), np.ones(1), scale_rewards="batch")


def test_unscored_completion_keeps_nan_reward_and_zero_advantage():
    rewards_per_func = np.array([[1.0, NAN, 0.0, 0.0], [NAN, NAN, 1.0, 0.0]])
    rewards, advantages = compute_group_advantages(rewards_per_func, np.ones(2))
    assert np.isnan(rewards[1]) and advantages[1] == 0.0
    np.testing.assert_allclose(rewards[[0, 2, 3]], [1.0, 1.0, 0.0])
    scored = rewards[[0, 2, 3]]
    np.testing.assert_allclose(advantages[[0, 2, 3]], (scored - scored.mean()) / (scored.std(ddof=1) + STD_EPSILON))


def test_constant_group_gets_exact_zeros_not_epsilon_noise():
    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        for scale in ("group", "none"):
            _, advantages = compute_group_advantages(np.full((2, 8), 0.7), np.array([1.0, 0.3]), aggregation, scale)
            assert np.all(advantages == 0.0), (aggregation, scale)


def test_single_scored_completion_is_constant():
    _, advantages = compute_group_advantages(np.array([[NAN, 1.0, NAN]]), np.ones(1))
    assert np.all(advantages == 0.0)


def test_all_unscored_group():
    rewards, advantages = compute_group_advantages(np.full((2, 3), NAN), np.ones(2))
    assert np.all(np.isnan(rewards)) and np.all(advantages == 0.0)


def test_normalize_then_sum_is_gdpo():
    # Two functions with very different scales; GDPO weighs them equally after the per-function z-score.
    rewards_per_func = np.array([[0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 100.0, 100.0]])
    weights = np.array([1.0, 1.0])
    _, advantages = compute_group_advantages(rewards_per_func, weights, "normalize_then_sum")
    z = [(row - row.mean()) / (row.std(ddof=1) + STD_EPSILON) for row in rewards_per_func]
    signal = z[0] + z[1]
    np.testing.assert_allclose(advantages, (signal - signal.mean()) / (signal.std(ddof=1) + STD_EPSILON))
    # Under sum_then_normalize the 100-point function swamps the other: completions 0 and 1 tie closely.
    _, summed = compute_group_advantages(rewards_per_func, weights)
    assert abs(summed[1] - summed[0]) < 0.02 < abs(advantages[1] - advantages[0])


def test_normalize_then_sum_constant_function_contributes_nothing():
    varying = np.array([[0.0, 1.0, 2.0]])
    with_constant = np.array([[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]])
    _, a = compute_group_advantages(varying, np.ones(1), "normalize_then_sum")
    _, b = compute_group_advantages(with_constant, np.ones(2), "normalize_then_sum")
    np.testing.assert_allclose(a, b)


def test_normalize_then_sum_zscores_each_function_over_what_it_scored():
    rewards_per_func = np.array([[1.0, 0.0, NAN, NAN], [NAN, NAN, 3.0, 1.0]])
    _, advantages = compute_group_advantages(rewards_per_func, np.ones(2), "normalize_then_sum", "none")
    z0 = 0.5 / (np.std([1.0, 0.0], ddof=1) + STD_EPSILON)  # function 0 over completions 0 and 1
    z1 = 1.0 / (np.std([3.0, 1.0], ddof=1) + STD_EPSILON)  # function 1 over completions 2 and 3
    np.testing.assert_allclose(advantages, [z0, -z0, z1, -z1], rtol=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rewards_per_func": np.ones(4)}, r"shape \(num_funcs, group_size\).*\(4,\)"),
        ({"rewards_per_func": np.ones((1, 0))}, r"shape"),
        ({"reward_weights": np.ones(3)}, r"`reward_weights` has shape \(3,\), but there are 2 reward columns"),
        ({"aggregation": "mean"}, r"aggregation='mean'"),
        ({"scale_rewards": "batchwise"}, r"scale_rewards='batchwise'"),
        ({"reward_weights": np.array([1.0, NAN])}, r"must be finite"),
        ({"rewards_per_func": np.array([[1.0, np.inf], [0.0, 0.0]])}, r"infinite"),
    ],
)
def test_bad_input_names_the_value(kwargs, match):
    args = {"rewards_per_func": np.ones((2, 4)), "reward_weights": np.ones(2)} | kwargs
    with pytest.raises(ValueError, match=match):
        compute_group_advantages(**args)


# --- properties ---------------------------------------------------------------------------------------------------

reward_values = st.one_of(st.just(NAN), st.sampled_from([0.0, 0.5, 1.0]), st.floats(-10, 10, width=32))


@st.composite
def groups(draw):
    num_funcs = draw(st.integers(1, 3))
    group_size = draw(st.integers(1, 9))
    rewards_per_func = draw(arrays(np.float64, (num_funcs, group_size), elements=reward_values))
    weights = draw(arrays(np.float64, (num_funcs,), elements=st.floats(0.125, 3.0, width=32)))
    aggregation = draw(st.sampled_from(["sum_then_normalize", "normalize_then_sum"]))
    scale = draw(st.sampled_from(["group", "none"]))
    return rewards_per_func, weights, aggregation, scale


@settings(max_examples=300, deadline=None)
@given(groups())
def test_property_zero_mean_over_scored_and_zero_for_unscored(case):
    rewards_per_func, weights, aggregation, scale = case
    rewards, advantages = compute_group_advantages(rewards_per_func, weights, aggregation, scale)
    scored = ~np.all(np.isnan(rewards_per_func), axis=0)
    assert np.array_equal(np.isnan(rewards), ~scored)
    assert np.all(np.isfinite(advantages))
    assert np.all(advantages[~scored] == 0.0)
    if scored.any():
        assert abs(advantages[scored].mean()) < 1e-6 * max(1.0, np.abs(advantages).max())


@settings(max_examples=300, deadline=None)
@given(groups(), st.floats(-5, 5, width=32), st.floats(0.125, 3.0, width=32))
def test_property_invariant_to_adding_a_constant_reward(case, constant, weight):
    # One more reward column that gives every scored completion the same value shifts the learning signal by a
    # constant, which centring removes.
    rewards_per_func, weights, aggregation, scale = case
    scored = ~np.all(np.isnan(rewards_per_func), axis=0)
    extra = np.where(scored, constant, np.nan)[None, :]
    _, before = compute_group_advantages(rewards_per_func, weights, aggregation, scale)
    _, after = compute_group_advantages(
        np.vstack([rewards_per_func, extra]), np.append(weights, weight), aggregation, scale
    )
    # The shift can merge values that differed only by rounding noise (before: +-0.7 from 1e-16 apart); skip those.
    signal_spread = np.ptp(np.nansum(weights[:, None] * rewards_per_func, axis=0)[scored]) if scored.any() else 0
    assume(signal_spread == 0 or signal_spread > 1e-6 or aggregation == "normalize_then_sum")
    np.testing.assert_allclose(after, before, atol=1e-4 * max(1.0, np.abs(before).max()))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 9),
    st.floats(-10, 10, width=32),
    st.sampled_from(["sum_then_normalize", "normalize_then_sum"]),
    st.sampled_from(["group", "none"]),
    st.data(),
)
def test_property_constant_groups_give_exact_zeros(num_funcs, group_size, value, aggregation, scale, data):
    # Each function constant over what it scored, and the weighted sums equal: no learning signal at all.
    rewards_per_func = np.full((num_funcs, group_size), value)
    unscored = data.draw(st.lists(st.integers(0, group_size - 1), max_size=group_size - 1))
    rewards_per_func[:, unscored] = NAN
    rewards, advantages = compute_group_advantages(rewards_per_func, np.ones(num_funcs), aggregation, scale)
    assert np.all(advantages == 0.0)
    assert np.all(np.isnan(rewards[unscored]))


@settings(max_examples=200, deadline=None)
@given(groups())
def test_property_nan_columns_do_not_change_other_advantages(case):
    # Appending a completion that no function scored leaves every other completion's advantage unchanged.
    rewards_per_func, weights, aggregation, scale = case
    _, before = compute_group_advantages(rewards_per_func, weights, aggregation, scale)
    padded = np.concatenate([rewards_per_func, np.full((rewards_per_func.shape[0], 1), NAN)], axis=1)
    rewards, after = compute_group_advantages(padded, weights, aggregation, scale)
    assert np.isnan(rewards[-1]) and after[-1] == 0.0
    np.testing.assert_array_equal(after[:-1], before)
