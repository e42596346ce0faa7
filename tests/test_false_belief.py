"""Unexpected transfer / unexpected contents generators: K24's answer table, labels, spans,
determinism, size, and counterbalancing of surface cues."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli import generate, lexicon
from tomlens.stimuli.false_belief import (
    CONTENTS_TEMPLATES, TRANSFER_TEMPLATES, make_tasks, mentions, unexpected_contents,
    unexpected_transfer,
)
from tomlens.stimuli.lexicon import CUE_POOLS
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
    before anything else, and the label sentence reads 'LABEL, not OTHER.'"""
    story = _story(s)
    y = re.search(r"\bno (\w+)\b", story).group(1)
    x = next(o for o in s.options if o != y)
    label_sentence = s.span_text("contrast_label")
    label = re.search(r"(\w+), not \w+\.$", label_sentence).group(1)
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
        # the seen contrast is the decoy and the deciding move; both cues occur in every story
        decoy, move = re.split(r"(?<=\.) ", seen)
        g, p, b = s.meta["cue_group"], s.meta["protagonist"], s.meta["bystander"]
        absence, presence = (CUE_POOLS[k][g].format(**fill) for k in ("absence", "presence"))
        assert s.meta["decoy"] and f"{b}, but not {p}," in told or f"{p}, but not {b}," in told
        if s.condition == "present":
            assert contrast == seen and cue == presence and presence in move and absence in decoy
        elif s.condition == "informed":
            assert contrast == told and cue == CUE_POOLS["told"][g].format(H=f"{p}, but not {b},")
        else:
            assert contrast == f"{seen} {told}" and cue == absence and absence in move
            assert presence in decoy and f"{b}, but not {p}," in told
        assert s.spans["cue"].start >= s.spans["contrast"].start and s.spans["cue"].end <= s.spans["contrast"].end
        # the decoy puts the object back; the move ends in the other location unless no transfer
        d, m = (x.replace(absence, "").replace(presence, "") for x in (decoy, move))
        assert d.rindex(" back") > d.rindex(f" {other}")
        assert (m.rindex(" back") > m.rindex(f" {other}")) == (s.condition == "no_transfer")
        assert s.meta["cue_kind"] == {"present": "presence", "informed": "told"}.get(s.condition, "absence")
        assert s.meta["cue_id"] == f"{s.meta['cue_kind']}:{g}"
        query = s.span_text("query")
        assert s.spans["query"].end == len(s.text)
        assert query == template[s.prompt_type].format(
            P=s.meta["protagonist"], obj=s.meta["object"], Ps=("she" if s.meta["protagonist"] in
            {n for n, p, *_ in lexicon.NAMES if p == "she"} else "he"))


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
        g, p, b, c = s.meta["cue_group"], s.meta["protagonist"], s.meta["bystander"], s.meta["container"]
        _check_sentence(s.text, s.spans["contrast"].start, s.spans["contrast"].end)
        look = CUE_POOLS["look"][g]
        assert CUE_POOLS["label"][g].format(C=c, LA=s.reference_state, LB=x if s.reference_state == y
                                            else y) == label
        if s.condition == "open_container":
            assert s.span_text("contrast") == seen and s.span_text("cue") == look.format(tgt=f"the {c}")
            assert seen.startswith(f"{p} {look.format(tgt=f'the {c}')}, not the glass ")
        elif s.condition == "informed":
            assert s.span_text("contrast") == told and f" {p}, but not {b}, " in told
            assert s.span_text("cue") == CUE_POOLS["told"][g].format(H=f"{p}, but not {b},")
        elif s.condition == "correct_label":
            assert s.span_text("contrast") == label and s.span_text("cue") == label[:-1]
        else:
            assert s.span_text("contrast") == f"{seen} {told}"
            assert seen.endswith(f", not the {c} next to it.") and " glass " in s.span_text("cue")
            assert f" {b}, but not {p}, " in told
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
        assert _rate(s.answer == o[0] for s, o in zip(group, order)) == 0.5, cell
        assert _rate(s.answer == o[-1] for s, o in zip(group, order)) == 0.5, cell
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
