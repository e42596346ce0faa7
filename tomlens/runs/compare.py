"""Compare runs of several models on one axis: relative depth, `layer / (n_layers - 1)`.

Models of different families have different numbers of layers, so "layer 14" means nothing across
them; relative depth puts the first layer at 0 and the last at 1 for every model. `compare_runs`
reads finished run folders (`tomlens run`, `tomlens study`: `<out>/<stage>/` for one model,
`<out>/<model_slug>/<stage>/` for several) and lays their results side by side, each table with a
`model` column:

- `behaviour`: accuracy per family x condition x prompt type and the papers' aggregates
  (reality-gated belief accuracy, Kosinski's strict task pass, the knowledge-state effect), with
  their intervals, in one long table (`measure`, `value`, `ci_low`, `ci_high`, `chance`);
- `probes`: every unit's cross-fitted accuracy on relative depth with its interval, each baseline
  (bag of words, length, position, embeddings, the random-init twin where run), the control task
  and selectivity, and the model's probe gate (`gate`: found / withheld) for that target;
- `probe_best`: per model and target, the unit chosen on selection stories with its held-out
  score and gate, and the best layer of the sweep (selection-biased), on both axes;
- `patching`: per head on relative depth, the effect as a fraction of that model's own gap (a noising
  run read as 1 - effect), effect / the model's largest |effect| as an extra column, and whether the
  ranking passed its gate, judged at validate's k (withheld or forced heads are never "found");
- `validation`: the checks of `tomlens validate` side by side;
- `gates`: one row per model x claim: found / withheld (with the reason) / not run;
- `missing`: what was asked for and is absent (models of `config.json` or `study.json` that did not
  finish or never started, stages without a finished result), so nothing is silently dropped.

Layer numbers are 0-based everywhere ("layer 4 (0-based) of 5" is the last of five).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pandas as pd

from tomlens.errors import TomlensError
from tomlens.io import read_json, read_table, write_json, write_table
from tomlens.provenance import versions
from tomlens.runs.compare_summary import ComparedModel, ComparedRun, CompareSummary
from tomlens.runs.files import CONFIG, MANIFEST, RESULT, summary_to_dict

if TYPE_CHECKING:
    from tomlens.runs.patching_summary import PatchingSummary
    from tomlens.runs.validate import ValidationSummary

# The stages a comparison reads (cache and pairs make no claim of their own).
COMPARED: tuple[str, ...] = ("behaviour", "probes", "patching", "steering", "validate")
ALL_STAGES: tuple[str, ...] = ("behaviour", "cache", "probes", "pairs", "patching", "steering", "validate")
NORMALISED = "effect_over_model_max_abs"  # patching: effect / that model's largest |effect|
BASELINES: tuple[str, ...] = ("baseline_bow", "baseline_length", "baseline_position", "baseline_embeddings",
                              "baseline_random_init")
# Final: the type checker reads each as its Literal, so a report's Finding status accepts them
FOUND: Final = "found"
WITHHELD: Final = "withheld"
NOT_RUN: Final = "not run"


def _unprefixed(reason: object) -> str:
    """A stage's withheld message without its own leading "withheld: " (the status says it)."""
    text = str(reason).strip()
    return text[len("withheld: "):] if text.lower().startswith("withheld: ") else text
RESULT_FILE = "result.json"


def relative_depth(layer: int | float, n_layers: int) -> float:
    """`layer / (n_layers - 1)`: 0 at the first layer, 1 at the last (a one-layer model's only layer is 0)."""
    return 0.0 if n_layers <= 1 else float(layer) / float(n_layers - 1)


@dataclass
class ModelEntry:
    """One model of one run: where its stages live, its layer count and what it ran."""

    label: str
    run: Path  # the run folder given
    folder: Path  # the model's folder (the run folder itself for a one-model run)
    n_layers: int
    n_heads: int | None
    provenance: dict[str, Any]
    asked: tuple[str, ...]  # stages its config asked for
    results: dict[str, Any] = field(default_factory=dict)  # stage -> loaded result


# ----------------------------------------------------------------------------------------------
# Finding the models of a run folder


def _stage_dirs(folder: Path) -> list[str]:
    return [s for s in ALL_STAGES if (folder / s).is_dir()]


def _model_folders(run: Path) -> list[tuple[Path, dict[str, Any] | None]]:
    """(model folder, its manifest entry or None) for each model of the run folder `run`."""
    manifest = read_json(run / MANIFEST) if (run / MANIFEST).is_file() else None
    models = manifest.get("models") if isinstance(manifest, dict) else None
    if isinstance(models, list) and models:
        out = []
        for m in models:  # the recorded folder may be absolute on another machine: look beside the manifest
            recorded = Path(str(m.get("folder", "")))
            here = run / recorded.name
            if recorded.name and here.is_dir() and _stage_dirs(here) and here != run:
                out.append((here, m))
            elif _stage_dirs(run) or not recorded.is_dir():
                out.append((run, m))
            else:
                out.append((recorded, m))
        return out
    if _stage_dirs(run):
        return [(run, None)]
    subs = sorted(p for p in run.iterdir() if p.is_dir() and (_stage_dirs(p) or (p / MANIFEST).is_file()))
    found: list[tuple[Path, dict[str, Any] | None]] = []
    for sub in subs:
        found.extend(_model_folders(sub))
    return found


def _asked(run: Path, folder: Path, entry: dict[str, Any] | None) -> tuple[str, ...]:
    """The stages the model's config asked for (its manifest, the run's config.json, else the folders)."""
    if entry is not None and isinstance(entry.get("stages"), dict):
        return tuple(s for s in ALL_STAGES if s in entry["stages"])
    for cfg in (folder / CONFIG, run / CONFIG):
        if cfg.is_file():
            data = read_json(cfg)
            if isinstance(data, dict) and "models" in data or isinstance(data, dict) and "model" in data:
                return tuple(s for s in ALL_STAGES if s in data)
    return tuple(_stage_dirs(folder))


def _stage_provenance(folder: Path, stages: Sequence[str]) -> dict[str, Any]:
    """The model provenance a stage recorded (its manifest's `model`, or its summary's `provenance`)."""
    for s in stages:
        for name, key in ((MANIFEST, "model"), (RESULT, "provenance"), ("summary.json", "provenance")):
            path = folder / s / name
            if path.is_file():
                data = read_json(path)
                prov = data.get(key) if isinstance(data, dict) else None
                if isinstance(prov, dict) and prov.get("n_layers") is not None:
                    return prov
    return {}


def _slug(folder: Path, entry: dict[str, Any] | None, provenance: dict[str, Any]) -> str:
    if entry is not None:
        models = (entry.get("config") or {}).get("models") or []
        if models:
            from tomlens.runs.base import ModelSpec, config_from_dict
            from tomlens.runs.experiment import model_slug

            try:
                return model_slug(config_from_dict(ModelSpec, models[0]))
            except TomlensError:
                pass
    return str(provenance.get("model") or folder.name)


def _load(stage: str, folder: Path, model: str) -> Any:
    """Load one finished stage; any failure (a corrupt Parquet or JSON file, a key this version does
    not know) is one TomlensError naming the model, the stage folder and the fix."""
    from tomlens.runs.experiment import STAGE_CLASSES, stage_module

    try:
        return getattr(stage_module(stage), STAGE_CLASSES[stage][1]).load(folder)
    except Exception as e:  # noqa: BLE001 - every load failure gets the same fix
        raise TomlensError(f"model {model}: the {stage} stage in {folder} cannot be read "
                           f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'})",
                           f"rerun that stage (delete {folder} and run the experiment again), or leave the model "
                           "out of the comparison") from e


def _spec_slugs(entries: Any) -> list[str]:
    """The folder names of a config's model entries (already expanded in a resolved config.json)."""
    from tomlens.runs.base import ModelSpec, config_from_dict
    from tomlens.runs.experiment import model_slug

    out = []
    for m in entries if isinstance(entries, list) else [entries]:
        try:
            out.append(model_slug(config_from_dict(ModelSpec, m)))
        except (TomlensError, TypeError, AttributeError):
            out.append(str(m.get("name", "?")) if isinstance(m, dict) else str(m))
    return out


def _asked_models(run: Path, found: Sequence[Path]) -> list[dict[str, Any]]:
    """Rows of `missing` for models the run asked for and that left no finished folder: every job
    of `study.json` that is not done or reused (with its `study-failed.json` error), then every model
    of `config.json` whose folder was not found (a crashed multi-model run writes no manifest, and a
    study's top-level manifest lists only finished jobs). A study folder `tomlens sweep` wrote reads
    the same (`runs.study.marker`)."""
    from tomlens.runs.study import FAILED, STUDY, marker

    rows: list[dict[str, Any]] = []
    seen = {Path(f).resolve() for f in found}
    study = marker(run, STUDY)
    if study.is_file():
        data = read_json(study)
        for job in (data.get("jobs") or []) if isinstance(data, dict) else []:
            if job.get("state") in ("done", "reused"):
                continue
            folder = run / Path(str(job.get("folder") or job.get("slug", ""))).name
            why = job.get("error") or ""
            failed = marker(folder, FAILED)
            if failed.is_file():
                rec = read_json(failed)
                why = (rec.get("error") if isinstance(rec, dict) else None) or why
            rows.append({"model": str(job.get("slug") or folder.name), "stage": "all", "folder": str(folder),
                         "reason": f"asked for but absent: study job {job.get('state', '?')}"
                                   + (f" ({why})" if why else "")})
            seen.add(folder.resolve())
    cfg = run / CONFIG
    data = read_json(cfg) if cfg.is_file() else None
    if isinstance(data, dict) and ("models" in data or "model" in data):
        slugs = _spec_slugs(data.get("models", data.get("model")))
        for slug in slugs:
            folder = run if len(slugs) == 1 else run / slug
            if folder.resolve() in seen:
                continue
            why = ("no folder: the run stopped before this model started" if not folder.is_dir()
                   else "no stage of this model finished")
            rows.append({"model": slug, "stage": "all", "folder": str(folder),
                         "reason": f"asked for in {cfg.name} but absent: {why}"})
            seen.add(folder.resolve())
    return rows


def _entries(run: Path, label: str | None) -> tuple[list[ModelEntry], list[dict[str, Any]]]:
    """The models of run folder `run` with their finished results, and the rows of what is missing."""
    if not run.is_dir():
        raise TomlensError(f"{str(run)!r} is not a folder", "pass run folders written by `tomlens run` or `tomlens study`")
    models = _model_folders(run)
    if not models:
        raise TomlensError(f"{run} is not a tomlens run: it holds no manifest.json and no stage folder "
                           f"({', '.join(ALL_STAGES)})", "pass the --out folder of `tomlens run` or `tomlens study`")
    entries: list[ModelEntry] = []
    missing: list[dict[str, Any]] = []
    done: list[Path] = []
    for folder, entry in models:
        asked = _asked(run, folder, entry)
        prov = dict(entry.get("model") or {}) if entry is not None else {}
        if prov.get("n_layers") is None:
            prov = {**prov, **_stage_provenance(folder, asked or _stage_dirs(folder))}
        slug = _slug(folder, entry, prov)
        name = slug if label is None else (label if len(models) == 1 else f"{label}:{slug}")
        done.append(folder)
        if not any((folder / s / RESULT).is_file() for s in COMPARED):
            missing.append({"model": name, "stage": "all", "folder": str(folder),
                            "reason": "asked for but absent: no stage of this model finished"})
            continue
        if prov.get("n_layers") is None:
            raise TomlensError(f"model {name} in {folder}: its layer count is recorded nowhere (no manifest.json with "
                               "the model's provenance, and no finished stage that records it)",
                               "rerun it with `tomlens run` (which records n_layers), or leave it out of the comparison")
        e = ModelEntry(name, run, folder, int(prov["n_layers"]),
                       int(prov["n_heads"]) if prov.get("n_heads") is not None else None, prov, asked)
        for stage in COMPARED:
            if stage not in asked:
                continue
            if (folder / stage / RESULT).is_file():
                e.results[stage] = _load(stage, folder / stage, name)
            else:
                why = "no stage folder" if not (folder / stage).is_dir() else "the stage did not finish (no result.json)"
                missing.append({"model": name, "stage": stage, "reason": f"asked for but absent: {why}",
                                "folder": str(folder / stage)})
        entries.append(e)
    for row in _asked_models(run, done):
        if label is not None:
            row["model"] = f"{label}:{row['model']}"
        missing.append(row)
    return entries, missing


# ----------------------------------------------------------------------------------------------
# The tables


def _behaviour(e: ModelEntry) -> pd.DataFrame:
    r = e.results.get("behaviour")
    if r is None:
        return pd.DataFrame()
    parts = []
    acc = r.accuracy
    if len(acc):
        parts.append(_with_mass(pd.DataFrame({
            "family": acc["family"], "condition": acc["condition"], "prompt_type": acc["prompt_type"],
            "measure": "accuracy", "value": acc["accuracy"], "ci_low": acc["ci_low"], "ci_high": acc["ci_high"],
            "n": acc["n"], "n_tasks": acc.get("n_tasks", pd.Series(float("nan"), index=acc.index)), "chance": 0.5}),
            acc))
    g = r.reality_gated
    if len(g):
        parts.append(pd.DataFrame({
            "family": g["family"], "condition": g["condition"], "prompt_type": "belief",
            "measure": "reality-gated belief accuracy", "value": g["accuracy"], "ci_low": g["ci_low"],
            "ci_high": g["ci_high"], "n": g["n_kept"], "n_tasks": g["n_tasks"], "chance": 0.5,
            # what the gate dropped: without these a high gated accuracy on few kept prompts reads as a result
            **{c: g[c] if c in g else float("nan") for c in ("n_belief", "n_dropped", "joint_accuracy",
                                                              "joint_ci_low", "joint_ci_high")}}))
    s = r.strict
    if len(s):
        # one row per family and scoring (two-way log-probability, and the first word of a greedy answer)
        scoring = s["scoring"].astype(str) if "scoring" in s else pd.Series("", index=s.index)
        parts.append(pd.DataFrame({
            "family": s["family"], "condition": "false_belief", "prompt_type": "all",
            "measure": "strict task pass (Kosinski" + scoring.map(lambda x: f", {x}" if x else "") + ")",
            "value": s["fraction_solved"], "ci_low": s["ci_low"],
            "ci_high": s["ci_high"], "n": s["tasks"], "n_tasks": s["tasks"], "chance": s["chance"]}))
    k = r.knowledge_state
    if len(k):
        parts.append(pd.DataFrame({
            "family": k["family"], "condition": "vs " + k["contrast"].astype(str), "prompt_type": "belief",
            "measure": "knowledge-state effect (FB - TB log-odds)", "value": k["effect"], "ci_low": k["ci_low"],
            "ci_high": k["ci_high"], "n": k["n_pairs"], "n_tasks": k["n_tasks"], "chance": 0.0}))
    if not parts:
        return pd.DataFrame()
    out = pd.concat(parts, ignore_index=True)
    out.insert(0, "model", e.label)
    return out


def _with_mass(part: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """`part` with the source table's mean option mass (how much of the next word the two options
    get: what the model would say at all), NaN where a run predates it. The low-mass flag is left to
    the behaviour tables: a bool column with gaps does not survive a CSV round trip as itself."""
    col = "mean_option_mass_first"
    part[col] = table[col].to_numpy() if col in table else float("nan")
    return part


def probe_test(sel: Any) -> str:
    """The test a found probe passed, in words, built from what ran: chance, the baselines that ran
    (by name), the type-level control where it ran, and the permutation null with its size."""
    ran = [k for k, v in sel.baselines.items() if v is not None and math.isfinite(v.score)]
    parts = [f"held-out interval above chance and the baselines that ran ({', '.join(ran)})"]
    if sel.control is not None and math.isfinite(sel.control.score):
        parts.append(f"type-level control {sel.control.score:.2f}")
    else:
        parts.append("no type-level control" + (f" ({sel.control_reason})" if sel.control_reason else ""))
    if sel.n_perm:
        parts.append(f"permutation p_max {sel.p_max:.3f} ({sel.n_perm} permutations)")
    else:
        parts.append("no permutation null was run")
    return "; ".join(parts)


def _probe_gate(r: Any, target: str) -> tuple[str, str]:
    """found only where the held-out selection said found AND at least one baseline ran: a score
    with nothing to beat but chance could be surface cues, so it is withheld."""
    sel = r.selection.get(target)
    if sel is None:
        return WITHHELD, "no held-out selection was run (selection = false): the sweep's maxima are selection-biased"
    if sel.verdict != FOUND:
        return WITHHELD, sel.reason
    if sel.best_baseline is None:
        return WITHHELD, ("no baseline ran (bag of words, length, position, embeddings, random-init twin), so "
                          "surface cues were not ruled out")
    return FOUND, probe_test(sel)


def _probes(e: ModelEntry) -> tuple[pd.DataFrame, pd.DataFrame]:
    r = e.results.get("probes")
    if r is None:
        return pd.DataFrame(), pd.DataFrame()
    t = r.table
    t = t[(t["features"] == "activations") & (t["metric"] == "accuracy")]
    if "train_on" in t:
        t = t[(t["train_on"] == "all") & (t["eval_set"] == "all")]
    keep = ["kind", "layer", "head", "position", "target", "score", "ci_low", "ci_high", "chance",
            *[b for b in BASELINES if b in t], "control", "control_ci_low", "control_ci_high",
            "selectivity", "selectivity_ci_low", "selectivity_ci_high", "best_baseline", "best_baseline_name"]
    out = t[[c for c in keep if c in t]].copy().reset_index(drop=True)
    for b in BASELINES:
        if b not in out:
            out[b] = float("nan")  # not run (e.g. no random-init twin): NaN, said in `describe`
    out.insert(0, "model", e.label)
    out.insert(3, "n_layers", e.n_layers)
    out.insert(4, "relative_depth", [relative_depth(x, e.n_layers) for x in out["layer"]])
    gates = {tg: _probe_gate(r, tg) for tg in out["target"].unique()}
    out["gate"] = [gates[tg][0] for tg in out["target"]]
    sel_units = {tg: s.unit for tg, s in r.selection.items()}
    out["selected"] = [bool(u and u["kind"] == k and int(u["layer"]) == int(la) and int(u["head"]) == int(h))
                       for tg, k, la, h in zip(out["target"], out["kind"], out["layer"], out["head"], strict=True)
                       for u in [sel_units.get(tg)]]
    best = []
    for target in sorted(set(out["target"]) | set(r.selection)):
        row: dict[str, Any] = {"model": e.label, "target": target, "n_layers": e.n_layers}
        sel = r.selection.get(target)
        if sel is not None and sel.unit is not None and sel.evaluation is not None:
            bb = sel.best_baseline
            twin = sel.baselines.get("random_init")
            row.update(selected_unit=sel.site, selected_layer=int(sel.unit["layer"]),
                       selected_relative_depth=relative_depth(sel.unit["layer"], e.n_layers),
                       held_out_score=sel.evaluation.score, held_out_ci_low=sel.evaluation.ci_low,
                       held_out_ci_high=sel.evaluation.ci_high, chance=sel.evaluation.chance,
                       best_baseline_name=bb[0] if bb else "", best_baseline=bb[1].score if bb else float("nan"),
                       random_init=twin.score if twin is not None else float("nan"), p_max=sel.p_max,
                       n_perm=int(sel.n_perm),
                       baselines_run=", ".join(k for k, v in sel.baselines.items()
                                               if v is not None and math.isfinite(v.score)),
                       control=sel.control.score if sel.control is not None else float("nan"))
        gate, reason = gates.get(target) or _probe_gate(r, target)
        row.update(gate=gate, reason=reason)
        layers = out[(out["target"] == target) & (out["head"] < 0) & (out["kind"] != "resid_pre")
                     & out["score"].notna()]
        if len(layers):
            b = layers.loc[layers["score"].idxmax()]
            row.update(best_layer_kind=b["kind"], best_layer=int(b["layer"]),
                       best_layer_relative_depth=float(b["relative_depth"]), best_layer_score=float(b["score"]),
                       best_layer_ci_low=float(b["ci_low"]), best_layer_ci_high=float(b["ci_high"]),
                       best_layer_baseline=float(b.get("best_baseline", float("nan"))),
                       best_layer_baseline_name=str(b.get("best_baseline_name", "") or ""),
                       best_layer_control=float(b.get("control", float("nan"))),
                       best_layer_selectivity=float(b.get("selectivity", float("nan"))))
        best.append(row)
    return out, pd.DataFrame(best)


@dataclass(frozen=True)
class RankingGate:
    """The head-ranking gate of one model: status, reason, the k it was judged at and that row's heads."""

    status: str
    reason: str
    k: int | None = None
    heads: str = ""  # the top-k set of that recovery row, e.g. "L3H1;L4H0"
    recovery: float = float("nan")
    random_mean: float = float("nan")


def gate_k(n_heads_total: int, validate_summary: ValidationSummary | None = None) -> tuple[int, str]:
    """The k the head ranking is judged at, as `tomlens validate` judges it: the validate stage's
    own k when it ran, else `default_k` (5% of all heads, at least 1); and where it came from."""
    from tomlens.runs.validate import default_k

    if validate_summary is not None:
        return int(validate_summary.k), "the validate stage's k"
    return default_k(n_heads_total), f"5% of the model's {n_heads_total} heads"


def patching_direction(summary: PatchingSummary) -> str:
    """The direction of the effects in the heads table (the run's first direction): `denoise`
    (clean into corrupted, important heads near 1) or `noise` (corrupted into clean, important heads
    near 0). Anything else is refused: its effects cannot be read on the denoising scale."""
    d = str(summary.directions[0]) if summary.directions else "denoise"
    if d not in ("denoise", "noise"):
        raise TomlensError(f"patching direction {d!r} is not one compare can read",
                           "rerun patching with direction = \"denoise\" (or \"noise\" / \"both\")")
    return d


def patching_gate(summary: PatchingSummary, n_heads_total: int, *, k: int | None = None,
                  thresholds: Any = None, k_source: str = "") -> RankingGate:
    """Whether a patching run's head ranking is a finding, judged as `tomlens validate` judges it:
    its pre-sweep gate passed (not withheld, not forced) and top-k recovery at validate's k (its own
    when it ran, else 5% of heads) passed `check_recovery` (held-out recovery at or above the
    threshold, layer-matched random sets below theirs). A run without recovery at that k is withheld."""
    from tomlens.patching.gate import FORCED_PREFIX
    from tomlens.runs.validate import Thresholds, check_recovery

    if k is None:
        k, k_source = gate_k(n_heads_total)
    t = thresholds if thresholds is not None else Thresholds()
    if summary.withheld:
        return RankingGate(WITHHELD, _unprefixed(summary.withheld), k)
    if summary.forced:
        return RankingGate(WITHHELD, "forced past a failed gate: " + (summary.forced_message or "").removeprefix(
            FORCED_PREFIX), k)
    if patching_direction(summary) == "noise":
        return RankingGate(WITHHELD, "the ranking is by noising effect; validate's recovery check is defined for "
                                     "denoising, so it was not judged (rerun patching with direction = denoise)", k)
    row = summary.topk_at(k)
    source = f" ({k_source})" if k_source else ""
    if row is None:
        ran = sorted({r.k for r in summary.topk or ()})
        return RankingGate(WITHHELD, f"no top-k recovery at k = {k}{source}, the k validate judges at"
                                     + (f" (run at k = {', '.join(map(str, ran))} only)" if ran else
                                        " (no top-k recovery was run)") + "; add it to patching.ks", k)
    heads = row.heads
    check = check_recovery(summary, k, t, n_heads_total=n_heads_total)
    if check.passed:
        return RankingGate(FOUND, f"top-{k} recovery{source} of {heads.replace(';', ', ')}: {check.value:.2f} >= "
                                  f"{check.threshold:g} on held-out pairs, layer-matched random sets "
                                  f"{check.null:.2f} <= {check.null_threshold:g}", k, heads, check.value, check.null)
    return RankingGate(WITHHELD, f"top-{k} recovery{source} fails its check: {check.detail}", k, heads,
                       check.value, check.null)


def _validate_thresholds(e: ModelEntry) -> Any:
    """The recovery thresholds the validate stage used (from its checks table), else the defaults."""
    from tomlens.runs.validate import Thresholds

    v = e.results.get("validate")
    t = Thresholds()
    if v is None or not len(v.table) or "check" not in v.table:
        return t
    row = v.table[v.table["check"] == "topk_recovery"]
    if not len(row):
        return t
    r = row.iloc[0]
    fin = lambda x, d: float(x) if x is not None and x == x else d  # noqa: E731
    return replace(t, min_recovery=fin(r.get("threshold"), t.min_recovery),
                   max_random_recovery=fin(r.get("null_threshold"), t.max_random_recovery))


def _patching(e: ModelEntry) -> pd.DataFrame:
    """Per-head effects on relative depth, on the denoising scale (a noising run's effect is read as
    1 - effect, the share of the gap the head's corruption removes), with effect / the model's
    largest |effect| as an extra column; and the ranking's gate at validate's k."""
    r = e.results.get("patching")
    if r is None or r.heads is None or not len(r.heads):
        return pd.DataFrame()
    h = r.heads
    col = "patch_effect" if "patch_effect" in h else next((c for c in h.columns if c.endswith("effect")), None)
    if col is None:
        return pd.DataFrame()
    direction = patching_direction(r.summary)
    effect = (1.0 - h[col]) if direction == "noise" else h[col]
    n_total = e.n_layers * (e.n_heads or int(h["head"].max()) + 1)
    v = e.results.get("validate")
    k, source = gate_k(n_total, v.summary if v is not None else None)
    g = patching_gate(r.summary, n_total, k=k, thresholds=_validate_thresholds(e), k_source=source)
    peak = float(effect.abs().max())
    out = pd.DataFrame({"model": e.label, "layer": h["layer"].astype(int), "head": h["head"].astype(int),
                        "n_layers": e.n_layers,
                        "relative_depth": [relative_depth(x, e.n_layers) for x in h["layer"]],
                        "effect": effect, "effect_kind": col if direction == "denoise" else f"1 - {col} (noise)",
                        "direction": direction,
                        NORMALISED: effect / peak if peak > 0 else float("nan"), "model_peak_abs_effect": peak,
                        "rank": h.get("patch_rank", pd.Series(range(1, len(h) + 1), index=h.index)),
                        "gate": g.status, "gate_reason": g.reason, "gate_k": g.k, "gate_heads": g.heads})
    out["found"] = out["gate"] == FOUND
    out["in_gate_set"] = [f"L{la}H{hd}" in g.heads.split(";") for la, hd in zip(out["layer"], out["head"], strict=True)]
    return out.sort_values(["layer", "head"]).reset_index(drop=True)


def _validation(e: ModelEntry) -> pd.DataFrame:
    r = e.results.get("validate")
    if r is None or not len(r.table):
        return pd.DataFrame()
    cols = [c for c in ("check", "value", "threshold", "comparison", "null", "null_threshold", "passed", "detail")
            if c in r.table]
    out = r.table[cols].copy()
    out.insert(0, "model", e.label)
    return out.reset_index(drop=True)


def _gates(e: ModelEntry, probe_best: pd.DataFrame, patching: pd.DataFrame) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def add(claim: str, status: str, reason: str, stage: str) -> None:
        rows.append({"model": e.label, "claim": claim, "stage": stage, "status": status, "reason": reason})

    if "probes" not in e.results:
        add("probe", NOT_RUN, "missing: the stage did not finish" if "probes" in e.asked else "no probes stage", "probes")
    else:
        mine = probe_best[probe_best["model"] == e.label] if len(probe_best) else probe_best
        for _, b in mine.iterrows():
            add(f"probe ({b['target']})", b["gate"], b["reason"], "probes")
    if "patching" not in e.results:
        add("head ranking", NOT_RUN,
            "missing: the stage did not finish" if "patching" in e.asked else "no patching stage", "patching")
    else:
        mine = patching[patching["model"] == e.label] if len(patching) else patching
        if len(mine):
            add("head ranking", mine["gate"].iloc[0], mine["gate_reason"].iloc[0], "patching")
        else:
            s = e.results["patching"].summary
            add("head ranking", WITHHELD, _unprefixed(s.withheld or "no head was ranked"), "patching")
    if "steering" in e.results:
        steer = e.results["steering"].summary
        rows_l = [x for x in steer.layers if x.layer == steer.layer]
        add(f"steering (layer {steer.layer})", FOUND if steer.verdict == FOUND else WITHHELD,
            rows_l[0].reason if rows_l else "", "steering")
    elif "steering" in e.asked:
        add("steering", NOT_RUN, "missing: the stage did not finish", "steering")
    if "validate" in e.results:
        t = e.results["validate"].table
        for _, c in t.iterrows():
            add(f"validation: {c['check']}", FOUND if bool(c["passed"]) else WITHHELD, str(c.get("detail", "")),
                "validate")
    elif "validate" in e.asked:
        add("validation", NOT_RUN, "missing: the stage did not finish", "validate")
    return rows


def _concat(frames: list[pd.DataFrame], columns: Sequence[str] = ()) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(columns))


# ----------------------------------------------------------------------------------------------
# The result


@dataclass
class CompareResult:
    """The comparison's tables (by name, see the module docstring) and where they came from."""

    tables: dict[str, pd.DataFrame]
    summary: CompareSummary  # runs, models (label, folder, n_layers, provenance), versions, time

    def __getattr__(self, name: str) -> pd.DataFrame:
        tables = self.__dict__.get("tables", {})
        if name in tables:
            return tables[name]
        raise AttributeError(name)

    @property
    def models(self) -> list[str]:
        return [m.label for m in self.summary.models]

    def save(self, out: str | Path) -> Path:
        """Each table as `<name>.parquet`, then `result.json` (the summary) last: a folder without it
        is not a finished comparison."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / RESULT_FILE).unlink(missing_ok=True)
        for name, df in self.tables.items():
            write_table(df, out / f"{name}.parquet")
        write_json(summary_to_dict(replace(self.summary, tables=tuple(self.tables))), out / RESULT_FILE)
        return out

    @classmethod
    def load(cls, out: str | Path) -> CompareResult:
        out = Path(out)
        if not (out / RESULT_FILE).is_file():
            raise TomlensError(f"{out} holds no finished comparison (no {RESULT_FILE})",
                               "write one with `tomlens compare RUN ... --out DIR`")
        summary = CompareSummary.from_json(read_json(out / RESULT_FILE), folder=out)
        tables = {name: read_table(out / f"{name}.parquet") for name in summary.tables
                  if (out / f"{name}.parquet").is_file()}
        return cls(tables, summary)

    def describe(self) -> str:
        """Each model with its layer count, each claim's gate, the best probe layer on both axes, and
        what is missing."""
        lines = [f"compared {len(self.models)} model(s) on relative depth = layer / (n_layers - 1):"]
        for m in self.summary.models:
            lines.append(f"  {m.label}: {m.n_layers} layers ({m.folder})")
        best = self.tables.get("probe_best", pd.DataFrame())
        for _, b in best.iterrows():
            if isinstance(b.get("selected_unit"), str):
                lines.append(f"probe {b['model']} ({b['target']}): selected {b['selected_unit']} (relative depth "
                             f"{b['selected_relative_depth']:.2f}), held-out {b['held_out_score']:.2f} "
                             f"[{b['held_out_ci_low']:.2f}, {b['held_out_ci_high']:.2f}] -> {b['gate']}")
            if "best_layer" in b and b["best_layer"] == b["best_layer"]:
                withheld = "" if b["gate"] == FOUND else "withheld: "
                extra = "".join(f", {name} {b[col]:.2f}" for name, col in
                                (("best baseline", "best_layer_baseline"), ("control", "best_layer_control"),
                                 ("selectivity", "best_layer_selectivity"))
                                if col in b and b[col] == b[col])
                lines.append(f"  {withheld}best layer of the sweep (selection-biased) for {b['model']} "
                             f"({b['target']}): {b['best_layer_kind']}:{int(b['best_layer'])} (0-based) of "
                             f"{int(b['n_layers'])} (relative depth {b['best_layer_relative_depth']:.2f}) at "
                             f"{b['best_layer_score']:.2f}{extra}")
        gates = self.tables.get("gates", pd.DataFrame())
        if len(gates):
            lines.append("gates:")
            for _, g in gates.iterrows():
                lines.append(f"  {g['model']:<24}{g['claim']:<28}{g['status']}" +
                             (f": {g['reason']}" if g["status"] != FOUND and g["reason"] else ""))
        probes = self.tables.get("probes", pd.DataFrame())
        if len(probes) and probes["baseline_random_init"].isna().all():
            lines.append("note: no random-init twin was run for any model (baseline_random_init is empty)")
        missing = self.tables.get("missing", pd.DataFrame())
        if len(missing):
            lines.append("missing (asked for, absent):")
            lines.extend(f"  {r['model']} {r['stage']}: {r['reason']}" for _, r in missing.iterrows())
        return "\n".join(lines)


def compare_runs(folders: Sequence[str | Path], *, missing: Sequence[str] = (),
                 labels: Sequence[str] | None = None) -> CompareResult:
    """Load every model of every run folder and lay their results side by side on relative depth.

    `missing` names models that were asked for and did not finish (e.g. a study's failed jobs):
    they are listed in the `missing` table. `labels` names each run folder (a run of several models
    labels them `label:slug`); without it a model is named by its folder slug."""
    if not folders:
        raise TomlensError("no run folder to compare", "pass one or more run folders, e.g. tomlens compare runs/a runs/b")
    if labels is not None and len(labels) != len(folders):
        raise TomlensError(f"{len(labels)} label(s) for {len(folders)} run folder(s)", "pass one --label per run folder")
    entries: list[ModelEntry] = []
    missing_rows: list[dict[str, Any]] = [{"model": str(m), "stage": "all", "reason": "asked for but absent: "
                                           "the model's run did not finish", "folder": ""} for m in missing]
    for i, folder in enumerate(folders):
        found, miss = _entries(Path(folder), labels[i] if labels is not None else None)
        entries.extend(found)
        missing_rows.extend(miss)
    unique: dict[tuple[str, str], dict[str, Any]] = {}
    for row in missing_rows:  # a model named by the caller (a study's failed job) and by study.json: once
        key = (row["model"], row["stage"])
        if key not in unique or (not unique[key]["folder"] and row["folder"]):  # keep the row that says more
            unique[key] = row
    missing_rows = list(unique.values())
    seen: dict[str, int] = {}
    for e in entries:  # the same model in two runs: name both by their run folder
        seen[e.label] = seen.get(e.label, 0) + 1
    if labels is not None and any(n > 1 for n in seen.values()):
        raise TomlensError(f"two models share the label {next(k for k, n in seen.items() if n > 1)!r}",
                           "give each run folder its own --label")
    for e in entries:
        if seen[e.label] > 1:
            old = e.label
            e.label = f"{e.run.name}/{old}"
            for row in missing_rows:
                if row["model"] == old and row["folder"].startswith(str(e.folder)):
                    row["model"] = e.label
    if len({e.label for e in entries}) < len(entries):
        raise TomlensError("two models of the comparison end up with the same name", "pass --label for each run folder")
    behaviour = _concat([_behaviour(e) for e in entries], ["model", "family", "condition", "measure", "value"])
    probe_parts = [_probes(e) for e in entries]
    probes = _concat([p[0] for p in probe_parts], ["model", "kind", "layer", "relative_depth", "score", "gate"])
    probe_best = _concat([p[1] for p in probe_parts], ["model", "target", "gate", "reason"])
    patching = _concat([_patching(e) for e in entries], ["model", "layer", "head", "relative_depth", NORMALISED,
                                                         "gate", "found"])
    validation = _concat([_validation(e) for e in entries], ["model", "check", "value", "threshold", "null", "passed"])
    gates = pd.DataFrame([g for e in entries for g in _gates(e, probe_best, patching)],
                         columns=["model", "claim", "stage", "status", "reason"])
    models = pd.DataFrame([{"model": e.label, "n_layers": e.n_layers, "n_heads": e.n_heads,
                            "name": e.provenance.get("model"), "revision": e.provenance.get("revision"),
                            "stages": ", ".join(s for s in e.asked if s in COMPARED),
                            "finished": ", ".join(e.results), "folder": str(e.folder)} for e in entries])
    tables = {"models": models, "behaviour": behaviour, "probes": probes, "probe_best": probe_best,
              "patching": patching, "validation": validation, "gates": gates,
              "missing": pd.DataFrame(missing_rows, columns=["model", "stage", "reason", "folder"])}
    runs = tuple(ComparedRun(folder=folder, manifest=read_json(Path(folder) / MANIFEST)
                             if (Path(folder) / MANIFEST).is_file() else None)
                 for folder in dict.fromkeys(str(Path(f)) for f in folders))
    summary = CompareSummary(
        command="compare", axis="relative depth = layer / (n_layers - 1)",
        normalisation="patching `effect` is each model's own fraction of its clean - corrupted gap "
                      "(plotted as is); `" + NORMALISED + "` = effect / the largest |effect| over that "
                      "model's heads, an extra column only",
        layers="layer numbers are 0-based: layer L of N runs from 0 to N - 1",
        models=tuple(ComparedModel(label=e.label, folder=str(e.folder), run=str(e.run), n_layers=e.n_layers,
                                   n_heads=e.n_heads, asked=tuple(e.asked), finished=tuple(e.results),
                                   provenance=e.provenance) for e in entries),
        missing=tuple(map(str, missing)), runs=runs, versions=versions(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"), tables=tuple(tables))
    return CompareResult(tables, summary)

