"""Findings: the claims a report opens with, each with the test it passed or the gate that withheld it.

A report states its conclusions before its figures; a claim whose gate failed is listed as
withheld with the reason, never as a result. `experiment_findings` reads them off the stage
results of a run (every number comes from a result, none is typed in); the `*_findings`
functions do the same for one stage, for reports that have only that stage.

A withheld claim is phrased as the question it would have answered ("whether ..."), with the
numbers that failed the gate in its test, so that no withheld sentence reads as a result.
"""

from __future__ import annotations

import html
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import pandas as pd

if TYPE_CHECKING:
    from tomlens.runs.steering_summary import SteeringLayer, SteeringSummary

Status = Literal["found", "withheld", "not run"]

# Two-option forced choice (`tomlens.behaviour.scoring`: p(a) / (p(a) + p(b))): chance is one half.
CHANCE_TWO_OPTIONS = 0.5
# The level of the stages' own tests (probe permutation p, top-k recovery against random heads).
ALPHA = 0.05


@dataclass(frozen=True)
class Finding:
    """One claim, in one sentence with its number and interval, and what backs or withholds it."""

    claim: str     # e.g. "belief is linearly decodable from layer 14 (0-based) of 30 at 0.91 [0.86, 0.95] ..."
    status: Status
    test: str      # the test it passed ("held-out accuracy 0.40 above the best baseline, p = 0.001"),
                   # or why it is withheld ("the random-init twin scores 0.88: the gate failed")
    model: str = ""  # which model (or "" for a claim about the comparison)
    stage: str = ""  # which stage made it (behaviour, probes, patching, steering, validate)
    # what the claim does or does not imply, said beside it: a probe that decodes belief next to
    # whether the model's answers show it ("but the model's answers are at chance: not shown to be used")
    context: str = ""


_HEAD = re.compile(r"\bL\d+H\d+\b")
_TAGS = {"found": "✓ found", "withheld": "✗ withheld", "not run": "– not run"}


def findings_html(findings: Sequence[Finding]) -> str:
    """The findings as an HTML list: found claims first, then withheld ones, then checks not run.
    The model is named on each line only when the findings are about more than one model."""
    if not findings:
        return "<p><em>No stage of this run makes a claim.</em></p>"
    order = {"found": 0, "withheld": 1, "not run": 2}
    several = len({f.model for f in findings}) > 1
    ordered = sorted(findings, key=lambda f: order[f.status])
    many = {key for key, n in Counter((f.model, f.stage) for f in ordered if f.status == "withheld").items()
            if n > MAX_OPEN_WITHHELD}
    items: list[str] = []
    folded: dict[tuple[str, str], list[str]] = {}
    for f in ordered:
        line = _finding_li(f, several)
        if f.status == "withheld" and (f.model, f.stage) in many:
            if (f.model, f.stage) not in folded:
                folded[(f.model, f.stage)] = []
                items.append(f"<!--fold {len(folded) - 1}-->")
            folded[(f.model, f.stage)].append(line)
        else:
            items.append(line)
    for i, ((model, stage), lines) in enumerate(folded.items()):
        who = f"{model}: " if model and several else ""
        summary = f"{who}{len(lines)} {stage or 'other'} claims withheld (click for each, with why)"
        items[items.index(f"<!--fold {i}-->")] = (
            f"<li class='finding withheld fold'><details><summary>{html.escape(summary)}</summary>"
            f"<ul class='findings'>{''.join(lines)}</ul></details></li>")
    note = f"<p class='note'>{html.escape(HEAD_NOTE)}</p>" if any(_HEAD.search(f.claim + f.test) for f in findings) \
        else ""
    return "<ul class='findings'>" + "".join(items) + "</ul>" + note


# A stage with more withheld claims than this shows them behind one line that says how many (its
# found claims always show): a page opens with what was found, not with a screen of non-results.
MAX_OPEN_WITHHELD = 3


def _finding_li(f: Finding, several: bool) -> str:
    who = f"<strong>{html.escape(f.model)}</strong>: " if f.model and several else ""
    stage = f"<span class='stage'>{html.escape(f.stage)}</span> " if f.stage else ""
    return (f"<li class='finding {f.status.replace(' ', '-')}'><span class='tag'>{_TAGS[f.status]}</span> "
            f"{stage}{who}{html.escape(f.claim)} <span class='test'>({html.escape(f.test)})</span>"
            + (f"<br><span class='context'>{html.escape(f.context)}</span>" if f.context else "") + "</li>")


# --------------------------------------------------------------------------------------------
# Helpers


def _finite(*values: Any) -> bool:
    try:
        return all(math.isfinite(float(v)) for v in values)
    except (TypeError, ValueError):
        return False


def _iv(lo: Any, hi: Any, fmt: str = ".2f") -> str:
    return f"[{float(lo):{fmt}}, {float(hi):{fmt}}]" if _finite(lo, hi) else "[no interval]"


def _num(v: Any, fmt: str = ".2f") -> str:
    return f"{float(v):{fmt}}" if _finite(v) else "n/a"


def _words(name: str) -> str:
    return str(name).replace("_", " ")


def _strip_withheld(text: str) -> str:
    """A gate message without its leading "withheld: " (the tag says it already)."""
    return text[len("withheld: "):] if text.lower().startswith("withheld: ") else text


def model_names(result: Any) -> list[str]:
    """The models of an experiment as their provenance records them (what was loaded, not what the
    file asked for), two entries of one model named apart by the settings they change
    (`variant_names`): "smollm2-135m (bos)" and "smollm2-135m (no bos)", never one name twice."""
    names = [str((run.provenance or {}).get("model") or run.model.name) for run in result.runs]
    return variant_names(names, [run.model for run in result.runs])


def model_settings(spec: Any) -> list[str]:
    """The settings a model entry (`tomlens.runs.base.ModelSpec`) changes from the defaults, in
    words: a revision, a dtype, the BOS rule, a weight seed (the same ones `model_slug` names
    folders by)."""
    words = []
    if getattr(spec, "revision", None):
        words.append(f"revision {spec.revision}")
    if getattr(spec, "dtype", None):
        words.append(str(spec.dtype))
    bos = getattr(spec, "prepend_bos", None)
    if bos is not None:
        words.append("bos" if bos else "no bos")
    if getattr(spec, "seed", 0):
        words.append(f"seed {spec.seed}")
    return words


def variant_names(names: Sequence[str], specs: Sequence[Any]) -> list[str]:
    """`names` with each one that occurs more than once followed by its entry's settings in
    brackets ("smollm2-135m (no bos)"), or by its place ("#2") where the entries do not differ
    in any setting: a title, a finding or a terminal line must tell the two apart."""
    counts = {n: list(names).count(n) for n in names}
    out = []
    for name, spec in zip(names, specs, strict=True):
        if counts[name] < 2:
            out.append(name)
            continue
        words = model_settings(spec)
        out.append(f"{name} ({', '.join(words) if words else 'default settings'})")
    if len(set(out)) < len(out):  # two entries alike in every setting: their place tells them apart
        out = [f"{n} #{i + 1}" if out.count(n) > 1 else n for i, n in enumerate(out)]
    return out


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (same order as `ps`; a nan stays nan and counts in no
    family): a claim among several tests is found only when its adjusted p is below ALPHA."""
    idx = [i for i, p in enumerate(ps) if _finite(p)]
    out = [float("nan")] * len(ps)
    m, running = len(idx), 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: float(ps[i]))):
        running = max(running, min(1.0, (m - rank) * float(ps[i])))
        out[i] = running
    return out


def p_from_interval(estimate: Any, lo: Any, hi: Any, null: float) -> float:
    """A two-sided p-value against `null` read off a 95% interval by its normal approximation
    (se = width / 3.92): the bootstrap tables keep intervals, not p-values, and Holm needs p."""
    if not _finite(estimate, lo, hi) or float(hi) - float(lo) <= 0:
        return float("nan")
    z = abs(float(estimate) - null) / ((float(hi) - float(lo)) / 3.92)
    return math.erfc(z / math.sqrt(2))


def layer_words(layer: Any, n_layers: int | None) -> str:
    """'layer 14 (0-based) of 30': layers are counted from 0, said every time; 'of ?' where the
    model's layer count is not known."""
    return f"layer {layer} (0-based) of {n_layers if n_layers else '?'}"


HEAD_NOTE = "L{l}H{h} names head h of layer l, both counted from 0."


def _n_layers(run: Any) -> int | None:
    n = (run.provenance or {}).get("n_layers")
    return int(n) if n is not None else None


# --------------------------------------------------------------------------------------------
# Behaviour


def _bias_check(acc: pd.DataFrame, gated: Any, family: str) -> tuple[bool, str]:
    """Whether a start-answer bias is ruled out for `family`: it scores false-belief belief prompts
    1.0 but true-belief ones 0 and reality prompts 0, so the family's true-belief belief accuracy
    (or the reality-gated joint accuracy of its false-belief prompts) must be above chance too.
    Returns (ruled out, the numbers in words)."""
    chance = CHANCE_TWO_OPTIONS
    tb = acc[(acc["family"] == family) & (acc["condition"] == "true_belief") & (acc["prompt_type"] == "belief")]
    words, ok = [], False
    if len(tb):
        r = tb.iloc[0]
        words.append(f"TB {r['accuracy']:.2f} {_iv(r['ci_low'], r['ci_high'])}")
        ok = _finite(r["ci_low"]) and float(r["ci_low"]) > chance
    else:
        words.append("TB not run")
    if gated is not None and len(gated) and {"family", "condition", "joint_accuracy"} <= set(gated.columns):
        g = gated[(gated["family"] == family) & (gated["condition"] == "false_belief")]
        if len(g):
            r = g.iloc[0]
            words.append(f"reality-gated joint {r['joint_accuracy']:.2f} {_iv(r['joint_ci_low'], r['joint_ci_high'])}")
            ok = ok or (_finite(r["joint_ci_low"]) and float(r["joint_ci_low"]) > chance)
    return ok, ", ".join(words)


def _mass_note(r: Any) -> str:
    """"; ..." saying a cell's options get little of the next word (its `low_option_mass` flag), or
    "": a finding about a choice the model would mostly not make must say so."""
    if not bool(getattr(r, "low_option_mass", False)):
        return ""
    mass = getattr(r, "mean_option_mass_first", float("nan"))
    return (f"; flagged: the two options get {_num(mass, '.2g')} of the next word's probability, so the model "
            "would more likely say neither")


def behaviour_findings(res: Any, model: str = "") -> list[Finding]:
    """Per family, the belief question of false-belief stories against chance (task-bootstrap
    interval), then the paired false- minus true-belief effect of every knowledge contrast (the
    test a response bias cannot pass). A cell from fewer than `FEW_TASKS` tasks, or whose interval
    includes the null, is withheld. Cells are tested together: each p (read off its interval) is
    Holm-corrected across the cells of its kind. Above chance on false-belief prompts is found
    only when the same family's true-belief prompts (or the reality-gated joint accuracy) are
    above chance too: a model that always gives the start answer scores 1.0 there."""
    from tomlens.runs.behaviour import FEW_TASKS

    out: list[Finding] = []
    acc = res.accuracy
    chance = CHANCE_TWO_OPTIONS
    if len(acc) and {"prompt_type", "condition"} <= set(acc.columns):
        rows = list(acc[(acc["prompt_type"] == "belief") & (acc["condition"] == "false_belief")].itertuples())
        testable = [r.n_tasks >= FEW_TASKS and _finite(r.ci_low, r.ci_high) for r in rows]
        adj = holm([p_from_interval(r.accuracy, r.ci_low, r.ci_high, chance) if t else float("nan")
                    for r, t in zip(rows, testable, strict=True)])
        n_cells = sum(testable)
        gated = getattr(res, "reality_gated", None)
        for r, t, p in zip(rows, testable, adj, strict=True):
            what = f"the belief question of {r.family} false-belief stories"
            nums = f"{r.accuracy:.2f} {_iv(r.ci_low, r.ci_high)} ({r.n} prompts, {r.n_tasks} tasks)"
            holm_s = f"Holm-corrected p {_num(p, '.3g')} across {n_cells} cells"
            if not t:
                out.append(Finding(f"whether the model answers {what} better or worse than chance", "withheld",
                                   f"{nums}: fewer than {FEW_TASKS} tasks, so the task-bootstrap interval "
                                   "understates the uncertainty", model, "behaviour"))
            elif (r.ci_low > chance or r.ci_high < chance) and p < ALPHA:
                side = "above" if r.ci_low > chance else "below"
                ruled_out, bias = _bias_check(acc, gated, r.family)
                if side == "above" and not ruled_out:
                    out.append(Finding(f"whether the model answers {what} better than chance because it tracks "
                                       "belief", "withheld", f"{nums}: a start-answer bias would score this too "
                                       f"({bias}; neither above chance)", model, "behaviour"))
                    continue
                out.append(Finding(f"the model answers {what} right {nums}, {side} chance ({chance:.2f})", "found",
                                   f"the 95% interval from resampling whole tasks lies {side} chance; {holm_s}"
                                   + (f"; not a start-answer bias: {bias}" if side == "above" else "")
                                   + _mass_note(r), model, "behaviour"))
            else:
                why = (f"the 95% interval includes chance ({chance:.2f})" if not (r.ci_low > chance or r.ci_high < chance)
                       else f"{holm_s} is not below {ALPHA}")
                out.append(Finding(f"whether the model answers {what} better or worse than chance", "withheld",
                                   f"{nums}: {why}", model, "behaviour"))
    effect = getattr(res, "knowledge_state", None)
    if effect is not None and len(effect):
        kinds = effect["contrast_kind"] if "contrast_kind" in effect else pd.Series("knowledge", index=effect.index)
        rows = list(effect[kinds.fillna("knowledge") == "knowledge"].itertuples())
        testable = [not (r.n_tasks < FEW_TASKS or not _finite(r.ci_low, r.ci_high) or r.ci_high - r.ci_low <= 0)
                    for r in rows]
        adj = holm([p_from_interval(r.effect, r.ci_low, r.ci_high, 0.0) if t else float("nan")
                    for r, t in zip(rows, testable, strict=True)])
        n_cells = sum(testable)
        for r, t, p in zip(rows, testable, adj, strict=True):
            what = (f"the log-odds of the start answer on {r.family} false-belief stories over their "
                    f"{_words(r.contrast)} controls")
            nums = (f"{r.effect:+.3g} {_iv(r.ci_low, r.ci_high, '+.3g')} ({r.n_pairs} pairs, {r.n_tasks} tasks, "
                    f"positive in {r.share_tasks_positive:.0%} of tasks)")
            holm_s = f"Holm-corrected p {_num(p, '.3g')} across {n_cells} contrasts"
            if not t:
                out.append(Finding(f"whether belief moves {what}", "withheld",
                                   f"{nums}: fewer than {FEW_TASKS} tasks or a zero-width interval is no evidence "
                                   "either way", model, "behaviour"))
            elif (r.ci_low > 0 or r.ci_high < 0) and p < ALPHA:
                sign = "raises" if r.ci_low > 0 else "lowers"
                out.append(Finding(f"false belief {sign} {what} by {nums}", "found",
                                   "paired within tasks; the 95% interval from resampling whole tasks excludes 0; "
                                   f"{holm_s}{_mass_note(r)}", model, "behaviour"))
            else:
                why = "the 95% interval includes 0" if not (r.ci_low > 0 or r.ci_high < 0) \
                    else f"{holm_s} is not below {ALPHA}"
                out.append(Finding(f"whether belief moves {what}", "withheld", f"{nums}: {why}", model, "behaviour"))
    return out


# --------------------------------------------------------------------------------------------
# Probes


def _unit_words(unit: dict[str, Any], n_layers: int | None) -> str:
    layer = layer_words(unit["layer"], n_layers)
    return f"head {unit['head']} (0-based) of {layer} ({unit['kind']})" if unit["head"] >= 0 \
        else f"{layer} ({unit['kind']})"


def _stories(config: Any) -> str:
    """What the held-out stories are, in words: the family, or the file."""
    spec = None if config is None else (config.test_stimuli or config.stimuli)
    if spec is None:
        return "held-out stories"
    name = spec.family if spec.family and spec.family != "bigtom" else \
        (spec.path.rsplit("/", 1)[-1] if spec.path else "the")
    if config.test_stimuli is not None:  # --test-stimuli: the claim names the set it was tested on
        return f"held-out stories of the test set {name}"
    return f"held-out {name} stories"


def probe_findings(res: Any, model: str = "", n_layers: int | None = None) -> list[Finding]:
    """Per target, the unit chosen on the selection stories and scored once on held-out stories,
    against chance, the best baseline (the random-init twin among them, named too) and the
    max-statistic permutation null; withheld with the selection's own reason when it fails. A sweep
    without held-out selection makes no claim (its maxima are biased by the choice): said as not run."""
    from tomlens.probes.selection import FOUND

    selection = getattr(res, "selection", None) or {}
    if not selection:
        return [Finding("a held-out probe result: the per-unit maxima are biased upwards by choosing the unit "
                        "on the stories it is scored on", "not run", "selection = false: no unit was chosen apart "
                        "from where it is scored", model, "probes")]
    where = _stories(getattr(res, "config", None))
    out = []
    for target, r in selection.items():
        name = _words(target)
        e = r.evaluation
        if r.unit is None or e is None:
            out.append(Finding(f"whether {name} is linearly decodable from {where.replace('held-out ', '')}",
                               "withheld", f"no unit was selected: {r.reason}", model, "probes"))
            continue
        unit = _unit_words(r.unit, n_layers)
        best = r.best_baseline
        twin = r.baselines.get("random_init")
        twin_s = f"; the random-init twin scores {twin.score:.2f}" \
            if twin is not None and _finite(twin.score) and (best is None or best[0] != "random_init") else ""
        nums = f"{e.score:.2f} {_iv(e.ci_low, e.ci_high)}"
        chosen = f"chosen among {r.n_units} units on {r.n_selection} selection stories, scored once on {r.n_evaluation}"
        null = (f"max-statistic permutation p {_num(r.p_max, '.3f')} ({r.n_perm} permutations, "
                f"{r.permutation or 'labels'})")
        if r.verdict == FOUND:
            above = f", {e.score - best[1].score:.2f} above the best baseline ({_words(best[0])} {best[1].score:.2f})" \
                if best is not None else ", with no baseline run"
            ctrl = f"; type-level control {r.control.score:.2f}" if r.control is not None else \
                (f"; type-level control withheld ({r.control_reason})" if r.control_reason else "")
            split = getattr(r, "condition_split", None)
            if split is not None:
                ctrl += f"; condition split {split.score:.2f} {_iv(split.ci_low, split.ci_high)}"
            out.append(Finding(f"{name} is linearly decodable from {unit} at {nums} on {where}{above}{twin_s}",
                               "found", f"{chosen}; its interval lies above chance ({e.chance:.2f}) and the best "
                               f"baseline; {null}{ctrl}", model, "probes"))
        else:
            base = f", best baseline {_words(best[0])} {best[1].score:.2f}" if best is not None else ""
            out.append(Finding(f"whether {name} is linearly decodable from {where.replace('held-out ', '')}",
                               "withheld", f"the unit chosen on selection, {unit}, scores {nums} held out "
                               f"(chance {e.chance:.2f}{base}{twin_s}): {r.reason}", model, "probes"))
    return out


# --------------------------------------------------------------------------------------------
# Patching


def patching_findings(res: Any, model: str = "") -> list[Finding]:
    """The heads patching ranks, as a claim only when the false- minus true-belief gap passed its
    gate and the top-k set, ranked on selection pairs, beats layer-matched random heads on held-out
    pairs (p < ALPHA, per k). A failed gate or a forced run withholds it with the reason."""
    if getattr(res, "dry_run", False):
        return []
    s = res.summary  # a tomlens.runs.patching_summary.PatchingSummary
    question = "which heads carry the false- minus true-belief difference, by patching"
    if s.withheld:
        return [Finding(f"{question}", "withheld", _strip_withheld(s.withheld), model, "patching")]
    if s.forced:
        return [Finding(f"{question}", "withheld", f"run past a failed gate with --force, so every number is "
                        f"flagged and none is a result: {s.forced_message or ''}", model, "patching")]
    topk = res.tables.get("topk")
    if topk is None or not len(topk):
        why = s.topk_skipped or "no top-k recovery against random heads was run (ks, top_k)"
        return [Finding(f"that the ranked heads ({', '.join((s.top_heads or ())[:5])}) matter more than random "
                        "heads", "not run", why, model, "patching")]
    sel, ev = s.pairs.selection, s.pairs.evaluation
    n_sel = sel.n if sel is not None else "?"
    held = s.validated_on or f"{ev.n if ev is not None else '?'} held-out pairs"
    rows = list(topk.itertuples())
    # Holm across the ks of one direction: several k tested, each called found only past the correction
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(str(getattr(r, "direction", "denoise")), []).append(i)
    adjusted = [float("nan")] * len(rows)
    for idx in groups.values():
        for i, p in zip(idx, holm([r.p_random for r in (rows[i] for i in idx)]), strict=True):
            adjusted[i] = p
    out = []
    for r, p_holm in zip(rows, adjusted, strict=True):
        heads = str(r.heads).replace(";", ", ")
        denoise = getattr(r, "direction", "denoise") == "denoise"
        verb = "recover" if denoise else "patched from the control leave"
        nums = (f"{r.top_effect:.2f} {_iv(r.top_ci_low, r.top_ci_high)} of the false- minus true-belief gap on "
                f"{held}, against {r.random_mean:.2f} [{_num(r.random_low)}, {_num(r.random_high)}] for "
                f"layer-matched random heads")
        n_k = len(groups[str(getattr(r, "direction", "denoise"))])
        ps = (f"p {_num(r.p_random, '.3f')} from {r.n_random} random head sets, Holm-corrected across {n_k} k: "
              f"{_num(p_holm, '.3f')}")
        better = r.top_effect > r.random_mean if denoise else r.top_effect < r.random_mean
        # recovery must be positive as well as better than random: an interval reaching 0 recovers nothing
        positive = _finite(r.top_ci_low) and r.top_ci_low > 0 if denoise else True
        if _finite(p_holm) and p_holm < ALPHA and better and positive:
            out.append(Finding(f"the top {r.k} heads ({heads}), ranked on {n_sel} selection pairs, {verb} {nums}",
                               "found", f"{ps}; the gap passed its one-sided gate", model, "patching"))
        else:
            why = ("no better than the random heads" if not better else
                   f"the Holm-corrected p {_num(p_holm, '.3f')} is not below {ALPHA}"
                   if not (_finite(p_holm) and p_holm < ALPHA) else
                   f"the interval's low end {_num(r.top_ci_low)} is not above 0")
            out.append(Finding(f"whether the top {r.k} heads ({heads}) carry more of the gap than random heads",
                               "withheld", f"they {verb} {nums}: {why} ({ps})", model, "patching"))
    return out


# --------------------------------------------------------------------------------------------
# Steering


# Steering that flips reality answers too is not steering belief: it may just push the start answer.
MAX_REALITY_FLIP = 0.1


def _flipped(res: Any, d: SteeringLayer, condition: str, rate: float) -> str:
    """'x (k of n)': the flip rate with its count, from the held-out dose table's n where the result
    has one (a stand-in with a summary only gives the rate)."""
    dose = getattr(res, "dose", None)
    if dose is not None and len(dose) and {"direction", "layer", "alpha", "condition", "n"} <= set(dose.columns):
        at = dose[(dose["direction"] == "belief") & (dose["layer"] == d.layer) & (dose["alpha"] == d.alpha)
                  & (dose["condition"] == condition)]
        if len(at) and _finite(rate):
            n = int(at["n"].iloc[0])
            return f"{float(rate):.2f} ({round(float(rate) * n)} of {n})"
    return _num(rate)


def steering_findings(res: Any, model: str = "", n_layers: int | None = None) -> list[Finding]:
    """The verdict of the layer chosen on the selection half, with its held-out flip rate against
    the random and shuffled-label directions; found also needs the reality answers left alone
    (reality flip rate at most the random directions' max, or at most MAX_REALITY_FLIP)."""
    from tomlens.runs.steering import chosen_layer

    s: SteeringSummary = res.summary
    layers = s.layers
    if not layers:
        return []
    d = next((x for x in layers if x.layer == s.layer), None) or chosen_layer(layers)
    where = layer_words(d.layer, n_layers)
    fb = _flipped(res, d, "false_belief", d.flip_false_belief)
    reality = _flipped(res, d, "reality", d.flip_reality)
    nums = (f"{fb} of false-belief answers on {s.n_evaluation_prompts} held-out "
            f"prompts at alpha {d.alpha:g}, against a 95th percentile of {_num(d.random_p95)} "
            f"(mean {_num(d.random_mean)}) for {s.n_random} norm-matched random directions and "
            f"{_num(d.shuffled)} for shuffled labels")
    side = f"; side effects: true-belief {_flipped(res, d, 'true_belief', d.flip_true_belief)}, reality {reality} flipped"
    chosen = f"layer and alpha chosen on {s.n_selection_prompts} selection prompts"
    # the random directions' 95th percentile, not their maximum: a maximum grows with the draws
    r_flip, r_max = d.flip_reality, d.random_p95
    reality_ok = _finite(r_flip) and (float(r_flip) <= MAX_REALITY_FLIP or (_finite(r_max) and float(r_flip) <= float(r_max)))
    if d.verdict == "found" and reality_ok:
        return [Finding(f"adding the belief direction at {where} flips {nums}", "found",
                        f"{chosen}; {d.reason}{side}", model, "steering")]
    reason = d.reason if d.verdict != "found" else \
        (f"it also flips reality answers ({reality}; more than {MAX_REALITY_FLIP:g} and than the random "
         f"directions' 95th percentile {_num(r_max)})" if _finite(r_flip) else "no reality prompts to show it leaves reality alone")
    return [Finding(f"whether a belief direction steers false-belief answers (at {where})", "withheld",
                    f"{chosen}; it flips {nums}: {reason}", model, "steering")]


# --------------------------------------------------------------------------------------------
# Validation

VALIDATION_CLAIMS = {
    "probe": "a probe chosen on selection stories reads belief from held-out order-only stories while a bag of "
             "words stays at chance",
    "topk_recovery": "the top-k heads recover the false- minus true-belief gap while layer-matched random heads "
                     "do not",
    "attribution": "attribution patching ranks the heads as exact patching does",
    "mean_ablation": "mean-ablating the top-k heads removes false-belief accuracy while random heads leave it",
    "steering": "the belief direction flips false-belief answers while random directions do not",
}


def validation_findings(res: Any, model: str = "") -> list[Finding]:
    """One finding per method check: passed ("found": the method finds belief where it should, with
    its number and its control against their thresholds) or failed (withheld, with the detail)."""
    out = []
    for r in res.table.to_dict(orient="records"):
        claim = VALIDATION_CLAIMS.get(r["check"], f"the {r['check']} check holds")
        has_null = r.get("null_comparison") not in (None, "-")
        nums = f"{_num(r['value'], '.3f')} (needs {r['comparison']} {r['threshold']:g})" + \
            (f", its control {_num(r['null'], '.3f')} (needs {r['null_comparison']} {r['null_threshold']:g})"
             if has_null else "")
        if bool(r["passed"]):
            out.append(Finding(f"{claim}: {nums}", "found", f"the {r['check']} check passes: {r['detail']}",
                               model, "validate"))
        else:
            out.append(Finding(f"whether {claim}", "withheld", f"the {r['check']} check fails at {nums}: "
                               f"{r['detail']}", model, "validate"))
    return out


# --------------------------------------------------------------------------------------------
# A whole run


def _probe_families(res: Any) -> list[str]:
    """The families of the rows a probe run was made on (a file names its own); [] if unreadable."""
    config = getattr(res, "config", None)
    specs = [sp for sp in (getattr(config, "stimuli", None), getattr(config, "test_stimuli", None)) if sp is not None]
    try:
        return sorted({s.family for sp in specs for s in sp.load()})
    except Exception:  # noqa: BLE001 - a moved file: the findings stay as they are, the audit section still shows
        return []


def _answers_found(f: Finding) -> bool:
    """Whether a behaviour finding says the model's answers track belief (above chance, or a
    positive knowledge-state effect), as opposed to being at or below chance or withheld."""
    return f.status == "found" and (" above chance" in f.claim or f.claim.startswith("false belief raises"))


def with_behaviour_context(probe: Finding, behaviour: Sequence[Finding], ran: bool) -> Finding:
    """A found probe line with the behaviour verdict it does or does not imply beside it: a probe
    that decodes belief says only that the information is there; whether the model uses it is
    the behaviour stage's question, and a reader must see both lines together."""
    if probe.status != "found":
        return probe
    decodable = probe.claim.split(" at ", 1)[0]
    if not ran:
        note = f"{decodable}; no behaviour stage ran, so whether the model's answers use it is not tested"
    elif any(_answers_found(f) for f in behaviour):
        shown = next(f for f in behaviour if _answers_found(f))
        note = f"{decodable}, and the model's answers track belief too (behaviour: {shown.claim})"
    else:
        n = len(behaviour)
        note = (f"{decodable}, but the model's answers are not above chance (behaviour: {n} cell"
                f"{'s' if n != 1 else ''} withheld or at chance): decodable, not shown to be used")
    return replace(probe, context=note)


def experiment_findings(result: Any) -> list[Finding]:
    """Every claim of an experiment run (`tomlens.runs.experiment.ExperimentResult`), model by model
    and stage by stage; stages that make no claim (cache, pairs) add none. With an audit stage, a
    behaviour or probe claim on a family that a text shortcut explains is withheld, naming it."""
    from tomlens.report.audit import withhold_explained

    out: list[Finding] = []
    for name, run in zip(model_names(result), result.runs, strict=True):
        r, n_layers = run.results, _n_layers(run)
        found = behaviour_findings(r["behaviour"], name) if "behaviour" in r else []
        probed = probe_findings(r["probes"], name, n_layers) if "probes" in r else []
        if "audit" in r:
            found = withhold_explained(found, r["audit"].report)
            probed = withhold_explained(probed, r["audit"].report, _probe_families(r["probes"]))
        out += found + [with_behaviour_context(f, found, "behaviour" in r) for f in probed]
        if "patching" in r:
            out += patching_findings(r["patching"], name)
        if "steering" in r:
            out += steering_findings(r["steering"], name, n_layers)
        if "validate" in r:
            out += validation_findings(r["validate"], name)
    return out
