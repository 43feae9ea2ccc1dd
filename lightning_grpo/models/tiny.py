"""The tiny random Llama and its in-code character tokenizer: a real model that needs no download.

`load_policy("tiny-random")` (or `"tiny-random:<seed>"`) builds it: 2 layers, hidden 128, GQA, trains a step in about
10 ms on a CPU, for tests, CI smoke runs and notebooks. `tiny_gemma3` is its Gemma 3 twin (sliding-window and
global layers), for tests of what differs per architecture.
"""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

TINY_MODEL = "tiny-random"

# ChatML; with tools, a one-line system message names them (`Tools: lookup(key)`), a call is written
# `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (TRL's Hermes parser reads it) and a result is a `tool`
# turn. Terse on purpose: every character is a token of this tokenizer.
CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\nTools:' }}"
    "{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- ' ' + f.name + '(' + (f.parameters.properties | default({}) | list | join(', ')) + ')' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '<tool_call>' + ({'name': call.name, 'arguments': call.arguments} | tojson) + '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

_SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def char_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level tokenizer built in code (printable ASCII plus newline), with a ChatML chat template that
    can also write tool calls (see `CHATML_TEMPLATE`).

    Ids: `<pad>`=0, `<unk>`=1, `<|im_start|>`=2 (bos), `<|im_end|>`=3 (eos), then one id per character.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(_SPECIAL_TOKENS + [chr(c) for c in range(32, 127)] + ["\n"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # "." in a regex skips "\n"; [\s\S] takes every character.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.add_special_tokens(_SPECIAL_TOKENS)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_llama_config(vocab_size: int = 100) -> LlamaConfig:
    """Config of the tiny random Llama: hidden 128, 2 layers, 2 query heads sharing 1 KV head (GQA), head_dim 64.

    head_dim 64 keeps it servable by vLLM's CPU backend, which rejects head_dim 16.
    """
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )


def tiny_llama(seed: int = 0, vocab_size: int = 100) -> LlamaForCausalLM:
    """A tiny random `LlamaForCausalLM` in fp32, the same for the same seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(vocab_size))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 3
    return model.eval()


def tiny_gemma3_config(vocab_size: int = 100, sliding_window: int = 4, head_dim: int = 16) -> Gemma3TextConfig:
    """Config of the tiny random Gemma 3: hidden 64, 3 layers (sliding, global, sliding) with a window of
    `sliding_window` positions, 4 query heads sharing 2 KV heads of `head_dim` dimensions (64 to be servable by
    vLLM's CPU backend, which rejects 16), the character tokenizer's ids."""
    return Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=sliding_window,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )


def tiny_gemma3(seed: int = 0, vocab_size: int = 100, sliding_window: int = 4, head_dim: int = 16) -> Gemma3ForCausalLM:
    """A tiny random `Gemma3ForCausalLM` in fp32, the same for the same seed.

    Its norm weights are drawn at random too: Gemma initialises them to 0, where its `(1 + weight)` RMSNorm and a
    plain one would agree.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForCausalLM(tiny_gemma3_config(vocab_size, sliding_window, head_dim))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.5)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 3
    return model.eval()
