"""The embedded generator: exact logprobs, stopping (EOS ids, stop strings), sampling options (top-k/top-p, min-p,
repetition penalty, against transformers' own processors), continuous batching, one prefill per prompt, seeds,
Llama-family architectures, a free event loop, shutdown."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
)

from lightning_grpo.models import char_tokenizer, tiny_llama
from lightning_grpo.rollout.generator import EmbeddedGenerator, GeneratorSpec, PolicySpec
from lightning_grpo.rollout.sampling import (
    process_logits,
    sample_from_logprobs,
    seen_tokens,
    teacher_forced_logprobs,
)

# Prompts of different lengths, so a batch is left-padded.
PROMPTS = [[2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [2, 50, 51], [2, 60, 61, 62, 63, 64], [2, 70]]


def generate_all(generator: EmbeddedGenerator, prompts, **kwargs):
    """Send every prompt concurrently from one event loop; one batch."""

    async def run():
        return await asyncio.gather(*(generator.generate(p, **kwargs) for p in prompts))

    return asyncio.run(run())


async def _gather(generator, calls):
    """`calls`: (prompt, keyword arguments of `generate`) pairs, sent concurrently."""
    return await asyncio.gather(*(generator.generate(p, **kwargs) for p, kwargs in calls))


def max_logprob_error(model, prompts, outputs, **sampling) -> float:
    errors = []
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = teacher_forced_logprobs(model, prompt, output.token_ids, **sampling)
        errors.append((reference - torch.tensor(output.logprobs)).abs().max().item())
    return max(errors)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced_forward_for_left_padded_batch(temperature):
    reference = tiny_llama(seed=0)
    with EmbeddedGenerator(
        tiny_llama(seed=0), eos_token_ids=[], temperature=temperature, max_tokens=24, seed=0
    ) as generator:
        outputs = generate_all(generator, PROMPTS)
        assert generator.metrics()["generation/steps_total"] == 24  # concurrent requests joined the same step
    assert [len(o.token_ids) for o in outputs] == [24] * len(PROMPTS)
    assert all(o.truncated and o.model_version == 0 for o in outputs)
    assert max_logprob_error(reference, PROMPTS, outputs, temperature=temperature) <= 1e-4


def test_sampled_tokens_stay_in_top_k_top_p_set_and_logprobs_are_renormalised():
    sampling = {"temperature": 0.8, "top_k": 7, "top_p": 0.8}
    reference = tiny_llama(seed=0)
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=32, seed=1, **sampling) as generator:
        outputs = generate_all(generator, PROMPTS)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = teacher_forced_logprobs(reference, prompt, output.token_ids, **sampling)
        assert torch.isfinite(expected).all()  # every sampled token is inside the kept set
    assert max_logprob_error(reference, PROMPTS, outputs, **sampling) <= 1e-4
    # a renormalised top-k/top-p logprob is above the plain tempered one whenever the cut removed mass
    plain = torch.cat(
        [teacher_forced_logprobs(reference, p, o.token_ids, 0.8) for p, o in zip(PROMPTS, outputs, strict=True)]
    )
    assert (torch.tensor([lp for o in outputs for lp in o.logprobs]) > plain + 1e-3).any()


def test_process_logits_keeps_top_k_then_top_p_and_sums_to_one():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    logprobs = process_logits(logits, temperature=0.5, top_k=10, top_p=0.7)
    probs = logprobs.exp()
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    for row in range(3):
        kept = torch.isfinite(logprobs[row]).nonzero().flatten()
        ranked = (logits[row] / 0.5).argsort(descending=True)
        assert set(kept.tolist()) == set(ranked[: len(kept)].tolist())  # a prefix of the ranking
        assert 1 <= len(kept) <= 10
        top_k_probs = (logits[row] / 0.5)[ranked[:10]].softmax(-1)
        mass = top_k_probs.cumsum(-1)
        assert mass[len(kept) - 1] >= 0.7 and (len(kept) == 1 or mass[len(kept) - 2] < 0.7)  # the smallest such set
        torch.testing.assert_close(logprobs[row, kept], torch.log(top_k_probs[: len(kept)] / mass[len(kept) - 1]))


def test_sampler_draws_only_kept_tokens_with_their_probabilities():
    logits = torch.tensor([[-3.0, 2.0, 1.0, 0.5, -1.0, 0.0]])
    logprobs = process_logits(logits.expand(20000, -1), top_k=3)  # keeps ids 1, 2, 3
    uniform = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample_from_logprobs(logprobs, uniform), minlength=6).float() / 20000
    assert counts[[0, 4, 5]].sum() == 0
    torch.testing.assert_close(counts, logprobs[0].exp(), atol=0.015, rtol=0)
    # the ends of [0, 1] (1.0 stands for a product rounded up to the total) land on the first and the last kept
    # token, never on a dropped one
    ends = sample_from_logprobs(logprobs[:3], torch.tensor([0.0, 1.0 - 2**-24, 1.0]))
    assert ends.tolist() == [1, 3, 3]


def test_each_completion_stops_at_its_first_eos_which_is_included():
    seeds = list(range(len(PROMPTS)))
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=30) as free:
        unstopped = asyncio.run(_seeded(free, PROMPTS, seeds))
    first = unstopped[0].token_ids
    eos = next(t for i, t in enumerate(first) if i >= 3 and t not in first[:i])  # first occurrence at index >= 3
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[eos], max_tokens=30) as stopping:
        stopped = asyncio.run(_seeded(stopping, PROMPTS, seeds))
    for full, out in zip(unstopped, stopped, strict=True):
        if eos in full.token_ids:
            end = full.token_ids.index(eos) + 1
            assert out.token_ids == full.token_ids[:end] and not out.truncated
        else:
            assert out.token_ids == full.token_ids and out.truncated
    assert stopped[0].token_ids[-1] == eos and len(stopped[0].token_ids) >= 4


async def _seeded(generator, prompts, seeds):
    return await asyncio.gather(*(generator.generate(p, seed=s) for p, s in zip(prompts, seeds, strict=True)))


def test_seeded_request_gives_the_same_completion_alone_or_in_a_batch():
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=16) as generator:
        alone = asyncio.run(generator.generate(PROMPTS[1], seed=7))
        batched = asyncio.run(_seeded(generator, PROMPTS, [1, 7, 2, 3]))[1]
        other_seed = asyncio.run(generator.generate(PROMPTS[1], seed=8))
    assert alone.token_ids == batched.token_ids
    assert alone.token_ids != other_seed.token_ids


def test_a_float16_policy_samples_through_torchs_sampler():
    """The fused sampler reads float32 and bf16 logits; a float16 policy's go through `sampling` (as float32), and its
    log-probabilities are a teacher-forced float16 forward's (to float16's resolution)."""
    with EmbeddedGenerator(tiny_llama(seed=0).half(), eos_token_ids=[], max_tokens=6) as generator:
        output = asyncio.run(generator.generate(PROMPTS[0], seed=3))
    reference = teacher_forced_logprobs(tiny_llama(seed=0).half(), PROMPTS[0], output.token_ids)
    assert len(output.token_ids) == 6
    torch.testing.assert_close(torch.tensor(output.logprobs), reference, atol=2e-2, rtol=0)


def test_greedy_decoding_follows_the_argmax_of_a_full_forward():
    reference = tiny_llama(seed=0)
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], temperature=0.0, max_tokens=12) as generator:
        output = generate_all(generator, PROMPTS[:1])[0]
    ids = torch.tensor([PROMPTS[0] + output.token_ids])
    with torch.no_grad():
        logits = reference(ids).logits[0, len(PROMPTS[0]) - 1 : -1]
    assert output.token_ids == logits.argmax(-1).tolist()


def test_per_call_max_tokens_caps_only_that_call_and_finished_rows_leave_the_batch_exactly():
    limits = [3, None, 7, 5]  # rows finish at different steps, so the batch (and its KV cache) shrinks twice
    reference = tiny_llama(seed=0)
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=20, seed=0) as generator:

        async def run():
            return await asyncio.gather(
                *(generator.generate(p, max_tokens=n) for p, n in zip(PROMPTS, limits, strict=True))
            )

        outputs = asyncio.run(run())
    assert [len(o.token_ids) for o in outputs] == [3, 20, 7, 5]
    assert max_logprob_error(reference, PROMPTS, outputs) <= 1e-4


@pytest.mark.timeout(60)
def test_event_loop_keeps_ticking_during_a_long_generation():
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=400, seed=0) as generator:

        async def run():
            gaps, last = [], time.perf_counter()
            task = asyncio.gather(*(generator.generate(p) for p in PROMPTS * 4))
            while not task.done():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            await task
            return gaps

        gaps = asyncio.run(run())
    assert sum(gaps) > 0.2, "the generation was too short to show anything"
    assert max(gaps) < 0.25, f"the event loop stalled for {max(gaps):.3f} s"


@pytest.mark.timeout(60)
def test_close_fails_waiting_callers_and_stops_the_thread():
    generator = EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=100_000)

    async def run():
        task = asyncio.ensure_future(generator.generate(PROMPTS[0]))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(generator.close)
        with pytest.raises(RuntimeError, match="closed"):
            await task
        with pytest.raises(RuntimeError, match="after `close"):
            await generator.generate(PROMPTS[0])

    asyncio.run(run())
    assert not generator._thread.is_alive()


def test_bad_prompts_are_rejected_with_the_bad_value():
    with EmbeddedGenerator(tiny_llama(seed=0), max_tokens=4) as generator:
        with pytest.raises(ValueError, match=r"prompt_ids=\[\]"):
            asyncio.run(generator.generate([]))
        with pytest.raises(ValueError, match="token id 100, outside the model's vocabulary"):
            asyncio.run(generator.generate([2, 100]))
        with pytest.raises(ValueError, match="max_tokens=0"):
            asyncio.run(generator.generate([2], max_tokens=0))
        assert len(asyncio.run(generator.generate([2])).token_ids) >= 1  # still serving


def test_invalid_sampling_options_are_reported_together():
    with pytest.raises(
        ValueError, match=r"temperature=-1.*top_p=0.*min_p=2.*repetition_penalty=0.*stop='x'.*max_batch"
    ):
        EmbeddedGenerator(
            tiny_llama(seed=0), temperature=-1, top_p=0, min_p=2, repetition_penalty=0, stop="x", max_batch_size=0
        )
    with pytest.raises(ValueError, match="needs the policy's tokenizer"):
        EmbeddedGenerator(tiny_llama(seed=0), stop=["x"])


def test_model_without_weights_needs_a_weight_receiver():
    with pytest.raises(ValueError, match="no `weight_receiver`"):
        EmbeddedGenerator(PolicySpec.from_model(tiny_llama(seed=0)))


def test_specs_pickle_small_and_build_the_named_model():
    model = tiny_llama(seed=0)
    config_spec = PolicySpec.from_model(model)
    assert len(pickle.dumps(GeneratorSpec(config_spec))) < 4096
    built = pickle.loads(pickle.dumps(config_spec)).build()
    assert [(n, p.shape) for n, p in built.named_parameters()] == [(n, p.shape) for n, p in model.named_parameters()]
    generator = GeneratorSpec(PolicySpec(name="tiny-random"), eos_token_ids=(3,), max_tokens=5).build()
    with generator:
        assert generator.eos_token_ids == {3}
        torch.testing.assert_close(generator.model.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match="exactly one of"):
        PolicySpec()


# -- min-p, repetition penalty and stop strings ------------------------------------------------------------------------


def test_process_logits_applies_repetition_penalty_temperature_and_min_p_as_transformers_does():
    """Against transformers' own processors, in the order vLLM and GRPOTrainer's generation config apply them."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 60, generator=gen) * 3
    history = torch.randint(0, 60, (4, 12), generator=gen)  # prompt and completion so far, per row
    seen = torch.zeros(4, 60, dtype=torch.bool).scatter_(1, history, True)
    expected = RepetitionPenaltyLogitsProcessor(1.4)(history, logits.clone())
    expected = TemperatureLogitsWarper(0.7)(history, expected)
    expected = MinPLogitsWarper(0.1)(history, expected).log_softmax(-1)
    got = process_logits(logits, 0.7, min_p=0.1, repetition_penalty=1.4, seen=seen)
    torch.testing.assert_close(got, expected)
    assert torch.isinf(got).any() and (got.exp().sum(-1) - 1).abs().max() < 1e-5
    greedy = process_logits(logits, 0.0, min_p=0.1, repetition_penalty=1.4, seen=seen)  # greedy: the penalty only
    torch.testing.assert_close(greedy, RepetitionPenaltyLogitsProcessor(1.4)(history, logits.clone()).log_softmax(-1))
    with pytest.raises(ValueError, match="needs `seen`"):
        process_logits(logits, repetition_penalty=1.4)


def test_seen_tokens_mark_the_prompt_and_the_completion_before_each_position():
    seen = seen_tokens([5, 6], [7, 5, 8], vocab_size=10)
    assert [row.nonzero().flatten().tolist() for row in seen] == [[5, 6], [5, 6, 7], [5, 6, 7]]


def test_stop_strings_and_repetition_penalty_give_logprobs_of_the_processed_distribution():
    tokenizer = char_tokenizer()
    sampling = {"temperature": 0.8, "min_p": 0.02, "repetition_penalty": 1.5}
    seeds = list(range(len(PROMPTS)))
    options = dict(eos_token_ids=[], max_tokens=30, tokenizer=tokenizer, **sampling)
    with EmbeddedGenerator(tiny_llama(seed=0), **options) as free:
        unstopped = asyncio.run(_seeded(free, PROMPTS, seeds))
    text = tokenizer.decode(unstopped[0].token_ids)
    stop = text[5:7]  # two characters, two tokens: found only once the second one is sampled
    assert len(stop) == 2 and len(tokenizer.encode(stop)) == 2
    with EmbeddedGenerator(tiny_llama(seed=0), stop=[stop, "never"], **options) as stopping:
        stopped = asyncio.run(_seeded(stopping, PROMPTS, seeds))
    for full, out in zip(unstopped, stopped, strict=True):
        full_text = tokenizer.decode(full.token_ids)
        if stop in full_text:  # the same draws up to the token completing the stop string, which ends it
            end = next(i for i in range(1, 31) if stop in tokenizer.decode(full.token_ids[:i]))
            assert out.token_ids == full.token_ids[:end] and out.stop_string == stop and not out.truncated
        else:
            assert out.token_ids == full.token_ids and out.truncated and out.stop_string is None
    assert stopped[0].stop_string == stop and tokenizer.decode(stopped[0].token_ids).endswith(stop)
    reference = tiny_llama(seed=0)
    assert max_logprob_error(reference, PROMPTS, stopped, **sampling) <= 1e-4
    plain = max_logprob_error(reference, PROMPTS, stopped, temperature=0.8)
    assert plain > 1e-2  # the penalty and min-p did change the distribution the tokens were drawn from


# -- continuous batching, shared prefill, seeds --------------------------------------------------------------------


def test_samples_of_one_prompt_share_one_prefill_and_each_is_exact():
    reference = tiny_llama(seed=0)
    calls = [(PROMPTS[0], {})] * 8 + [(PROMPTS[1], {})] * 2
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=12, seed=0) as generator:
        outputs = asyncio.run(_gather(generator, calls))
        metrics = generator.metrics()
    assert metrics["generation/prefills_total"] == 2
    assert metrics["generation/prefill_tokens_total"] == len(PROMPTS[0]) + len(PROMPTS[1])
    assert len({tuple(o.token_ids) for o in outputs[:8]}) == 8  # independent samples of the same prompt
    assert max_logprob_error(reference, [p for p, _ in calls], outputs) <= 1e-4


@pytest.mark.timeout(60)
def test_a_request_joins_the_running_batch_and_leaves_it_as_soon_as_it_ends():
    reference = tiny_llama(seed=0)
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=120, seed=0) as generator:

        async def run():
            long = asyncio.ensure_future(generator.generate(PROMPTS[0]))
            while generator.metrics()["generation/steps_total"] < 10:
                await asyncio.sleep(0.001)
            short = await generator.generate(PROMPTS[2], max_tokens=5)  # joins the running completion
            return short, long.done(), generator.metrics()["generation/steps_total"], await long

        short, long_done_then, steps_then, long = asyncio.run(run())
        steps = generator.metrics()["generation/steps_total"]
    assert not long_done_then and steps_then < 120  # the short one ended while the long one was still running
    assert steps == 120  # and shared its steps: one step per token of the long completion
    assert len(short.token_ids) == 5 and len(long.token_ids) == 120
    assert max_logprob_error(reference, [PROMPTS[2], PROMPTS[0]], [short, long]) <= 1e-4


def test_requests_beyond_max_batch_size_join_as_rows_free_and_reuse_their_prompts_prefill():
    reference = tiny_llama(seed=0)
    limits = [3, 9, 4, 7, 5, 8, 2, 6]  # rows leave at different steps; the slots they free are reused
    calls = [(PROMPTS[0], {"max_tokens": n}) for n in limits] + [(PROMPTS[1], {"max_tokens": 4})]
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_batch_size=3, seed=0) as generator:
        outputs = asyncio.run(_gather(generator, calls))
        metrics = generator.metrics()
    assert [len(o.token_ids) for o in outputs] == [*limits, 4]
    assert metrics["generation/prefills_total"] == 2  # the group's prompt is prefilled once, its samples join later
    assert metrics["generation/steps_total"] < sum(limits) + 4  # rows ran together
    assert max_logprob_error(reference, [p for p, _ in calls], outputs) <= 1e-4


def test_seeded_request_gives_the_same_completion_alone_in_a_group_or_joining_late():
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=16) as generator:
        alone = asyncio.run(generator.generate(PROMPTS[1], seed=7))
        in_group = asyncio.run(_gather(generator, [(PROMPTS[1], {"seed": s}) for s in (1, 7, 2, 3)]))[1]

        async def late():
            running = asyncio.ensure_future(_gather(generator, [(PROMPTS[0], {"max_tokens": 40})] * 3))
            while generator.metrics()["generation/steps_total"] < 5:
                await asyncio.sleep(0.001)
            joined = await generator.generate(PROMPTS[1], seed=7)
            await running
            return joined

        steps_before = generator.metrics()["generation/steps_total"]
        joined = asyncio.run(late())
        assert generator.metrics()["generation/steps_total"] - steps_before < 40 + 16  # it did join running rows
    assert alone.token_ids == in_group.token_ids == joined.token_ids


# -- architectures --------------------------------------------------------------------------------------------------


def _tiny(model_type: str, **extra):
    config = AutoConfig.for_model(
        model_type,
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": None}), ("llama", {"attention_bias": True})],
)
def test_llama_family_decoders_sample_with_exact_logprobs(model_type, extra):
    model = _tiny(model_type, **extra)
    with EmbeddedGenerator(model, eos_token_ids=[], max_tokens=10, seed=0) as generator:
        outputs = generate_all(generator, PROMPTS)
    assert max_logprob_error(_tiny(model_type, **extra), PROMPTS, outputs) <= 1e-4


def test_a_model_that_is_not_a_causal_lm_is_refused_and_gpt2_runs_on_the_generic_decoder():
    """Every family's generation: tests/models/test_family_generation.py."""
    bert = AutoConfig.for_model("bert", vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"decoder-only causal LMs.*model_type='bert' is an encoder"):
        GeneratorSpec(PolicySpec(config=bert.to_dict()))  # in the trainer, before a child is spawned
    config = AutoConfig.for_model("gpt2", vocab_size=100, n_embd=32, n_layer=1, n_head=2)
    gpt2 = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*generator='vllm'"):
        EmbeddedGenerator(gpt2, decoder="fast")
    with EmbeddedGenerator(gpt2, eos_token_ids=[], max_tokens=3) as generator:  # the generic decoder runs it
        assert len(generate_all(generator, PROMPTS[:1])[0].token_ids) == 3


def test_a_burst_of_prompts_is_prefilled_over_several_steps_within_the_token_budget(monkeypatch):
    from lightning_grpo.rollout import batching

    monkeypatch.setattr(batching, "_MAX_PREFILL_TOKENS", 12)  # the prompts have 11, 3, 6 and 2 tokens
    reference = tiny_llama(seed=0)
    with EmbeddedGenerator(tiny_llama(seed=0), eos_token_ids=[], max_tokens=6, seed=0) as generator:
        outputs = generate_all(generator, PROMPTS)
        metrics = generator.metrics()
    assert metrics["generation/prefills_total"] == 4
    assert metrics["generation/steps_total"] == 6 + 1  # the first prompt alone, the other three one step later
    assert max_logprob_error(reference, PROMPTS, outputs) <= 1e-4
