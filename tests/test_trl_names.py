"""TRL's private names that lightning_grpo relies on, pinned: a TRL release that moves one fails here, with the list.

`lightning_grpo/_trl.py` is the only module that imports TRL. This test lists, for each TRL name it imports, what
the rollout loop, the worker, the planner's rows and the weight transfers use of it: module names, the methods the
loop overrides or calls (with their parameters), the attributes it reads from TRL's loop and those TRL's loop reads
back from ours, and the fields of TRL's records.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import multiprocessing as mp

ASYNC_GRPO = "trl.experimental.async_grpo"

#: module -> names imported from it
MODULE_NAMES = {
    f"{ASYNC_GRPO}.async_rollout_worker": [
        "_AsyncRolloutLoop",
        "_child_main",
        "RolloutGroup",
        "TrainingSequence",
        "TurnRecord",
        "_chain_to_sequences",
    ],
    f"{ASYNC_GRPO}.packing": ["TreeRow", "tree_attention", "_flash_attn"],
    f"{ASYNC_GRPO}.async_grpo_trainer": [
        "_iter_vllm_named_params",
        "validate_lora_for_vllm_sync",
        "select_adapter_sync",
        "round_lora_rank",
    ],
    f"{ASYNC_GRPO}.weight_transfer": ["WeightTransferClient"],
    f"{ASYNC_GRPO}.vllm_client": ["VLLMClient"],
    "trl.chat_template_utils": [
        "add_response_schema",
        "get_training_chat_template",
        "is_chat_template_prefix_preserving",
        "parse_response",
        "supports_tool_calling",
        "qwen3_template",
    ],
    "trl.trainer.utils": ["get_callable_name", "is_async_callable"],
}

#: `_AsyncRolloutLoop` methods GRPORolloutLoop overrides or calls -> the parameters it passes or accepts
LOOP_METHODS = {
    "__init__": [
        "model_name",
        "dataset",
        "reward_funcs",
        "processing_class",
        "eos_token_ids",
        "tools",
        "min_p",
        "repetition_penalty",
        "lora_name",
    ],
    "run": [],
    "_run_loops": ["stop_event"],
    "_generate_loop": ["stop_event"],
    "_generate_one": ["prompt", "tool_dict", "tools", "group_id"],
    "_generate_one_turn": ["prompt_ids"],
    "_score_group": ["group"],
    "_post": ["path", "payload", "timeout", "max_retries"],
    "_retry": ["coro_factory", "label", "max_attempts"],
    "_push_metrics": ["values"],
    "_push_rollout_metrics": ["turns", "sequences", "completion_ids", "tally", "loop_exhausted", "duration_s"],
}

#: attributes TRL's loop sets in `__init__` that GRPORolloutLoop reads
LOOP_ATTRIBUTES = [
    "dataset",
    "reward_funcs",
    "reward_func_names",
    "tokenizer",
    "eos_token_ids",
    "num_generations",
    "max_inflight_tasks",
    "chat_template_kwargs",
    "vllm_server_url",
    "tools",
    "environment_factories",
    "_counters",
    "_rates",
    "_heartbeat_value",
    "_model_version_value",
    "_groups_to_score",
    "_tool_pool",
    "_total_completion_tokens",
    "_standalone_tools",
    "_multi_environment",
    "_env_reward_types",
    "max_tool_calling_iterations",
    "_fork_threshold_tokens",
]
#: set only with an `environment_factory`
ENVIRONMENT_ATTRIBUTES = ["_env_tools", "_environment_pool"]
#: attributes set by GRPORolloutLoop and read by TRL's loop (the vLLM request path adds `stop` to TRL's
#: `/v1/completions` payload, which carries min_p and repetition_penalty, and sends it over a pool of its own)
LOOP_SOURCE_NAMES = [
    "_generation_start_time",
    "_inflight",
    "_total_completion_tokens",
    'self._post("/v1/completions", payload',
    '"repetition_penalty": self.repetition_penalty',
    'payload["min_p"] = self.min_p',
    '"model": self._request_model',  # names the adapter `{lora_name}-v{model_version}` (adapter-only vLLM sync)
    'f"{self.lora_name}-v{self.model_version}"',
    # `_push_rollout_metrics` offsets this count by the generator's own truncation flag
    'self._rates["completions/clipped_ratio"][0] += completion_ids[-1] not in eos_and_pad',
]

ROLLOUT_GROUP_FIELDS = [
    "prompts",
    "reward_kwargs",
    "completions",
    "completions_ids",
    "completions_sequences",
    "tool_call_counts",
    "tool_failure_counts",
    "model_version",
    "group_id",
    "env_rewards",
    "rollout_rewards",
    "queued_at",
]
TRAINING_SEQUENCE_FIELDS = ["input_ids", "completion_mask", "old_log_probs", "rollout_id"]
TURN_RECORD_FIELDS = ["prompt_ids", "output_ids", "output_log_probs"]
#: functions `Conversation` and `lightning_grpo.rollout.chat` call -> the parameters they pass
FUNCTION_PARAMETERS = {
    "_chain_to_sequences": ["turns", "rollout_id", "fork_threshold"],
    "parse_response": ["tokenizer", "ids", "prefix", "tools"],
}
#: TreeRow members `ScoredRow` reads or rewrites (its `pop` undoes an `add` in place)
TREE_ROW_MEMBERS = [
    "fits",
    "add",
    "pack",
    "tokens",
    "children",
    "roots",
    "samples",
    "sample_nodes",
    "groups",
    "load",
    "trained",
]
CHILD_MAIN_PARAMETERS = [
    "loop_cls",
    "loop_kwargs",
    "samples_queue",
    "model_version_value",
    "stop_event",
    "child_ready_event",
    "heartbeat_value",
    "failed_event",
    "exception_info_queue",
    "metrics_queue",
]
WEIGHT_TRANSFER_METHODS = {
    "__init__": ["vllm_client", "weight_update_info", "weight_sync_timeout"],
    "init_weight_transfer": [],
    "pause": [],
    "send_weights": ["iterator"],
    "resume": [],
    "destroy": [],
}


def _parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def _missing_parameters(owner: type, methods: dict[str, list[str]]) -> list[str]:
    missing = []
    for name, parameters in methods.items():
        method = getattr(owner, name, None)
        if method is None:
            missing.append(f"{owner.__name__}.{name}")
            continue
        present = _parameters(method)
        missing += [f"{owner.__name__}.{name}({p}=...)" for p in parameters if p not in present]
    return missing


def _trl_loop(**kwargs):
    from datasets import Dataset

    from lightning_grpo._trl import _AsyncRolloutLoop
    from lightning_grpo.models import char_tokenizer

    ctx = mp.get_context("spawn")
    tokenizer = char_tokenizer()
    tokenizer.response_template = {"fields": {"content": {"content": "text"}}}
    return _AsyncRolloutLoop(
        model_name="tiny-random",
        dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]}),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        processing_class=tokenizer,
        eos_token_ids=[3],
        rollout_buffer=ctx.Queue(),
        model_version_value=ctx.Value("i", 0),
        heartbeat_value=ctx.Value("d", 0.0),
        failed_event=ctx.Event(),
        exception_info_queue=ctx.Queue(),
        metrics_queue=ctx.Queue(),
        **kwargs,
    )


class _Environment:
    def reset(self, **kwargs):
        return None

    def get_reward(self):
        return 1.0


def test_every_private_trl_name_lightning_grpo_relies_on_is_where_it_was():
    missing = []
    for module_name, names in MODULE_NAMES.items():
        module = importlib.import_module(module_name)
        missing += [f"{module_name}.{name}" for name in names if not hasattr(module, name)]
    from lightning_grpo._trl import RolloutGroup, TrainingSequence, TreeRow, _AsyncRolloutLoop, _child_main

    missing += _missing_parameters(_AsyncRolloutLoop, LOOP_METHODS)
    loop, environment_loop = _trl_loop(), _trl_loop(environment_factory=_Environment)
    try:
        missing += [f"_AsyncRolloutLoop().{a}" for a in LOOP_ATTRIBUTES if not hasattr(loop, a)]
        missing += [
            f"_AsyncRolloutLoop(environment_factory=...).{a}"
            for a in ENVIRONMENT_ATTRIBUTES
            if not hasattr(environment_loop, a)
        ]
    finally:
        for each in (loop, environment_loop):
            each._tool_pool.shutdown(wait=False)
            each._loop.close()
    source = inspect.getsource(_AsyncRolloutLoop)
    missing += [f"_AsyncRolloutLoop source: {text!r}" for text in LOOP_SOURCE_NAMES if text not in source]
    missing += [
        f"RolloutGroup.{f}" for f in ROLLOUT_GROUP_FIELDS if f not in {x.name for x in dataclasses.fields(RolloutGroup)}
    ]
    missing += [
        f"TrainingSequence.{f}"
        for f in TRAINING_SEQUENCE_FIELDS
        if f not in {x.name for x in dataclasses.fields(TrainingSequence)}
    ]
    from lightning_grpo import _trl

    missing += [
        f"TurnRecord.{f}" for f in TURN_RECORD_FIELDS if f not in {x.name for x in dataclasses.fields(_trl.TurnRecord)}
    ]
    for name, parameters in FUNCTION_PARAMETERS.items():
        missing += [f"{name}({p}=...)" for p in parameters if p not in _parameters(getattr(_trl, name))]
    template = _trl.hermes_response_template  # the Hermes parser: what the tiny and ChatML tool templates rely on
    if (
        template.get("start_anchor") != "<|im_start|>assistant\n"
        or template["fields"]["tool_calls"].get("open") != "<tool_call>"
    ):
        missing.append("qwen3_template: Hermes-style <tool_call> after <|im_start|>assistant")
    row = TreeRow()
    missing += [f"TreeRow().{m}" for m in TREE_ROW_MEMBERS if not hasattr(row, m)]
    missing += [f"_child_main({p}=...)" for p in CHILD_MAIN_PARAMETERS if p not in _parameters(_child_main)]
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    missing += _missing_parameters(WeightTransferClient, WEIGHT_TRANSFER_METHODS)
    assert not missing, f"TRL moved names lightning_grpo relies on (update lightning_grpo/_trl.py): {missing}"


def test_trls_vllm_manifest_names_a_plain_models_parameters_as_its_checkpoint_does():
    from lightning_grpo._trl import iter_vllm_named_params
    from lightning_grpo.models import tiny_llama

    model = tiny_llama()
    assert [name for name, _ in iter_vllm_named_params(model)] == [name for name, _ in model.named_parameters()]


def test_trls_vllm_manifest_names_a_peft_models_base_parameters_as_the_base_checkpoint_does():
    from peft import LoraConfig, get_peft_model

    from lightning_grpo._trl import iter_vllm_named_params
    from lightning_grpo.models import tiny_llama

    base_names = [name for name, _ in tiny_llama().named_parameters()]
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert [name for name, _ in iter_vllm_named_params(model)] == base_names


def test_only_the_trl_module_imports_trl():
    import pathlib
    import re

    package = pathlib.Path(importlib.import_module("lightning_grpo").__file__).parent
    importers = [
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if re.search(r"^\s*(from trl[. ]|import trl\b)", path.read_text(), flags=re.MULTILINE)
    ]
    assert importers == ["_trl.py"], importers


#: TRL's synchronous trainers' methods the parity tests call or override (tests/helpers/trl_grpo.py), with the
#: parameters they pass or accept
GRPO_TRAINER_METHODS = {
    "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
    "training_step": ["model", "inputs", "num_items_in_batch"],
    "_compute_loss": ["model", "inputs"],
    "_generate_and_score_completions": ["inputs"],
    "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"],
    "_get_per_token_logps_and_entropies": ["model", "input_ids", "attention_mask", "logits_to_keep"],
    "get_high_entropy_mask": ["entropies", "mask", "threshold"],
    "get_off_policy_mask": ["advantages", "per_token_logps", "sampling_per_token_logps", "mask"],
    "get_gamma_weights": ["advantages", "log_ratio_per_token", "mask", "importance_sampling_ratio"],
}
RLOO_TRAINER_METHODS = {
    "_generate_and_score_completions": ["inputs"],
    "_generate_single_turn": ["prompt_ids", "images", "multimodal_fields"],
}
#: attributes of a built trainer that tests/helpers/trl_grpo.py and the parity tests set or read: `use_vllm` (set to
#: stand in for vLLM), `model` (a `LogprobsModel` for one `_generate_and_score_completions` call),
#: `current_gradient_accumulation_steps` (set as `Trainer.train` does, for `_compute_loss` outside it), the rest read
GRPO_TRAINER_ATTRIBUTES = [
    "args",
    "model",
    "use_vllm",
    "temperature",
    "beta",
    "current_gradient_accumulation_steps",
    "_metrics",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
]


def test_the_trl_trainer_code_the_parity_tests_call_is_where_it_was():
    """The GRPO family's parity tests call TRL's own `GRPOTrainer`/`RLOOTrainer` code and `SyncRefModelCallback`;
    a TRL release that renames a method, a parameter or an attribute they read fails here, with the list."""
    from trl.trainer.callbacks import SyncRefModelCallback
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.rloo_trainer import RLOOTrainer

    missing = _missing_parameters(GRPOTrainer, GRPO_TRAINER_METHODS)
    missing += _missing_parameters(RLOOTrainer, RLOO_TRAINER_METHODS)
    missing += _missing_parameters(SyncRefModelCallback, {"_sync_target_model": ["model", "target_model", "alpha"]})
    source = inspect.getsource(GRPOTrainer)
    missing += [f"GRPOTrainer source: self.{name}" for name in GRPO_TRAINER_ATTRIBUTES if f"self.{name}" not in source]
    assert not missing, (
        f"TRL moved names the GRPO-family parity tests rely on (update tests/helpers/trl_grpo.py): {missing}"
    )
