"""EPITOME's tasks: the generators' design (balance, labels re-derived from the story text, spans,
determinism), the paper's scoring rules on hand-made tables, and the extra scoring (story-free
PMI_DC scores, bets over 0..3, greedy answers) against a direct computation on tiny-llama."""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

from tomlens.behaviour import epitome as E
from tomlens.behaviour.batteries import BATTERIES, battery_summaries
from tomlens.behaviour.generate import generate_answers, greedy_continuation
from tomlens.behaviour.scoring import score
from tomlens.errors import TomlensError
from tomlens.models.tokens import encode
from tomlens.stimuli import generate
from tomlens.stimuli.epitome import (
    E1_CELLS, E2_CELLS, expected_count, indirect_request, recursive_mindreading, scalar_implicature,
    short_story_items, strange_stories_items,
)
from tomlens.stimuli.factorial import false_belief_factorial

# ---- recursive mindreading: design ----------------------------------------------------------------


def _derive_story(text: str) -> tuple[list[str], dict[tuple[str, str], str], str]:
    """From a narrative story alone: the telling chain (in order), the relation map
    (person, relation) -> the person who is that relation of them, and the outsider."""
    first = re.search(r"(\w+) hopes that .*?, and \w+ tells (\w+) so\.", text)
    chain = [first.group(1), first.group(2)]
    for giver, taker in re.findall(r"(\w+) then tells (\w+) everything", text):
        assert giver == chain[-1]
        chain.append(taker)
    rel = {(of, r): who for who, r, of in re.findall(r"(\w+) is the (\w+) of (\w+)\.", text)}
    outsider = re.search(r"(\w+) has never met any of them and is away all month, so nobody tells", text).group(1)
    assert re.search(rf"{outsider} has never met .*? nobody tells \w+ anything; \w+ has never hoped for any such", text)
    return chain, rel, outsider


def _mental_true(clause: str, chain: list[str], outsider: str) -> bool:
    """Truth of "X [does not] know(s) that C" / "X [does not] hope(s) that H" in the story: the
    first person hopes H; each later person in the chain is told everything before them; the
    outsider hopes no such thing and is told nothing (and nobody knows a false thing)."""
    m = re.match(r"(\w+) (does not know|knows|does not hope|hopes) that (.*)$", clause)
    who, verb, rest = m.groups()
    if "hope" in verb:
        hopes = who == chain[0]
        return hopes if verb == "hopes" else not hopes
    inner_true = _mental_true(rest, chain, outsider)
    inner_who = rest.split()[0]
    knows = inner_true and who in chain and inner_who in chain and chain.index(inner_who) < chain.index(who)
    return knows if verb == "knows" else not knows


def _true_in_story(statement: str, chain: list[str], rel: dict[tuple[str, str], str], outsider: str) -> bool:
    """Evaluate a continuation's clause against the derived story: mental chains by `_mental_true`;
    "X is [not] the R_k of the ... of P" by walking the relations from P (the outsider is nobody's
    anything)."""
    clause = re.search(r"it is clear that (.*)\.$|As it turns out, (.*)\.\"$", statement)
    clause = clause.group(1) or clause.group(2)
    if re.match(r"\w+ (does not know|knows|does not hope|hopes) that", clause):
        return _mental_true(clause, chain, outsider)
    m = re.match(r"(\w+) (is|is not) the (.*) of (\w+)$", clause)
    who, verb, rels, base = m.group(1), m.group(2), m.group(3).split(" of the "), m.group(4)
    cur = base
    for r in reversed(rels):
        cur = rel.get((cur, r))
    return (cur == who) == (verb == "is")


def test_recursive_mindreading_counts_cells_and_option_balance():
    st = recursive_mindreading(n=3, seed=1)
    assert len(st) == 3 * 56
    cells = Counter((s.task_id, s.meta["mental"], s.meta["level"], s.meta["story_format"], s.meta["question_format"])
                    for s in st)
    assert set(cells.values()) == {1} and len(cells) == 3 * 2 * 7 * 2 * 2
    first = Counter((s.task_id, s.condition, s.meta["question_format"]) for s in st if s.options[0] == s.answer)
    assert set(first.values()) == {7}  # consistent option first in exactly half of each story x kind x format
    for s in st:
        assert s.answer == s.meta["consistent_option"] == s.world_state == s.protagonist_belief
        assert s.options[0] != s.options[1]


def test_recursive_mindreading_labels_rederived_from_the_story():
    st = recursive_mindreading(n=4, seed=2)
    narratives = {s.task_id: s.text[: s.spans["query"].start] for s in st if s.meta["story_format"] == "narrative"}
    for s in st:
        chain, rel, outsider = _derive_story(narratives[s.task_id])
        assert len(chain) == 8 and len(rel) == 7 and outsider not in chain
        good, bad = s.answer, next(o for o in s.options if o != s.answer)
        assert _true_in_story(good, chain, rel, outsider), (s.id, good)
        assert not _true_in_story(bad, chain, rel, outsider), (s.id, bad)
        assert ("not" in good.split()) == s.meta["consistent_negated"] == (outsider in good)
        clause = good.split("that ", 1)[1] if s.meta["mental"] else good
        verbs = len(re.findall(r"\b(knows|hopes|know|hope)\b", good))
        relations = len(re.findall(r"\bthe (\w+) of\b", good))
        assert (verbs if s.meta["mental"] else relations) == s.meta["level"], clause


def test_recursive_mindreading_negation_and_length_are_balanced_and_foils_alike():
    """Neither "not" nor length gives the answer: the consistent option is the negated one in half
    of each story x kind x level (so the answer - foil length difference sums to 0 there), and
    mental and non-mental foils are the same kind of change (the outer verb's polarity)."""
    st = recursive_mindreading(n=4, seed=7)
    cells: dict = {}
    for s in st:
        good, bad = s.answer, next(o for o in s.options if o != s.answer)
        cells.setdefault((s.task_id, s.condition, s.meta["level"]), []).append(s)
        neg_good, neg_bad = "not" in good.split(), "not" in bad.split()
        assert neg_good != neg_bad  # exactly one option negated, in both kinds
        # the foil is the consistent option with the outer verb's polarity flipped, nothing else
        flip = {"does not know": "knows", "does not hope": "hopes", "is not the": "is the"}
        neg, pos = (good, bad) if neg_good else (bad, good)
        assert any(neg.replace(k, v, 1) == pos for k, v in flip.items()), (neg, pos)
        words = re.findall(r"the (\w+) of", good)
        assert len(words) == len(set(words))  # no relation repeated ("the dentist of the dentist")
    for key, group in cells.items():
        assert len(group) == 4
        assert sum("not" in s.answer.split() for s in group) == 2, key
        assert sum(len(s.answer) - len(next(o for o in s.options if o != s.answer)) for s in group) == 0, key
    neg_rate = Counter((s.condition, s.meta["consistent_negated"]) for s in st)
    assert len(set(neg_rate.values())) == 1  # half negated in mental and in non-mental
    first = Counter((s.condition, s.meta["level"], s.meta["consistent_negated"], s.options[0] == s.answer)
                    for s in st)
    assert len(set(first.values())) == 1  # answer-first balanced within every kind x level x polarity


def test_recursive_mindreading_story_free_tail_and_spans():
    for s in recursive_mindreading(n=1, seed=0):
        tail = s.meta["story_free_text"]
        assert s.text.endswith(tail) and s.spans["query"].of(s.text).strip() == tail
        assert s.span_text("protagonist") == s.meta["people"][0]
        assert s.span_text("other_agent") == s.meta["people"][1]
        assert s.spans["protagonist"].end <= s.spans["query"].start


def test_generators_are_deterministic_and_prefix_stable():
    for fam in ("recursive-mindreading", "indirect-request", "scalar-implicature"):
        a, b = generate(fam, n=3, seed=5), generate(fam, n=3, seed=5)
        assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
        c = generate(fam, n=3, seed=6)
        assert [s.text for s in a] != [s.text for s in c]
        small = generate(fam, n=2, seed=5)
        assert [s.to_dict() for s in small] == [s.to_dict() for s in a[: len(small)]]
    with pytest.raises(TomlensError):
        recursive_mindreading(n=0)


# ---- indirect request: design -------------------------------------------------------------------

def test_indirect_request_design_labels_and_balance():
    st = indirect_request(n=16, seed=3)
    assert len(st) == 64
    assert len({s.template_id for s in st}) == 16  # every passage once before any repeats
    for s in st:
        aware, cue = s.meta["speaker_aware"], s.meta["knowledge_cue"]
        speaker = s.meta["speaker"]
        contrast = s.span_text("contrast")
        assert s.answer == ("No" if aware else "Yes") and set(s.options) == {"Yes", "No"}
        assert s.protagonist_belief == ("blocked" if aware else "open") and s.world_state == "blocked"
        assert s.belief_differs == (not aware)
        if cue == "explicit":
            assert (f"{speaker} does not know" in contrast) == (not aware)
            assert (f"{speaker} knows all about" in contrast) == aware
        else:
            assert (f"While {speaker} is away" in contrast) == (not aware)
            assert contrast.startswith(f"{speaker} and {s.meta['hearer']} both notice that") == aware
        assert s.span_text("protagonist") == speaker and s.span_text("other_agent") == s.meta["hearer"]
        assert s.span_text("query").startswith(f"Question: Is {speaker} making a request?")
        assert s.meta["obstacle"] in s.text or cue == "implicit"
    yes_first = Counter((s.condition, s.meta["knowledge_cue"]) for s in st if s.options[0] == "Yes")
    assert set(yes_first.values()) == {8}


# ---- scalar implicature: design -----------------------------------------------------------------

def test_scalar_implicature_design_and_expected_counts():
    st = scalar_implicature(n=8, seed=4)
    assert len(st) == 8 * 10
    by_story = Counter(s.meta["story"] for s in st)
    assert set(by_story.values()) == {10}
    assert expected_count(None, None) == "3"
    assert [expected_count(a, n) for a, n in E1_CELLS] == ["3", "3", "2"]
    assert [expected_count(a, n) for a, n in E2_CELLS] == ["3", "2", "1", "3", "2", "3"]
    for s in st:
        assert s.answer in s.options and s.meta["bets"] == ["0", "1", "2", "3"]
        if s.meta["timing"] == "before":
            assert "utterance" not in s.spans and "I have looked" not in s.text
        else:
            u = s.span_text("utterance")
            assert f"I have looked at {s.meta['access']} of the 3" in u
            said = {"Some": "Some", "1": "One", "2": "Two", "3": "All three"}[s.meta["said"]]
            assert f"{said} of the" in u
            verb = re.search(r"\b(is|has|comes|are|have|come)\b", u.split(f"{said} of the ")[-1]).group(1)
            assert verb in (("is", "has", "comes") if said == "One" else ("are", "have", "come")), u
            assert s.protagonist_belief == ("complete" if s.meta["access"] == 3 else "partial")
        assert s.text.endswith("(0, 1, 2, or 3)\nA:") and s.span_text("query").startswith("Q: How many")
    first = Counter(s.condition for s in st if s.options[0] == s.answer)
    assert set(first.values()) == {4}  # expected count first in half of each cell's 8 stories


# ---- scoring rules on hand-made tables ----------------------------------------------------------

def test_rm_pmi_dc_on_a_hand_table():
    df = pd.DataFrame({
        "id": ["a", "b", "c"], "family": E.RM_FAMILY, "task_id": ["t1", "t1", "t2"], "mental": [True, True, False],
        "level": [1, 1, 2], "option_a": ["good", "bad", "good"], "option_b": ["bad", "good", "bad"],
        "answer": ["good", "good", "good"], "p_answer": 0.5,
        "logp_a": [-10.0, -12.0, -20.0], "logp_b": [-11.0, -11.0, -19.0],
        "logp_a_nostory": [-5.0, -8.0, -15.0], "logp_b_nostory": [-7.0, -10.0, -16.0]})
    d = E.rm_scores(df)
    # a: raw +1; pmi (-10+5) - (-11+7) = -1.  b: good is b: raw +1; pmi (-11+10) - (-12+8) = 3.
    # c: raw -1; pmi (-20+15) - (-19+16) = -2.
    assert d["logodds"].tolist() == [1.0, 1.0, -1.0]
    assert d["pmi_dc"].tolist() == [-1.0, 3.0, -2.0]
    assert d["correct_pmi"].tolist() == [False, True, False]
    summ = E.rm_summary(df, n_boot=50)
    row = summ[(summ["cell"] == "mental, all levels") & (summ["metric"] == "accuracy (PMI_DC)")].iloc[0]
    assert row["value"] == 0.5 and row["paper"] == 0.73 and row["paper_human"] == 0.84
    raw = summ[(summ["cell"] == "mental, all levels") & (summ["metric"] == "accuracy (raw log-odds)")].iloc[0]
    assert raw["value"] == 1.0
    # without story-free scores the PMI_DC rows are withheld, not guessed
    bare = E.rm_summary(df.drop(columns=["logp_a_nostory", "logp_b_nostory"]), n_boot=50)
    pmi = bare[bare["metric"] == "accuracy (PMI_DC)"]
    assert pmi["value"].isna().all() and pmi["note"].str.startswith("withheld").all()


def test_indirect_request_rule_on_a_hand_table():
    df = pd.DataFrame({
        "id": list("abcd"), "family": E.IR_FAMILY, "task_id": ["t1", "t1", "t2", "t2"],
        "condition": ["aware", "unaware", "aware", "unaware"], "speaker_aware": [True, False, True, False],
        "knowledge_cue": "explicit", "option_a": ["Yes", "No", "No", "Yes"], "option_b": ["No", "Yes", "Yes", "No"],
        "answer": ["No", "Yes", "No", "Yes"], "p_answer": 0.5,
        "logp_a": [-1.0, -2.0, -1.0, -3.0], "logp_b": [-2.0, -1.0, -2.0, -1.0]})
    d = E.ir_scores(df)
    # log p(Yes) - log p(No): a +1 (aware: wrong), b +1 (unaware: right), c -1 (aware: right), d -2 (wrong)
    assert d["logodds_yes"].tolist() == [1.0, 1.0, -1.0, -2.0]
    assert d["correct_ir"].tolist() == [False, True, True, False]
    s = E.ir_summary(df, n_boot=50)
    assert s[(s["cell"] == "all") & (s["metric"] == "accuracy")]["value"].item() == 0.5
    assert s[s["metric"] == "share answering Yes"]["value"].item() == 0.5
    # awareness effect: t1 (1 - 1) = 0, t2 (-2 - -1) = -1 -> mean -0.5
    assert s[s["cell"] == "unaware - aware"]["value"].item() == -0.5


def test_scalar_implicature_criteria_follow_appendix_c():
    c = E.si_criterion
    assert c("E2", 3, "3", 0, 0.1) and not c("E2", 3, "3", 0, 0)
    assert c("E2", 3, "2", 5, -0.1) and not c("E2", 3, "2", 0, 0)
    assert c("E2", 3, "1", -0.1, -0.1) and not c("E2", 3, "1", 0.1, -0.1)
    assert c("E2", 2, "2", 0.1, 0) and not c("E2", 2, "2", 0, 0)
    assert c("E2", 2, "1", 0, -0.1) and not c("E2", 2, "1", 0, 0)
    assert c("E2", 1, "1", 0, 0) and not c("E2", 1, "1", -0.1, 0)
    # E1: the text's rule by default, the printed table's signs on request
    assert c("E1", 3, "Some", 0, -0.1) and not c("E1", 3, "Some", 0, 0.1)
    assert c("E1", 2, "Some", 0, 0) and not c("E1", 1, "Some", 0, -0.1)
    assert c("E1", 3, "Some", 0, 0.1, e1_rule="table") and c("E1", 2, "Some", 0, 0, e1_rule="table")
    with pytest.raises(TomlensError):
        c("E2", 1, "2", 0, 0)


def test_scalar_implicature_deltas_on_a_hand_table():
    def row(i, timing, exp, a, n, p):
        return {"id": i, "family": E.SI_FAMILY, "task_id": "t", "story": "t", "timing": timing, "experiment": exp,
                "access": a, "said": n, **{f"p_{k}": v for k, v in zip("0123", p)}}
    df = pd.DataFrame([row("b", "before", None, None, None, [0.1, 0.1, 0.2, 0.6]),
                       row("x", "after", "E1", 3, "Some", [0.1, 0.2, 0.5, 0.2]),
                       row("y", "after", "E1", 1, "Some", [0.1, 0.1, 0.3, 0.5]),
                       row("z", "after", "E2", 2, "1", [0.0, 0.2, 0.6, 0.2])])
    d = E.si_deltas(df).set_index("id")
    assert d.loc["x", "delta_3"] == pytest.approx(-0.4) and d.loc["x", "delta_2"] == pytest.approx(0.3)
    assert d["correct_si"].tolist() == [True, False, True]  # y: bets on 3 fell with partial access
    s = E.si_summary(df, n_boot=20)
    assert s[(s["cell"] == "E1") & (s["metric"] == "accuracy (Δbet criteria)")]["value"].item() == 0.5
    assert s[s["cell"] == "E2"]["value"].item() == 1.0
    withheld = E.si_summary(df.drop(columns=["p_0", "p_1", "p_2", "p_3"]))
    assert withheld["value"].isna().all() and withheld["note"].str.startswith("withheld").all()


def test_scalar_implicature_two_option_view_reports_its_chance():
    """Always preferring "3" scores 0.6 on the coarse two-option view (6 of 10 answers are "3"):
    the summary says so instead of letting 0.6 pass for above chance."""
    st = scalar_implicature(n=8, seed=1)
    rows = []
    for s in st:
        a, b = s.options
        lp = {"3": -1.0}  # a model that always prefers "3"
        la, lb = lp.get(a, -2.0), lp.get(b, -2.0)
        rows.append({"id": s.id, "family": s.family, "task_id": s.task_id, "option_a": a, "option_b": b,
                     "answer": s.answer, "logp_a": la, "logp_b": lb, "correct": (la > lb) == (s.answer == a),
                     "timing": s.meta["timing"], "experiment": s.meta["experiment"], "access": s.meta["access"],
                     "said": s.meta["said"], "story": s.meta["story"]})
    df = pd.DataFrame(rows)
    assert df["correct"].mean() == pytest.approx(0.6)
    assert E.constant_preference_chance(df) == pytest.approx(0.6)
    out = E.si_summary(df, n_boot=20).set_index("metric")
    view = out.loc["accuracy (coarse; not the paper's measure)"]
    assert view["value"] == pytest.approx(0.6) and "chance = 0.60" in view["note"]
    assert out.loc["chance: best constant preference", "value"] == pytest.approx(0.6)
    # the paper's rows (Δbet criteria) are withheld without bets, never filled from the coarse view
    assert out.loc["accuracy (Δbet criteria)", "value"].isna().all()


def test_battery_summaries_pass_the_runs_n_boot_and_seed(monkeypatch):
    from tomlens.behaviour import batteries

    seen = {}
    monkeypatch.setitem(batteries.BATTERIES, "takes", lambda df, *, n_boot=1000, seed=0: seen.setdefault(
        "takes", (n_boot, seed)) and pd.DataFrame({"v": [1]}))
    monkeypatch.setitem(batteries.BATTERIES, "plain", lambda df: seen.setdefault("plain", len(df)) and pd.DataFrame())
    out = battery_summaries(pd.DataFrame({"family": ["takes", "plain"]}), n_boot=17, seed=3)
    assert seen == {"takes": (17, 3), "plain": 1} and set(out) == {"takes", "plain"}
    df = _fake_fb_table(1.0, -1.0)
    a = battery_summaries(df, n_boot=200, seed=1)["false-belief-factorial"]
    b = battery_summaries(df, n_boot=200, seed=2)["false-belief-factorial"]
    assert a["value"].tolist() == b["value"].tolist()
    assert E.fb_summary(df, n_boot=200, seed=1).equals(a)


def _fake_fb_table(margin_fb: float, margin_tb: float) -> pd.DataFrame:
    """Factorial belief rows scored by hand: log p(Start) - log p(End) = margin by knowledge state."""
    rows = []
    for s in false_belief_factorial(n=2, seed=0, prompt_types=["belief"]):
        start, end = s.meta["location_1"], s.meta["location_2"]
        lo = margin_fb if s.condition == "false_belief" else margin_tb
        lp = {start: -1.0 + lo / 2, end: -1.0 - lo / 2}
        a, b = s.options
        rows.append({"id": s.id, "family": s.family, "task_id": s.task_id, "condition": s.condition,
                     "prompt_type": s.prompt_type, "option_a": a, "option_b": b, "answer": s.answer,
                     "world_state": s.world_state, "protagonist_belief": s.protagonist_belief,
                     "reference_state": s.reference_state, "reversed": False, "logp_a": lp[a], "logp_b": lp[b],
                     "p_answer": 0.5, "correct": lp[s.answer] > max(lp[a], lp[b]) - 1e-12 and lp[a] != lp[b],
                     **{k: s.meta[k] for k in ("knowledge_state", "first_mention", "recent_mention", "knowledge_cue")}})
    return pd.DataFrame(rows)


def test_false_belief_summary_uses_the_log_odds_and_the_knowledge_state_effect():
    df = _fake_fb_table(margin_fb=2.0, margin_tb=-1.0)  # both right: FB prefers Start, TB End
    s = E.fb_summary(df, n_boot=50)
    assert s.iloc[0]["value"] == 1.0 and s.iloc[0]["paper"] == 0.74
    eff = s[s["metric"].str.startswith("knowledge-state effect")]
    assert len(eff) == 1 and eff["value"].item() == pytest.approx(3.0)
    s2 = E.fb_summary(_fake_fb_table(1.0, 1.0), n_boot=50)  # always Start: half right, no effect
    assert s2.iloc[0]["value"] == 0.5
    assert s2[s2["metric"].str.startswith("knowledge-state effect")]["value"].item() == pytest.approx(0.0)


def test_batteries_registered():
    for fam in ("false-belief-factorial", "recursive-mindreading", "indirect-request", "scalar-implicature"):
        assert fam in BATTERIES


# ---- free-text: export, code, import, score -----------------------------------------------------

def _answers(items) -> pd.DataFrame:
    return pd.DataFrame([{"id": it.id, "family": it.family, "story_id": it.story_id, "kind": it.meta.get("kind", ""),
                          "question_type": it.question_type, "question": it.question, "answer": "because",
                          "rubric": it.rubric_text(), "max_score": it.max_score} for it in items])


def test_free_text_items_structure():
    shs = short_story_items()
    assert Counter(i.question_type for i in shs) == {"RC": 4, "EMSR": 8, "SMSI": 1}
    assert all(i.max_score == (2 if i.question_type == "EMSR" else 1) for i in shs)
    sts = strange_stories_items()
    assert len(sts) == 22 and sum(i.meta["kind"] == "control" for i in sts) == 6
    for i in sts:
        assert i.prompt.endswith("Answer:")
        if i.question_type == "justification":
            assert f"Answer: {i.meta['expected']}\nQuestion:" in i.prompt


def test_export_import_and_scores_round_trip(tmp_path):
    ans = _answers(short_story_items() + strange_stories_items())
    path = E.export_for_coding(ans, tmp_path / "codes.csv")
    coded = pd.read_csv(path)
    assert coded["code"].isna().all() and set(E.CODING_COLUMNS) <= set(coded.columns)
    with pytest.raises(TomlensError, match="no valid code"):
        E.import_codes(path)
    # code: every item its maximum, except sts-01 (comprehension wrong) and EMSR half marks
    codes = []
    for _, r in coded.iterrows():
        c = r["max_score"]
        if r["id"] in ("sts-01-comp", "sts-01-just"):
            c = 0
        if r["question_type"] == "EMSR":
            c = 1
        codes.append(c)
    coded["code"] = codes
    coded.to_csv(path, index=False)
    back = E.import_codes(path)
    s = E.free_text_summary(back).set_index(["family", "cell"])
    assert s.loc[("short-story", "EMSR"), "value"] == 0.5 and s.loc[("short-story", "RC"), "value"] == 1.0
    assert s.loc[("strange-stories", "comprehension"), "value"] == pytest.approx(10 / 11)
    # the model's justifications are not filtered on its own comprehension: all 8 count against the
    # paper; the paper's human filter (drop sts-01 after its wrong comprehension) is a secondary row
    just = s.loc[("strange-stories", "justification, mental")]
    assert just["value"] == pytest.approx(7 / 8) and just["n"] == 8 and just["paper"] == 0.83
    kept = s.loc[("strange-stories", "justification, mental, comprehension right")]
    assert kept["value"] == 1.0 and kept["n"] == 7 and np.isnan(kept["paper"])
    assert "5 in the paper" in s.loc[("short-story", "RC"), "note"]
    coded.loc[0, "code"] = 5  # above the maximum
    coded.to_csv(path, index=False)
    with pytest.raises(TomlensError):
        E.import_codes(path)
    # the maximum comes from the items, not from a CSV whose max_score was edited up
    coded.loc[0, "max_score"] = 5
    coded.to_csv(path, index=False)
    with pytest.raises(TomlensError, match="no valid code"):
        E.import_codes(path)
    coded.loc[0, ["code", "max_score"]] = [1, 1]
    for broken, why in ((pd.concat([coded, coded.iloc[[3]]]), "repeated"), (coded.iloc[1:], "missing"),
                        (coded.assign(id=coded["id"].replace({"shs-02": "shs-99"})), "unknown")):
        broken.to_csv(path, index=False)
        with pytest.raises(TomlensError, match=why):
            E.import_codes(path)
    coded.to_csv(path, index=False)
    assert len(E.import_codes(path)) == len(coded)
    # a partial export is checked against the items it was made from
    part = coded[coded["family"] == "short-story"].iloc[:3]
    part.to_csv(path, index=False)
    with pytest.raises(TomlensError, match="missing"):
        E.import_codes(path)
    assert len(E.import_codes(path, items=short_story_items()[:3])) == 3


# ---- extra scoring on tiny-llama equals a direct computation ------------------------------------

def _direct_logp(model, text: str, option: str) -> float:
    """Summed log-prob of `option` after `text` (with a space) from one unpadded forward."""
    tok = model.tokenizer
    enc = tok(f"{text} {option}", return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    first = next(t for t, (a, b) in enumerate(offs) if b > a and (a >= len(text) or b > len(text)))
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].float()
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[t - 1, ids[t]] for t in range(first, len(ids))))


def test_story_free_scores_and_bets_equal_a_direct_computation(load_tiny):
    model = load_tiny("tiny-llama")
    rm = recursive_mindreading(n=1, seed=0)[:2]
    sf = E.story_free_scores(model, rm).set_index("id")
    for s in rm:
        tail = s.meta["story_free_text"]
        assert sf.loc[s.id, "logp_a_nostory"] == pytest.approx(_direct_logp(model, tail, s.options[0]), abs=1e-4)
        assert sf.loc[s.id, "logp_b_nostory"] == pytest.approx(_direct_logp(model, tail, s.options[1]), abs=1e-4)
    si = scalar_implicature(n=1, seed=0)[:2]
    bets = E.bet_scores(model, si).set_index("id")
    for s in si:
        lps = np.array([_direct_logp(model, s.text, k) for k in "0123"])
        p = np.exp(lps) / np.exp(lps).sum()
        assert bets.loc[s.id, ["p_0", "p_1", "p_2", "p_3"]].to_numpy() == pytest.approx(p, abs=1e-5)
        assert bets.loc[s.id, ["p_0", "p_1", "p_2", "p_3"]].sum() == pytest.approx(1.0)


def test_enrich_and_summaries_end_to_end_on_tiny_llama(load_tiny):
    model = load_tiny("tiny-llama")
    st = recursive_mindreading(n=1, seed=0)[:6] + indirect_request(n=2, seed=0) + scalar_implicature(n=2, seed=0)
    table = E.enrich(model, st, score(model, st, progress=False))
    out = battery_summaries(table)
    assert set(out) == {"recursive-mindreading", "indirect-request", "scalar-implicature"}
    rm = out["recursive-mindreading"]
    assert rm[rm["metric"] == "accuracy (PMI_DC)"]["value"].notna().all()
    si = out["scalar-implicature"]
    assert set(si[si["metric"] == "accuracy (Δbet criteria)"]["cell"]) >= {"E1", "E2"}
    assert si["value"].notna().all()
    # PMI_DC by hand for one row
    r = table[table["family"] == "recursive-mindreading"].iloc[0]
    sign = 1 if r["answer"] == r["option_a"] else -1
    expect = sign * ((r["logp_a"] - r["logp_a_nostory"]) - (r["logp_b"] - r["logp_b_nostory"]))
    assert E.rm_scores(table[table["id"] == r["id"]])["pmi_dc"].item() == pytest.approx(expect)


def test_greedy_answers_are_the_argmax_path_and_repeatable(load_tiny):
    model = load_tiny("tiny-llama")
    item = strange_stories_items()[0]
    text, toks = greedy_continuation(model, item.prompt, max_new_tokens=5, stop=None)
    ids = model.tokenizer(item.prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        for t in toks.tolist():
            nxt = int(model(ids)[0, -1].argmax())
            assert nxt == t
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert text == model.tokenizer.decode(toks.tolist()).strip()
    a = generate_answers(model, strange_stories_items()[:2], max_new_tokens=4, seed=1, progress=False)
    b = generate_answers(model, strange_stories_items()[:2], max_new_tokens=4, seed=1, progress=False)
    assert a["answer"].tolist() == b["answer"].tolist()
    assert set(E.CODING_COLUMNS) - {"code"} <= set(a.columns)
    assert set(a["stop_reason"]) <= {"eos", "stop", "max_new_tokens", "context"} and not a["cut_by_context"].any()
    assert math.isfinite(a["n_new_tokens"].sum())


def test_a_prompt_filling_the_context_window_is_an_error_not_an_empty_answer(load_tiny):
    model = load_tiny("tiny-llama")
    n_ctx = model.cfg.n_ctx
    item = strange_stories_items()[0]
    long_item = type(item)(item.id + "-long", item.family, "word " * (n_ctx + 5) + item.prompt, item.question,
                           item.question_type, dict(item.rubric), item.story_id, dict(item.meta))
    with pytest.raises(TomlensError, match="context"):
        greedy_continuation(model, long_item.prompt, max_new_tokens=2)
    with pytest.raises(TomlensError, match="-long"):  # named, before any answer is decoded
        generate_answers(model, [item, long_item], max_new_tokens=2, progress=False)
    # exactly a full window: the silent-"" case (encode accepts it, no token fits after it)
    full = next(("w " * k).strip() for k in range(n_ctx - 8, n_ctx + 1)
                if encode(model, [("w " * k).strip()]).input_ids.shape[1] == n_ctx)
    with pytest.raises(TomlensError, match="fills the model's context window"):
        greedy_continuation(model, full, max_new_tokens=2)


def test_matched_cue_rows_are_left_out_of_the_battery_summary_with_a_note():
    """The minimal-pair wording (`matched_cue=True`, ids ending "-matched") is not the battery's
    text: with or without those rows the summary is the same, plus a note saying how many."""
    battery = indirect_request(4, 0)
    matched = indirect_request(4, 0, matched_cue=True)
    assert all(s.id.endswith("-matched") for s in matched)
    assert not {s.id for s in battery} & {s.id for s in matched}
    rng = np.random.default_rng(0)

    def table(stimuli, flag_column=True):
        return pd.DataFrame([{"id": s.id, "family": E.IR_FAMILY, "task_id": s.task_id, "condition": s.condition,
                              "speaker_aware": s.meta["speaker_aware"], "knowledge_cue": s.meta["knowledge_cue"],
                              "option_a": s.options[0], "option_b": s.options[1], "answer": s.answer,
                              "logp_a": float(rng.normal()), "logp_b": float(rng.normal()),
                              **({"matched_cue": "true" if s.meta.get("matched_cue") else np.nan}
                                 if flag_column else {})} for s in stimuli])

    plain = table(battery)
    for with_flag in (True, False):  # the meta flag ("true" after a CSV round trip), else the id suffix
        mixed = pd.concat([plain, table(matched, with_flag)], ignore_index=True)
        if with_flag:
            mixed.loc[: len(plain) - 1, "matched_cue"] = "false"  # a "false" string must not count as matched
        want = E.ir_summary(plain, n_boot=50)
        got = E.ir_summary(mixed, n_boot=50)
        note = f"{len(matched)} matched-cue rows"
        pd.testing.assert_frame_equal(got.drop(columns="note"), want.drop(columns="note"))
        assert all(note in n for n in got["note"]) and not any(note in str(n) for n in want["note"])
        assert [re.sub(rf"(; )?{note}.*$", "", n) for n in got["note"]] == want["note"].fillna("").tolist()
