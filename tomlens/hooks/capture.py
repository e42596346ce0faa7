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
    """
    groups: dict[str, list[Site]] = defaultdict(list)
    for site in sites:
        groups[hook_name(site)].append(site)
    out: dict[Site, Tensor] = {}
    pending = set(groups)
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]

    def make_hook(name: str, group: list[Site]):
        def hook(tensor: Tensor, hook: Any) -> None:
            idx = positions.to(tensor.device)
            picked = tensor[rows.to(tensor.device), idx]  # advanced indexing: a copy, [b, n_sel, ...]
            for site in group:
                value = head_out(model, site.layer, picked) if site.kind == "head_out" else picked
                if site.head is not None:
                    value = value[:, :, site.head].contiguous()
                out[site] = value.to(dtype) if dtype is not None else value
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
    missing = [str(s) for s in sites if s not in out]
    if missing:
        raise RuntimeError(f"the forward finished without firing the hooks for {missing}")
    return out
