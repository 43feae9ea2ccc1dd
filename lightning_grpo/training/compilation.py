"""`GRPOModule(torch_compile=True)`: the policy's decoder layers compiled with `torch.compile` for training.

Each decoder layer (the classes a transformers model lists in `_no_split_modules`) is compiled on its own, with
dynamic shapes: every layer runs the same code, so one compiled graph serves all of them (the compile time is about
one layer's, not the model's), and the packed rows, whose token count changes every step, reuse it instead of
compiling again per length. The fusion of the layer's many small operations (norms, rotary embedding, activation,
residual adds, autocast's casts) is what the compiler buys: the products were already oneDNN's.

The parameters stay the module's own (the layer's `forward` is compiled, not the module wrapped), so checkpoints,
weight pushes and LoRA are unchanged, and hooks on a layer run eagerly around its compiled forward. Validation's
batched `generate` runs eagerly (`eager_layers`): its cache and growing shapes would only add compiles. The compiled
graphs depend on torch's thread count, so a new count compiles once more (the trainer's core sharing uses two).

TRL's `torch_compile` compiles the whole model (transformers' Trainer); the options keep TRL's names, defaults and
meaning otherwise: setting `torch_compile_backend` or `torch_compile_mode` turns compilation on, and the backend
defaults to `"inductor"`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

DEFAULT_BACKEND = "inductor"


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """Whether and how the policy's decoder layers are compiled (TRL's `torch_compile*` options, resolved)."""

    enabled: bool
    backend: str = DEFAULT_BACKEND
    mode: str | None = None

    @classmethod
    def resolve(cls, torch_compile: bool, backend: str | None, mode: str | None) -> CompileOptions:
        """TRL's rule: a backend or mode turns compilation on; the backend defaults to inductor. Raises a
        `ValueError` naming an unknown backend or mode and the known ones."""
        enabled = torch_compile or backend is not None or mode is not None
        backend = backend or DEFAULT_BACKEND
        known_backends = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known_backends:
            raise ValueError(
                f"`GRPOModule(torch_compile_backend={backend!r})` is not a torch.compile backend here; use one of "
                f"{sorted(known_backends)} (default {DEFAULT_BACKEND!r})."
            )
        if mode is not None and backend == DEFAULT_BACKEND:
            modes = list(torch._inductor.list_mode_options())
            if mode not in modes:
                raise ValueError(
                    f"`GRPOModule(torch_compile_mode={mode!r})` is not an inductor mode; use one of {modes}."
                )
        return cls(enabled, backend, mode)


def decoder_layers(policy: torch.nn.Module) -> list[torch.nn.Module]:
    """The policy's decoder layers: the modules whose class it lists in `_no_split_modules` (transformers' decoder
    layer classes; read through a PEFT or other wrapper)."""
    layer_classes = set(getattr(policy, "_no_split_modules", None) or ())
    return [module for module in policy.modules() if module is not policy and type(module).__name__ in layer_classes]


def compile_policy(policy: torch.nn.Module, options: CompileOptions) -> int:
    """Compile each decoder layer of `policy` as `options` say (nothing when off); returns how many run compiled.

    Raises:
        ValueError: a policy without decoder layers to compile (no `_no_split_modules`), naming its class.
        RuntimeError: inductor on a CPU policy where no C++ compiler is found, naming the fix.
    """
    if not options.enabled:
        return 0
    layers = decoder_layers(policy)
    if not layers:
        raise ValueError(
            f"`GRPOModule(torch_compile=True)`: {type(policy).__name__} lists no decoder layer classes in "
            "`_no_split_modules` (transformers' decoder models do), so there is nothing to compile layer by layer. "
            "Leave `torch_compile` off for this policy."
        )
    if options.backend == DEFAULT_BACKEND and next(policy.parameters()).device.type == "cpu":
        _require_cpp_compiler()
    for layer in layers:
        if _is_compiled(layer.forward):  # a second fit of the same policy
            continue
        # the forward, not the module's call: hooks on the layer (the trainer's core sharing sets torch's threads
        # around each layer) stay eager, outside the graph
        layer.forward = torch.compile(layer.forward, backend=options.backend, mode=options.mode, dynamic=True)
    log.info(
        "torch.compile (%s, mode %s): %d decoder layers, dynamic shapes", options.backend, options.mode, len(layers)
    )
    return len(layers)


def _is_compiled(forward: object) -> bool:
    return getattr(forward, "_torchdynamo_orig_callable", None) is not None


def _require_cpp_compiler() -> None:
    """Inductor's CPU code is C++ built at run time: refuse now, by name, rather than at the first step."""
    from torch._inductor import config
    from torch._inductor.cpp_builder import cpp_compiler_search

    search = tuple(config.cpp.cxx) if isinstance(config.cpp.cxx, list | tuple) else (config.cpp.cxx,)
    try:
        cpp_compiler_search(search)
    except Exception as error:  # inductor raises its own InvalidCxxCompiler (or an OSError from the probe)
        raise RuntimeError(
            f"`GRPOModule(torch_compile=True)` on CPU needs a C++ compiler for inductor, and none of {list(search)} "
            "runs here. Install one (`apt-get install g++`), point the `CXX` environment variable at one, or leave "
            "`torch_compile` off."
        ) from error


@contextlib.contextmanager
def eager_layers() -> Iterator[None]:
    """Run compiled layers eagerly within (validation's `generate`)."""
    with torch.compiler.set_stance("force_eager"):
        yield
