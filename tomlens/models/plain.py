"""The Hugging Face model under a `TransformerBridge`, without the bridge's wrappers.

Why: the bridge replaces every module of the Hugging Face model it wraps (each decoder layer, its
attention, each linear layer, each norm) by a wrapper that holds the original and runs hook points
around it, and some wrappers recompute what the original computes (a norm's scale, for its hook).
On the Llama-3.2-1B shape that is about 940 kernel launches per forward on a GPU, 58 per layer,
where transformers' own forward makes about 40; a forward of a small model on a fast GPU is bound by
launches, so caching through the bridge ran 2.4x slower than a plain transformers forward.

Where only the residual stream is read (a cache of `resid_pre` / `resid_post`) or only the logits
(option scoring) and no hook is attached, tomlens runs `plain_forward(model)` instead: the same
modules rebuilt without the wrappers. It shares every parameter and buffer with the bridge (no
copy; a weight changed in place is seen by both) and computes the same numbers, in the same order,
as the bridge does. It is built once per bridge and kept while the bridge lives.

It is not used, and `plain_forward` returns None, where it could differ from what the bridge runs:
a hook attached to the bridge (steering, a patch: the bridge must run them), a module whose
`forward` was replaced (a device map's dispatch hooks, tomlens's own block skipping), or a model
that is not a bridge over a Hugging Face model.
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

_WRAPPED = "_original_component"  # where a TransformerLens bridge component keeps the module it wraps


@dataclass(frozen=True)
class PlainForward:
    """`model`: the causal LM, called as transformers' own (`model(input_ids, attention_mask=...,
    position_ids=..., use_cache=False).logits`). `layers[l]`: decoder layer `l`, whose input is the
    residual stream `resid_pre` of layer `l` and whose output (or its first element) `resid_post`."""

    model: nn.Module
    layers: tuple[nn.Module, ...]


class _NotPlain(Exception):
    """A module of the wrapped model cannot be rebuilt faithfully (its `forward` was replaced)."""


_BUILT: weakref.WeakKeyDictionary[Any, PlainForward | None] = weakref.WeakKeyDictionary()


def plain_forward(model: Any) -> PlainForward | None:
    """The bridge's model without its wrappers, or None where it must not stand in for the bridge
    (see the module docstring). Costs a walk over the bridge's hook points per call (no device work)."""
    if _hooked(model):
        return None
    try:
        return _BUILT[model]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: not a bridge
        return None
    built = _build(model)
    _BUILT[model] = built
    return built


def forward_logits(model: Any, input_ids: Tensor, **kwargs: Any) -> Tensor:
    """`model(input_ids, **kwargs)`: the logits `[batch, pos, vocab]`, through the plain forward
    where it stands in for the bridge (kwargs as transformers takes them: `attention_mask`,
    `position_ids`, `use_cache`, `logits_to_keep`, `past_key_values`)."""
    plain = plain_forward(model)
    return model(input_ids, **kwargs) if plain is None else plain.model(input_ids, **kwargs).logits


def forward_logits_and_cache(model: Any, input_ids: Tensor, **kwargs: Any) -> tuple[Tensor, Any]:
    """The logits and transformers' key/value cache after them (call with `use_cache=True`)."""
    plain = plain_forward(model)
    if plain is None:
        logits, cache = model(input_ids, return_type="logits_and_cache", **kwargs)
        return logits, cache
    out = plain.model(input_ids, **kwargs)
    return out.logits, out.past_key_values


def _hooked(model: Any) -> bool:
    """Whether a hook is attached to the bridge's hook points, to the bridge itself or to one of its
    blocks, or a block's `forward` is replaced: then only the bridge's own forward runs it."""
    points = getattr(model, "hook_dict", None)
    if points is None:
        return True
    watched = [model, *getattr(model, "blocks", ()), *points.values()]
    return any(m._forward_hooks or m._forward_pre_hooks or "forward" in vars(m) for m in watched)


def _build(model: Any) -> PlainForward | None:
    hf = getattr(model, "original_model", None)
    blocks = getattr(model, "blocks", None)
    if not isinstance(hf, nn.Module) or blocks is None or getattr(hf, "hf_device_map", None):
        return None  # a device map places and moves tensors through hooks of its own
    memo: dict[int, nn.Module] = {}
    try:
        plain = _unwrapped(hf, memo)
        layers = tuple(memo[id(_innermost(b))] for b in blocks)
    except (_NotPlain, KeyError):
        return None
    if {id(p) for p in plain.parameters()} != {id(p) for p in hf.parameters()}:
        return None  # a wrapper owned a weight of its own: the rebuilt model would not compute the same
    return PlainForward(plain, layers)


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


__all__ = ["PlainForward", "forward_logits", "forward_logits_and_cache", "plain_forward"]
