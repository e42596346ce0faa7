"""The Hugging Face model under a `TransformerBridge`, without the bridge's wrappers.

Why: the bridge replaces every module of the Hugging Face model it wraps (each decoder layer, its
attention, each linear layer, each norm) by a wrapper that holds the original and runs hook points
around it, and some wrappers recompute what the original computes (a norm's scale, for its hook).
On the Llama-3.2-1B shape that is about 940 kernel launches per forward on a GPU, 58 per layer; a
forward of a small model on a fast GPU is bound by launches, so caching through the bridge ran 2.4x
slower than a plain transformers forward.

Where only the residual stream is read (a cache of `resid_pre` / `resid_post`) or only the logits
(option scoring), tomlens runs `plain_forward(model)` instead: the same modules rebuilt without the
wrappers. It shares every parameter and buffer with the bridge (the originals' own dictionaries: a
weight changed or replaced, a `.to()` or a loaded state dict is seen by both) and runs the
originals' operations in the same order. Tested equal to the bridge's numbers for Llama, Gemma 3
and the organism (fp32 and bf16; bit-identical on the CPUs tried, compared to float rounding, as
kernels may differ by machine); other architectures should agree to float rounding. It is built once per bridge and kept on the bridge (so it goes when the
bridge goes), and is rebuilt when a module of the bridge or of the model it wraps is swapped for
another. Its modules are copies of the originals' attributes, though: an attribute reassigned on a
wrapped module after the twin was built (an attention's `scaling`, a module's `config`) is not seen
by the twin; call `forget(model)` after such a change, and the next call builds it again.

Each caller asks once per call (`cache_activations`, `score_options`), and the bridge runs instead
(`plain_forward` returns None) where it would compute otherwise:
  - a hook anywhere in it or in the model it wraps: on a hook point (steering, patching), on a
    wrapper or a wrapped module or container, forward or backward, or a global module hook; three
    hooks that only read are known by name and not counted: the two TransformerLens's blocks wire
    to feed their hook points (they change nothing unless `use_hook_mlp_in` is set, which is
    checked) and the one transformers leaves once a forward asked for attentions or hidden states;
  - a module in train mode (dropout), or a module whose `forward` was replaced (tomlens's block
    skipping, a device map's dispatch);
  - a bridge setting under which it computes other than the original (`use_attn_result`,
    `use_split_qkv_input`, `use_attn_in`, `use_hook_mlp_in`);
  - a device-mapped model; dynamic or long-context rotary scaling (it keeps its state in plain
    attributes, which a copy does not share); a model that is not a bridge over a Hugging Face
    model, or one whose wrappers own weights of their own (GPT-2 and GPT-NeoX: the bridge splits the
    fused query-key-value weight and computes attention with the parts).
The check walks every module twice (about half a millisecond at the Llama-3.2-1B depth; no device work).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch.nn.modules.module as torch_module
from torch import Tensor, nn

_WRAPPED = "_original_component"  # where a TransformerLens bridge component keeps the module it wraps
_OWN_ARITHMETIC = ("use_attn_result", "use_split_qkv_input", "use_attn_in", "use_hook_mlp_in")
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = tuple(getattr(torch_module, n, {}) for n in (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))
# Hooks that only read, known by module and name: the two TransformerLens 4.3's blocks attach to their
# norms after the first forward (they read the norm's input for `hook_resid_mid`-style hook points,
# and feed `hook_mlp_in` only if it is used), and the one transformers 5 leaves on a layer once a
# forward asked for `output_attentions` / `output_hidden_states` (it records only while one does).
_READ_ONLY_HOOKS = frozenset({
    ("transformer_lens.model_bridge.generalized_components.block",
     "BlockBridge._maybe_wire_capture_hooks.<locals>._capture_pre_ln1"),
    ("transformer_lens.model_bridge.generalized_components.block",
     "BlockBridge._maybe_wire_capture_hooks.<locals>._capture_mlp_in"),
    ("transformers.utils.output_capturing", "install_output_capuring_hook.<locals>.output_capturing_hook"),
    ("transformers.utils.output_capturing", "install_output_capturing_hook.<locals>.output_capturing_hook"),
})
_KEPT_ON_THE_BRIDGE = "_tomlens_plain_forward"  # the bridge's __dict__ key of its `_Built`


@dataclass(frozen=True)
class PlainForward:
    """`model`: the causal LM, called as transformers' own (`model(input_ids, attention_mask=...,
    position_ids=..., use_cache=False).logits`). `layers[l]`: decoder layer `l`, whose input is the
    residual stream `resid_pre` of layer `l` and whose output (or its first element) `resid_post`."""

    model: nn.Module
    layers: tuple[nn.Module, ...]


@dataclass(frozen=True)
class _Built:
    """A bridge's twin (None: it cannot have one) and the tree it was built from: every module of the
    bridge and of the model it wraps, with each module's children at the time. Kept in the bridge's
    own `__dict__`, so it goes when the bridge goes; the bridge itself is left out of it, so keeping
    it adds no reference cycle (nothing here outlives the bridge; TransformerBridge's own closures
    may still hold it until the next garbage collection)."""

    twin: PlainForward | None
    hf: nn.Module  # the bridge's `original_model` then
    modules: tuple[nn.Module, ...]
    children: tuple[tuple[nn.Module | None, ...], ...]
    root_children: tuple[nn.Module | None, ...]

    @classmethod
    def of(cls, model: nn.Module, hf: nn.Module, modules: tuple[nn.Module, ...]) -> _Built:
        return cls(_build(model), hf, modules, tuple(tuple(m._modules.values()) for m in modules),
                   tuple(model._modules.values()))

    def current(self, model: nn.Module) -> bool:
        """No module was swapped for another since the twin was built (nor the wrapped model itself)."""
        return getattr(model, "original_model", None) is self.hf \
            and tuple(model._modules.values()) == self.root_children and all(
            tuple(m._modules.values()) == kids for m, kids in zip(self.modules, self.children, strict=True))


class _NotPlain(Exception):
    """A module of the wrapped model cannot be rebuilt faithfully (its `forward` was replaced)."""


def plain_forward(model: Any) -> PlainForward | None:
    """The bridge's model without its wrappers, or None where the bridge must run itself (see the
    module docstring). Ask once per call of a batch loop, not per batch: the check walks every module."""
    built = _built(model)
    if built is None or built.twin is None or _computes_otherwise(model, built.modules):
        return None
    return built.twin


def forward_logits(model: Any, plain: PlainForward | None, input_ids: Tensor, **kwargs: Any) -> Tensor:
    """`model(input_ids, **kwargs)`: the logits `[batch, pos, vocab]`, through `plain` (what
    `plain_forward(model)` said) where it is not None (kwargs as transformers takes them:
    `attention_mask`, `position_ids`, `use_cache`, `logits_to_keep`, `past_key_values`)."""
    return model(input_ids, **kwargs) if plain is None else plain.model(input_ids, **kwargs).logits


def forward_logits_and_cache(model: Any, plain: PlainForward | None, input_ids: Tensor,
                             **kwargs: Any) -> tuple[Tensor, Any]:
    """The logits and transformers' key/value cache after them (call with `use_cache=True`)."""
    if plain is None:
        logits, cache = model(input_ids, return_type="logits_and_cache", **kwargs)
        return logits, cache
    out = plain.model(input_ids, **kwargs)
    return out.logits, out.past_key_values


def _built(model: Any) -> _Built | None:
    """The twin built for `model`, rebuilt when a module was swapped since; None for an object that is
    no bridge over a Hugging Face model."""
    hf = getattr(model, "original_model", None)
    if not isinstance(model, nn.Module) or getattr(type(model), "hook_dict", None) is None \
            or not isinstance(hf, nn.Module):
        return None  # (`hook_dict` read off the class: the bridge's property builds a dictionary each time)
    built = model.__dict__.get(_KEPT_ON_THE_BRIDGE)
    if built is None or not built.current(model):
        modules = tuple(dict.fromkeys((*list(model.modules())[1:], *hf.modules())))
        if _computes_otherwise(model, modules):
            return None  # build later, from the tree as it is without the hooks or overrides
        built = _Built.of(model, hf, modules)
        model.__dict__[_KEPT_ON_THE_BRIDGE] = built  # past the bridge's __setattr__; not a module or weight
    return built


def _computes_otherwise(model: Any, modules: tuple[nn.Module, ...]) -> bool:
    """Whether the bridge would compute something its twin does not: see the module docstring."""
    cfg = getattr(model, "cfg", None)
    if any(getattr(cfg, flag, False) for flag in _OWN_ARITHMETIC) or any(_GLOBAL_HOOKS):
        return True
    for m in (model, *modules):
        d = m.__dict__
        if d["training"] or "forward" in d:
            return True
        if (d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]) \
                and not all((getattr(h, "__module__", None), getattr(h, "__qualname__", None)) in _READ_ONLY_HOOKS
                            for name in _HOOK_DICTS for h in d[name].values()):
            return True
    return False


def _build(model: Any) -> PlainForward | None:
    hf = getattr(model, "original_model", None)
    blocks = getattr(model, "blocks", None)
    if not isinstance(hf, nn.Module) or blocks is None or getattr(hf, "hf_device_map", None) \
            or any("dynamic" in kind or kind == "longrope" for kind in _rope_types(getattr(hf, "config", None))):
        return None  # a device map moves tensors through hooks of its own; a stateful rope keeps state in attributes
    memo: dict[int, nn.Module] = {}
    try:
        plain = _unwrapped(hf, memo)
        layers = tuple(memo[id(_innermost(b))] for b in blocks)
    except (_NotPlain, KeyError):
        return None
    if {id(p) for p in plain.parameters()} != {id(p) for p in hf.parameters()}:
        return None  # a wrapper owns a weight of its own: the rebuilt model would not compute the same
    return PlainForward(plain, layers)


def _rope_types(config: Any) -> list[str]:
    """The rotary scaling types a config names (`rope_scaling`, or transformers 5's `rope_parameters`,
    which may hold one set per attention type), its text model's config included."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            found.extend(str(value[k]) for k in ("rope_type", "type") if k in value)
            for v in value.values():
                walk(v)

    text = config.get_text_config() if hasattr(config, "get_text_config") else None  # a multimodal model's
    for part in (config,) if text is config else (config, text):
        for name in ("rope_scaling", "rope_parameters"):
            walk(getattr(part, name, None))
    return found


def forget(model: Any) -> None:
    """Drop the twin built for `model`, so the next `plain_forward` builds it from the model as it is
    now: after reassigning an attribute of a wrapped module (see the module docstring)."""
    if isinstance(model, nn.Module):
        model.__dict__.pop(_KEPT_ON_THE_BRIDGE, None)


def _innermost(module: nn.Module) -> nn.Module:
    while _WRAPPED in module._modules:
        module = module._modules[_WRAPPED]  # type: ignore[assignment]
    return module


def _unwrapped(module: nn.Module, memo: dict[int, nn.Module]) -> nn.Module:
    """A shallow copy of `module`'s innermost original with every child unwrapped the same way and
    no hooks; parameters and buffers are the originals' own dictionaries (shared, not copied)."""
    module = _innermost(module)
    if id(module) in memo:
        return memo[id(module)]
    if "forward" in vars(module):
        raise _NotPlain(type(module).__name__)
    twin = copy.copy(module)
    for name, value in vars(module).items():
        if name.startswith("_") and "hooks" in name and isinstance(value, dict):
            setattr(twin, name, OrderedDict())  # hooks are the original's: the twin starts with none
    memo[id(module)] = twin
    twin._modules = OrderedDict((n, None if c is None else _unwrapped(c, memo)) for n, c in module._modules.items())
    return twin


__all__ = ["PlainForward", "forget", "forward_logits", "forward_logits_and_cache", "plain_forward"]
