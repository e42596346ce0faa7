"""Kosoy et al.'s developmental battery: design (cells, balance, labels, spans, renaming) and the
gating rule and summaries on hand-made behaviour tables."""

from __future__ import annotations

import itertools
import json
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
from tomlens.stimuli.kosoy import CELLS, TASKS, TWINS, VARIANTS, kosoy

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
    # Wynn's 1 + 1 and 2 - 1 are two stories of each addition item
    assert per_cell == {cell: N * len(VARIANTS.get(CELLS[cell], (None,))) for cell in CELLS}
    ids = {s.id for s in stims}
    assert len(ids) == len(stims)
    for _key, group in stories.items():
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


YES_NO_CELLS = ("object-permanence", "rational-action", "altruism-out-of-reach", "altruism-physical-obstacle",
                "gears-a-pushes-b", "gears-symbiotic", "blicket-categorisation", "blicket-induction",
                "lucas-given-conjunctive", "lucas-given-disjunctive", "lucas-open-conjunctive", "lucas-open-disjunctive")


def test_option_order_and_yes_no_answers_are_balanced_per_cell(stims):
    for cell in CELLS:
        for kind in ("test", "control"):
            rows = [s for s in stims if s.condition == cell and s.meta["question"] == kind]
            assert Counter(s.answer_index for s in rows) == Counter({0: len(rows) // 2, 1: len(rows) // 2}), (cell, kind)
    for cell in YES_NO_CELLS:
        answers = Counter(s.answer for s in stims if s.condition == cell and s.meta["question"] == "test")
        assert answers == Counter({"yes": N // 2, "no": N // 2}), cell
    assert Counter(s.answer for s in stims if s.condition == "addition" and s.meta["question"] == "test") \
        == Counter({"one": N, "two": N})
    assert Counter(s.meta["operation"] for s in stims if s.condition == "addition" and s.meta["question"] == "test") \
        == Counter({"1+1": N, "2-1": N})
    assert Counter(s.meta["helper_first"] for s in stims if s.condition == "helper-hinderer"
                   and s.meta["question"] == "test") == Counter({True: N // 2, False: N // 2})


OWNER_PUTS = re.compile(r"(\w+) puts (?:his|her) (\w+) in the (\w+)\.")
MOVES = re.compile(r"(\w+) takes the \w+ out of the (\w+) and puts it in the (\w+)\.")
LEAVES = re.compile(r"(\w+) goes off to ")
CALLS = re.compile(r"(\w+) phones (\w+), who trusts")
LOOKS = re.compile(r"(\w+) looks in at the table through the window")
ASKED = re.compile(r"^(?:Right now, )?(\w+) (?:will look for|thinks) the ")


def _transfer_belief(story: str, asked: str) -> tuple[str, str, str]:
    """(where the object is, where `asked` thinks it is, where it started), read from the events
    in story order: a character knows of the move if they made it or had not gone off before it,
    and learns of it afterwards from a trusted call or a look through clear walls."""
    sentences = re.split(r"(?<=\.) ", story.strip())
    at = lambda pattern: [(k, m) for k, sent in enumerate(sentences) if (m := pattern.search(sent))]
    (_, put), = at(OWNER_PUTS)
    (k_move, move), = at(MOVES)
    start, end = put.group(3), move.group(3)
    left = [k for k, m in at(LEAVES) if m.group(1) == asked]
    saw = move.group(1) == asked or not left or left[0] > k_move
    told = any(k > k_move and m.group(2) == asked for k, m in at(CALLS))
    looked = "clear walls" in sentences[0] and any(k > k_move and m.group(1) == asked for k, m in at(LOOKS))
    return end, end if saw or told or looked else start, start


def test_transfer_labels_rederived_from_the_text(stims):
    for s in stims:
        if s.meta["task"] not in ("sally-anne", "ullman"):
            continue
        story, q = s.text[: s.spans["query"].start], s.text[s.spans["query"].start:]
        test_q = next(x for x in stims if x.id == s.meta["test_id"]).text[s.spans["query"].start:]
        asked = ASKED.match(test_q).group(1)
        world, belief, start = _transfer_belief(story, asked)
        assert (s.world_state, s.protagonist_belief, s.reference_state) == (world, belief, start), s.id
        assert s.meta["queried"] == asked
        if s.meta["question"] == "test":
            assert s.answer == belief
        elif q.startswith("At the start"):
            assert s.answer == start
        elif q.startswith("In the end"):
            assert s.answer == world
        elif s.meta["task"] == "ullman" and q.startswith("Right now, the") and q.endswith("is on the"):
            box = re.match(r"Right now, the (\w+) is on the", q).group(1)
            lift = story.index("lifts the container")
            holder = start if story.index(f"puts it in the {world}") > lift else world
            assert s.answer == ("floor" if box == holder else "table") and "on the floor" in story
        else:
            assert q.startswith("Right now, the") and s.answer == world


def test_twins_flip_the_belief_of_their_paper_cell(stims):
    """Every order twin is its paper cell's story with the same words (names aside) in another
    order, whose keyed answer is the other option; the paper's cells keep the paper's belief."""
    paper_fb = {"sally-anne", "smarties"}
    tests = {(s.task_id, s.condition): s for s in stims if s.meta["question"] == "test" and s.meta["domain"] == "tom"}
    for (tid, cell), s in tests.items():
        assert s.belief_differs == (cell in paper_fb or (cell in TWINS and TWINS[cell][0] not in paper_fb)), cell
        if cell not in TWINS:
            continue
        base = tests[(tid, TWINS[cell][0])]
        assert s.meta["twin_of"] == base.condition and base.meta["twin_of"] is None
        names = set(s.meta["rename"]["map"][k] for k in ("Sally", "Anne", "child", "newcomer")
                    if k in s.meta["rename"]["map"])
        words = lambda x: Counter("NAME" if w in names else w for w in re.findall(r"[A-Za-z']+", x.text))
        assert words(s) == words(base) and s.text != base.text
        assert s.options == base.options and s.answer != base.answer


def test_smarties_controls_ask_about_the_world_not_a_mind(stims):
    """The test is the only belief question of a ToM story: its controls ask what is inside, what
    the outside shows, where things are or were, and never with a verb of mind."""
    mind = re.compile(r"\b(think|thinks|thought|expect|expected|expects|believe|believes|believed|know|knows|knew)\b")
    for s in stims:
        if s.meta["domain"] != "tom":
            continue
        q = s.text[s.spans["query"].start:]
        assert bool(mind.search(q)) == (s.meta["question"] == "test" and "thinks" in q or
                                        s.condition.startswith("smarties") and s.meta["question"] == "test"), q
        if s.condition.startswith("smarties") and s.meta["control_kind"] == "memory":
            assert q.startswith("On the outside, the") and s.answer == re.search(r"pictures of (\w+)", s.text).group(1)


def _plural_of(noun: str, word: str) -> bool:
    return word in (noun + "s", noun + "es")


def test_smarties_and_control_family_answers_rederived(stims):
    for s in stims:
        story, q = s.text[: s.spans["query"].start], s.text[s.spans["query"].start:]
        if s.meta["task"] == "smarties":
            label = re.search(r"pictures of (\w+)", story).group(1)
            contents = re.search(r"is full of (\w+)\.", story).group(1)
            saw = story.index("walks into the room") < story.index("opens it")
            belief = contents if saw else label
            want = {"test": belief}.get(s.meta["question"]) or (contents if q.startswith("In fact") else label)
            assert s.answer == want and s.world_state == contents and s.protagonist_belief == belief
        elif s.condition == "addition" and s.meta["question"] == "test":
            asked = re.search(r"the number of (\w+) behind it", q).group(1)
            if "another" in story:
                first, second = re.search(r"watches an? (\w+) fly .* then an? (\w+) flies behind it too", story).groups()
                again = re.search(r"Then another (\w+) flies", story).group(1)
                counts = {k: 1 + (k == again) for k in (first, second)}
            else:
                kinds = re.search(r"watches two (\w+) and two (\w+) fly", story).groups()
                out = re.search(r"Then an? (\w+) flies out", story).group(1)
                counts = {k: 1 if _plural_of(out, k) else 2 for k in kinds}
            n = next(v for k, v in counts.items() if k == asked or _plural_of(k, asked))
            assert s.answer == ("two" if n == 2 else "one"), (story, q)
        elif s.meta["task"] == "object-permanence":
            hidden = re.search(r"in front of the (\w+),", story).group(1)
            gone = re.search(r"The (\w+) rolls on, out", story).group(1)
            if s.meta["question"] == "test":
                asked = re.search(r"Is the (\w+) behind the screen", q).group(1)
                assert s.answer == ("yes" if asked == hidden else "no")
            else:
                assert s.answer == (hidden if "hide" in q else gone)
        elif s.meta["task"] == "gears" and s.meta["question"] == "test":
            x, y = re.search(r"the (\w+) gear (?:need|spin without) the (\w+) gear", q).groups() if "need" not in q \
                else re.search(r"the (\w+) gear need the (\w+) gear", q).groups()
            alone = bool(re.search(rf"the {x} gear spins on its own", story))
            assert s.answer == (("no" if alone else "yes") if "need" in q else ("yes" if alone else "no"))
        elif s.meta["task"] == "blicket":
            nonce = s.meta["rename"]["map"]["blicket"]
            if s.meta["question"] == "test":
                x = re.search(r"the (\w+) block", q).group(1)
                if q.startswith("Question: If the"):  # induction: the two new blocks are named members or not
                    named = re.search(r"two more blocks: (.*)", story).group(1)
                    member = re.search(rf"the (\w+) block is(?: an? {nonce})?[,.]", named).group(1)
                else:  # categorisation: the block that made the machine play
                    member = re.search(r"the (\w+) block(?: on the machine)?, and it plays music", story).group(1)
                assert s.answer == ("yes" if x == member else "no"), (story, q)
            else:
                order = re.findall(r"(?:puts|then) the (\w+) block(?: on the machine)?, and", story)
                assert s.answer == order[0 if "first" in q else 1]
        elif s.meta["task"] == "lucas" and s.meta["question"] == "test":
            x = re.search(r"the (\w+) block", q).group(1)
            member = _lucas_member(story, x)
            assert s.answer == ("yes" if member != ("not a" in q) else "no")
        if s.meta["domain"] != "tom":
            assert s.protagonist_belief is None


ACCIDENT = re.compile(r"the (\w+) (?:slips out of \w+ hand|cupboard swings shut) by accident")
ON_PURPOSE = re.compile(r"(?:throws the (\w+) onto the floor|pushes the door of the (\w+) cupboard shut) on purpose")


def test_altruism_helps_only_with_the_accident_read_from_the_text(by_seed):
    """Both outcomes happen in every story, one by accident and one on purpose; the keyed answer is
    "yes" (help) exactly when the thing asked about met its outcome by accident. Which happens
    first, which is introduced first and which is asked about are crossed in each block of 8."""
    for seed, stims in by_seed.items():
        for cell in ("altruism-out-of-reach", "altruism-physical-obstacle"):
            rows = [s for s in stims if s.condition == cell]
            plan = Counter()
            for s in rows:
                story, q = s.text[: s.spans["query"].start], s.text[s.spans["query"].start:]
                acc, dlb = ACCIDENT.search(story), ON_PURPOSE.search(story)
                acc_x, dlb_x = acc.group(1), next(g for g in dlb.groups() if g)
                if s.meta["question"] == "test":
                    asked = re.search(r"(?:pick up|door of) the (\w+)", q).group(1)
                    assert asked in (acc_x, dlb_x) and s.answer == ("yes" if asked == acc_x else "no")
                    intro = story.split(".")[0]
                    plan[(acc.start() < dlb.start(), asked == acc_x, intro.index(acc_x) < intro.index(dlb_x))] += 1
                else:
                    first = acc_x if acc.start() < dlb.start() else dlb_x
                    assert s.answer == (first if "first?" in q else ({acc_x, dlb_x} - {first}).pop()), q
            assert set(plan.values()) == {N // 8} and len(plan) == 8, (seed, cell, plan)


VOWEL_SOUND_EXCEPTIONS = {"one", "once", "unit", "unique", "use", "used", "useful", "user", "uniform", "university"}
SILENT_H = {"hour", "honest", "honour", "heir"}


def test_articles_agree_with_the_next_word_in_every_text():
    """Every "a"/"an" in every prompt (all cells, the pairs-only twins, 4 seeds) agrees with the
    word after it: no "A orange square", no "an tub"."""
    bad = []
    for seed in range(4):
        for s in kosoy(8, seed, witnessed=True):
            for art, word in re.findall(r"\b(a|an|A|An)\s+([A-Za-z]+)", s.text):
                vowel = word[0].lower() in "aeiou" and word.lower() not in VOWEL_SOUND_EXCEPTIONS \
                    or word.lower() in SILENT_H
                if (art.lower() == "an") != vowel:
                    bad.append(f"{art} {word}: {s.id}")
    assert not bad, bad[:10]


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
    fits = [(need, dict(zip(blocks, m, strict=True))) for need in rules
            for m in itertools.product((False, True), repeat=len(blocks))
            if all((sum(dict(zip(blocks, m, strict=True))[b] for b in on) >= need) == played for on, played in trials)]
    assert len({need for need, _ in fits}) == 1, "the story must settle the rule"
    answers = {m[block] for _, m in fits}
    assert len(answers) == 1, "the story must settle the asked block"
    return answers.pop()


CLASSIC = {"sally", "anne", "rose", "eliza", "marble", "basket", "box", "smarties", "candy", "tube", "pencil",
           "car", "curtain", "blicket", "zerpda", "marker", "clothespin", "cabinet", "magazine"}


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
            for _role, sp in s.spans.items():
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
            # the sentence that decides the cell: the move, the call, the look or the lift
            assert re.search(r"takes the \w+ out of|phones|looks in at|lifts the container", s.span_text("contrast"))
        if s.condition == "smarties":
            assert s.span_text("container") == s.meta["rename"]["map"]["tube"]
        for _role, ms in s.mentions.items():
            assert all(m.end <= len(s.text) for m in ms)
        if s.meta["task"] != "woodward":  # goal encoding's contrast is the test reach itself
            assert s.spans["contrast"].end <= q.start


def test_renaming_changes_words_not_structure():
    a, b = kosoy(8, 0, tasks="tom", rename=1), kosoy(8, 0, tasks="tom", rename=2)
    assert [s.answer_index for s in a] == [s.answer_index for s in b]
    assert [s.condition for s in a] == [s.condition for s in b]
    assert sum(x.text != y.text for x, y in zip(a, b, strict=True)) > len(a) * 0.9
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
            m = s.meta["woodward"]
            fruit = re.search(r"Right now, the (\w+) is on the$", s.text).group(1)
            # half ask where the goal fruit is now, half where the fruit on the habituated pillar is
            assert s.answer == {m["goal_object"]: m["goal_location"], m["location_target"]: m["habituated_location"]}[fruit]
    controls = [s for s in w if s.meta["question"] == "control"]
    assert sum(s.answer == s.meta["woodward"]["habituated_location"] for s in controls) == len(controls) // 2


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
    g = kb.score_stories(df).set_index("story_id")
    assert g.loc["sally-anne-0", "passed"] and not g.loc["sally-anne-1", "passed"]
    assert not g.loc["sally-anne-2", "passed"] and g.loc["sally-anne-2", "controls_correct"]
    assert pd.isna(g.loc["lonely", "passed"])
    row = kb.cell_summary(df, n_boot=200).iloc[0]
    assert (row["n_stories"], row["n_unmatched"]) == (4, 1)
    assert row["score"] == 0.5 and row["test_accuracy"] == 0.75 and row["control_pass"] == 0.75
    assert row["gated_accuracy"] == pytest.approx(2 / 3) and row["chance"] == 0.125
    # the paper's LRS is a rating of other items, kept apart in the last column and never rescaled
    assert row["paper_lrs"] == 4.7 and "score_10" not in row.index and "paper" not in row.index
    assert list(row.index)[-2:] == ["paper_condition", "paper_lrs"] and set(kb.COLUMN_NOTES) == {"paper_condition",
                                                                                                  "paper_lrs"}
    assert row["ci_low"] <= 0.5 <= row["ci_high"]


def test_gate_names_missing_columns_and_unknown_cells():
    df = pd.DataFrame(_story("sally-anne", 0, True, [True]))
    with pytest.raises(TomlensError, match="question"):
        kb.score_stories(df.drop(columns="question"))
    with pytest.raises(TomlensError, match="unknown conditions"):
        kb.score_stories(df.assign(condition="sally"))
    with pytest.raises(TomlensError, match="test rows"):
        kb.score_stories(pd.DataFrame(_story("sally-anne", 0, True, [True]) + _story("sally-anne", 0, True, [True])))
    # the pairs-only twins (kosoy(..., witnessed=True)) are not the paper's battery: left out, not refused
    twins = df.assign(condition="sally-anne-witnessed", story_id="twin")
    assert list(kb.score_stories(pd.concat([df, twins]))["story_id"]) == list(kb.score_stories(df)["story_id"])


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
    assert dom.loc["tom", "score"] == 0.75 and dom.loc["tom", "paper_lrs"] == 5.12
    assert dom.loc["object", "score"] == 0.0 and dom.loc["object", "n_cells"] == 1
    assert dom.loc["causal", "score"] == 0.5 and dom.loc["causal", "paper_lrs"] == 1.79
    assert dom.loc["non-tom", "score"] == 0.25 and np.isnan(dom.loc["non-tom", "paper_lrs"])
    assert dom.loc["tom-minus-non-tom", "score"] == 0.5
    cells = out[out["level"] == "cell"].set_index("condition")
    assert cells.loc["woodward-nonhuman", "score"] == 1.0 and np.isnan(cells.loc["woodward-nonhuman", "paper_lrs"])
    assert "social" not in dom.index


def test_paper_table_matches_the_notes():
    """Every paper row has its cell (Exp. 9, altruism, included: 8.8 and 6.6, seeds-notes 5.3); the
    cells without a paper row are the order twins and the non-human Woodward comparison; each
    domain's cells average to Table 2's number."""
    assert set(kb.PAPER) | {"woodward-nonhuman"} | set(TWINS) == set(CELLS)
    assert kb.PAPER["altruism-out-of-reach"][1] == 8.8 and kb.PAPER["altruism-physical-obstacle"][1] == 6.6
    assert TASKS["altruism"][:2] == ("social", 9)
    for domain, (avg, n) in kb.PAPER_DOMAINS.items():
        cells = [lrs for c, (_, lrs) in kb.PAPER.items() if TASKS[CELLS[c]][0] == domain]
        assert len(cells) == n and np.mean(cells) == pytest.approx(avg, abs=0.01), domain
    for twin in TWINS:
        assert twin in kb.NOTES and "not a paper cell" in kb.NOTES[twin]


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
    assert not plain["note"].fillna("").str.contains("pairs-only").any()
    note = f"{twins.sum()} pairs-only twin rows (sally-anne-witnessed, smarties-looked) left out: not the paper's cells"
    assert all(n.endswith(note) for n in mixed["note"])
    pd.testing.assert_frame_equal(mixed.drop(columns="note"), plain.drop(columns="note"))
    assert [n.removesuffix(note).removesuffix("; ") for n in mixed["note"]] == plain["note"].fillna("").tolist()
    assert battery_summaries(both, n_boot=100)["kosoy"]["note"].str.endswith(note).all()


# --- the shortcut audit's view of the battery ---------------------------------------------------------


def _contrast_labels():
    from tomlens.audit.contrasts import BELIEF
    from tomlens.stimuli import kosoy as K

    assert K.BELIEF_CONTRAST == BELIEF.name  # the ToM rules join the audit's own belief contrast
    return {BELIEF.name: BELIEF.label, **{c.name: c.label for c in K.CONTRASTS}}


def test_every_rule_is_exactly_balanced_against_each_contrast_it_joins(by_seed):
    """A reviewer's rule (the one asked is the owner, is named first, is in the last sentence)
    sees each class of every contrast it is tried on equally often within every task and every
    value of the rule, on every seed: the crossings, not luck, put it at chance."""
    from tomlens.stimuli.kosoy import RULES

    labels = _contrast_labels()
    for rule in RULES:
        assert rule.contrasts and set(rule.contrasts) <= set(labels), rule.name
        for name in rule.contrasts:
            for seed, stims in by_seed.items():
                counts = defaultdict(Counter)
                for s in stims:
                    label = labels[name](s)
                    if label is not None:
                        counts[(s.meta["task"], rule.feature(s))][label] += 1
                seen = {k: c for k, c in counts.items() if k[1] is not None}
                assert seen, (rule.name, name, seed)  # the rule reads the rows it is tried on
                for key, c in seen.items():
                    assert len(c) == 2 and len(set(c.values())) == 1, (rule.name, name, seed, key, c)


def test_option_mentions_key_half_the_answers_in_every_task(by_seed):
    """The option the story names first, last or most is the keyed one in exactly half of each
    task's prompts where it is defined (tests and controls together), so the audit's mention
    heuristics cannot read the keyed position. Woodward is left out: its text is goal encoding's."""
    from tomlens.audit.heuristics import first_mentioned, last_mentioned, most_mentioned

    for seed, stims in by_seed.items():
        for name, cue in (("first", first_mentioned), ("last", last_mentioned), ("most", most_mentioned)):
            hits = defaultdict(Counter)
            for s in stims:
                if s.meta["task"] != "woodward" and (v := cue(s)) is not None:
                    hits[s.meta["task"]][v == s.answer_index] += 1
            for task, c in hits.items():
                assert c[True] == c[False], (seed, name, task, c)


def test_the_audit_finds_no_shortcut_in_the_altruism_experiment_on_fresh_seeds():
    from tomlens.audit import audit_stimuli

    for seed in (101, 202, 303):
        report = audit_stimuli(kosoy(64, seed, tasks="altruism"), seed=seed)
        contrasts = {r.contrast for r in report.rows}
        assert {"yes/no test: keyed answer", "altruism: the asked thing met its outcome by accident"} <= contrasts
        assert any(r.heuristic.startswith("rule: ") for r in report.rows)
        assert not report.shortcuts, [(r.contrast, r.heuristic, r.accuracy) for r in report.shortcuts]


def test_the_pre_fix_sample_shows_what_this_battery_fixed():
    """Today's sample (6bc1cca, seed 7): no altruism experiment, the Smarties memory control asked
    what the child expected (a belief question, like the test it gated), "A orange square", and
    false from true belief told apart by the words of Ullman's alterations alone."""
    import gzip
    from pathlib import Path

    from tomlens.stimuli.records import Stimulus

    path = Path(__file__).parent / "data" / "audit" / "kosoy-6bc1cca.jsonl.gz"
    old = [Stimulus.from_dict(json.loads(line)) for line in gzip.open(path, "rt")]
    assert not any(s.meta["task"] == "altruism" for s in old)
    smarties_memory = [s for s in old if s.condition == "smarties" and s.meta["control_kind"] == "memory"]
    assert smarties_memory and all("expected" in s.text[s.spans["query"].start:] for s in smarties_memory)
    assert any(re.search(r"\bA orange\b", s.text) for s in old)
    # the words of the alterations sit in true-belief stories only
    tb_words = {w for s in old if s.protagonist_belief and not s.belief_differs for w in ("clear", "phones", "lifts")
                if re.search(rf"\b{w}\b", s.text)} | {"clear" for s in old if "clear walls" in s.text}
    fb_texts = [s.text for s in old if s.belief_differs]
    assert tb_words and not any(re.search(r"\b(clear|phones)\b", t) for t in fb_texts)
    # the audit, with this battery's contrasts, finds it: the ToM answer from the alterations' words,
    # addition's number from "a second" / "flies out", object permanence's answer from the question
    from tomlens.audit import audit_stimuli

    flagged = {(r.contrast, r.heuristic) for r in audit_stimuli(old, seed=7).shortcuts}
    assert {("tom test: keyed answer is the start or the label", "1-gram bag (story)"),
            ("false vs true belief", "1-gram bag (story)"), ("addition: keyed number", "1-gram bag (story)"),
            ("yes/no test: keyed answer", "1-gram bag (prompt)")} <= flagged
    # fixed: each of them now occurs in false-belief stories too, and the controls ask no belief
    new = kosoy(8, 7)
    assert {w for s in new if s.belief_differs for w in ("clear", "phones", "lifts") if re.search(rf"\b{w}\b", s.text)} \
        == {"clear", "phones", "lifts"}
    assert not any("expected" in s.text for s in new)


def test_cells_and_domains_report_their_option_mass_and_flag_low_mass():
    """Every cell and domain row carries the mean next-word mass its prompts (tests and controls)
    put on their options, and flags it under `min_mass`, which the battery runner passes on."""
    rows = _story("sally-anne", 0, True, [True, True]) + _story("sally-anne", 1, True, [True, True])
    rows += _story("gears-a-pushes-b", 0, True, [True]) + _story("gears-a-pushes-b", 1, False, [True])
    df = pd.DataFrame(rows)
    df["option_mass_first"] = np.where(df["condition"] == "sally-anne", 0.8, 0.2)
    df["option_mass"] = df["option_mass_first"] / 2
    out = battery_summaries(df, n_boot=50, min_mass=0.5)["kosoy"].set_index(["level", "domain", "condition"])
    tom = out.loc[("cell", "tom", "sally-anne")]
    gears = out.loc[("cell", "causal", "gears-a-pushes-b")]
    assert tom["mean_option_mass_first"] == pytest.approx(0.8) and tom["mean_option_mass"] == pytest.approx(0.4)
    assert not tom["low_option_mass"] and gears["low_option_mass"]
    assert out.loc[("domain", "tom", "")]["mean_option_mass_first"] == pytest.approx(0.8)
    assert not battery_summaries(df, n_boot=50, min_mass=0.1)["kosoy"]["low_option_mass"].any()
    with pytest.raises(TomlensError, match="share of probability"):
        kb.summary(df, n_boot=50, min_mass=2.0)
