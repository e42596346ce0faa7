"""Interventions along a direction in the residual stream: add it, project it out, or patch only
the component along it from another run.

With u = v / |v| and alpha the dose, at the chosen positions of each row:
- "add":         h <- h + alpha v                  (alpha = 1 adds exactly v)
- "project_out": h <- h - alpha (h . u) u          (alpha = 1 removes the component, 2 reflects it)
- "patch":       h <- h + alpha ((s - h) . u) u    (alpha = 1 swaps in the source's component)
so alpha = 0 is always the unhooked run. Rows are left padded (`tomlens.models.tokens`), so the
last column is every row's last real token: "final" edits that column and nothing else; "all"
edits every column (pad columns are never attended, so editing them changes nothing).

`steering` is the context manager for any forward; `row_hooks` gives each row of one forward its
own vector and dose, which is how `tomlens.steering.dose` runs many (direction, alpha) pairs at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.hooks.sites import Site, check_sites, hook_name
from tomlens.models.protocol import Model
from tomlens.steering.directions import Direction, check_finite

MODES: tuple[str, ...] = ("add", "project_out", "patch")
POSITIONS: tuple[str, ...] = ("final", "all")
Hook = tuple[str, Callable[..., Any]]


def check_mode(mode: str, positions: str) -> None:
    if mode not in MODES:
        raise TomlensError(f"steering mode {mode!r} is not one of {', '.join(MODES)}", f"use one of {', '.join(MODES)}")
    if positions not in POSITIONS:
        raise TomlensError(f"steering positions {positions!r} is not one of {', '.join(POSITIONS)}",
                           "use 'final' (the last real token of each prompt) or 'all'")


def edit(h: Float[Tensor, "r *pos d"], vectors: Float[Tensor, "r d"], alphas: Float[Tensor, " r"], mode: str,
         source: Tensor | None = None) -> Tensor:
    """`h` after the intervention (a new tensor in h's dtype); per row its own vector and dose.
    `h` is `[r, d]` or `[r, pos, d]`; `source` has h's shape (mode "patch" only)."""
    x = h.to(torch.float32)
    v = vectors.to(device=h.device, dtype=torch.float32)
    a = alphas.to(device=h.device, dtype=torch.float32)
    extra = (1,) * (h.ndim - 2)
    v_ = v.view(v.shape[0], *extra, v.shape[1])
    a_ = a.view(-1, *extra, 1)
    if mode == "add":
        return (x + a_ * v_).to(h.dtype)
    u = v_ / v_.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    if mode == "project_out":
        return (x - a_ * (x * u).sum(-1, keepdim=True) * u).to(h.dtype)
    if source is None:
        raise TomlensError("mode 'patch' needs the source run's activations",
                           "pass source = activations of the other run at the same positions")
    s = source.to(device=h.device, dtype=torch.float32)
    if s.shape != x.shape:
        raise TomlensError(f"source activations of shape {tuple(s.shape)} do not match the steered "
                           f"activations {tuple(x.shape)}",
                           "pass [n, d] for positions = 'final' or [n, pos, d] for 'all', rows in batch order")
    return (x + a_ * ((s - x) * u).sum(-1, keepdim=True) * u).to(h.dtype)


def row_hooks(layer: int, vectors: Float[Tensor, "r d"], alphas: Float[Tensor, " r"], *, mode: str = "add",
              positions: str = "final", source: Tensor | None = None) -> list[Hook]:
    """One hook on resid_post of `layer` that edits row i along `vectors[i]` with dose `alphas[i]`."""
    check_mode(mode, positions)

    def fn(act: Tensor, hook: Any = None) -> Tensor:
        if act.shape[0] != vectors.shape[0]:
            raise TomlensError(f"the steering hook has {vectors.shape[0]} rows but the forward has {act.shape[0]}",
                               "pass one vector and one dose per row of the batch")
        if positions == "final":
            out = act.clone()
            out[:, -1] = edit(act[:, -1], vectors, alphas, mode, source)
            return out
        src = source
        if src is not None and src.shape[1] != act.shape[1]:  # a prefix-cached run sees its last columns only
            src = src[:, -act.shape[1]:]
        return edit(act, vectors, alphas, mode, src)

    return [(hook_name(Site("resid_post", int(layer))), fn)]


def model_device(model: Model) -> torch.device:
    """Where the model's weights are (the CPU for a model without parameters)."""
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _on(t: Tensor, device: torch.device | None) -> Tensor:
    """`t` on `device` (moved once, without a host sync), or as it is where no device is named. A
    hook that moved a host tensor to the GPU itself would copy it, blocking, on every forward."""
    return t if device is None else to_device(t, device)


def _source_for(source: Tensor | Mapping[int, Tensor] | None, layer: int) -> Tensor | None:
    if source is None or isinstance(source, Tensor):
        return source
    if layer not in source:
        raise TomlensError(f"no source activations for layer {layer}", "pass source = {layer: tensor} for every layer")
    return source[layer]


def steering_hooks(directions: Sequence[Direction], alpha: float, *, n_rows: int, mode: str = "add",
                   positions: str = "final", source: Tensor | Mapping[int, Tensor] | None = None,
                   device: torch.device | str | None = None) -> list[Hook]:
    """Hooks applying every direction with dose `alpha` to all `n_rows` rows (one hook per layer;
    several directions at one layer are applied in turn). `device`: where the forwards run; the
    vectors, doses and sources are put there once, here, instead of copied in every forward. A
    direction with NaN or infinite entries is refused (one read for them all), as `steering` does:
    added to the residual stream it would turn every answer into NaN without a word."""
    check_finite(directions)
    return _row_steering_hooks(directions, alpha, n_rows=n_rows, mode=mode, positions=positions, source=source,
                               device=device)


def _row_steering_hooks(directions: Sequence[Direction], alpha: float, *, n_rows: int, mode: str,
                        positions: str, source: Tensor | Mapping[int, Tensor] | None,
                        device: torch.device | str | None) -> list[Hook]:
    """`steering_hooks` for directions already checked (`steering` checks them with the model)."""
    check_mode(mode, positions)
    device = None if device is None else torch.device(device)
    by_layer: dict[int, list[Direction]] = {}
    for d in directions:
        by_layer.setdefault(int(d.layer), []).append(d)
    hooks: list[Hook] = []
    for layer, ds in sorted(by_layer.items()):
        dose = torch.full((n_rows,), float(alpha), device=device)
        src = _source_for(source, layer)
        if src is not None:
            src = _on(src, device)
        parts = [row_hooks(layer, _on(d.vector, device).expand(n_rows, -1), dose, mode=mode, positions=positions,
                           source=src)[0][1] for d in ds]

        def fn(act: Tensor, hook: Any = None, parts: list[Callable[..., Tensor]] = parts) -> Tensor:
            for p in parts:
                act = p(act, hook)
            return act

        hooks.append((hook_name(Site("resid_post", layer)), fn))
    return hooks


def check_directions(model: Model, directions: Sequence[Direction]) -> None:
    """Each direction's layer exists and its vector has the model's width and finite entries."""
    if not directions:
        raise TomlensError("no directions to steer along", "pass at least one Direction")
    check_sites(model, [Site("resid_post", int(d.layer)) for d in directions])
    d_model = int(model.cfg.d_model)
    for d in directions:
        if d.vector.numel() != d_model:
            raise TomlensError(f"direction {d.name!r} has {d.vector.numel()} entries; the model's d_model is {d_model}",
                               "fit the direction on this model's activations")
    check_finite(directions)


@contextmanager
def steering(model: Model, directions: Sequence[Direction], alpha: float, *, mode: str = "add",
             positions: str = "final", source: Tensor | Mapping[int, Tensor] | None = None,
             n_rows: int | None = None) -> Iterator[None]:
    """Every forward inside the block is steered along `directions` with dose `alpha`.

    `source` (mode "patch"): the other run's activations at the same positions, `[n, d]` for
    "final" or `[n, pos, d]` for "all", rows in the order of the batch (one tensor, or one per
    layer as {layer: tensor}). `n_rows`: the batch size (default: the source's rows, else the
    hooks broadcast one vector over any batch)."""
    check_mode(mode, positions)
    check_directions(model, directions)
    if n_rows is None and source is not None:
        first = source if isinstance(source, Tensor) else next(iter(source.values()))
        n_rows = int(first.shape[0])
    device = model_device(model)
    if n_rows is None:
        hooks = _broadcast_hooks(directions, alpha, mode, positions, device)
    else:
        hooks = _row_steering_hooks(directions, alpha, n_rows=n_rows, mode=mode, positions=positions,
                                    source=source, device=device)
    with model.hooks(fwd_hooks=hooks):
        yield


def _broadcast_hooks(directions: Sequence[Direction], alpha: float, mode: str, positions: str,
                     device: torch.device | None = None) -> list[Hook]:
    """Hooks that fit any batch size (one vector for every row), for modes without a source; the
    vectors are put on `device` once, and each forward's doses are made where its activations are."""
    by_layer: dict[int, list[Tensor]] = {}
    for d in directions:
        by_layer.setdefault(int(d.layer), []).append(_on(d.vector, device))
    hooks: list[Hook] = []
    for layer, vs in sorted(by_layer.items()):

        def fn(act: Tensor, hook: Any = None, vs: list[Tensor] = vs, layer: int = layer) -> Tensor:
            n = act.shape[0]
            for v in vs:
                act = row_hooks(layer, v.expand(n, -1), torch.full((n,), float(alpha), device=act.device), mode=mode,
                                positions=positions)[0][1](act, hook)
            return act

        hooks.append((hook_name(Site("resid_post", layer)), fn))
    return hooks
