"""Kosoy et al.'s developmental battery: design (cells, balance, labels, spans, renaming) and the
gating rule and summaries on hand-made behaviour tables."""

from __future__ import annotations

import itertools
import re
from collections import Counter, defaultdict

import numpy as np
import pandas as pd
import pytest

from tomlens.behaviour import kosoy as kb
from tomlens.behaviour.batteries import BATTERIES, battery_summaries
from tomlens.behaviour.scoring import story_id
from tomlens.errors import TomlensError
from tomlens.stimuli import FAMILIES, generate, stimuli_hash
from tomlens.stimuli.kosoy import CELLS, TASKS, kosoy

N = 8
SEEDS = range(6)


@pytest.fixture(scope="module")
def stims():
    return kosoy(N, 3)


@pytest.fixture(scope="module")
def by_seed():
    return {seed: kosoy(N, seed) for seed in SEEDS}


def _stories(stims):
    out = defaultdict(list)
    for s in stims:
        out[s.meta["story"]].append(s)
    return out


def test_registered_deterministic_and_prefix_stable():
    assert "kosoy" in FAMILIES and BATTERIES["kosoy"] is kb.summary
    a = kosoy(4, 5)
    assert stimuli_hash(a) == stimuli_hash(generate("kosoy", n=4, seed=5))
    assert stimuli_hash(a) != stimuli_hash(kosoy(4, 6))
    small = kosoy(2, 5)
    assert [s for s in a if s.task_id in {x.task_id for x in small}] == small


def test_every_cell_every_item_with_linked_test_and_controls(stims):
    assert set(s.condition for s in stims) == set(CELLS)
    stories = _stories(stims)
    per_cell = Counter(group[0].condition for group in stories.values())
    assert set(per_cell.values()) == {N}
    ids = {s.id for s in stims}
    assert len(ids) == len(stims)
    for key, group in stories.items():
        tests = [s for s in group if s.meta["question"] == "test"]
        controls = [s for s in group if s.meta["question"] == "control"]
        assert len(tests) == 1 and controls
        assert len(controls) == (2 if group[0].meta["domain"] == "tom" else 1)
        assert {s.meta["test_id"] for s in group} == {tests[0].id}
        assert sorted(tests[0].meta["control_ids"]) == sorted(c.id for c in controls)
        assert all(c.prompt_type == "reality" for c in controls)
        # the behaviour table links them through story_id: one per story, distinct across stories
        assert len({story_id(s) for s in group}) == 1
    assert len({story_id(g[0]) for g in stories.values()}) == len(stories)
    tom_tests = [s for s in stims if s.meta["question"] == "test" and s.meta["domain"] == "tom"]
    assert tom_tests and all(s.prompt_type == "belief" for s in tom_tests)


def test_option_order_and_yes_no_answers_are_balanced_per_cell(stims):
    for cell in CELLS:
        for kind in ("test", "control"):
            rows = [s for s in stims if s.condition == cell and s.meta["question"] == kind]
            assert Counter(s.answer_index for s in rows) == Counter({0: len(rows) // 2, 1: len(rows) // 2}), (cell, kind)
    for cell in ("object-permanence", "gears-a-pushes-b", "gears-symbiotic", "blicket-categorisation",
                 "blicket-induction", "lucas-given-conjunctive", "lucas-open-disjunctive", "rational-action"):
        answers = Counter(s.answer for s in stims if s.condition == cell and s.meta["question"] == "test")
        assert answers == Counter({"yes": N // 2, "no": N // 2}), cell
    assert Counter(s.meta["operation"] for s in stims if s.condition == "addition" and s.meta["question"] == "test") \
        == Counter({"1+1": N // 2, "2-1": N // 2})
    assert Counter(s.meta["helper_first"] for s in stims if s.condition == "helper-hinderer"
                   and s.meta["question"] == "test") == Counter({True: N // 2, False: N // 2})


TRANSFER = re.compile(r"puts (?:his|her) (\w+) in the (\w+)\.")
MOVED = re.compile(r"takes the \w+ out of the \w+ and puts it in the (\w+)\.")


def test_transfer_labels_rederived_from_the_text(stims):
    asked_in = {s.meta["story"]: s.text[s.spans["query"].start:].split()[0]
                for s in stims if s.meta["question"] == "test"}
    for s in stims:
        if s.meta["task"] not in ("sally-anne", "ullman"):
            continue
        story = s.text[: s.spans["query"].start]
        obj, start = TRANSFER.search(story).groups()
        moved = MOVED.search(story)
        world = moved.group(1) if moved else start
        owner, mover = s.meta["rename"]["map"]["Sally"], s.meta["rename"]["map"]["Anne"]
        asked = asked_in[s.meta["story"]]  # whose belief the story's test question asks about
        informed = ("clear walls" in story or "phones" in story or asked == mover or not moved)
        belief = world if informed else start
        assert (s.world_state, s.protagonist_belief, s.reference_state) == (world, belief, start)
        assert s.belief_differs == (s.condition == "sally-anne")
        q = s.text[s.spans["query"].start:]
        if s.meta["question"] == "test":
            assert asked == (mover if s.condition == "ullman-additional-actor" else owner)
            assert s.answer == belief
        elif q.startswith("At the start"):
            assert s.answer == start
        elif s.condition == "ullman-relationship-change":
            asked_box = re.match(r"Right now, the (\w+) is on the", q).group(1)
            moved_box = re.search(r"picks up the (\w+),", story).group(1)
            assert s.answer == ("floor" if asked_box == moved_box else "table") and "on the floor" in story
        else:
            assert s.answer == world


def test_smarties_and_control_family_answers_rederived(stims):
    for s in stims:
        story, q = s.text[: s.spans["query"].start], s.text[s.spans["query"].start:]
        if s.condition == "smarties":
            label = re.search(r"pictures of (\w+)", story).group(1)
            contents = re.search(r"is full of (\w+)\.", story).group(1)
            want = {"test": label}.get(s.meta["question"]) or (contents if q.startswith("In fact") else label)
            assert s.answer == want and s.world_state == contents and s.protagonist_belief == label
        elif s.condition == "addition" and s.meta["question"] == "test":
            assert s.answer == ("two" if "a second" in story else "one")
        elif s.meta["task"] == "gears" and s.meta["question"] == "test":
            x, y = re.search(r"the (\w+) gear (?:need|spin without) the (\w+) gear", q).groups() if "need" not in q \
                else re.search(r"the (\w+) gear need the (\w+) gear", q).groups()
            alone = bool(re.search(rf"the {x} gear spins on its own", story))
            assert s.answer == (("no" if alone else "yes") if "need" in q else ("yes" if alone else "no"))
        elif s.meta["task"] == "blicket" and s.meta["question"] == "test":
            x = re.search(r"the (\w+) block", q).group(1)
            nonce = s.meta["rename"]["map"]["blicket"]
            member = bool(re.search(rf"the {x} block (?:is a {nonce}|on the machine, and it plays)", story))
            assert s.answer == ("yes" if member else "no")
        elif s.meta["task"] == "lucas" and s.meta["question"] == "test":
            x = re.search(r"the (\w+) block", q).group(1)
            member = _lucas_member(story, x)
            assert s.answer == ("yes" if member != ("not a" in q) else "no")
        if s.meta["domain"] != "tom":
            assert s.protagonist_belief is None


OBS_ALONE = re.compile(r"the (\w+) block alone (does nothing|makes the machine play)")
OBS_PAIR = re.compile(r"the (\w+) and (\w+) blocks together (do nothing|make the machine play)")


def _lucas_member(story, block):
    """Whether `block` is a nonce-word member, by brute force over every rule and membership that
    fits the story: the rule comes from the explanation when given, else from the trials it alone
    can explain (conjunctive: the machine plays with two or more members; disjunctive: one or more)."""
    trials = [({m[0]}, "play" in m[1]) for m in OBS_ALONE.findall(story)]
    trials += [({m[0], m[1]}, "play" in m[2]) for m in OBS_PAIR.findall(story)]
    blocks = sorted(set().union(*(on for on, _ in trials)))
    if "only when two" in story:
        rules = [2]
    elif "at least one" in story:
        rules = [1]
    else:
        rules = [1, 2]
    fits = [(need, dict(zip(blocks, m))) for need in rules
            for m in itertools.product((False, True), repeat=len(blocks))
            if all((sum(dict(zip(blocks, m))[b] for b in on) >= need) == played for on, played in trials)]
    assert len({need for need, _ in fits}) == 1, "the story must settle the rule"
    answers = {m[block] for _, m in fits}
    assert len(answers) == 1, "the story must settle the asked block"
    return answers.pop()


CLASSIC = {"sally", "anne", "rose", "eliza", "marble", "basket", "box", "smarties", "candy", "tube", "pencil",
           "car", "curtain", "blicket", "zerpda"}


def _classic(word):
    w = word.lower()
    return w in CLASSIC or w[:-1] in CLASSIC and w.endswith("s") or w[:-2] in CLASSIC and w.endswith("es") \
        or w == "candies"


def test_no_classic_word_leaks_into_any_item(by_seed):
    for seed, stims in by_seed.items():
        for s in stims:
            for k, v in s.meta["rename"]["map"].items():
                assert v != k and not any(_classic(part) for part in v.split()), (seed, s.id, k, v)
            leaked = [w for w in re.findall(r"[A-Za-z]+", s.text) if _classic(w)]
            assert not leaked, (seed, s.id, leaked)
    # goal encoding's own draws reach Woodward's items: a classic name there is swapped in place
    for rename in range(40):
        for s in kosoy(8, 0, tasks="woodward", rename=rename):
            assert not re.search(r"\b(Rose|Sally|Anne|Eliza)\b", s.text)
            for role, sp in s.spans.items():
                assert 0 <= sp.start <= sp.end <= len(s.text)


FIXED = {"yes", "no", "one", "two", "floor", "table", "spun", "stayed still"}


def test_no_cell_has_a_constant_answer_word(by_seed):
    """A model that prefers one word must not pass a cell: every fixed-vocabulary answer (yes/no,
    one/two, floor/table, spun/stayed still) is balanced in every cell and question kind, each block."""
    for seed, stims in by_seed.items():
        for cell in CELLS:
            for kind in ("test", "control"):
                rows = [s for s in stims if s.condition == cell and s.meta["question"] == kind]
                assert len({s.answer for s in rows}) > 1, (seed, cell, kind)
                for probe in ("reality", "memory", None):
                    sub = [s for s in rows if s.meta["control_kind"] == probe]
                    fixed = Counter(s.answer for s in sub if s.answer in FIXED)
                    if fixed:
                        assert sum(fixed.values()) == len(sub) and set(fixed.values()) == {len(sub) // 2} \
                            and len(fixed) == 2, (seed, cell, kind, probe, fixed)


def test_gears_ask_and_polarity_are_one_crossed_plan(by_seed):
    for seed, stims in by_seed.items():
        for cell in ("gears-a-pushes-b", "gears-symbiotic"):
            tests = [s for s in stims if s.condition == cell and s.meta["question"] == "test"]
            for block in range(0, len(tests), 8):
                b = tests[block:block + 8]
                plan = Counter((s.meta["asked_about"] == s.meta["rename"]["map"]["gear A"], s.meta["polarity"])
                               for s in b)
                assert set(plan.values()) == {2} and len(plan) == 4, (seed, cell, plan)
                assert Counter(s.answer for s in b) == Counter({"yes": 4, "no": 4}), (seed, cell)


def test_rational_action_asks_whether_the_jump_makes_sense(by_seed):
    for seed, stims in by_seed.items():
        tests = [s for s in stims if s.condition == "rational-action" and s.meta["question"] == "test"]
        plan = Counter((s.meta["wall"], s.meta["polarity"]) for s in tests)
        assert set(plan.values()) == {2} and len(plan) == 4, (seed, plan)
        for s in stims:
            if s.condition != "rational-action":
                continue
            story, q = s.text[: s.spans["query"].start], s.text[s.spans["query"].start:]
            wall = bool(re.search(r"A low \w+ stands between the two circles\.", story))
            assert "jumps" in story and s.world_state == ("sensible" if wall else "pointless")
            if "make sense" in q:
                want = wall
            elif "pointless" in q:
                want = not wall
            else:
                assert q.startswith("Question: Was there a")
                want = wall
            assert s.answer == ("yes" if want else "no"), (seed, q, story)


def test_lucas_same_evidence_flips_with_the_trained_rule(by_seed):
    for seed, stims in by_seed.items():
        tests = {(s.task_id, s.condition): s for s in stims if s.meta["task"] == "lucas" and s.meta["question"] == "test"}
        for (tid, cell), s in tests.items():
            story = s.text[: s.spans["query"].start]
            d = re.search(r"the (\w+) block", s.text[s.spans["query"].start:]).group(1)
            member = _lucas_member(story, d)
            assert member == cell.endswith("-conjunctive"), (seed, cell)
            evidence = re.search(r"Next, .*", story).group(0)
            twin = tests[(tid, cell.replace("conjunctive", "X").replace("disjunctive", "conjunctive")
                          .replace("X", "disjunctive"))]
            tstory = twin.text[: twin.spans["query"].start]
            assert re.search(r"Next, .*", tstory).group(0) == evidence  # identical test evidence
            assert _lucas_member(tstory, d) != member  # whose answer flips with the rule
        for cell in ("lucas-given-conjunctive", "lucas-given-disjunctive", "lucas-open-conjunctive",
                     "lucas-open-disjunctive"):
            controls = [s for s in stims if s.condition == cell and s.meta["question"] == "control"]
            for c in controls:
                story, q = c.text[: c.spans["query"].start], c.text[c.spans["query"].start:]
                blocks = re.findall(r"the (\w+)(?: and (\w+))? blocks? ", q)[0]
                on = {b for b in blocks if b}
                trials = [({m[0]}, "play" in m[1]) for m in OBS_ALONE.findall(story)]
                trials += [({m[0], m[1]}, "play" in m[2]) for m in OBS_PAIR.findall(story)]
                played = [p for t, p in trials if t == on]
                assert len(played) == 1 and c.answer == ("yes" if played[0] else "no"), (cell, q)


def test_option_orders_of_test_and_controls_are_crossed(by_seed):
    """Always choosing option A passes half of the stories whose controls it passes, in every cell:
    the test's option order tells nothing about the controls'."""
    for seed, stims in by_seed.items():
        passed = defaultdict(list)
        for group in _stories(stims).values():
            test = next(s for s in group if s.meta["question"] == "test")
            if all(c.answer_index == 0 for c in group if c.meta["question"] == "control"):
                passed[test.condition].append(test.answer_index == 0)
        assert set(passed) == set(CELLS), seed
        for cell, ok in passed.items():
            assert np.mean(ok) == 0.5, (seed, cell, ok)


def test_spans_point_at_their_words_and_the_question(stims):
    for s in stims:
        q = s.spans["query"]
        assert s.text[q.start:] == s.text[q.start:q.end] and q.end == len(s.text)
        if s.meta["task"] in ("sally-anne", "ullman"):
            m = s.meta["rename"]["map"]
            assert s.span_text("protagonist") == m["Sally"] and s.span_text("other_agent") == m["Anne"]
            assert s.span_text("location_1") == m["basket"] and s.span_text("location_2") == m["box"]
            assert s.span_text("object") == m["marble"]
            assert s.span_text("contrast").startswith("While") or "phones" in s.span_text("contrast")
        if s.condition == "smarties":
            assert s.span_text("container") == s.meta["rename"]["map"]["tube"]
        for role, ms in s.mentions.items():
            assert all(m.end <= len(s.text) for m in ms)
        if s.meta["task"] != "woodward":  # goal encoding's contrast is the test reach itself
            assert s.spans["contrast"].end <= q.start


def test_renaming_changes_words_not_structure():
    a, b = kosoy(8, 0, tasks="tom", rename=1), kosoy(8, 0, tasks="tom", rename=2)
    assert [s.answer_index for s in a] == [s.answer_index for s in b]
    assert [s.condition for s in a] == [s.condition for s in b]
    assert sum(x.text != y.text for x, y in zip(a, b)) > len(a) * 0.9
    for s in kosoy(8, 0):
        assert not re.search(r"\b(Sally|Anne|Smarties|blicket)\b", s.text)
        used = s.meta["rename"]["map"]
        assert used and all(re.search(rf"\b{re.escape(v)}s?\b", s.text) for v in used.values())


def test_task_selection_and_bad_options():
    assert {s.meta["task"] for s in kosoy(2, 0, tasks=["causal"])} == {"gears", "blicket", "lucas"}
    assert {s.meta["domain"] for s in kosoy(2, 0, tasks="non-tom")} == {"object", "social", "causal"}
    with pytest.raises(TomlensError, match="did you mean 'sally-anne'"):
        kosoy(2, 0, tasks="sallyanne")
    with pytest.raises(TomlensError):
        kosoy(0, 0)
    with pytest.raises(TomlensError):
        kosoy(2, 0, woodward_k=0)


def test_woodward_wraps_goal_encoding():
    from tomlens.stimuli.goal_encoding import goal_encoding

    w = kosoy(4, 0, tasks="woodward", rename=7, woodward_k=2)
    base = goal_encoding(4, 7, ks=(2,), test_cases=("animate", "inanimate"), target_types=("fruit",),
                         anim_denotations=(False,))
    tests = [s for s in w if s.meta["question"] == "test"]
    assert [s.text for s in tests] == [s.text for s in base]
    assert [s.answer for s in tests] == [s.meta["object_target"] for s in base]
    for s in w:
        assert "object_target" not in s.meta  # goal-encoding's own aggregates must not pick these up
        if s.meta["question"] == "control":
            assert s.answer == s.meta["woodward"]["goal_location"]


# --- the gate and the summaries, on hand-made tables ----------------------------------------------


def _row(cell, task_id, story, question, correct):
    return {"family": "kosoy", "condition": cell, "task_id": task_id, "story_id": story,
            "question": question, "correct": correct, "prompt_type": "reality"}


def _story(cell, i, test_ok, controls_ok):
    tid = f"{CELLS[cell]}-{i}"
    return [_row(cell, tid, f"{cell}-{i}", "test", test_ok),
            *(_row(cell, tid, f"{cell}-{i}", "control", ok) for ok in controls_ok)]


def test_gate_scores_a_story_only_when_every_control_is_right():
    rows = (_story("sally-anne", 0, True, [True, True]) + _story("sally-anne", 1, True, [True, False])
            + _story("sally-anne", 2, False, [True, True]) + _story("sally-anne", 3, True, [True, True])
            + [_row("sally-anne", "sally-anne-4", "lonely", "test", True)])  # no control: cannot be gated
    df = pd.DataFrame(rows)
    g = kb.gate(df).set_index("story_id")
    assert g.loc["sally-anne-0", "passed"] and not g.loc["sally-anne-1", "passed"]
    assert not g.loc["sally-anne-2", "passed"] and g.loc["sally-anne-2", "controls_correct"]
    assert pd.isna(g.loc["lonely", "passed"])
    row = kb.cell_summary(df, n_boot=200).iloc[0]
    assert (row["n_stories"], row["n_unmatched"]) == (4, 1)
    assert row["score"] == 0.5 and row["test_accuracy"] == 0.75 and row["control_pass"] == 0.75
    assert row["gated_accuracy"] == pytest.approx(2 / 3) and row["chance"] == 0.125
    assert row["paper"] == 4.7 and row["score_10"] == 5.0
    assert row["ci_low"] <= 0.5 <= row["ci_high"]


def test_gate_names_missing_columns_and_unknown_cells():
    df = pd.DataFrame(_story("sally-anne", 0, True, [True]))
    with pytest.raises(TomlensError, match="question"):
        kb.gate(df.drop(columns="question"))
    with pytest.raises(TomlensError, match="unknown conditions"):
        kb.gate(df.assign(condition="sally"))
    with pytest.raises(TomlensError, match="test rows"):
        kb.gate(pd.DataFrame(_story("sally-anne", 0, True, [True]) + _story("sally-anne", 0, True, [True])))
    # the pairs-only twins (kosoy(..., witnessed=True)) are not the paper's battery: left out, not refused
    twins = df.assign(condition="sally-anne-witnessed", story_id="twin")
    assert list(kb.gate(pd.concat([df, twins]))["story_id"]) == list(kb.gate(df)["story_id"])


def test_domain_means_are_unweighted_cell_means_and_tom_minus_non_tom():
    rows = []
    # ToM: sally-anne 1/2 passed, smarties 2/2 passed -> ToM mean 0.75
    rows += _story("sally-anne", 0, True, [True, True]) + _story("sally-anne", 1, False, [True, True])
    rows += _story("smarties", 0, True, [True, True]) + _story("smarties", 1, True, [True, True])
    # object: addition 0/4 (two fail the control) -> 0; woodward-nonhuman is a comparison cell, left out
    rows += sum((_story("addition", i, True, [False]) for i in range(2)), [])
    rows += sum((_story("addition", i, False, [True]) for i in range(2, 4)), [])
    rows += _story("woodward-nonhuman", 0, True, [True]) + _story("woodward-nonhuman", 1, True, [True])
    # causal: gears-a-pushes-b 1/2 -> 0.5
    rows += _story("gears-a-pushes-b", 0, True, [True]) + _story("gears-a-pushes-b", 1, True, [False])
    out = battery_summaries(pd.DataFrame(rows))["kosoy"]
    dom = out[out["level"] != "cell"].set_index("domain")
    assert dom.loc["tom", "score"] == 0.75 and dom.loc["tom", "paper"] == 5.12
    assert dom.loc["object", "score"] == 0.0 and dom.loc["object", "n_cells"] == 1
    assert dom.loc["causal", "score"] == 0.5 and dom.loc["causal", "paper"] == 1.79
    assert dom.loc["non-tom", "score"] == 0.25 and np.isnan(dom.loc["non-tom", "paper"])
    assert dom.loc["tom-minus-non-tom", "score"] == 0.5
    cells = out[out["level"] == "cell"].set_index("condition")
    assert cells.loc["woodward-nonhuman", "score"] == 1.0 and np.isnan(cells.loc["woodward-nonhuman", "paper"])
    assert "social" not in dom.index


def test_paper_table_matches_the_notes():
    assert set(kb.PAPER) | {"woodward-nonhuman"} == set(CELLS)
    for domain, (avg, n) in kb.PAPER_DOMAINS.items():
        cells = [lrs for c, (_, lrs) in kb.PAPER.items() if TASKS[CELLS[c]][0] == domain]
        if domain != "social":  # the paper's social domain also holds Exp. 9, not built here
            assert len(cells) == n and np.mean(cells) == pytest.approx(avg, abs=0.01)


def test_end_to_end_on_tiny_llama_the_summary_is_the_gate_of_the_scored_table():
    from tomlens.models.registry import load_model
    from tomlens.runs.behaviour import run_behaviour

    res = run_behaviour(load_model("tiny-llama"), kosoy(2, 0, tasks=["sally-anne", "gears"]), progress=False,
                        n_boot=100)
    table = res.table
    assert set(table["question"]) == {"test", "control"}
    out = battery_summaries(table)["kosoy"].set_index("condition")
    for cell, g in table.groupby("condition"):
        passed = [bool(s.loc[s.question == "test", "correct"].iloc[0]) and bool(s.loc[s.question == "control",
                  "correct"].all()) for _, s in g.groupby("story_id")]
        assert out.loc[cell, "score"] == pytest.approx(np.mean(passed))


def test_the_summary_with_pairs_only_twins_is_the_summary_without_them_plus_a_note():
    """Twin rows (`witnessed=True`, for patching) are left out of the paper's table, visibly."""
    rng = np.random.default_rng(3)
    rows = [{"family": "kosoy", "id": s.id, "condition": s.condition, "task_id": s.task_id,
             "story_id": s.meta["story"], "question": s.meta["question"], "correct": bool(rng.random() < 0.7),
             "prompt_type": s.prompt_type} for s in kosoy(8, 0, tasks=["sally-anne", "smarties", "gears"], witnessed=True)]
    both = pd.DataFrame(rows)
    twins = both["condition"].isin(["sally-anne-witnessed", "smarties-looked"])
    assert twins.sum() == 2 * 8 * 3 and kb.twin_rows(both) == twins.sum()
    plain = kb.summary(both[~twins], n_boot=100)
    mixed = kb.summary(both, n_boot=100)
    assert not plain["note"].fillna("").str.contains("twin").any()
    note = f"{twins.sum()} pairs-only twin rows (sally-anne-witnessed, smarties-looked) left out: not the paper's cells"
    assert all(n.endswith(note) for n in mixed["note"])
    pd.testing.assert_frame_equal(mixed.drop(columns="note"), plain.drop(columns="note"))
    assert [n.removesuffix(note).removesuffix("; ") for n in mixed["note"]] == plain["note"].fillna("").tolist()
    assert battery_summaries(both, n_boot=100)["kosoy"]["note"].str.endswith(note).all()
