"""Bad configuration of the newer features (tools, environments, LoRA, the loss family, group and completion sizes, a
vLLM server that is not there) ends `lightning-grpo fit` with exit code 2 and one line naming the value and the fix,
before any process starts.

The command runs in this process (`in_process`); `bad_features` holds the tools and factories it is given.
"""

from __future__ import annotations

from importlib.resources import files

import lightning.pytorch  # noqa: F401 - imported now, its log handler holds the session's stderr, not one test's
import pytest

from lightning_grpo.cli import main

SMOKE = str(files("lightning_grpo.configs") / "smoke.yaml")
LORA = ["--model.peft_config=peft.LoraConfig", "--model.peft_config.target_modules=[qkv]"]

CASES = {
    "tool_not_callable": (
        ["--data.tools=[bad_features.NOT_CALLABLE]"],
        "'bad_features.NOT_CALLABLE'",
        "name a function",
    ),
    "tool_without_schema": (["--data.tools=[bad_features.untyped_tool]"], "untyped_tool", "needs type hints"),
    "factory_not_callable": (["--data.environment_factory=bad_features.NOT_CALLABLE"], "NOT_CALLABLE", "pass a class"),
    "factory_takes_arguments": (["--data.environment_factory=bad_features.env_for"], "env_for", "functools.partial"),
    "class_takes_arguments": (
        ["--data.environment_factory=bad_features.SizedEnv"],
        "SizedEnv)` takes arguments (size)",
        "give them defaults",
    ),
    "class_without_reset": (["--data.environment_factory=bad_features.NoReset"], "NoReset", "needs `reset(**row)`"),
    "instances_without_reset": (
        ["--data.environment_factory=bad_features.no_reset"],
        "NoReset",
        "needs `reset(**row)`",
    ),
    "environment_tool_without_schema": (
        ["--data.environment_factory=bad_features.guess_env"],
        "GuessEnv.guess",
        "needs type hints",
    ),
    "lora_targets_nothing": (LORA, "target_modules=['qkv']", "Pass some of these as `target_modules`"),
    "loss_type": (["--model.loss_type=grpo2"], "Got value: grpo2", "Did you mean 'grpo'?"),
    "importance_sampling_level": (["--model.importance_sampling_level=tokens"], "tokens", "Did you mean 'token'?"),
    "vllm_importance_sampling_mode": (
        ["--model.vllm_importance_sampling_mode=truncate"],
        "Got value: truncate",
        "Did you mean 'token_truncate'?",
    ),
    "num_generations": (["--data.num_generations=1"], "num_generations=1", "at least 2 completions"),
    "max_completion_length": (["--data.max_completion_length=0"], "max_completion_length=0", "at least 1"),
    "vllm_server_unreachable": (
        ["--data.generator=vllm", "--data.vllm_server_url=http://127.0.0.1:9", "--data.vllm_server_timeout=1"],
        "no vLLM server answered http://127.0.0.1:9/health",
        "lightning-grpo vllm-serve",
    ),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("options", "value", "fix"), list(CASES.values()), ids=list(CASES))
def test_bad_feature_configuration_exits_2_in_one_line_naming_value_and_fix_before_any_process_starts(
    options, value, fix, capsys, in_process, started_processes, no_leaked_processes
):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", SMOKE, *options])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "Traceback" not in error, error[-2000:]
    message = error[error.rindex("error: ") :].strip()  # the parser's usage lines come before it
    assert len(message.splitlines()) == 1, message
    assert value in message and fix in message, message
    assert started_processes == []
