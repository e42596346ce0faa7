"""One forward that keeps only the requested sites at the requested positions, then stops.

Why not `run_with_cache`: it keeps whole `[batch, pos, d]` tensors and runs the model to the
logits. Here each hook gathers its few positions into a fresh tensor (so nothing holds a view of
the full activation), and the hook that captures the last site still missing raises, which ends
the forward right there: later blocks, the final norm and the unembedding never run. That is
TransformerLens's `stop_at_layer`, moved from "before block k" to "after the last site needed".
No KV cache is built either: a single forward never reads it back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from tomlens.hooks.heads import head_out
from tomlens.hooks.sites import Site, hook_name
from tomlens.models.plain import PlainForward, plain_forward
from tomlens.models.protocol import Model


class _Captured(Exception):
    """Raised from a hook once every site is captured: stops the forward early."""


def capture(
    model: Model,
    batch: Any,
    sites: Sequence[Site],
    positions: Int[Tensor, "batch n_sel"],
    *,
    dtype: torch.dtype | None = None,
) -> dict[Site, Tensor]:
    """Run `batch` through `model` and return each site at `positions`.

    Shapes: `[batch, n_sel, d_model]` for residual / attn_out / mlp_out sites,
    `[batch, n_sel, head, d_head]` for `z`, `[batch, n_sel, head, d_model]` for `head_out`
    (a site with a `head` drops the head axis). Tensors stay on the model's device, in `dtype`
    (default: the model's). Call under `torch.inference_mode()` unless gradients are needed.

    A call whose sites are all residual-stream sites (`resid_pre`, `resid_post`) reads them off the
    Hugging Face model without the bridge's wrappers where nothing makes the bridge compute otherwise
    (`tomlens.models.plain`: the same numbers, fewer kernel launches); any other call runs the
    bridge and reads its hook points.
    """
    return capture_via(twin_for(model, sites), model, batch, sites, positions, dtype=dtype)


def twin_for(model: Model, sites: Sequence[Site]) -> PlainForward | None:
    """What a capture of `sites` runs: the plain forward (residual-stream sites only, where it can
    stand in for the bridge) or None, the bridge. A loop over many batches asks once (`capture_via`)."""
    return plain_forward(model) if sites and all(s.kind in RESIDUAL_KINDS for s in sites) else None


def capture_via(plain: PlainForward | None, model: Model, batch: Any, sites: Sequence[Site],
                positions: Int[Tensor, "batch n_sel"], *, dtype: torch.dtype | None = None) -> dict[Site, Tensor]:
    """`capture` through `plain` (`twin_for(model, sites)`, asked once before the loop) or the bridge."""
    if not sites:
        return {}
    if plain is not None:
        return _capture_plain(plain, batch, sites, positions, dtype)
    return _capture_bridge(model, batch, sites, positions, dtype)


# Residual-stream kinds and which side of a decoder layer carries them: its input or its output.
RESIDUAL_KINDS: dict[str, str] = {"resid_pre": "input", "resid_post": "output"}


def _keep(out: dict[Site, Tensor], site: Site, value: Tensor, dtype: torch.dtype | None) -> None:
    if site.head is not None:
        value = value[:, :, site.head].contiguous()
    out[site] = value if dtype is None or value.dtype == dtype else value.to(dtype)


def _capture_plain(plain: PlainForward, batch: Any, sites: Sequence[Site], positions: Tensor,
                   dtype: torch.dtype | None) -> dict[Site, Tensor]:
    """Residual-stream sites off the unwrapped decoder layers: a pre-hook reads a layer's input, a
    hook its output; the last one in forward order raises, so nothing after it runs."""
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
    out: dict[Site, Tensor] = {}
    last = max(sites, key=lambda s: (s.layer, RESIDUAL_KINDS[s.kind] == "output"))

    def keep(site: Site, tensor: Tensor) -> None:
        _keep(out, site, tensor[rows, positions], dtype)  # advanced indexing: a copy, [b, n_sel, d]
        if site == last:
            raise _Captured

    def on_input(site: Site):
        return lambda module, args, kwargs: keep(site, args[0] if args else kwargs["hidden_states"])

    def on_output(site: Site):
        return lambda module, args, kwargs, result: keep(site, result[0] if isinstance(result, tuple) else result)

    handles = [plain.layers[s.layer].register_forward_pre_hook(on_input(s), with_kwargs=True)
               if RESIDUAL_KINDS[s.kind] == "input" else
               plain.layers[s.layer].register_forward_hook(on_output(s), with_kwargs=True)
               for s in dict.fromkeys(sites)]
    try:
        plain.model(batch.input_ids, use_cache=False, **batch.forward_kwargs())
    except _Captured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return _all_there(sites, out)


def _capture_bridge(model: Model, batch: Any, sites: Sequence[Site], positions: Tensor,
                    dtype: torch.dtype | None) -> dict[Site, Tensor]:
    """Any site, through the bridge's hook points; the hook that captures the last one raises."""
    groups: dict[str, list[Site]] = defaultdict(list)
    for site in sites:
        groups[hook_name(site)].append(site)
    out: dict[Site, Tensor] = {}
    pending = set(groups)
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]

    def make_hook(name: str, group: list[Site]):
        def hook(tensor: Tensor, hook: Any) -> None:
            idx = positions.to(tensor.device)  # a device map may place blocks on several devices
            picked = tensor[rows.to(tensor.device), idx]  # advanced indexing: a copy, [b, n_sel, ...]
            for site in group:
                _keep(out, site, head_out(model, site.layer, picked) if site.kind == "head_out" else picked, dtype)
            pending.discard(name)
            if not pending:
                raise _Captured

        return hook

    fwd_hooks = [(name, make_hook(name, group)) for name, group in groups.items()]
    # use_cache=False: otherwise Hugging Face keeps every layer's keys and values for generation,
    # which is most of the memory of a caching forward (SmolLM2, batch 16 x 106: 126 -> 55 MiB).
    kwargs = {"use_cache": False, **batch.forward_kwargs()}
    with model.hooks(fwd_hooks=fwd_hooks):
        try:
            model(batch.input_ids, **kwargs)
        except _Captured:
            pass
    return _all_there(sites, out)


def _all_there(sites: Sequence[Site], out: dict[Site, Tensor]) -> dict[Site, Tensor]:
    missing = [str(s) for s in sites if s not in out]
    if missing:
        raise RuntimeError(f"the forward finished without firing the hooks for {missing}")
    return out
