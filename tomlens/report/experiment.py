"""The report of an experiment run: one self-contained `report.html` over the stages that ran,
built from the result objects (the tables the run just wrote are not read back).

`write_experiment_figures` writes each stage's figure files into its folder and returns the
figures, so that the page shows the same ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from tomlens.report.audit import audit_sections
from tomlens.report.findings import HEAD_NOTE, Finding, experiment_findings, layer_words, model_names
from tomlens.report.html import Section, write_report

if TYPE_CHECKING:
    from tomlens.runs.cache import CacheSummary
    from tomlens.runs.pairs import PairsSummary
    from tomlens.runs.steering_summary import SteeringSummary

Figures = dict[str, Any]  # file stem -> plotly Figure

# One line per kind of figure (by file stem): what each mark means, so a figure reads without the code.
_GUIDES: list[tuple[str, str]] = [
    (r"layers_.+", "Each solid line is a target's held-out probe accuracy per layer, with its 95% band; the "
                   "dash-dot line is that layer's best baseline (bag of words, length, position, embeddings or the "
                   "random-init twin), the dotted line the control task on its own labels, the grey dashed line "
                   "chance; the star is the unit chosen on selection stories, at its held-out score."),
    (r"heads_(exact|attribution|search)_.+", "Each cell is one head (layer down, head across): its patching "
                                             "effect on the false- minus true-belief gap, 0 = the corrupted "
                                             "(true-belief) run, 1 = the clean (false-belief) run; white is the "
                                             "unpatched run, red cells move toward the clean run, blue away."),
    (r"attribution_vs_exact_.+", "Each point is one head: its exact patching effect (x) against the gradient "
                                 "attribution estimate (y); points on the grey dashed y = x line agree."),
    (r"topk_recovery", "The blue line is the effect of patching the top-k heads together, with its 95% band; the "
                       "grey line and band are the mean and 95% range of layer-matched random head sets of the "
                       "same size: the top heads matter only where blue clears the grey band."),
    (r"steering_dose", "One panel per layer: the logit difference (start minus now) against the steering "
                       "strength alpha, one line per condition for the belief direction; the grey band spans the "
                       "random directions, the black dashed line is the shuffled-label direction, the green dotted "
                       "line the alpha chosen on the selection half."),
    (r"steering_flips", "One panel per layer: the share of answers flipped against alpha, one line per condition "
                        "for the belief direction; the grey band spans the random directions on false-belief "
                        "prompts, the black dashed line is the shuffled-label direction, the green dotted line the "
                        "alpha chosen on the selection half."),
]
_PROBE_HEADS = ("Each cell is one head's held-out probe accuracy (layer down, head across), brighter is higher; "
                "the star marks the head chosen on selection stories. The brightest cell is a maximum over many "
                "heads: read the findings for the held-out verdict.")
# The clause of a guide that promises the star of the chosen unit, and what replaces it where the
# figure draws none (the unit chosen is of another kind, or no selection ran).
_STAR_CLAUSE = re.compile(r"(; )?the star (is|marks) the (unit|head) chosen on selection stories(, at its held-out score)?")
_NO_STAR = "no star: the unit chosen on selection stories is not on this figure"


def has_star(fig: Any) -> bool:
    """Whether a figure marks a unit with a star (the probe figures' chosen unit)."""
    return any(getattr(getattr(t, "marker", None), "symbol", None) == "star" for t in fig.data)


def true_guide(guide: str, fig: Any) -> str:
    """`guide` as true to `fig`: its promise of a star dropped (and the absence said) where none is drawn."""
    if not _STAR_CLAUSE.search(guide) or has_star(fig):
        return guide
    return _STAR_CLAUSE.sub(lambda m: ("; " if m.group(1) else "") + _NO_STAR, guide)


def guide_for(stem: str, stage: str) -> str:
    """The one-line reading guide of a figure by its file stem ("" where none is written: the page
    then reads one off the figure's axes)."""
    if stage == "probes" and stem.startswith("heads_"):
        return _PROBE_HEADS
    for pattern, guide in _GUIDES:
        if guide and re.fullmatch(pattern, stem):
            return guide
    return ""


def write_experiment_figures(result: Any) -> dict[tuple[int, str], Figures]:
    """Every stage's figures, written as HTML files into the stage's folder; returned by
    (model index, stage). A reused patching stage keeps the figure files it wrote (its sweeps are
    not saved, so they cannot be drawn again); only its recovery curve is redrawn from its table."""
    from tomlens.report.layers import write_probe_figures
    from tomlens.report.patching import recovery_curve, write_patching_figures
    from tomlens.report.steering import dose_figure, flip_figure, write_steering_figures

    out: dict[tuple[int, str], Figures] = {}
    for i, run in enumerate(result.runs):
        if "probes" in run.results:
            probes = run.results["probes"]
            out[(i, "probes")] = write_probe_figures(probes.table, run.folders["probes"], probes.selection)
        patching = run.results.get("patching")
        if patching is not None and not patching.dry_run:
            if patching.sweeps:
                out[(i, "patching")] = write_patching_figures(patching, run.folders["patching"])
            elif patching.tables.get("topk") is not None:
                out[(i, "patching")] = {"topk_recovery": recovery_curve(patching.tables["topk"])}
        steering = run.results.get("steering")
        if steering is not None and len(steering.dose):
            # the files are the ones `tomlens steer` writes; the page draws the same figures again
            # from the same result (a reused stage reloads its dose tables, so it is redrawn too)
            write_steering_figures(steering, run.folders["steering"])
            out[(i, "steering")] = {"steering_dose": dose_figure(steering), "steering_flips": flip_figure(steering)}
    return out


def _behaviour_sections(res: Any) -> list[Section]:
    sections = [Section("Behaviour", "Accuracy per family, condition and prompt type, with 95% intervals from "
                        "resampling whole tasks (prompts of one task are not independent). Every table gives its "
                        "cells' option mass: mean_option_mass_first is the next-word probability of the two "
                        "options' first tokens, mean_option_mass that of the whole options; low_option_mass marks "
                        f"a cell under {_min_mass(res):g}, where the model would more likely say neither option "
                        "and a two-way score describes a choice it mostly would not make.",
                        collapsed=[_fold("accuracy per family, condition and prompt type", [res.accuracy])]
                        + ([_fold("the strict rule per family", [res.strict])] if len(res.strict) else []),
                        fold_text=True)]
    first_words = getattr(res, "first_word", None)
    if first_words is not None and len(first_words):
        sections.append(Section("Behaviour: the first word of a greedy completion (Kosinski)",
                                "Kosinski's scoring of the unexpected-transfer and unexpected-contents tasks: the "
                                "model writes, and its answer is right only when its first word is the keyed "
                                "option's; an answer that names neither option (off_key) is wrong. His strict rule "
                                "over these answers is the strict table's 'first word (greedy)' rows.",
                                collapsed=[_fold("first words per family and condition", [first_words])],
                                fold_text=True))
    gated = getattr(res, "reality_gated", None)
    if gated is not None and len(gated):
        sections.append(Section("Behaviour: belief accuracy gated on the reality prompt",
                                "Belief prompts counted only where the model answers the same story's reality "
                                "prompt right (kept and dropped counts per cell).",
                                collapsed=[_fold("reality-gated accuracy per cell", [gated])], fold_text=True))
    effect = getattr(res, "knowledge_state", None)
    if effect is not None and len(effect):
        sections.append(Section("Behaviour: the knowledge-state effect (Jones et al.)",
                                "Paired false- minus true-belief difference of the log-odds of the start answer "
                                "over matched stories, with a task-bootstrap 95% interval and the share of tasks "
                                "where it is positive. A model that tracks belief shows a positive effect on the "
                                "knowledge contrasts (contrast_kind); label contrasts change what the label says, "
                                "not what the protagonist saw. Cells from too few tasks (few_tasks) have no "
                                "interval and are no evidence either way.",
                                collapsed=[_fold("the knowledge-state effect per contrast", [effect])],
                                fold_text=True))
    if len(res.object_bias):
        k0 = getattr(res, "k0_check", None)
        sections.append(Section("Behaviour: object bias per cell (Ruis et al.)",
                                "o_b per cell with its 95% interval and the unclassified share (the probability on "
                                "neither target, which o_b, normalised over the two, leaves out); the k = 0 check "
                                "(with no habituation nothing marks a goal, so o_b should sit near 0.5: near_half "
                                "by a TOST against 0.5); and the selective-encoding criterion as the paper states "
                                "it (animate distinct from inanimate and from control, inanimate equal to control by "
                                "a TOST equivalence test), with the direction the animate case differs in "
                                "(passes_object_bias: toward the goal object).",
                                collapsed=[_fold("object bias, the k = 0 check and the selective-encoding criterion",
                                                 [res.object_bias] + ([k0] if k0 is not None and len(k0) else [])
                                                 + ([res.selective] if len(res.selective) else []))],
                                fold_text=True))
    batteries = getattr(res, "batteries", None) or {}
    if batteries:
        sections.append(Section("Behaviour: the seed papers' batteries",
                                "Each battery summarised the way its paper reports it: one row per reported cell, "
                                "with intervals from resampling whole tasks. A paper's number appears only in a "
                                "column named for what it is (e.g. paper_other_items_gpt4, paper_lrs: LaMDA's 0-10 "
                                "rating of other items, not a pass rate): it comes from other items, other models "
                                "and, for some tasks, another scoring rule or scale, so it is context, never a "
                                "target or a comparison. One line per battery: click it for its table.",
                                collapsed=[_battery_fold(family, df) for family, df in batteries.items()]))
    return sections


def _fold(what: str, tables: list[pd.DataFrame]) -> tuple[str, list[pd.DataFrame]]:
    """A collapsed entry: what the tables hold, with their row count, as the line a reader clicks."""
    n = sum(len(t) for t in tables)
    return f"{what} ({n} row{'s' if n != 1 else ''})", tables


def _battery_fold(family: str, table: pd.DataFrame) -> tuple[str, list[pd.DataFrame]]:
    """One battery as one summary line (its name, source, row count and how many rows are flagged)
    over its table: the flags are what a reader must not miss with the table closed."""
    source = BATTERY_SOURCES.get(family, "")
    flags = table["flag"].replace("", pd.NA).notna().sum() if "flag" in table.columns else 0
    what, tables = _fold(f"{family}" + (f" ({source})" if source else ""), [table])
    return what + (f", {flags} flagged" if flags else ""), tables


def _min_mass(res: Any) -> float:
    """The option-mass threshold the behaviour run flagged cells by."""
    from tomlens.behaviour.aggregates import MIN_OPTION_MASS

    config = getattr(res, "config", None)
    return float(getattr(config, "min_option_mass", MIN_OPTION_MASS))


# Where each battery's design comes from (the summaries' `paper` columns cite the same).
BATTERY_SOURCES = {
    "false-belief-factorial": "Jones, Trott & Bergen (EPITOME): false belief",
    "recursive-mindreading": "Jones, Trott & Bergen (EPITOME): recursive mindreading",
    "indirect-request": "Jones, Trott & Bergen (EPITOME): indirect request",
    "scalar-implicature": "Jones, Trott & Bergen (EPITOME): scalar implicature",
    "motomqa": "Street et al. (MoToMQA): higher-order statements",
    "kosoy": "Kosoy et al.: the developmental battery",
}


def _cache_sections(res: Any) -> list[Section]:
    s: CacheSummary = res.summary
    row = {"store": s.store, "reused": s.reused, "n": s.n, "sites": ", ".join(s.sites),
           "positions": ", ".join(s.positions), "dtype": s.dtype}
    return [Section("Activations", "Cached in the content-addressed store (shared by every run that asks for "
                    "the same stimuli, sites and positions).", tables=[pd.DataFrame([row])])]


def _selection_table(selection: dict[str, Any]) -> pd.DataFrame:
    """One row per target: the unit chosen on the selection stories, its held-out evaluation score
    next to the best baseline and the control on the same stories, the permutation p and the verdict."""
    rows = []
    for target, r in selection.items():
        e, best = r.evaluation, r.best_baseline
        rows.append({"target": target, "unit": r.site, "selection score": r.selection_score,
                     "held-out score": None if e is None else e.score,
                     "ci_low": None if e is None else e.ci_low, "ci_high": None if e is None else e.ci_high,
                     "chance": None if e is None else e.chance,
                     "best baseline": "-" if best is None else f"{best[0]} {best[1].score:.2f}",
                     "control": None if r.control is None else r.control.score,
                     "p_max": r.p_max, "permutations": r.n_perm, "verdict": r.verdict, "reason": r.reason})
    return pd.DataFrame(rows)


def _set_name(spec: Any) -> str:
    """A stimulus set in words: its file's name, or its family."""
    if spec is None:
        return "the stimuli"
    if getattr(spec, "path", None):
        return Path(spec.path).name
    return str(getattr(spec, "family", None) or "the stimuli")


def _test_set(res: Any) -> str:
    """The name of a probe run's separate test set (`--test-stimuli`), or "" where it had none."""
    spec = getattr(getattr(res, "config", None), "test_stimuli", None)
    return _set_name(spec) if spec is not None else ""


def _probe_sections(res: Any, figures: Figures) -> list[Section]:
    table = res.table
    keys = [c for c in ("target", "train_on", "eval_set", "kind") if c in table.columns]
    shown = [c for c in (*keys, "layer", "head", "score", "ci_low", "ci_high", "best_baseline", "best_baseline_name",
                         "above_baseline", "control", "control_chance", "condition_split", "chance")
             if c in table.columns]
    best = (table[(table["metric"] == "accuracy") & (table["features"] == "activations")]
            .sort_values("score", ascending=False).groupby(keys, sort=False).head(1)[shown])
    targets = sorted(table["target"].unique())
    title = " vs ".join(t.replace("_", " ") for t in targets)
    order = [f for f in figures if f.startswith("layers_")] + [f for f in figures if f.startswith("heads_")]
    selection = getattr(res, "selection", None) or {}
    lead = ("The unit was chosen on half of the stories and is scored here on the other half, beside the "
            "baselines and the control task fitted the same way; 'found' needs an interval above chance and "
            "above the best baseline and a max-statistic permutation p below 0.05, else the result is withheld "
            "(each target's verdict and reason are in the table).") if selection else \
        "No held-out selection was run (selection = false): the maxima below are biased upwards by the choice."
    test_set = _test_set(res)
    if test_set:
        title += f" (tested on {test_set})"
        lead = (f"Probes trained on {_set_name(res.config.stimuli)} and scored on the test set {test_set}. "
                + lead)
    return [Section(f"Probes: {title}", lead, tables=[_selection_table(selection)] if selection else []),
            Section("Probes: every layer and head (selection-biased maxima)",
                    "Logistic probes per layer and per head (each head's own write to the residual stream), "
                    "scored on held-out stories; bands are bootstrap 95% intervals over test stories. The best "
                    "layer or head per target, training set, evaluation set and site is a maximum over many units "
                    "and is not a finding by itself; read it against its best baseline and control:",
                    collapsed=[_fold("the best unit per target, set and site", [best])], fold_text=True,
                    figures=[figures[f] for f in order],
                    guides=[true_guide(guide_for(f, "probes"), figures[f]) for f in order])]


def _pairs_sections(res: Any) -> list[Section]:
    s: PairsSummary = res.summary
    row = {"family": s.family, "pairs aligned": s.aligned, "of": s.total,
           "contrasts": ", ".join(map(str, s.contrasts)) or "the family's own", "dropped": len(s.dropped_pairs)}
    return [Section("Minimal pairs", res.describe(), collapsed=[_fold("pairs aligned and dropped", [pd.DataFrame([row])])])]


def _patching_sections(res: Any, figures: Figures) -> list[Section]:
    from tomlens.patching.metric import gap_note
    from tomlens.runs.patching_summary import num

    summary = res.summary  # a tomlens.runs.patching_summary.PatchingSummary
    if summary.withheld:  # the gate failed: no sweep ran; say why, with the raw numbers
        why = _short(summary.withheld)
        # figures a reused or partial run still holds are shown flagged, never under a result's heading
        picked = [f for f in figures if f.startswith(("heads_", "attribution_vs_exact", "topk_recovery"))]
        return [Section(f"Patching (withheld: {why})", summary.withheld, figures=[figures[f] for f in picked],
                        guides=[f"WITHHELD ({why}), not a result: " + guide_for(f, "patching") for f in picked],
                        tables=[t for t in (res.tables.get("gate"), res.tables.get("base")) if t is not None])]
    baselines = summary.baselines or {}
    ranked = summary.ranked_by or ""
    key = next((k for k in baselines if ranked.startswith(k.replace("_", " "))), next(iter(baselines), ""))
    b = baselines.get(key)
    note = gap_note(b.gap, num(b.gap_se), b.gap_unstable) if b is not None else None
    heads, topk, ablation = (res.tables.get(name) for name in ("heads", "topk", "ablation"))
    tables = [t for t in (topk,) if t is not None and len(t)]
    folds = [_fold("the 15 heads of largest effect", [heads.head(15)])] if heads is not None and len(heads) else []
    picked = [f for f in figures if re.fullmatch(r"heads_[a-z]+_[a-z]+", f)]
    picked += [f for f in figures if f.startswith("attribution_vs_exact")]
    picked += [f for f in figures if f == "topk_recovery"]
    text = ("Exact and attribution patching of every head from the false-belief story into its matched "
            "true-belief story (effect 0 = true-belief run, 1 = false-belief run), then the top-k heads "
            "patched together against random heads." + (f" Note: {note}." if note else ""))
    text += f" {HEAD_NOTE}"
    heading, flag = "Patching: heads that carry belief", ""
    if summary.forced:
        text = f"{summary.forced_message}. {text}"
        heading, flag = "Patching (forced past its gate: not a result)", "FORCED past a failed gate, not a result: "
    if not res.sweeps:
        text += " (Reused from an earlier run: the per-head figures are the files under patching/figures/.)"
    picked = list(dict.fromkeys(picked))
    sections = [Section(heading, text, tables=tables, figures=[figures[f] for f in picked],
                        guides=[flag + guide_for(f, "patching") for f in picked], collapsed=folds)]
    if ablation is not None and len(ablation):
        sections.append(Section(
            "Mean ablation of the top heads",
            f"Each of the top-k heads' outputs replaced by its mean over all stories {_ablation_where(summary)}: "
            "false-belief accuracy and its drop, against the same number of random heads.",
            collapsed=[_fold("mean ablation against random heads, per k", [ablation])], fold_text=True))
    comparisons = summary.head_comparisons()
    row: dict[str, Any] = {"pairs": summary.pairs.n_aligned, "top heads": ", ".join((summary.top_heads or ())[:5])}
    if comparisons:
        c = comparisons[0]
        row["attribution vs exact Spearman"] = round(num(c.spearman), 3)
        row["Spearman over heads that matter"] = round(num(c.spearman_active), 3)
        row[f"top-{c.k} overlap"] = num(c.topk_overlap)
    sections.append(Section("Patching summary", tables=[pd.DataFrame([row])]))
    return sections


def _short(text: str, n: int = 80) -> str:
    """A gate message cut to a heading's length, without its leading 'withheld: '."""
    text = text[len("withheld: "):] if text.lower().startswith("withheld: ") else text
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def _ablation_where(summary: Any) -> str:
    """Where the mean ablation replaced the heads' outputs, by the run's mode (a PatchingSummary)."""
    mode = summary.ablation.mode if summary.ablation is not None else None
    where: dict[str | None, str] = {
        "final": "at the final token", "all": "at every position (the mean at the same right-aligned position)"}
    return where.get(mode, f"(mode {mode or 'not recorded'})")


STEERING_COLUMNS = {"layer": "layer", "alpha": "alpha (chosen on selection)", "flip_false_belief": "FB flip",
                    "flip_true_belief": "TB flip", "flip_reality": "reality flip", "random_mean": "random mean",
                    "random_p95": "random p95", "random_max": "random max (not judged)", "shuffled": "shuffled labels", "verdict": "verdict",
                    "reason": "reason"}


def steering_table(summary: SteeringSummary) -> pd.DataFrame:
    """The per-layer steering summary as shown: every layer with its verdict and reason, so a
    withheld layer reads as withheld next to its numbers, never as a finding."""
    rows = [{label: getattr(d, key) for key, label in STEERING_COLUMNS.items()} for d in summary.layers]
    return pd.DataFrame(rows, columns=list(STEERING_COLUMNS.values()))


def _steering_sections(res: Any, figures: Figures, n_layers: int | None = None) -> list[Section]:
    s: SteeringSummary = res.summary
    layers = s.layers
    from tomlens.runs.steering import chosen_layer

    d = next((x for x in layers if x.layer == s.layer), None) or (chosen_layer(layers) if layers else None)
    verdict = "No layer was run." if d is None else (
        f"The layer chosen on the selection half is {layer_words(d.layer, n_layers)}, at alpha {d.alpha:g}: "
        f"{d.verdict} held out ({d.reason}); the verdict of the findings above also needs the "
        "reality answers left alone. The other rows are per-layer held-out verdicts, not chosen: no claim.")
    if layers and not any(x.verdict == "found" for x in layers):
        verdict = ("No layer passed: every layer is withheld (reasons in the table), so nothing here shows a "
                   f"direction that steers belief. {verdict}")
    text = (f"Directions fitted on the selection half ({s.n_selection_prompts} prompts, {s.method}, "
            f"{s.mode} at the {s.positions} position); each layer's alpha was chosen there, and the "
            f"flip rates are on the held-out evaluation half ({s.n_evaluation_prompts} prompts) against "
            f"{s.n_random} norm-matched random directions and a direction fitted on shuffled labels. "
            "A layer is 'found' only when the belief direction flips enough false-belief answers and more than "
            f"every control; otherwise it is withheld with the reason. {verdict}")
    notes = s.notes
    if notes:
        text += " Notes: " + "; ".join(notes) + "."
    order = [f for f in ("steering_dose", "steering_flips") if f in figures]
    return [Section("Steering along the belief direction", text, tables=[steering_table(s)],
                    figures=[figures[f] for f in order], guides=[guide_for(f, "steering") for f in order])]


def validation_table(table: pd.DataFrame) -> pd.DataFrame:
    """The checks as shown: each number beside its threshold, the control (null) beside its own,
    PASS or FAIL, and the detail that says what was measured or why the check failed."""
    rows = []
    for r in table.to_dict(orient="records"):
        has_null = r.get("null_comparison") not in (None, "-")
        rows.append({"check": r["check"], "value": r["value"],
                     "threshold": f"{r['comparison']} {r['threshold']:g}",
                     "null": r["null"] if has_null else None,
                     "null threshold": f"{r['null_comparison']} {r['null_threshold']:g}" if has_null else "-",
                     "result": "PASS" if bool(r["passed"]) else "FAIL", "detail": r["detail"]})
    return pd.DataFrame(rows, columns=["check", "value", "threshold", "null", "null threshold", "result", "detail"])


def _validation_sections(res: Any) -> list[Section]:
    s = res.summary
    n_pass = int(res.table["passed"].astype(bool).sum())
    n = len(res.table)
    text = (f"{n_pass} of {n} checks pass on {s.model or 'the model'} "
            f"({'every check passes' if res.passed else 'the validation FAILED'}). "
            f"The method checks on {s.n_tasks} order-only tasks (k = {s.k} of {s.heads} heads): "
            "each method's number against its threshold, and its control (bag of words, random heads, random "
            "directions) against the control's own threshold; a check passes only when both hold. A stage that "
            "was withheld or refused its input fails its checks, with the reason in the detail. On a model "
            "trained to track belief every check should pass; on its random twin none should.")
    return [Section("Validation of the methods", text, tables=[validation_table(res.table)])]


# The order a report shows the stages in (the order an experiment runs them).
STAGE_ORDER = ("audit", "behaviour", "cache", "probes", "pairs", "patching", "steering", "validate")


def stage_sections_of(stage: str, res: Any, figures: Figures, n_layers: int | None = None) -> list[Section]:
    """The sections of one stage's result: the same for an experiment's page and for the page a
    single command (`tomlens behave`, `probe`, `patch`, `steer`) writes beside its tables."""
    if stage == "audit":
        return audit_sections(res)
    if stage == "behaviour":
        return _behaviour_sections(res)
    if stage == "cache":
        return _cache_sections(res)
    if stage == "probes":
        return _probe_sections(res, figures)
    if stage == "pairs":
        return _pairs_sections(res)
    if stage == "patching":
        return _patching_sections(res, figures)
    if stage == "steering":
        return _steering_sections(res, figures, n_layers)
    if stage == "validate":
        return _validation_sections(res)
    raise ValueError(f"no report sections for stage {stage!r}")


def stage_findings(stage: str, res: Any, model: str, n_layers: int | None = None) -> list[Finding]:
    """The claims of one stage's result on its own (`experiment_findings` adds what needs two stages:
    the audit's withholding and a probe's line beside the behaviour verdict)."""
    from tomlens.report import findings as f

    if stage == "behaviour":
        return f.behaviour_findings(res, model)
    if stage == "probes":
        return [f.with_behaviour_context(x, [], ran=False) for x in f.probe_findings(res, model, n_layers)]
    if stage == "patching":
        return f.patching_findings(res, model)
    if stage == "steering":
        return f.steering_findings(res, model, n_layers)
    return []


def stage_model_name(result: Any) -> str:
    """The model of a single command's result as its manifest records it, with the settings its
    entry changes ("smollm2-135m (no bos)"), so two runs of one model read apart."""
    from tomlens.report.findings import model_settings

    spec = getattr(getattr(result, "config", None), "model", None)
    record = (getattr(result, "manifest", None) or {}).get("model") or {}
    name = str(record.get("model") or getattr(spec, "name", "") or "the model")
    words = model_settings(spec) if spec is not None else []
    return f"{name} ({', '.join(words)})" if words else name


def _stage_figures(stage: str, result: Any) -> Figures:
    """The figures of a single command's page, drawn from its result where that is cheap and needs
    no sweep objects (a patching run passes the figures it wrote instead)."""
    if stage == "probes":
        from tomlens.report.layers import probe_figures

        return dict(probe_figures(result.table, result.selection))
    if stage == "steering" and len(result.dose):
        from tomlens.report.steering import dose_figure, flip_figure

        return {"steering_dose": dose_figure(result), "steering_flips": flip_figure(result)}
    return {}


def write_stage_report(stage: str, result: Any, out: str | Path, figures: Figures | None = None) -> Path:
    """`<out>/report.html` for a single command's result (the typed result an experiment holds for
    `stage`): its findings, its figures (`figures`, or drawn from the result), its sections and
    its manifest, built by the same functions as an experiment's page."""
    model = stage_model_name(result)
    n_layers = ((getattr(result, "manifest", None) or {}).get("model") or {}).get("n_layers")
    shown = _stage_figures(stage, result) if figures is None else figures
    findings = stage_findings(stage, result, model, n_layers)
    sections = stage_sections_of(stage, result, shown, n_layers)
    command = {"behaviour": "behave", "probes": "probe", "patching": "patch", "steering": "steer"}.get(stage, stage)
    return write_report(Path(out) / "report.html", f"tomlens {command}: {model}", sections,
                        getattr(result, "manifest", None) or None, findings=findings)


def write_experiment_report(result: Any, out: str | Path,
                            figures: dict[tuple[int, str], Figures] | None = None) -> Path:
    """`<out>/report.html` over the stages that ran (`result`: a `tomlens.runs.experiment.
    ExperimentResult`); `figures` from `write_experiment_figures` (built here when not given). The
    page opens with `experiment_findings(result)`, then the figures, the tables and provenance."""
    if figures is None:
        figures = write_experiment_figures(result)
    config = result.config
    names = model_names(result)
    several = len(result.runs) > 1
    overview = pd.DataFrame([{"model": name, "stage": stage, "folder": str(run.folders[stage]),
                              "reused": run.reused.get(stage, False)}
                             for name, run in zip(names, result.runs, strict=True) for stage in run.results])
    sections = [Section("Experiment", config.description, collapsed=[_fold("the stages and their folders", [overview])])]
    for i, (name, run) in enumerate(zip(names, result.runs, strict=True)):
        n_layers = (run.provenance or {}).get("n_layers")
        stage_sections = [s for stage in STAGE_ORDER if stage in run.results
                          for s in stage_sections_of(stage, run.results[stage], figures.get((i, stage), {}), n_layers)]
        if several:
            for s in stage_sections:
                s.heading = f"{name}: {s.heading}"
        sections += stage_sections
    provenance = {"experiment": config.name, "models": [run.provenance for run in result.runs],
                  "argv": result.manifest.get("argv")}
    title = f"tomlens {config.name}: {', '.join(names)}"
    findings = experiment_findings(result)
    if not findings:
        stages = ", ".join(dict.fromkeys(s for run in result.runs for s in run.results))
        findings = [Finding("a finding: no stage of this run makes a claim", "not run",
                            f"the stages that ran ({stages}) hold data, not claims: add behaviour, probes, "
                            "patching, steering or validate")]
    return write_report(Path(out) / "report.html", title, sections, provenance, findings=findings)
