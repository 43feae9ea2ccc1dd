"""The option lists of the reference, generated from the signatures and docstrings of the configurable classes.

Each entry is one `__init__` parameter: its type and default from `inspect.signature`, its meaning from the class
docstring's `Args:` section, and its TRL counterpart: the `GRPOConfig` (else `AsyncGRPOConfig`) field of the same
name with TRL's default, or the name listed in `TRL_NAMES`, checked against TRL's own classes when the page is built.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from dataclasses import dataclass
from typing import Any

# Ours -> TRL's, where TRL names the same knob differently. Each entry is checked against TRL at build time.
TRL_NAMES: dict[str, tuple[str, ...]] = {
    "GRPOModule.model": ("GRPOTrainer(model=)",),
    "GRPOModule.betas": ("GRPOConfig.adam_beta1", "GRPOConfig.adam_beta2"),
    "GRPOModule.optimizer": ("GRPOConfig.optim",),
    "GRPOModule.lr_scheduler": ("GRPOConfig.lr_scheduler_type",),
    "GRPOModule.scorers": ("GRPOTrainer(reward_funcs=)",),
    "GRPOModule.peft_config": ("GRPOTrainer(peft_config=)",),
    "GRPODataModule.tokenizer": ("GRPOTrainer(processing_class=)",),
    "GRPODataModule.dataset": ("GRPOTrainer(train_dataset=)",),
    "GRPODataModule.val_dataset": ("GRPOTrainer(eval_dataset=)",),
    "GRPODataModule.reward_funcs": ("GRPOTrainer(reward_funcs=)",),
    "GRPODataModule.generator": ("GRPOConfig.use_vllm",),
    "GRPODataModule.vllm_server_url": ("AsyncGRPOConfig.vllm_server_base_url",),
    "GRPODataModule.weight_transfer": ("AsyncGRPOTrainer(weight_transfer=)",),
    "GRPODataModule.epochs": ("GRPOConfig.num_train_epochs",),
    "GRPODataModule.heartbeat_timeout": ("AsyncGRPOConfig.heartbeat_stale_after_s",),
    "GRPODataModule.tools": ("GRPOTrainer(tools=)",),
    "GRPODataModule.environment_factory": ("GRPOTrainer(environment_factory=)",),
    "WeightSyncCallback.every_n_steps": ("AsyncGRPOConfig.weight_sync_steps",),
    "CompletionsTableCallback.log_completions_every_n_steps": (
        "GRPOConfig.log_completions",
        "GRPOConfig.logging_steps",
    ),
}


@dataclass(frozen=True)
class Option:
    """One constructor parameter as the reference shows it."""

    name: str
    type: str  # the annotation as written in the signature; "" when there is none
    default: str  # repr() of the default; "required" when there is none
    trl: str  # the TRL counterpart(s) with TRL's default, as Markdown; "" when TRL has none
    meaning: str  # the docstring's Args entry, on one line; "" when undocumented


def _trl_classes() -> dict[str, Any]:
    from trl import GRPOConfig, GRPOTrainer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    return {
        "GRPOConfig": GRPOConfig,
        "AsyncGRPOConfig": AsyncGRPOConfig,
        "GRPOTrainer": GRPOTrainer,
        "AsyncGRPOTrainer": AsyncGRPOTrainer,
    }


def _describe_trl(ref: str, classes: dict[str, Any]) -> str:
    """`GRPOConfig.field` -> "`GRPOConfig.field` (`default`)"; `Trainer(arg=)` -> the argument, checked to exist."""
    owner, _, rest = ref.partition(".") if "(" not in ref else ref.partition("(")
    cls = classes[owner]
    if "(" in ref:
        argument = rest.rstrip("=)")
        if argument not in inspect.signature(cls.__init__).parameters:
            raise ValueError(f"TRL_NAMES names {ref}, but {owner}.__init__ has no parameter {argument!r}.")
        return f"`{ref}`"
    fields = {field.name: field for field in dataclasses.fields(cls)}
    if rest not in fields:
        raise ValueError(f"TRL_NAMES names {ref}, but {owner} has no field {rest!r}.")
    return f"`{ref}` (`{fields[rest].default!r}`)"


def _counterpart(cls_name: str, name: str, classes: dict[str, Any]) -> str:
    refs = TRL_NAMES.get(f"{cls_name}.{name}")
    if refs is None:
        for config in ("GRPOConfig", "AsyncGRPOConfig"):
            if name in {field.name for field in dataclasses.fields(classes[config])}:
                refs = (f"{config}.{name}",)
                break
    return ", ".join(_describe_trl(ref, classes) for ref in refs or ())


def parse_args_section(doc: str) -> dict[str, str]:
    """The `Args:` entries of a Google-style docstring, one line each; `a, b: text` documents both `a` and `b`."""
    entries: dict[str, str] = {}
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return entries
    names: list[str] = []
    indent = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break  # the next section (Raises:, Example::)
        match = re.match(r"([\w, ]+?):\s(.*)", line.strip()) if depth == indent else None
        if match:
            names = [part.strip() for part in match.group(1).split(",") if part.strip() not in entries]
            for part in names:
                entries[part] = match.group(2).strip()
        else:
            for part in names:
                entries[part] += " " + line.strip()
    return entries


def _annotation(parameter: inspect.Parameter, namespace: dict[str, Any]) -> str:
    """The annotation as written; a bare alias of a `Literal` (`LossType`) is spelled out, since readers need the choices."""
    annotation = parameter.annotation
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str) and annotation.isidentifier():
        alias = namespace.get(annotation)
        if typing.get_origin(alias) is typing.Literal:
            return "Literal[" + ", ".join(repr(choice) for choice in typing.get_args(alias)) + "]"
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def options(cls: type) -> list[Option]:
    """Every `__init__` parameter of `cls` (but `self`), in signature order."""
    classes = _trl_classes()
    docs = parse_args_section(cls.__doc__ or "")
    docs.update({k: v for k, v in parse_args_section(cls.__init__.__doc__ or "").items() if k not in docs})
    namespace = vars(sys.modules[cls.__module__])
    rows = []
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        default = "required" if parameter.default is inspect.Parameter.empty else repr(parameter.default)
        rows.append(
            Option(
                name,
                _annotation(parameter, namespace),
                default,
                _counterpart(cls.__name__, name, classes),
                docs.get(name, ""),
            )
        )
    return rows


def readable_type(annotation: str) -> str:
    """An annotation as a reader says it: `int | None` -> `int or None`, `Literal['a', 'b']` -> `"a" / "b"`."""

    def choices(match: re.Match) -> str:
        return " / ".join(f'"{choice.strip().strip(chr(39) + chr(34))}"' for choice in match.group(1).split(","))

    return re.sub(r"\s*\|\s*", " or ", re.sub(r"Literal\[([^\]]*)\]", choices, annotation))


def markdown_list(cls: type) -> str:
    """The options of `cls` as a Markdown list: each one's name, type and default on its first line (so the default
    never falls off a narrow screen), then its meaning and its TRL counterpart."""
    items = []
    for option in options(cls):
        head = [f'<code class="lg-name">{option.name}</code>']
        if option.type:
            head.append(f"`{readable_type(option.type)}`")
        head.append(f"default `{option.default}`" if option.default != "required" else "**required**")
        item = f"- {' · '.join(head)}<br>{option.meaning.replace(chr(10), ' ')}"
        if option.trl:
            item += f"<br>TRL: {option.trl}"
        items.append(item)
    return "\n".join(items)


def undocumented(cls: type) -> list[str]:
    """The parameters of `cls` its docstring's `Args:` section leaves out."""
    return [option.name for option in options(cls) if not option.meaning]
