"""Directions to steer along: the difference of class means, a logistic probe's weights, a probe
direction file, and the two controls (norm-matched random directions, labels shuffled so
that each class splits evenly).

A `Direction` is not unit length: alpha = 1 adds exactly its vector. Every direction of one layer
has the norm of that layer's belief direction (the mean difference, unless given otherwise), so
an alpha means the same size of push for the belief direction and for each of its controls, and
alpha = 1 along the mean difference moves a class-0 mean onto the class-1 mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.models.protocol import Model

METHODS: tuple[str, ...] = ("mean_difference", "probe")
SOURCES: tuple[str, ...] = ("mean_difference", "probe", "random", "shuffled_labels", "file")
BELIEF, SHUFFLED = "belief", "shuffled"


@dataclass(frozen=True)
class Direction:
    """A vector in the residual stream after block `layer` (`site`), with where it came from.

    Its entries are checked to be finite where directions are fitted or used (`check_finite`, one
    read of many vectors), not here: a steering run builds hundreds (twenty random ones per layer),
    and a check per construction would read each vector's values on its own."""

    name: str  # "belief", "shuffled", "random:0" .. "random:19"
    source: str  # one of SOURCES
    layer: int
    vector: Float[Tensor, " d_model"]  # NOT unit: alpha = 1 adds exactly this vector
    site: str = "resid_post"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise TomlensError(f"direction {self.name!r}: source {self.source!r} is not one of {', '.join(SOURCES)}",
                               f"use one of {', '.join(SOURCES)}")
        if self.site != "resid_post":
            raise TomlensError(f"direction {self.name!r}: site {self.site!r} cannot be steered",
                               "steer the residual stream after a block (site = 'resid_post')")
        if self.vector.ndim != 1:
            raise TomlensError(f"direction {self.name!r} has shape {tuple(self.vector.shape)}",
                               "give a direction as one vector of length d_model")

    @property
    def norm(self) -> float:
        return float(self.vector.norm())

    @property
    def unit(self) -> Float[Tensor, " d_model"]:
        return self.vector / self.vector.norm().clamp_min(torch.finfo(self.vector.dtype).tiny)


def check_finite(directions: Sequence[Direction]) -> None:
    """Refuse a direction with NaN or infinite entries, naming the first; one read for them all."""
    if not directions:
        return
    finite = torch.stack([torch.isfinite(d.vector).all() for d in directions]).tolist()
    bad = next((d for d, ok in zip(directions, finite, strict=True) if not ok), None)
    if bad is not None:
        raise TomlensError(f"direction {bad.name!r} (layer {bad.layer}) has NaN or infinite entries",
                           "fit it again on stimuli where both classes occur, or drop that layer")


def _check_binary(labels: Sequence[int]) -> None:
    """`labels` (host ints) are 0 or 1 and hold both classes."""
    bad = sorted(set(labels) - {0, 1})
    if bad:
        raise TomlensError(f"labels must be 0 or 1, got {bad}", "use a binary target (e.g. protagonist_belief)")
    for c in (0, 1):
        if c not in labels:
            raise TomlensError(f"no row has label {c}, so no direction separates the classes",
                               "use stimuli with both conditions (false and true belief)")


def _classes(labels: Sequence[int]) -> tuple[list[int], list[int]]:
    """Rows of label 1 and of label 0, in order (what `x[y == c]` picks, without reading a mask)."""
    return [i for i, v in enumerate(labels) if v == 1], [i for i, v in enumerate(labels) if v == 0]


def _mean_difference(acts: Float[Tensor, "n d"], one: list[int], zero: list[int]) -> Float[Tensor, " d"]:
    """mu(rows `one`) - mu(rows `zero`) in float64, returned as float32 (no check, no host read)."""
    x = acts.to(torch.float64)
    return (x[one].mean(0) - x[zero].mean(0)).to(torch.float32)


def _rescale(vector: Tensor, norm: float) -> Tensor:
    """`vector` at length `norm`, unchecked: `match_norm` without its read of the vector's length."""
    return (vector / vector.norm() * norm).to(torch.float32)


def _binary(acts: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    if acts.ndim != 2:
        raise TomlensError(f"activations must be [n, d], got shape {tuple(acts.shape)}",
                           "pass one layer's activations, one row per prompt")
    labels = torch.as_tensor(labels).long().reshape(-1)
    if labels.numel() != acts.shape[0]:
        raise TomlensError(f"{labels.numel()} labels for {acts.shape[0]} rows", "pass one label per row")
    bad = sorted(set(labels.tolist()) - {0, 1})
    if bad:
        raise TomlensError(f"labels must be 0 or 1, got {bad}", "use a binary target (e.g. protagonist_belief)")
    for c in (0, 1):
        if not bool((labels == c).any()):
            raise TomlensError(f"no row has label {c}, so no direction separates the classes",
                               "use stimuli with both conditions (false and true belief)")
    return acts.to(torch.float64), labels


def mean_difference(acts: Float[Tensor, "n d"], labels: Int[Tensor, " n"]) -> Float[Tensor, " d"]:
    """mu(label 1) - mu(label 0): the contrastive-activation-addition direction, in raw units."""
    x, y = _binary(acts, labels)
    return (x[y == 1].mean(0) - x[y == 0].mean(0)).to(torch.float32)


def match_norm(vector: Tensor, norm: float) -> Tensor:
    """`vector` rescaled to length `norm` (its direction kept)."""
    n = vector.norm()
    if not bool(n > 0):
        raise TomlensError("a zero vector has no direction to rescale",
                           "fit the direction on rows whose classes differ")
    return (vector / n * norm).to(torch.float32)


def probe_direction(acts: Float[Tensor, "n d"], labels: Int[Tensor, " n"], *,
                    groups: Int[Tensor, " n"] | None = None, seed: int = 0) -> Float[Tensor, " d"]:
    """The weights of an L2 logistic probe (tomlens.probes's solver, C chosen by grouped CV), in raw
    activation space, pointing to label 1 and scaled to the mean difference's norm (so alphas
    compare across methods)."""
    from tomlens.probes.logistic import fit_logistic

    x, y = _binary(acts, labels)
    n_groups = len(set(groups.tolist())) if groups is not None else x.shape[0]
    fit = fit_logistic(x.to(torch.float32)[None], y, groups=groups, seed=seed, cv=max(2, min(4, n_groups)),
                       device="cpu")
    coef = fit.coef[0, 0, 0]
    if not bool(torch.isfinite(coef).all()) or not bool(coef.norm() > 0):
        raise TomlensError("the logistic probe could not be fitted (NaN or zero weights)",
                           "use method = 'mean_difference', or more stimuli")
    sign = 1.0 if int(fit.classes[-1]) == 1 else -1.0
    return match_norm(sign * coef, float(mean_difference(acts, labels).norm()))


def _fit(method: str, acts: Tensor, labels: Tensor, groups: Tensor | None, seed: int) -> Tensor:
    if method == "mean_difference":
        return mean_difference(acts, labels)
    if method == "probe":
        return probe_direction(acts, labels, groups=groups, seed=seed)
    raise TomlensError(f"method {method!r} is not one of {', '.join(METHODS)}", f"use one of {', '.join(METHODS)}")


def balanced_shuffle(labels: Int[Tensor, " n"], seed: int = 0) -> Int[Tensor, " n"]:
    """New labels that carry no class information: half of each true class (rounded alternately)
    gets label 1 and half gets 0, at random.

    Why not a plain permutation, or one within tasks: in a paired design (one false- and one
    true-belief story per task) labels shuffled within tasks only flip each task's sign, and the
    mean difference of the result is the belief direction again, scaled; a plain permutation leaves
    a chance imbalance along it. Splitting each class evenly makes the shuffled classes' means
    differ only by noise, so the control cannot reproduce the belief direction."""
    labels = torch.as_tensor(labels).long().reshape(-1)
    host = labels.tolist()  # one read; the rows of each class are then picked on the host
    gen = torch.Generator().manual_seed(int(seed))
    out = torch.zeros_like(labels)
    for c in (0, 1):
        rows = torch.tensor([i for i, v in enumerate(host) if v == c], dtype=torch.long)
        rows = rows[torch.randperm(rows.numel(), generator=gen)]
        out[rows[: (rows.numel() + c) // 2]] = 1  # class 0 rounds down, class 1 up
    return out


def shuffled_direction(acts: Float[Tensor, "n d"], labels: Int[Tensor, " n"], reference: Direction, *,
                       seed: int = 0, method: str | None = None) -> Direction:
    """The reference's method on balanced-shuffled labels (`balanced_shuffle`), norm-matched to it."""
    method = method or (reference.source if reference.source in METHODS else "mean_difference")
    shuffled = balanced_shuffle(torch.as_tensor(labels).long(), seed=seed)
    vec = _fit(method, acts, shuffled, None, seed)
    if not bool(vec.norm() > 0):  # shuffled classes with equal means: any direction is as good
        vec = torch.randn(vec.shape, generator=torch.Generator().manual_seed(seed))
    return Direction(SHUFFLED, "shuffled_labels", reference.layer, match_norm(vec, reference.norm), reference.site)


def random_directions(reference: Direction, n: int = 20, seed: int = 0, *, norm: float | None = None
                      ) -> list[Direction]:
    """`n` Gaussian directions at the reference's layer, each rescaled to the reference's norm
    (`norm`, when the caller has it already: reading it costs a look at the reference's values)."""
    if n < 0:
        raise TomlensError(f"n_random = {n}", "use 0 or more random directions (the issue asks for at least 20)")
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(reference.layer))
    d = reference.vector.numel()
    norm = reference.norm if norm is None else float(norm)
    # a Gaussian draw has a non-zero length (with probability one): no per-vector check
    return [Direction(f"random:{i}", "random", reference.layer,
                      _rescale(torch.randn(d, generator=gen, dtype=torch.float64), norm), reference.site)
            for i in range(n)]


def directions_from_file(path: str | Path, layer: int, *, target: str = "protagonist_belief",
                         position: str = "final", norm: float | None = None) -> Direction:
    """The probe direction of `layer` from a `tomlens probe` run's directions.safetensors (its
    raw-space `coef` for resid_post at `position`), pointing to label 1, rescaled to `norm`."""
    from tomlens.probes.directions import direction_name, load_directions

    tensors, _ = load_directions(path)
    coef_name = direction_name(target, "resid_post", position, "coef")
    layers_name = direction_name(target, "resid_post", position, "layers")
    if coef_name not in tensors or layers_name not in tensors:
        have = sorted({k.rsplit("/", 1)[0] for k in tensors})
        raise TomlensError(f"{path} has no resid_post probe for {target!r} at {position!r} (it has {have})",
                           "run `tomlens probe --sites resid_post` with that target and position")
    layers = tensors[layers_name].tolist()
    if layer not in layers:
        raise TomlensError(f"{path} has no probe for layer {layer} (it has layers {layers})",
                           "steer a layer the probe run covered")
    coef = tensors[coef_name][layers.index(layer)].reshape(-1, tensors[coef_name].shape[-1])[0].to(torch.float32)
    classes = tensors.get(direction_name(target, "resid_post", position, "classes"))
    if classes is not None and int(classes[-1]) != 1:
        coef = -coef
    if not bool(torch.isfinite(coef).all()) or not bool(coef.norm() > 0):
        raise TomlensError(f"the probe of layer {layer} in {path} did not fit (NaN or zero weights)",
                           "choose another layer, or fit directions here (method = 'mean_difference')")
    return Direction(BELIEF, "file", layer, match_norm(coef, norm if norm is not None else float(coef.norm())))


def with_controls(belief: Direction, acts: Float[Tensor, "n d"], labels: Int[Tensor, " n"], *, n_random: int = 20, seed: int = 0,
                  method: str = "mean_difference") -> list[Direction]:
    """[belief, shuffled, random:0 .. random:n-1] for one layer."""
    return [belief, shuffled_direction(acts, labels, belief, seed=seed, method=method),
            *random_directions(belief, n_random, seed)]


def fit_directions(model: Model, stimuli: Sequence[Any], *, layers: Sequence[int], target: str = "protagonist_belief",
                   position: str = "final", method: str = "mean_difference", n_random: int = 20, seed: int = 0,
                   prompt_type: str | None = "belief", directions_path: str | Path | None = None,
                   store: str | Path | None = None, batch_size: int | None = None,
                   progress: bool = True) -> dict[int, list[Direction]]:
    """Per layer: the belief direction fitted on `stimuli` (their `prompt_type` prompts, default
    the belief questions, whose final token is where the answer is read out), then the shuffled-
    label control and `n_random` norm-matched random directions.

    The activations are cached through tomlens.activations (reused on a second call). With
    `directions_path`, the belief direction is that file's probe, rescaled to the mean difference's
    norm here (the controls are built the same way)."""
    from tomlens.activations import cache_activations
    from tomlens.probes.splits import group_codes
    from tomlens.probes.targets import make_target

    if method not in METHODS:
        raise TomlensError(f"method {method!r} is not one of {', '.join(METHODS)}", f"use one of {', '.join(METHODS)}")
    layers = sorted({int(layer) for layer in layers})
    if not layers:
        raise TomlensError("no layers to steer", "name at least one layer, e.g. layers = [2, 3]")
    rows = [s for s in stimuli if prompt_type is None or s.prompt_type == prompt_type]
    if not rows:
        raise TomlensError(f"no {prompt_type} prompts to fit directions on",
                           "use stimuli with belief questions, or prompt_type = None for every prompt")
    labels, keep = make_target(rows, target)
    kept = [i for i, k in enumerate(keep.tolist()) if k]
    rows = [rows[i] for i in kept]
    labels = labels[kept]
    y = labels.tolist()  # the labels on the host, read once: every layer picks its class rows from them
    _check_binary(y)
    one, zero = _classes(y)
    shuffled = balanced_shuffle(labels, seed=seed)  # the same for every layer
    s_one, s_zero = _classes(shuffled.tolist())
    groups = group_codes(rows, "task")
    sites = " ".join(f"resid_post:{layer}" for layer in layers)
    acts = cache_activations(model, rows, sites, [position], store=store, batch_size=batch_size, progress=progress)
    stored = acts.layers("resid_post")
    x = acts.get("resid_post", position)
    xs = {layer: x[:, stored.index(layer)].to(torch.float32) for layer in layers}
    md = {layer: _mean_difference(xl, one, zero) for layer, xl in xs.items()}
    belief_method = method if directions_path is None else "probe"
    if belief_method == "mean_difference":  # the shuffled labels' direction, by the belief direction's method
        sh = {layer: _mean_difference(xl, s_one, s_zero) for layer, xl in xs.items()}
    else:
        sh = {layer: probe_direction(xl, shuffled, seed=seed) for layer, xl in xs.items()}
    # every length and check a layer needs, read in one go: [|mean difference|, shuffled one is non-zero]
    read = torch.stack([torch.stack([md[l].norm().double(), (sh[l].norm() > 0).double()]) for l in layers]).tolist()
    md_norm = {l: r[0] for l, r in zip(layers, read, strict=True)}
    beliefs: dict[int, Direction] = {}
    for layer in layers:
        if directions_path is not None:
            beliefs[layer] = directions_from_file(directions_path, layer, target=target, position=position,
                                                  norm=md_norm[layer])
        else:
            vec = md[layer] if method == "mean_difference" else probe_direction(xs[layer], labels, groups=groups,
                                                                                seed=seed)
            beliefs[layer] = Direction(BELIEF, method, layer, vec)
    norm = md_norm if directions_path is None and method == "mean_difference" else dict(zip(
        layers, torch.stack([beliefs[l].vector.norm() for l in layers]).tolist(), strict=True))
    out: dict[int, list[Direction]] = {}
    for layer, (_, nonzero) in zip(layers, read, strict=True):
        belief = beliefs[layer]
        vec = sh[layer] if nonzero else torch.randn(sh[layer].shape, generator=torch.Generator().manual_seed(seed))
        control = Direction(SHUFFLED, "shuffled_labels", layer, _rescale(vec, norm[layer]), belief.site)
        out[layer] = [belief, control, *random_directions(belief, n_random, seed, norm=norm[layer])]
    check_finite([d for ds in out.values() for d in ds])
    return out
