"""The steering stage: fit belief directions, pick a layer and a dose, and test them on held-out stories.

Selection is kept apart from evaluation: the tasks are split (`fraction_split`) into a selection
half, where the directions are fitted and the layer and dose are chosen, and an evaluation half,
where every direction (belief, shuffled labels, the random ones) is run at every alpha.

On the selection half the belief direction runs beside `n_random` random directions of its norm,
drawn apart from the evaluation half's (another seed), so the choice can see specificity and not
only strength: the dose is the alpha whose belief direction beats the random directions' 95th
percentile by the widest margin among those flipping at least `min_flip` of the false-belief
answers (all alphas when none does), and the layer is the one whose chosen dose has the widest
margin. A large push flips every answer whatever its direction; choosing by the belief direction's
flip alone would pick it.

A layer's verdict is "found" only when, at the chosen alpha on the evaluation half, the belief
direction flips at least `min_flip` of the false-belief answers, more than the random directions'
95th percentile (`RANDOM_QUANTILE`) and more than the shuffled one, and (with `max_random_flip`)
the random directions flip at most that share on average; otherwise "withheld", with the reason.

Why a quantile and a mean, never the most-flipping random direction: the random directions are
draws from a distribution, and the maximum of n draws grows with n (if a share q of random
directions flips more than t, the chance that one of n does is 1 - (1 - q)^n, which goes to 1). A
rule on the maximum therefore fails any model, the organism included, once enough directions are
drawn: `tomlens validate --model tom-organism --seed 4242` failed with its 20 directions' maximum at
0.125 while their 95th percentile was 0.085 and their mean 0.019 (at that layer and dose, 1 and -1,
pooled over 440 random directions of 11 seeds: mean 0.012, 95th percentile 0.042). The mean and the 95th
percentile estimate fixed properties of that distribution; more draws only make them more precise.
The maximum and an empirical p-value, (1 + the number of random directions flipping at least as
much as the belief direction) / (n + 1), are reported beside them, not judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import pandas as pd
import torch

from tomlens.errors import TomlensError
from tomlens.io import read_table, write_table
from tomlens.messages import say
from tomlens.models.protocol import Model
from tomlens.probes.splits import fraction_split, group_codes
from tomlens.probes.targets import TARGETS
from tomlens.provenance import run_manifest
from tomlens.runs.base import DEFAULT_N, ModelSpec, StimuliSpec
from tomlens.runs.files import (
    begin_save,
    check_store_writable,
    finish_save,
    read_finished,
    summary_from_dict,
    summary_to_dict,
)
from tomlens.runs.steering_summary import SteeringLayer, SteeringSummary
from tomlens.steering import (
    METHODS,
    MODES,
    POSITIONS,
    Direction,
    count_passes,
    dose_response,
    fit_directions,
    paired_sources,
    random_directions,
)
from tomlens.stimuli.records import stimuli_hash
from tomlens.vocabulary import one_of

FORMATS = ("parquet", "csv")
# alpha = 1 moves one class's mean exactly onto the other's; half doses are tried too, since where
# that difference is large next to the residual stream a full dose flips answers whatever its
# direction (the organism's layer 2: random directions of its norm flipped 0.24 at alpha -1, 0.03 at
# -0.5, where the belief direction flips every held-out false-belief answer)
DEFAULT_ALPHAS: tuple[float, ...] = (-4.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 4.0)
FOUND, WITHHELD = "found", "withheld"
SELECTION_SEED = 1  # added to the seed for the selection half's random directions
RANDOM_QUANTILE = 0.95  # the random directions' quantile the belief direction must flip more than
Rates: TypeAlias = np.ndarray | pd.Series | Sequence[float]  # one flip rate per random direction


@dataclass(frozen=True)
class RandomFlips:
    """The random directions' false-belief flip rates at one layer and dose, summarised by numbers
    that do not grow with how many were drawn (`mean`, `p95`: see the module text), with the
    maximum and the belief direction's empirical p-value beside them (reported, not judged)."""

    n: int
    mean: float
    p95: float
    max: float
    p_value: float  # (1 + #{random >= belief}) / (n + 1): the belief direction's rank among them

    @classmethod
    def of(cls, rates: Rates, belief: float) -> RandomFlips:
        """Summarise `rates` (one flip rate per random direction) against the belief direction's
        flip rate; NaN throughout when there are none."""
        rates = np.asarray(rates, dtype=float)
        if not rates.size:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan)
        at_least = int((rates >= belief - 1e-12).sum()) if belief == belief else rates.size
        return cls(int(rates.size), float(rates.mean()), random_quantile(rates), float(rates.max()),
                   (1 + at_least) / (rates.size + 1))


def random_quantile(rates: Rates) -> float:
    """The `RANDOM_QUANTILE` quantile of the random directions' flip rates (linear interpolation,
    numpy's default); NaN when there are none."""
    rates = np.asarray(rates, dtype=float)
    return float(np.percentile(rates, 100 * RANDOM_QUANTILE)) if rates.size else float("nan")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    one_of(name, value, allowed)


@dataclass(frozen=True)
class SteeringConfig:
    """Which model and stories, which layers, how directions are fitted and applied, the doses,
    the controls and the thresholds of the verdict."""

    model: ModelSpec = ModelSpec()
    stimuli: StimuliSpec = StimuliSpec(family="order-only", n=DEFAULT_N)
    layers: tuple[int, ...] | None = None  # None: every layer
    target: str = "protagonist_belief"
    method: str = "mean_difference"
    mode: str = "add"
    positions: str = "final"
    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    n_random: int = 20
    select_fraction: float = 0.5
    seed: int = 0
    directions_path: str | None = None  # a `tomlens probe` directions.safetensors
    min_flip: float = 0.8  # the belief direction must flip at least this share of false-belief answers
    max_random_flip: float | None = None  # and, when set, the random directions' mean flip at most this
    batch_size: int = 16
    store: str | None = None  # activation store root
    format: str = "parquet"

    def __post_init__(self) -> None:
        _one_of("probe target", self.target, tuple(TARGETS))
        _one_of("method", self.method, METHODS)
        _one_of("mode", self.mode, MODES)
        _one_of("positions", self.positions, POSITIONS)
        _one_of("format", self.format, FORMATS)
        alphas = tuple(float(a) for a in self.alphas)
        object.__setattr__(self, "alphas", alphas)
        if not any(a != 0 for a in alphas):
            raise TomlensError(f"alphas {list(alphas)} hold no non-zero dose", "give e.g. alphas = [-4, -2, 0, 2, 4]")
        if len(set(alphas)) != len(alphas):
            raise TomlensError(f"alphas {list(alphas)} repeat a value", "list each dose once")
        if self.layers is not None:
            layers = tuple(int(x) for x in self.layers)
            if not layers or min(layers) < 0:
                raise TomlensError(f"layers {list(layers)}", "give layer indices from 0 (or leave layers out for all)")
            object.__setattr__(self, "layers", tuple(sorted(set(layers))))
        if self.n_random < 1:
            raise TomlensError(f"n_random = {self.n_random}", "use at least 1 random direction (the issue asks for 20)")
        if not 0 < float(self.select_fraction) < 1:
            raise TomlensError(f"select_fraction = {self.select_fraction}", "use a fraction strictly between 0 and 1")
        if not 0 < float(self.min_flip) <= 1:
            raise TomlensError(f"min_flip = {self.min_flip}", "use a share in (0, 1], e.g. 0.8")
        if self.batch_size < 1:
            raise TomlensError(f"batch_size = {self.batch_size}", "use 1 or more prompts per forward")
        if self.directions_path is not None and not Path(self.directions_path).is_file():
            raise TomlensError(f"no direction file at {self.directions_path}",
                               "run `tomlens probe --sites resid_post` and pass its directions.safetensors")


def _belief_false_belief_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The belief direction's rows on false-belief prompts at a non-zero alpha."""
    return table[(table["direction"] == "belief") & (table["condition"] == "false_belief") & (table["alpha"] != 0)]


def selection_scores(selection: pd.DataFrame) -> pd.DataFrame:
    """Per non-zero alpha (the index) of one layer's selection table: the belief direction's
    false-belief flip rate (`belief`), the random directions' mean, 95th percentile and maximum
    (`random_mean`, `random_p95`, `random_max`; NaN without random rows) and the margin of the
    belief flip over the 95th percentile (`margin`; the belief flip where there are no random rows).
    The margin is over a quantile, not the maximum: the maximum of more draws is larger, so a margin
    over it would choose by how many random directions were drawn (see the module text)."""
    fb = _belief_false_belief_rows(selection).set_index("alpha")["flip_rate"].astype(float)
    rand = selection.iloc[:0] if "source" not in selection else selection[
        (selection["source"] == "random") & (selection["condition"] == "false_belief") & (selection["alpha"] != 0)]
    groups = rand.groupby("alpha")["flip_rate"]
    out = pd.DataFrame({"belief": fb,
                        "random_mean": groups.mean().astype(float).reindex(fb.index),
                        "random_p95": groups.agg(random_quantile).astype(float).reindex(fb.index),
                        "random_max": groups.max().astype(float).reindex(fb.index)})
    out["margin"] = out["belief"] - out["random_p95"].fillna(0.0)
    return out


def choose_alpha(selection: pd.DataFrame, min_flip: float | None = None) -> float:
    """The dose, chosen on one layer's selection half (see the module text).

    With random directions in the table: among the non-zero alphas whose belief direction flips at
    least `min_flip` of the false-belief answers (all of them when none does, or without
    `min_flip`), the one with the widest margin over the random directions' 95th percentile. Without
    random rows (tables from before they ran there): the smallest |alpha| reaching `min_flip`, else
    the most flipping. Ties go to the smallest |alpha|, then to the negative one."""
    scores = selection_scores(selection)
    if scores.empty:
        raise TomlensError("the selection half has no false-belief prompts to choose a dose on",
                           "use stimuli with false-belief belief questions (e.g. order-only)")
    reaching = scores[scores["belief"] >= min_flip - 1e-12] if min_flip is not None else scores.iloc[:0]
    if scores["random_p95"].notna().any():
        pool = reaching if len(reaching) else scores
        best = pool["margin"].max()
        tied = pool.index[pool["margin"] >= best - 1e-12].tolist()
    elif len(reaching):
        tied = reaching.index.tolist()
    else:
        tied = scores.index[scores["belief"] >= scores["belief"].max() - 1e-12].tolist()
    return float(sorted(tied, key=lambda a: (abs(a), a))[0])


def layer_summary(dose: pd.DataFrame, layer: int, alpha: float, *, min_flip: float = 0.8,
                  max_random_flip: float | None = None) -> SteeringLayer:
    """The summary row of one layer at `alpha` on the evaluation table (see the module text): the
    belief direction must flip at least `min_flip`, more than the random directions' 95th
    percentile and more than the shuffled-label direction, and (with `max_random_flip`) the random
    directions' mean flip must stay at most that. `random_max` and `p_random` are reported only:
    both move with the number of random directions drawn. The selection half's columns are left
    None: `run` fills them from the selection table."""
    at = dose[(dose["layer"] == layer) & (dose["alpha"] == alpha)]

    def flip(direction: str, condition: str) -> float:
        row = at[(at["direction"] == direction) & (at["condition"] == condition)]
        return float(row["flip_rate"].iloc[0]) if len(row) else float("nan")

    rates = at[(at["source"] == "random") & (at["condition"] == "false_belief")]["flip_rate"].to_numpy(dtype=float)
    fb = flip("belief", "false_belief")
    rand = RandomFlips.of(rates, fb)
    shuffled = flip("shuffled", "false_belief")
    reasons = []
    if not fb == fb:
        reasons.append("no false-belief prompts in the evaluation half")
    else:
        if fb < min_flip:
            reasons.append(f"the belief direction flips {fb:.2f} of false-belief answers (< {min_flip:.2f})")
        if not rand.n:
            reasons.append("no random directions to compare with")
        elif not fb > rand.p95:
            reasons.append(f"the random directions' 95th percentile flips {rand.p95:.2f} >= the belief direction's "
                           f"{fb:.2f}")
        if not fb > shuffled:
            reasons.append(f"the shuffled-label direction flips {shuffled:.2f} >= the belief direction's {fb:.2f}")
        if max_random_flip is not None and rand.n and rand.mean > max_random_flip + 1e-12:
            reasons.append(f"the random directions flip {rand.mean:.3f} on average (> {max_random_flip:.2f})")
    reason = "; ".join(reasons) if reasons else (
        f"belief flips {fb:.2f} of false-belief answers (>= {min_flip:.2f}); {rand.n} random directions: mean "
        f"{rand.mean:.3f}, p95 {rand.p95:.2f} (max {rand.max:.2f}, p_random {rand.p_value:.3f}, not judged); "
        f"shuffled {shuffled:.2f}")
    return SteeringLayer(layer=int(layer), alpha=float(alpha), flip_false_belief=fb,
                         flip_true_belief=flip("belief", "true_belief"), flip_reality=flip("belief", "reality"),
                         random_mean=rand.mean, random_p95=rand.p95, random_max=rand.max, p_random=rand.p_value,
                         n_random=rand.n, shuffled=shuffled, verdict=WITHHELD if reasons else FOUND, reason=reason)


@dataclass
class SteeringResult:
    """The evaluation-half dose-response table, the selection-half one (the belief direction and
    the selection half's own random directions, which are not saved: `random_directions` with
    seed + `SELECTION_SEED` redraws them), the evaluation directions, and the per-layer summary."""

    dose: pd.DataFrame
    selection: pd.DataFrame
    summary: SteeringSummary
    directions: dict[int, list[Direction]] = field(default_factory=dict)
    config: SteeringConfig | None = None
    manifest: dict[str, Any] = field(default_factory=dict)

    def best(self) -> SteeringLayer:
        """The layer row chosen on the selection half (`chosen_layer`: the widest margin of the
        belief direction over random ones there); like the dose, never chosen on evaluation numbers."""
        layers = self.summary.layers
        if not layers:
            raise TomlensError("this steering result has no layers", "run the stage with at least one layer")
        return chosen_layer(layers)

    def files(self, out: str | Path) -> list[Path]:
        out = Path(out)
        fmt = self.config.format if self.config is not None else "parquet"
        return [out / f"dose.{fmt}", out / f"dose_selection.{fmt}", out / "directions.safetensors"]

    def save(self, out: str | Path) -> Path:
        from tomlens.probes.directions import save_directions

        out = begin_save(out)
        dose_f, sel_f, dir_f = self.files(out)
        write_table(self.dose, dose_f)
        write_table(self.selection, sel_f)
        tensors = {f"layer{layer}/{d.name}": d.vector for layer, ds in self.directions.items() for d in ds}
        every = [(layer, d) for layer, ds in self.directions.items() for d in ds]
        meta = {"directions": [{"name": d.name, "source": d.source, "layer": d.layer, "site": d.site,
                                "tensor": f"layer{layer}/{d.name}", "norm": norm}
                               for (layer, d), norm in zip(every, _norms([d for _, d in every]), strict=True)]}
        if tensors:
            save_directions(dir_f, tensors, meta)
        return finish_save(out, self.config, self.manifest, summary_to_dict(self.summary))

    @classmethod
    def load(cls, out: str | Path) -> SteeringResult:
        from tomlens.probes.directions import load_directions

        out, config, manifest, data = read_finished(out, SteeringConfig)
        summary = summary_from_dict(SteeringSummary, data, folder=out, stage="steering")
        fmt = config.format if config is not None else "parquet"
        directions: dict[int, list[Direction]] = {}
        if (out / "directions.safetensors").is_file():
            tensors, meta = load_directions(out / "directions.safetensors")
            for m in meta.get("directions", []):
                directions.setdefault(int(m["layer"]), []).append(
                    Direction(m["name"], m["source"], int(m["layer"]), tensors[m["tensor"]], m.get("site", "resid_post")))
        return cls(dose=read_table(out / f"dose.{fmt}"), selection=read_table(out / f"dose_selection.{fmt}"),
                   summary=summary, directions=directions, config=config, manifest=manifest)

    def describe(self) -> str:
        s = self.summary
        lines = [f"steering ({s.mode}, {s.positions} position, {s.method} directions): "
                 f"{s.n_selection_prompts} selection / {s.n_evaluation_prompts} evaluation prompts, "
                 f"{s.n_random} random directions + shuffled labels, {s.forward_passes} forward passes",
                 ("layer and alpha chosen on the selection half (widest margin over its own random directions' "
                  "95th percentile); " if s.random_quantile is not None else
                  "layer and alpha chosen on the selection half (widest margin over its own random directions); "
                  if any(d.selection_margin is not None for d in s.layers) else
                  "layer and alpha chosen on the selection half (by the belief direction's flips alone: a result "
                  "from before random directions ran there); ") + "flip rates on the evaluation half at that alpha:",
                 f"{'layer':>5} {'alpha':>6} {'FB flip':>8} {'TB flip':>8} {'reality':>8} {'rand mean':>10} "
                 f"{'rand p95':>9} {'rand max':>9} {'shuffled':>9}  verdict"]
        for d in s.layers:
            lines.append(f"{d.layer:>5} {d.alpha:>6.2f} {d.flip_false_belief:>8.2f} {d.flip_true_belief:>8.2f} "
                         f"{d.flip_reality:>8.2f} {d.random_mean:>10.3f} "
                         f"{d.random_p95:>9.2f} {d.random_max:>9.2f} {d.shuffled:>9.2f}  {d.verdict}: "
                         f"{d.reason}")
        if s.random_quantile is not None:
            lines.append("random directions are judged by their mean and 95th percentile, which do not grow with how "
                         "many are drawn; their maximum does, and is shown, not judged")
        lines.append(f"layer chosen on the selection half: {s.layer} ({s.verdict}); the others are "
                     "shown, not chosen among on these numbers")
        lines.extend(f"note: {n}" for n in s.notes)
        return "\n".join(lines)


def run(config: SteeringConfig, *, model: Model | None = None, progress: bool = True) -> SteeringResult:
    """Split the tasks, fit the directions and choose the dose on the selection half, then run
    every direction at every alpha on the evaluation half and judge each layer."""
    stimuli = config.stimuli.load()
    check_store_writable(config)  # a read-only store: one clear error before the model loads
    if model is None:
        model = config.model.load()
    n_layers = int(model.cfg.n_layers)
    layers = list(config.layers) if config.layers is not None else list(range(n_layers))
    if max(layers) >= n_layers:
        raise TomlensError(f"layer {max(layers)} does not exist (the model has {n_layers} layers)",
                           f"use layers 0-{n_layers - 1}")
    groups = group_codes(stimuli, "task")
    if len(set(groups.tolist())) < 2:
        raise TomlensError("the stimuli hold one task, which cannot be split into selection and evaluation halves",
                           "use n = 2 or more tasks (8 or more for stable flip rates)")
    split = fraction_split(groups, config.select_fraction, seed=config.seed)
    sel = [stimuli[i] for i in split.train.tolist()]
    ev = [stimuli[i] for i in split.test.tolist()]
    n_dirs = 2 + config.n_random
    n_sel_dirs = 1 + config.n_random
    passes = count_passes(len(sel), n_sel_dirs * len(layers), config.alphas) + count_passes(
        len(ev), n_dirs * len(layers), config.alphas)
    if progress:
        say(f"steering plan: selection {n_sel_dirs * len(layers)} directions (belief and random) x "
              f"{len(config.alphas)} alphas x {len(sel)} prompts, evaluation {n_dirs * len(layers)} directions x "
              f"{len(config.alphas)} alphas x {len(ev)} prompts: {passes} forward passes (alpha 0 is the unsteered "
            "run)")
    dirs = fit_directions(model, sel, layers=layers, target=config.target, method=config.method,
                          n_random=config.n_random, seed=config.seed, directions_path=config.directions_path,
                          store=config.store, batch_size=config.batch_size, progress=progress)

    def dose(st: list[Any], directions: list[Direction]) -> pd.DataFrame:
        sources = paired_sources(model, st, layers, store=config.store, batch_size=config.batch_size,
                                 progress=progress) if config.mode == "patch" else None
        return dose_response(model, st, directions, config.alphas, mode=config.mode, positions=config.positions,
                             batch_size=config.batch_size, progress=progress, sources=sources)

    # the selection half's random directions are a draw of their own: a layer or dose chosen where the
    # evaluation's random directions happen to be weak would flatter the evaluation's null
    norms = dict(zip(layers, _norms([dirs[layer][0] for layer in layers]), strict=True))
    selection_random = {layer: random_directions(dirs[layer][0], config.n_random, seed=config.seed + SELECTION_SEED,
                                                 norm=norms[layer])
                        for layer in layers}
    selection = dose(sel, [d for layer in layers for d in (dirs[layer][0], *selection_random[layer])])
    evaluation = dose(ev, [d for layer in layers for d in dirs[layer]])
    per_layer = []
    for layer in layers:
        mine = selection[selection["layer"] == layer]
        alpha = choose_alpha(mine, config.min_flip)
        row = layer_summary(evaluation, layer, alpha, min_flip=config.min_flip, max_random_flip=config.max_random_flip)
        scores = selection_scores(mine)
        flip = float(scores.at[alpha, "belief"])
        per_layer.append(replace(
            row, selection_flip=flip, selection_random_p95=float(scores.at[alpha, "random_p95"]),
            selection_random_max=float(scores.at[alpha, "random_max"]),  # shown, not chosen by
            selection_margin=float(scores.at[alpha, "margin"]),  # what picks the layer: never an evaluation number
            selection_flip_max=float(scores["belief"].max()), selection_reached=bool(flip >= config.min_flip - 1e-12)))
    notes = []
    if config.directions_path is not None:
        notes.append(f"belief directions from {config.directions_path}: fitted by `tomlens probe` on its own "
                     "stimuli; if those include this run's evaluation stories, selection is not kept apart")
    if len({s.task_id for s in ev}) < 8:
        notes.append(f"the evaluation half holds {len({s.task_id for s in ev})} tasks: flip rates move in large steps")
    chosen = chosen_layer(per_layer)
    summary = SteeringSummary(
        layers=tuple(per_layer), mode=config.mode, positions=config.positions, method=config.method,
        target=config.target, alphas=tuple(config.alphas), n_random=config.n_random,
        n_selection_prompts=len(sel), n_evaluation_prompts=len(ev),
        selection_tasks=tuple(sorted({s.task_id for s in sel})), forward_passes=passes,
        norms={str(layer): norms[layer] for layer in layers},
        random_quantile=RANDOM_QUANTILE, verdict=chosen.verdict, layer=chosen.layer, notes=tuple(notes))
    manifest = run_manifest(model, config, stimuli_hash=stimuli_hash(stimuli))
    return SteeringResult(dose=evaluation, selection=selection, summary=summary,
                          directions={layer: dirs[layer] for layer in layers}, config=config, manifest=manifest)


def _norms(directions: list[Direction]) -> list[float]:
    """Each direction's `norm`, read in one go instead of one read per direction."""
    if not directions:
        return []
    return torch.stack([d.vector.norm() for d in directions]).tolist()


def chosen_layer(layers: Sequence[SteeringLayer]) -> SteeringLayer:
    """Of the per-layer summaries, the one whose chosen dose had the widest margin on the selection
    half (belief flip minus the random directions' 95th percentile: `selection_margin`), among the
    layers whose dose flipped at least `min_flip` there (`selection_reached`; all layers where none
    did: a layer that cannot reach it would only fail on the evaluation half); ties to the lower
    layer. Summaries written before the selection half ran random directions fall back to
    `selection_flip_max`, then `selection_flip`, then the evaluation rate."""
    def key(d: SteeringLayer) -> tuple[bool, float, int]:
        v = next(x for x in (d.selection_margin, d.selection_flip_max, d.selection_flip, d.flip_false_belief)
                 if x is not None)
        return (bool(d.selection_reached), v if v == v else -2.0, -d.layer)

    return max(layers, key=key)


def summary_frame(result: SteeringResult) -> pd.DataFrame:
    """The per-layer summary as a table."""
    return pd.DataFrame([summary_to_dict(d) for d in result.summary.layers])


__all__ = ["DEFAULT_ALPHAS", "FOUND", "RANDOM_QUANTILE", "RandomFlips", "SteeringConfig", "SteeringLayer",
           "SteeringResult", "SteeringSummary", "WITHHELD",
           "choose_alpha", "chosen_layer", "layer_summary", "random_quantile", "run", "selection_scores",
           "summary_frame"]
