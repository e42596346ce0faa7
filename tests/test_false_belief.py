"""Unexpected transfer / unexpected contents generators: K24's answer table, labels, spans,
determinism, size, and counterbalancing of surface cues."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli import generate, lexicon
from tomlens.stimuli.false_belief import (
    CONDITIONS,
    CONTENTS_TEMPLATES,
    CONTRASTS_BY_FAMILY,
    EPISODE_POOLS,
    LAYOUTS,
    RULES_BY_FAMILY,
    TRANSFER_TEMPLATES,
    make_tasks,
    mentions,
    unexpected_contents,
    unexpected_transfer,
)
from tomlens.stimuli.lexicon import CUE_POOLS, label_sentence
from tomlens.stimuli.records import Stimulus

GENERATORS = {"unexpected-transfer": unexpected_transfer, "unexpected-contents": unexpected_contents}
N_BIG = 200


@pytest.fixture(scope="module")
def transfer_200() -> list[Stimulus]:
    return unexpected_transfer(N_BIG, seed=3)


@pytest.fixture(scope="module")
def contents_200() -> list[Stimulus]:
    return unexpected_contents(N_BIG, seed=3)


def _big(family, transfer_200, contents_200):
    return transfer_200 if family == "unexpected-transfer" else contents_200


def _story(s: Stimulus) -> str:
    """The story without the final prompt."""
    return s.text[: s.spans["query"].start].rstrip()


def _sentence_with(text: str, *needles: str) -> str:
    for sent in re.split(r"(?<=\.) ", text):
        if all(re.search(rf"\b{re.escape(n)}\b", sent) for n in needles):
            return sent
    raise AssertionError(f"no sentence with {needles} in {text!r}")


# ---- the answer table, read off the text itself ----------------------------------------------


def _transfer_roles(s: Stimulus) -> tuple[str, str]:
    """(start, other) location words, from the sentence that first mentions the object: the
    protagonist puts it somewhere, and that sentence ends with the start location."""
    obj = s.meta["object"]
    story = _story(s)
    sent = _sentence_with(story, obj)
    start = mentions(sent, s.options)[-1]
    other = next(o for o in s.options if o != start)
    return start, other


def _contents_roles(s: Stimulus) -> tuple[str, str, str]:
    """(true contents X, other word Y, label word) read from the text: the story says 'no Y'
    before anything else, and the label sentence reads 'LABEL, not OTHER.' or 'not OTHER but LABEL.'"""
    story = _story(s)
    y = re.search(r"\bno (\w+)\b", story).group(1)
    x = next(o for o in s.options if o != y)
    sentence = s.span_text("contrast_label")
    said = re.search(r"(\w+), not \w+\.$|not \w+ but (\w+)\.$", sentence)  # either word order
    label = said.group(1) or said.group(2)
    return x, y, label


TRANSFER_TABLE = {  # condition -> (reality, belief) in roles, K24 Study 2
    "false_belief": ("other", "start"), "present": ("other", "other"),
    "informed": ("other", "other"), "no_transfer": ("start", "start"),
}
CONTENTS_TABLE = {  # K24 Study 1: X = true contents, Y = the false label's word
    "false_belief": ("X", "Y"), "open_container": ("X", "X"), "correct_label": ("X", "X"),
    "informed": ("X", "X"),
}


def test_transfer_answer_table_matches_k24():
    stims = unexpected_transfer(16, seed=1)
    by_task = defaultdict(dict)
    for s in stims:
        start, other = _transfer_roles(s)
        role = {"start": start, "other": other}
        want = TRANSFER_TABLE[s.condition][0 if s.prompt_type == "reality" else 1]
        assert s.answer == role[want], s.id
        assert s.reference_state == start
        assert s.world_state == role[TRANSFER_TABLE[s.condition][0]]
        assert s.protagonist_belief == role[TRANSFER_TABLE[s.condition][1]]
        assert s.belief_differs == (s.condition == "false_belief")
        by_task[s.task_id][(s.condition, s.reversed, s.prompt_type)] = start
    for task_id, starts in by_task.items():
        for (cond, rev, pt), start in starts.items():
            if not rev:  # the reversed version swaps the two locations
                assert starts[(cond, True, pt)] != start, task_id


def test_contents_answer_table_matches_k24():
    stims = unexpected_contents(16, seed=1)
    x_of = {}
    for s in stims:
        x, y, label = _contents_roles(s)
        role = {"X": x, "Y": y}
        want = CONTENTS_TABLE[s.condition][0 if s.prompt_type == "reality" else 1]
        assert s.answer == role[want], s.id
        assert label == (x if s.condition == "correct_label" else y), s.id
        assert s.reference_state == label
        assert s.world_state == x
        assert s.belief_differs == (s.condition == "false_belief")
        x_of[(s.task_id, s.condition, s.reversed, s.prompt_type)] = x
    for (task_id, cond, rev, pt), x in x_of.items():
        if not rev:  # reversed: contents and label word trade places
            assert x_of[(task_id, cond, True, pt)] != x


@pytest.mark.parametrize("family", list(GENERATORS))
def test_sixteen_prompts_per_task_with_stable_unique_ids(family):
    stims = GENERATORS[family](5, seed=0)
    assert len(stims) == 5 * 16
    assert len({s.id for s in stims}) == len(stims)
    per_task = Counter(s.task_id for s in stims)
    assert len(per_task) == 5 and set(per_task.values()) == {16}
    cells = {(s.condition, s.reversed, s.prompt_type) for s in stims if s.task_id == stims[0].task_id}
    assert len(cells) == 16
    prefix = "ut" if family == "unexpected-transfer" else "uc"
    first = stims[0]
    assert first.id == f"{prefix}-s0-0000-fb-belief".replace("belief", first.prompt_type)
    assert re.fullmatch(rf"{prefix}-s0-\d{{4}}-[a-z]+(-rev)?-(reality|belief)",
                        stims[-1].id)
    for s in stims:
        assert s.family == family
        assert s.template_id in (TRANSFER_TEMPLATES if prefix == "ut" else CONTENTS_TEMPLATES)
        # options without a leading space; the prompt stops right before the answer word
        assert all(o == o.strip() and " " not in o for o in s.options)
        assert not s.text.endswith((" ", ".", "\n"))
        assert len({t.template_id for t in stims if t.task_id == s.task_id}) == 1


@pytest.mark.parametrize("family", list(GENERATORS))
def test_deterministic_given_seed_and_prefix_stable(family):
    gen = GENERATORS[family]
    a = [s.to_dict() for s in gen(12, seed=7)]
    b = [s.to_dict() for s in gen(12, seed=7)]
    assert a == b
    assert [s.to_dict() for s in gen(4, seed=7)] == a[: 4 * 16]
    c = [s.to_dict() for s in gen(12, seed=8)]
    assert [d["text"] for d in c] != [d["text"] for d in a]
    assert [s.to_dict() for s in generate(family, n=12, seed=7)] == a


@pytest.mark.parametrize("family", list(GENERATORS))
def test_records_round_trip(family):
    for s in GENERATORS[family](2, seed=0):
        assert Stimulus.from_dict(s.to_dict()) == s


# ---- spans -----------------------------------------------------------------------------------


def _first(text: str, word: str) -> tuple[int, int]:
    m = re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text)
    assert m, word
    return m.start(), m.end()


def _pool_fill(s: Stimulus) -> dict[str, str]:
    """Pronoun slots of the cue pools for a record's protagonist and other agent."""
    row = {n: r for n, *r in lexicon.NAMES}
    return {"Pp": row[s.meta["protagonist"]][2], "Ao": row[s.meta["other_agent"]][1]}


def _check_sentence(text: str, start: int, end: int) -> None:
    assert start == 0 or text[start - 2: start] == ". ", text[start - 5: start + 5]
    assert text[end - 1] == "."


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=\.) ", text)


def _pronoun(name: str) -> str:
    return next(r[2] for r in lexicon.NAMES if r[0] == name)


def _check_tellings(s: Stimulus, told: str, g: int) -> None:
    """Two telling sentences in one frame, one per person, the told person's in the task's order:
    the protagonist is told only when informed, the bystander (same pronoun) otherwise."""
    p, b = s.meta["protagonist"], s.meta["bystander"]
    first, second = _sentences(told)
    phrase = CUE_POOLS["told"][g].format(H=_pronoun(p))
    told_sentence, untold_sentence = (first, second) if phrase in first else (second, first)
    assert phrase in told_sentence and untold_sentence.endswith(f"tells {_pronoun(p)} nothing."), told
    hearer = p if s.condition == "informed" else b
    assert f" {hearer}, " in f" {told_sentence}" and f" {p if hearer == b else b}, " in f" {untold_sentence}"
    assert _pronoun(b) == _pronoun(p)


def test_transfer_spans_point_at_the_right_words():
    for s in unexpected_transfer(16, seed=2):
        start, other = _transfer_roles(s)
        expect = {"protagonist": s.meta["protagonist"], "other_agent": s.meta["other_agent"],
                  "object": s.meta["object"], "location_1": start, "location_2": other}
        for role, word in expect.items():
            span = s.spans[role]
            assert s.span_text(role) == word, (s.id, role)
            assert (span.start, span.end) == _first(s.text, word), (s.id, role)
        template = TRANSFER_TEMPLATES[s.template_id]
        contrast = s.span_text("contrast")
        seen, told = s.span_text("contrast_seen"), s.span_text("contrast_told")
        cue, fill = s.span_text("cue"), _pool_fill(s)
        _check_sentence(s.text, s.spans["contrast"].start, s.spans["contrast"].end)
        g = s.meta["cue_group"]
        absence, presence = (CUE_POOLS[k][g].format(**fill) for k in ("absence", "presence"))
        leave = EPISODE_POOLS["leave"][g].format(**fill)
        # the seen contrast runs from the decoy to the object's event (or back), in the layout's order
        episode = s.meta["episode"]
        assert tuple(episode) == LAYOUT_ROLES[(s.meta["layout"], s.condition == "present")]
        sentences = _sentences(seen)
        i, j = sorted((episode.index("decoy"), episode.index("move")))
        assert len(sentences) == j - i + 1
        decoy, move = sentences[episode.index("decoy") - i], sentences[episode.index("move") - i]
        assert mentions(move, [s.meta["object"]]) and not mentions(move, [s.meta["decoy_object"]])
        assert mentions(decoy, [s.meta["decoy_object"]]) and not mentions(decoy, [s.meta["object"]])
        assert mentions(decoy, s.meta["decoy_places"]) and not mentions(decoy, s.options)
        # both kinds of cue occur in every story; the present control sees the object's event
        episode_text = " ".join(_sentences(s.text)[4: 4 + len(episode)])
        assert presence in episode_text and (absence in episode_text or leave in episode_text)
        _check_tellings(s, told, g)
        if s.condition == "present":
            assert contrast == seen and cue == presence and presence in move
        elif s.condition == "informed":
            assert contrast == told and cue == CUE_POOLS["told"][g].format(H=_pronoun(s.meta["protagonist"]))
        else:
            assert (s.spans["contrast"].start, s.spans["contrast"].end) == (
                s.spans["contrast_seen"].start, s.spans["contrast_told"].end) and presence in decoy
            assert cue == (leave if s.meta["layout"] == "leaves_and_returns" else absence)
            assert (cue in move) == (s.meta["layout"] != "leaves_and_returns")
        assert s.spans["cue"].start >= s.spans["contrast"].start and s.spans["cue"].end <= s.spans["contrast"].end
        # the object's event ends in the other location, or in the start with no transfer
        assert mentions(move, s.options)[-1] == (start if s.condition == "no_transfer" else other)
        kind = {"present": "presence", "informed": "told"}.get(s.condition, "absence")
        assert s.meta["cue_kind"] == kind
        pool = "leave" if kind == "absence" and s.meta["layout"] == "leaves_and_returns" else kind
        assert s.meta["cue_id"] == f"{pool}:{g}"
        query = s.span_text("query")
        assert s.spans["query"].end == len(s.text)
        assert query == template[s.prompt_type].format(
            P=s.meta["protagonist"], obj=s.meta["object"], Ps=("she" if s.meta["protagonist"] in
            {n for n, p, *_ in lexicon.NAMES if p == "she"} else "he"))


# (layout, the object's event is seen) -> the episode's sentence roles in story order
LAYOUT_ROLES = {
    ("seen_first", False): ("decoy", "move"), ("seen_first", True): ("move", "decoy"),
    ("unseen_first", False): ("move", "decoy"), ("unseen_first", True): ("decoy", "move"),
    ("leaves_and_returns", False): ("decoy", "away", "move", "back"),
    ("leaves_and_returns", True): ("move", "away", "decoy", "back"),
    ("away_then_returns", False): ("move", "back", "decoy", "pause"),
    ("away_then_returns", True): ("decoy", "back", "move", "pause"),
}


def test_contents_spans_point_at_the_right_words():
    for s in unexpected_contents(16, seed=2):
        x, y, _label = _contents_roles(s)
        expect = {"protagonist": s.meta["protagonist"], "other_agent": s.meta["other_agent"],
                  "container": s.meta["container"], "object": x, "location_2": x,
                  "location_1": y}
        for role, word in expect.items():
            assert s.span_text(role) == word, (s.id, role)
            assert (s.spans[role].start, s.spans[role].end) == _first(s.text, word), (s.id, role)
        seen, told = s.span_text("contrast_seen"), s.span_text("contrast_told")
        label = s.span_text("contrast_label")
        g, p, c = s.meta["cue_group"], s.meta["protagonist"], s.meta["container"]
        d = s.meta["second_container"]
        _check_sentence(s.text, s.spans["contrast"].start, s.spans["contrast"].end)
        look = CUE_POOLS["look"][g].format(tgt="it")
        assert s.meta["label_last"] == (g % 2 == 1)  # the same in both versions and every condition
        assert label_sentence(g, g % 2 == 1).format(C=c, LA=s.reference_state, LB=x if s.reference_state == y
                                                    else y) == label
        # one container looked into, the other left shut, each in the same frame, in the task's order
        first, second = _sentences(seen)
        assert (look in first) == (s.meta["layout"] == "look_first") and (look in second) != (look in first)
        looked, shut = (first, second) if look in first else (second, first)
        opened = c if s.condition == "open_container" else d
        assert f" the {opened}, {p} " in f" {looked}" and f" the {c if opened == d else d}, {p} " in f" {shut}"
        assert s.span_text("cue") == (look if s.condition in ("open_container", "false_belief")
                                      else s.span_text("cue"))
        _check_tellings(s, told, g)
        if s.condition == "open_container":
            assert s.span_text("contrast") == seen and s.span_text("cue") == look
        elif s.condition == "informed":
            assert s.span_text("contrast") == told
            assert s.span_text("cue") == CUE_POOLS["told"][g].format(H=_pronoun(p))
        elif s.condition == "correct_label":
            assert s.span_text("contrast") == label and s.span_text("cue") == label[:-1]
        else:
            assert s.span_text("contrast") == f"{seen} {told}" and s.span_text("cue") == look
        # K24: contents and label words occur equally often, so word frequency tells nothing
        counts = Counter(mentions(_story(s), s.options))
        assert counts[x] == counts[y] > 0


# ---- size and counterbalancing ---------------------------------------------------------------


@pytest.mark.parametrize("family", list(GENERATORS))
def test_at_least_200_distinct_tasks(family, transfer_200, contents_200):
    stims = _big(family, transfer_200, contents_200)
    fb = [s for s in stims if s.condition == "false_belief" and not s.reversed
          and s.prompt_type == "belief"]
    assert len({s.task_id for s in stims}) == N_BIG
    assert len({s.text for s in fb}) == N_BIG
    key = "object" if family == "unexpected-transfer" else "container"
    combos = {(s.meta["protagonist"], s.meta[key], frozenset(s.options)) for s in fb}
    assert len(combos) == N_BIG
    # the lexicon has room for many more
    assert len(make_tasks(family, 1000, seed=0)) == 1000


def _rate(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@pytest.mark.parametrize("family", list(GENERATORS))
def test_surface_cues_do_not_predict_the_answer(family, transfer_200, contents_200):
    """Within each condition x version x prompt type, the answer is options[0] in exactly half
    the tasks, the first-mentioned word in half, the last-mentioned word in half."""
    stims = _big(family, transfer_200, contents_200)
    cells = defaultdict(list)
    for s in stims:
        cells[(s.condition, s.reversed, s.prompt_type)].append(s)
    assert len(cells) == 16
    for cell, group in cells.items():
        assert len(group) == N_BIG
        order = [mentions(_story(s), s.options) for s in group]
        assert _rate(s.answer == s.options[0] for s in group) == 0.5, cell
        assert _rate(s.answer == o[0] for s, o in zip(group, order, strict=True)) == 0.5, cell
        assert _rate(s.answer == o[-1] for s, o in zip(group, order, strict=True)) == 0.5, cell
        assert [o[0] for o in order] == [s.meta["first_mentioned"] for s in group]
        assert [o[-1] for o in order] == [s.meta["last_mentioned"] for s in group]
    # templates are used equally often
    assert set(Counter(s.template_id for s in stims).values()) == {N_BIG * 16 // 4}


@pytest.mark.parametrize("family", list(GENERATORS))
def test_each_answer_word_is_right_as_often_as_wrong(family, transfer_200, contents_200):
    stims = _big(family, transfer_200, contents_200)
    by_task = defaultdict(list)
    for s in stims:
        by_task[s.task_id].append(s)
    for task_id, group in by_task.items():
        right = Counter(s.answer for s in group)
        assert sorted(right.values()) == [8, 8], task_id
    # and across the set, a word's rate of being the answer when offered is 1/2
    offered, correct = Counter(), Counter()
    for s in stims:
        for o in s.options:
            offered[o] += 1
            correct[o] += s.answer == o
    assert all(correct[w] * 2 == offered[w] for w in offered)


# ---- lexicon and tokens ----------------------------------------------------------------------


def test_lexicon_words_fit_their_slots():
    for words in (lexicon.TRANSFER_LOCATIONS, lexicon.CONTAINERS, lexicon.ROOMS):
        assert all(lexicon.article(w) == "a" for w in words)
    assert not set(lexicon.TRANSFER_LOCATIONS) & set(lexicon.TRANSFER_OBJECTS)
    assert len({n for n, *_ in lexicon.NAMES}) == len(lexicon.NAMES)
    assert lexicon.names_by_pronoun("she") and lexicon.names_by_pronoun("he")
    for words in (lexicon.TRANSFER_LOCATIONS, lexicon.CONTENTS, lexicon.TRANSFER_OBJECTS):
        assert len(set(words)) == len(words)


def test_option_words_and_swapped_words_are_single_smollm2_tokens(load_tiny):
    tok = load_tiny("tiny-gpt2").tokenizer

    def n_tokens(word: str) -> int:
        return len(tok(" " + word, add_special_tokens=False)["input_ids"])

    # minimal pairs swap a hearer's name for another (or for "nobody"); cues trade places whole
    swapped = {"nobody"} | {n for n, *_ in lexicon.NAMES}
    for word in (*lexicon.TRANSFER_LOCATIONS, *lexicon.CONTENTS, *swapped):
        assert n_tokens(word) == 1, word
    firsts = [tok(" " + w, add_special_tokens=False)["input_ids"][0]
              for w in (*lexicon.TRANSFER_LOCATIONS,)]
    assert len(set(firsts)) == len(firsts)


# ---- user mistakes ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(GENERATORS))
def test_bad_arguments_raise_tomlens_errors(family):
    gen = GENERATORS[family]
    with pytest.raises(TomlensError, match="n >= 1"):
        gen(0, seed=0)
    with pytest.raises(TomlensError, match="conditions"):
        gen(2, seed=0, conditions=("telepathy",))
    only_fb = gen(3, seed=0, conditions=("false_belief",))
    assert len(only_fb) == 3 * 4 and {s.condition for s in only_fb} == {"false_belief"}


# ---- the shortcut audit (issue #27): no cue's wording or position tells a condition -----------

FRESH_SEEDS = (101, 202, 303)
FIXTURES = Path(__file__).parent / "data" / "audit"


@pytest.mark.parametrize("seed", FRESH_SEEDS)
@pytest.mark.parametrize("family", list(GENERATORS))
def test_the_audit_finds_no_shortcut_on_fresh_seeds(family, seed):
    """64 tasks of a fresh seed, all 16 prompts of each: every (contrast, heuristic) row at chance
    (neither above nor below), every n-gram bag at most 0.60, on the family's own contrasts (false
    belief vs each control) and rules as well as the generic battery. Before issue #27 the
    contents bag read false belief vs the open container at 1.00 and the transfer's last cue told
    false belief from presence at 1.00."""
    from tomlens.audit import audit_stimuli

    report = audit_stimuli(GENERATORS[family](64, seed=seed), seed=0)
    contrasts = {r.contrast for r in report.rows}
    controls = CONDITIONS[family][1:]
    assert {f"false_belief_vs_{c}" for c in controls} <= contrasts
    rules = {r.heuristic for r in report.rows if r.source == "family rule"}
    assert rules == {f"rule: {rule.name}" for rule in RULES_BY_FAMILY[family]}
    assert all(r.n_tasks == 64 for r in report.rows)
    bags = [r for r in report.rows if "gram bag" in r.heuristic]
    assert bags and max(r.accuracy for r in bags) <= 0.60, max(bags, key=lambda r: r.accuracy)
    assert not report.shortcuts, report.shortcuts
    assert all(r.verdict == "at chance" for r in report.rows), [r for r in report.rows if r.verdict != "at chance"]


@pytest.mark.parametrize("family", list(GENERATORS))
def test_conditions_share_their_ngrams_and_cue_order(family):
    """Why the audit finds nothing, checked on every task: over a task's two versions every
    condition has the same set of word 1- to 3-grams as the false belief (a bag of n-grams holds
    nothing the conditions differ in; within one version, the same number of them), and within a
    version the presence/absence words of the audit's lexicon come in the same order."""
    from sklearn.feature_extraction.text import CountVectorizer

    from tomlens.audit.heuristics import _CUE_PATTERN

    grams = CountVectorizer(ngram_range=(1, 3), binary=True, token_pattern=r"(?u)\b[\w']+\b").build_analyzer()
    union: dict[tuple, set] = defaultdict(set)
    per_version: dict[tuple, dict[str, tuple[int, list[str]]]] = defaultdict(dict)
    for seed in (11, 12):
        for s in GENERATORS[family](16, seed=seed):
            story = _story(s)
            union[(s.task_id, s.condition)] |= set(grams(story))
            cues = [c.lower() for c in _CUE_PATTERN.findall(story)]
            per_version[(s.task_id, s.reversed)][s.condition] = (len(set(grams(story))), cues)
    for (task, condition), ngrams in union.items():
        assert ngrams == union[(task, "false_belief")], (task, condition)
    for key, by_condition in per_version.items():
        assert len(set(map(str, by_condition.values()))) == 1, key


def test_transfer_word_order_varies_and_no_cue_position_decides():
    """The four layouts, each twice in every block of 8 tasks and the same for all conditions of a
    task: a false belief whose last cue is presence (the protagonist leaves before the move and
    comes back after it, or watches the decoy after the move) and a present control whose last
    cue is absence (watches the move, then leaves or looks away), in equal numbers; the decoy
    before the move as often as after it in both conditions."""
    stims = [s for s in unexpected_transfer(32, seed=4) if s.prompt_type == "belief" and not s.reversed]
    tasks = sorted({s.task_id for s in stims})
    for block in range(0, 32, 8):
        layouts = Counter(s.meta["layout"] for s in stims if s.condition == "false_belief"
                          and s.task_id in tasks[block: block + 8])
        assert layouts == {name: 2 for name in LAYOUTS}
    rules = {r.name: r.feature for r in RULES_BY_FAMILY["unexpected-transfer"]}
    by_task = defaultdict(dict)
    for s in stims:
        by_task[s.task_id][s.condition] = s
    for name in ("last_episode_cue", "first_episode_cue", "return_cue"):  # a task's conditions alike
        assert all(len({rules[name](s) for s in c.values()}) == 1 for c in by_task.values()), name
    fb = [c["false_belief"] for c in by_task.values()]
    present = [c["present"] for c in by_task.values()]
    assert Counter(rules["last_episode_cue"](s) for s in fb) == Counter(rules["last_episode_cue"](s) for s in present)
    assert {rules["last_episode_cue"](s) for s in fb} == {"absence", "presence"}
    for rows in (fb, present):
        assert _rate(rules["decoy_before_move"](s) for s in rows) == 0.5
        assert Counter(rules["move_position"](s) for s in fb) == Counter(rules["move_position"](s) for s in present)
        assert Counter(rules["move_from_end"](s) for s in fb) == Counter(rules["move_from_end"](s) for s in present)
    # whatever the order, the labels follow who saw the object's own event
    assert all(s.answer == s.reference_state for s in fb) and not any(s.belief_differs for s in present)
    # the reversed version tells the mirror layout: within every task the object's event stands
    # before and after the decoy in each condition (a rule learns nothing one task could hold
    # against another's held-out prompts)
    both = defaultdict(set)
    for s in unexpected_transfer(8, seed=4):
        both[(s.task_id, s.condition)].add((s.reversed, rules["decoy_before_move"](s), rules["move_position"](s)))
    for key, seen in both.items():
        assert {before for _, before, _ in seen} == {True, False}, key
        assert sorted(p for rev, _, p in seen if rev) != sorted(p for rev, _, p in seen if not rev), key


def _fixture(family: str) -> list[Stimulus]:
    with gzip.open(FIXTURES / f"{family}-6bc1cca.jsonl.gz", "rt") as f:
        return [Stimulus.from_dict(json.loads(line)) for line in f]


@pytest.mark.parametrize("family,control,rule", [
    ("unexpected-transfer", "present", "last_episode_cue"),
    ("unexpected-contents", "open_container", "labelled_container_named_last"),
])
def test_the_rules_read_the_old_defects_off_the_samples_of_6bc1cca(family, control, rule):
    """The registered rules read the text (pooled cue phrasings, container words), so they apply to
    the stories from before the fix: there each one alone tells the false belief from its control,
    while on today's stories its values are spread alike over both."""
    feature = next(r.feature for r in RULES_BY_FAMILY[family] if r.name == rule)
    old = [s for s in _fixture(family) if s.condition in ("false_belief", control)]
    values = defaultdict(set)
    for s in old:
        values[s.condition].add(feature(s))
    assert None not in values["false_belief"] and not values["false_belief"] & values[control]
    new = [s for s in GENERATORS[family](16, seed=5) if s.condition in ("false_belief", control)]
    counts = {c: Counter(feature(s) for s in new if s.condition == c) for c in ("false_belief", control)}
    assert counts["false_belief"] == counts[control] and len(counts[control]) == 2
    labels = {c.name: c.label for c in CONTRASTS_BY_FAMILY[family]}
    contrast = labels[f"false_belief_vs_{control}"]
    assert {contrast(s) for s in old} == {"false_belief", control}
    assert contrast(next(s for s in _fixture(family) if s.condition not in ("false_belief", control))) is None
