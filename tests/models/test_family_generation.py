"""The embedded generator on every zoo family (tests/helpers/model_zoo.py): the logprobs of what it samples equal
those of a teacher-forced forward of the same model, with prompts of different lengths, a group sharing one prefill,
rows that finish early (the longest one first) and requests that join mid-stream, shorter and longer than the
running rows; after a weight sync the next samples come from the new weights. Each family runs on the decoder
`choose_decoder` picks for it and, where that is the fast one, on the generic one too. A model that is not a
decoder-only causal LM is refused in one line."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch
from helpers.model_zoo import FAMILIES, zoo_config, zoo_model
from transformers import AutoConfig

from lightning_grpo.rollout.decoder_choice import choose_decoder
from lightning_grpo.rollout.generator import EmbeddedGenerator, GeneratorSpec, PolicySpec
from lightning_grpo.rollout.sampling import teacher_forced_logprobs

SHORT, GROUP, MEDIUM, TINY = [2, 50, 51], [2, 60, 61, 62, 63, 64], [2, 80, 81, 82, 83], [2, 70]
LONGEST = [2, *range(40, 50)]  # 11 tokens, over the zoo's sliding window of 8
LATE_LONG = [2, *range(20, 39)]  # 20 tokens: longer than the running rows when it joins
# (prompt, max_tokens): the longest row leaves first, the group's samples leave at different steps
FIRST_WAVE = [(LONGEST, 3), (GROUP, 10), (GROUP, 6), (GROUP, 10), (GROUP, 8), (TINY, 12)]
LATE_WAVE = [(LATE_LONG, 6), (MEDIUM, 5), (SHORT, 4)]  # join at step `JOIN_AT_STEP`
JOIN_AT_STEP = 5


def _paths(family: str) -> list[str]:
    """The decoders a family is tested on: the one chosen for it, and the generic one where that is the fast one."""
    return ["auto"] if choose_decoder(zoo_config(family)).path == "generic" else ["auto", "generic"]


FAMILY_PATHS = [pytest.param(family, path, id=f"{family}-{path}") for family in FAMILIES for path in _paths(family)]


def logprob_errors(reference, calls, outputs) -> list[float]:
    """Each completion's largest distance from the logprobs of a teacher-forced forward of `reference`."""
    return [
        (teacher_forced_logprobs(reference, prompt, output.token_ids) - torch.tensor(output.logprobs))
        .abs()
        .max()
        .item()
        for (prompt, _), output in zip(calls, outputs, strict=True)
    ]


class _PollHook:
    """A weight receiver whose `poll` (the worker calls it once before each step) runs `action(model)` at its `at`-th
    call; `action` returns the version of weights it copied in, or None."""

    def __init__(self, at: int, action) -> None:
        self.at, self.action, self.polls = at, action, 0
        self.reached, self.resume = threading.Event(), threading.Event()

    def poll(self, model: torch.nn.Module) -> int | None:
        self.polls += 1
        return self.action(model) if self.polls == self.at else None

    def close(self) -> None:
        self.resume.set()


def pause_before_step(at: int) -> _PollHook:
    """A receiver that holds the worker before step `at` until `resume` is set (and syncs nothing)."""

    def pause(model: torch.nn.Module) -> None:
        hook.reached.set()
        hook.resume.wait(30)

    hook = _PollHook(at, pause)
    return hook


def sync_before_step(at: int, state: dict[str, torch.Tensor], version: int) -> _PollHook:
    """A receiver that copies `state` into the model, in place, before step `at`."""

    def sync(model: torch.nn.Module) -> int:
        model.load_state_dict(state)  # copies into the model's own tensors
        return version

    return _PollHook(at, sync)


def late_join_generator(model, **options) -> tuple[EmbeddedGenerator, _PollHook]:
    """A generator for `first_then_late` and the hook that pauses it before step `JOIN_AT_STEP - 1`."""
    hook = pause_before_step(JOIN_AT_STEP - 1)
    return EmbeddedGenerator(model, eos_token_ids=[], seed=0, weight_receiver=hook, **options), hook


async def first_then_late(generator: EmbeddedGenerator, hook: _PollHook):
    """The first wave at once; the late wave while the worker waits before step `JOIN_AT_STEP - 1`, so that it joins
    the running rows at step `JOIN_AT_STEP`."""
    first = asyncio.gather(*(generator.generate(p, max_tokens=n, seed=i) for i, (p, n) in enumerate(FIRST_WAVE)))
    await asyncio.to_thread(hook.reached.wait, 30)
    late = asyncio.gather(*(generator.generate(p, max_tokens=n, seed=9 + i) for i, (p, n) in enumerate(LATE_WAVE)))
    for _ in range(3):  # the calls start, then hand their requests over to the worker
        await asyncio.sleep(0)
    hook.resume.set()
    return [*await first, *await late]


@pytest.mark.parametrize(("family", "decoder"), FAMILY_PATHS)
def test_every_family_samples_with_the_logprobs_of_a_teacher_forced_forward(family, decoder):
    generator, hook = late_join_generator(zoo_model(family), decoder=decoder)
    with generator:
        outputs = asyncio.run(first_then_late(generator, hook))
        metrics = generator.metrics()
    calls = FIRST_WAVE + LATE_WAVE
    assert [len(o.token_ids) for o in outputs] == [n for _, n in calls]
    assert metrics["generation/prefills_total"] == 3 + 3  # the group's 4 samples share one prefill
    assert metrics["generation/steps_total"] == 12  # the late wave (6 steps from step 5) joined the running rows
    errors = logprob_errors(zoo_model(family), calls, outputs)
    assert max(errors) <= 1e-4, errors


@pytest.mark.parametrize("family", list(FAMILIES))
def test_after_a_weight_sync_the_next_samples_come_from_the_new_weights(family):
    """4 samples of one prompt, 2 at a time: the first two run while the weights change at their third step; the
    last two start after it and must not reuse the prompt's prefill by the old weights."""
    old, new = zoo_model(family, seed=0), zoo_model(family, seed=1)
    receiver = sync_before_step(3, new.state_dict(), version=1)
    options = dict(eos_token_ids=[], max_tokens=6, max_batch_size=2, weight_receiver=receiver)
    with EmbeddedGenerator(zoo_model(family, seed=0), **options) as generator:

        async def run():
            return await asyncio.gather(*(generator.generate(GROUP, seed=i) for i in range(4)))

        outputs = asyncio.run(run())
        metrics = generator.metrics()
    assert metrics["generation/weight_syncs_total"] == 1 and metrics["generation/prefills_total"] == 2
    for running in outputs[:2]:  # the weights changed under them, between their second and third token
        assert running.token_versions == (0, 0, 1, 1, 1, 1) and running.model_version == 0
        before = teacher_forced_logprobs(old, GROUP, running.token_ids)[:2]
        assert (before - torch.tensor(running.logprobs[:2])).abs().max() <= 1e-4
    started_after = outputs[2:]
    assert all(o.token_versions == (1,) * 6 and o.model_version == 1 for o in started_after)
    calls = [(GROUP, 6)] * 2
    assert max(logprob_errors(new, calls, started_after)) <= 1e-4
    assert min(logprob_errors(old, calls, started_after)) > 1e-3  # the old weights would be told apart


@pytest.mark.parametrize(("family", "decoder"), [("llama", "fast"), ("lfm2", "generic")])
def test_bf16_models_sample_with_the_logprobs_of_their_teacher_forced_forward_at_bf16_resolution(family, decoder):
    """In bf16 a batched step and a full forward round differently; the logprobs still agree to bf16's resolution."""
    generator, hook = late_join_generator(zoo_model(family, dtype=torch.bfloat16))
    with generator:
        assert choose_decoder(generator.model.config).path == decoder
        outputs = asyncio.run(first_then_late(generator, hook))
    errors = logprob_errors(zoo_model(family, dtype=torch.bfloat16), FIRST_WAVE + LATE_WAVE, outputs)
    assert max(errors) <= 2e-2, errors


def test_the_generic_decoder_on_llama_gives_the_logprobs_of_the_fast_one(caplog):
    """Both against the same teacher-forced forward; where both sampled the same tokens, the same logprobs."""
    outputs = {}
    for decoder in ("fast", "generic"):
        with caplog.at_level(logging.INFO, logger="lightning_grpo.rollout.generator"):
            generator, hook = late_join_generator(zoo_model("llama"), decoder=decoder)
        with generator:
            outputs[decoder] = asyncio.run(first_then_late(generator, hook))
        assert f"on the {decoder} path" in caplog.text
        errors = logprob_errors(zoo_model("llama"), FIRST_WAVE + LATE_WAVE, outputs[decoder])
        assert max(errors) <= 1e-4, (decoder, errors)
    for fast, generic in zip(outputs["fast"], outputs["generic"], strict=True):
        pairs = enumerate(zip(fast.token_ids, generic.token_ids, strict=True))  # the same lengths: no EOS
        same = next((i for i, (a, b) in pairs if a != b), len(fast.token_ids))
        torch.testing.assert_close(fast.logprobs[:same], generic.logprobs[:same], atol=2e-4, rtol=0)


def test_the_choice_is_logged_in_one_line_with_its_reason(caplog):
    with caplog.at_level(logging.INFO, logger="lightning_grpo.rollout.generator"):
        EmbeddedGenerator(zoo_model("gpt2"), max_tokens=2).close()
    (line,) = [r.getMessage() for r in caplog.records if "path" in r.getMessage()]
    assert "generic path" in line and "model_type='gpt2'" in line and "\n" not in line


def test_choose_decoder_picks_the_fast_decoder_for_its_families_and_the_generic_one_for_the_others():
    assert choose_decoder(zoo_config("llama")).path == "fast"
    gpt2 = choose_decoder(zoo_config("gpt2"))
    assert gpt2.path == "generic" and "model_type='gpt2'" in gpt2.reason
    assert choose_decoder(zoo_config("llama"), "generic").path == "generic"
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        choose_decoder(zoo_config("gpt2"), "fast")
    with pytest.raises(ValueError, match=r"`decoder='slow'` is not one of 'auto', 'fast', 'generic'"):
        choose_decoder(zoo_config("llama"), "slow")
    with pytest.raises(ValueError, match=r"`decoder='slow'`"):  # a named policy's too, before a child is spawned
        GeneratorSpec(PolicySpec(name="tiny-random"), decoder="slow")


@pytest.mark.parametrize(
    ("model_type", "what"), [("t5", "an encoder-decoder"), ("bert", "an encoder"), ("bart", "an encoder-decoder")]
)
def test_a_model_that_is_not_a_decoder_only_causal_lm_is_refused_in_one_line(model_type, what):
    config = AutoConfig.for_model(model_type, vocab_size=100).to_dict()
    for build in (GeneratorSpec, EmbeddedGenerator):  # in the trainer before a child is spawned, and in the child
        with pytest.raises(ValueError, match=rf"decoder-only causal LMs.*model_type='{model_type}' is {what}") as error:
            build(PolicySpec(config=config), weight_receiver=pause_before_step(1))
        assert "\n" not in str(error.value)


def test_a_decoder_set_to_attend_both_ways_is_refused_in_one_line():
    config = zoo_config("llama").to_dict() | {"use_bidirectional_attention": True}
    with pytest.raises(ValueError, match=r"model_type='llama' is set to attend both ways.*set it to False"):
        choose_decoder(config)
