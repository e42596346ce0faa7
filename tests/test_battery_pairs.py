"""Minimal pairs and probe labels for the kosoy and indirect-request batteries (issue 13): the pairs
differ only inside their contrast, flip the answer, share question and options, align for the
SmolLM2 (and Gemma 3) tokenizers, and run through the patching and probes stages on tiny-llama.

Labels of the pairs-only variants are re-derived here from the text alone, not from the generator.
"""

from __future__ import annotations

import json
import re

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli.epitome import indirect_request, ir_minimal_pairs
from tomlens.stimuli.kosoy import kosoy
from tomlens.stimuli.kosoy import minimal_pairs as kosoy_pairs
from tomlens.stimuli.pairs import CONTRASTS, PAIR_FAMILIES, diff_positions, make_pairs, structural_problem
from tomlens.stimuli.records import Stimulus

# Sally-Anne: the owner goes off, then the move; the witnessed twin: the move, then the owner goes off
MOVE_AWAY = re.compile(r"goes off to [^.]+\. Then (\w+) takes the (.+?) out of the (\w+) and puts it in the (\w+)\.")
MOVE_SEEN = re.compile(r"Then (\w+) takes the (.+?) out of the (\w+) and puts it in the (\w+)\. Then \w+ goes off to ")
CONTENTS = re.compile(r"there are no (\w+) inside: the (\w+) is full of (\w+)\.")
NEWCOMER = re.compile(r"Then (\w+), who has (never|already) looked inside the (\w+), walks into the room\.")
IR_CUE = re.compile(r"(\w+) knows (nothing|all) about ")


def _derived(s: Stimulus) -> dict[str, str]:
    """protagonist_belief, world_state and answer of a kosoy ToM test prompt, read from its text."""
    if m := MOVE_AWAY.search(s.text):
        start, moved = m.group(3), m.group(4)
        return {"protagonist_belief": start, "world_state": moved, "answer": start}
    if m := MOVE_SEEN.search(s.text):
        moved = m.group(4)
        return {"protagonist_belief": moved, "world_state": moved, "answer": moved}
    c, n = CONTENTS.search(s.text), NEWCOMER.search(s.text)
    assert c and n, s.text
    label, contents = c.group(1), c.group(3)
    belief = label if n.group(2) == "never" else contents
    return {"protagonist_belief": belief, "world_state": contents, "answer": belief}


def _tok(name: str):
    from tomlens.models.registry import load_tokenizer

    return load_tokenizer(name)


def _check_pair_shape(p, tok) -> None:
    c, k = p.clean, p.corrupted
    assert structural_problem(p) is None
    assert c.options == k.options and c.answer != k.answer and {c.answer, k.answer} == set(c.options)
    assert p.other_answer == k.answer
    assert c.span_text("query") == k.span_text("query") and c.task_id == k.task_id
    # everything outside the contrast is the same text; inside, the same number of words
    cs, ks = c.spans["contrast"], k.spans["contrast"]
    assert c.text[: cs.start] == k.text[: ks.start] and c.text[cs.end:] == k.text[ks.end:]
    assert len(cs.of(c.text).split()) == len(ks.of(k.text).split())
    positions = diff_positions(p, tok)
    enc = tok(c.text, return_offsets_mapping=True)
    assert positions
    for i in positions:
        start, end = enc["offset_mapping"][i]
        piece = c.text[start:end]
        start += len(piece) - len(piece.lstrip())  # a token's leading space belongs to the word before
        assert cs.start <= start and end <= cs.end


def test_families_are_registered_for_pairs():
    assert {"kosoy", "indirect-request"} <= set(PAIR_FAMILIES)
    assert set(CONTRASTS["kosoy"]) == {"witnessed", "looked"} and set(CONTRASTS["indirect-request"]) == {"aware"}
    with pytest.raises(TomlensError, match="unknown option"):
        make_pairs("kosoy", 2, bogus=1)
    with pytest.raises(TomlensError, match="unknown option"):
        make_pairs("indirect-request", 2, bogus=1)
    with pytest.raises(TomlensError, match="contrasts"):
        make_pairs("kosoy", 2, contrasts=("aware",))


def test_kosoy_pairs_flip_the_answer_inside_the_contrast_with_labels_from_the_text():
    tok = _tok("tiny-llama")
    pairs, report = make_pairs("kosoy", 16, seed=2, tokenizer=tok)
    assert report.total == 32 and report.aligned == len(pairs) >= 0.8 * report.total
    assert {p.contrast for p in pairs} == {"witnessed", "looked"}
    for p in pairs:
        _check_pair_shape(p, tok)
        c, k = p.clean, p.corrupted
        assert c.meta["question"] == k.meta["question"] == "test" and c.prompt_type == k.prompt_type == "belief"
        assert c.condition == {"witnessed": "sally-anne", "looked": "smarties"}[p.contrast]
        assert k.condition == {"witnessed": "sally-anne-witnessed", "looked": "smarties-looked"}[p.contrast]
        for s in (c, k):
            want = _derived(s)
            assert (s.protagonist_belief, s.world_state, s.answer) == (
                want["protagonist_belief"], want["world_state"], want["answer"]), s.id
        # clean: belief = start (label), the world elsewhere; corrupted: belief = world = moved (contents)
        assert c.belief_differs and not k.belief_differs
        assert c.answer == c.reference_state and k.answer == k.world_state != k.reference_state
        assert k.meta["protagonist_access"] == "saw" and c.meta["protagonist_access"] == "absent"
    # the clean prompt is the battery's own test prompt (text and labels), only its contrast span moved
    battery = {s.id: s for s in kosoy(16, 2, tasks=["sally-anne", "smarties"])}
    for p in pairs:
        b = battery[p.clean.id]
        assert (b.text, b.options, b.answer, b.protagonist_belief) == (
            p.clean.text, p.clean.options, p.clean.answer, p.clean.protagonist_belief)


def test_the_witnessed_option_adds_twins_and_leaves_the_battery_text_alone():
    plain = kosoy(8, 0, tasks="tom")
    both = kosoy(8, 0, tasks="tom", witnessed=True)
    twins = [s for s in both if s.condition in ("sally-anne-witnessed", "smarties-looked")]
    assert [s.to_dict() for s in both if s not in twins] == [s.to_dict() for s in plain]
    assert len(twins) == 2 * 8 * 3  # two twin cells x 8 items x (test + two controls)
    tests = [s for s in twins if s.meta["question"] == "test"]
    assert sum(s.reversed for s in tests) == len(tests) // 2  # option order balanced in the twins too
    for s in tests:
        want = _derived(s)
        assert (s.protagonist_belief, s.world_state, s.answer) == (
            want["protagonist_belief"], want["world_state"], want["answer"])
    with pytest.raises(TomlensError, match="witnessed"):
        kosoy(2, 0, witnessed="yes")


def test_indirect_request_pairs_flip_yes_to_no_in_one_word():
    tok = _tok("tiny-llama")
    pairs, report = make_pairs("indirect-request", 16, seed=3, tokenizer=tok)
    assert report.total == 16 and report.aligned == len(pairs) >= 0.8 * report.total
    for p in pairs:
        _check_pair_shape(p, tok)
        c, k = p.clean, p.corrupted
        assert len(diff_positions(p, tok)) == 1  # "nothing" vs "all"
        for s, word in ((c, "nothing"), (k, "all")):
            m = IR_CUE.search(s.text)
            assert m and m.group(2) == word and m.group(1) == s.meta["speaker"]
            unaware = m.group(2) == "nothing"  # re-derived from the cue's words
            assert s.answer == ("Yes" if unaware else "No")
            assert s.protagonist_belief == ("open" if unaware else "blocked") and s.world_state == "blocked"
            assert s.meta["speaker_aware"] is (not unaware) and s.meta["knowledge_cue"] == "explicit"
            assert s.belief_is_reference is unaware  # the probe target protagonist_belief = speaker unaware
    # the battery's default text keeps its own wording: its explicit cue names who knows and who does not
    default = indirect_request(4, 3)
    assert all("knows nothing about" not in s.text and "matched_cue" not in s.meta for s in default)
    assert all({s.meta["speaker"], s.meta["hearer"]} <= set(re.findall(r"\w+", s.span_text("contrast")))
               for s in default if s.meta["knowledge_cue"] == "explicit")
    matched = indirect_request(4, 3, matched_cue=True)
    assert [s.text for s in matched if s.meta["knowledge_cue"] == "implicit"] == [
        s.text for s in default if s.meta["knowledge_cue"] == "implicit"]
    with pytest.raises(TomlensError, match="matched_cue"):
        indirect_request(2, 0, matched_cue=1)
    assert len(ir_minimal_pairs(5, 1)) == 5


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_pairs_align_for_real_tokenizers(model):
    """The aligned fraction for each real model's tokenizer (only when it is already in the cache:
    nothing is converted or downloaded here)."""
    from tomlens.models.paths import models_dir

    if not (models_dir() / model).is_dir():
        pytest.skip(f"{model} is not converted in {models_dir()}: its tokenizer is not checked")
    tok = _tok(model)
    for family in ("kosoy", "indirect-request"):
        pairs, report = make_pairs(family, 40, seed=1, tokenizer=tok)
        print(f"{model}: {report.summary()}")
        assert report.aligned_fraction >= 0.8, report.summary()


def test_exact_patching_runs_on_kosoy_pairs_and_the_cli_writes_them(load_tiny, tmp_path, capsys):
    from tomlens.cli import main
    from tomlens.runs.base import ModelSpec
    from tomlens.runs.pairs import PairsConfig
    from tomlens.runs.patching import PatchingConfig, run

    tiny = ModelSpec("tiny-llama")
    config = PatchingConfig(model=tiny, pairs=PairsConfig(model=tiny, family="kosoy", n=4, contrasts=("witnessed",)),
                            method="exact", sites=("heads",), positions=("final",), top_k=1, n_random=2,
                            ablation="none", force=True)
    result = run(config, model=load_tiny("tiny-llama"), progress=False)
    assert result.summary.pairs.n_aligned == 4
    assert set(result.sweeps) == {("exact", "denoise")}
    cells = result.tables["cells_exact_denoise"]
    assert len(cells) > 0 and cells["effect"].notna().any()
    assert result.forced or result.withheld is None  # a random model's gate may fail: then flagged, not hidden

    out = tmp_path / "kosoy.jsonl"
    assert main(["pairs", "kosoy", "--model", "tiny-llama", "--n", "4", "--out", str(out)]) == 0
    assert "8 of 8 pairs aligned" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8 and {r["contrast"] for r in rows} == {"witnessed", "looked"}
    assert main(["pairs", "indirect-request", "--model", "tiny-llama", "--n", "4", "--out", str(tmp_path / "ir.jsonl")]) == 0


@pytest.mark.parametrize("family,contrast", [("indirect-request", "aware"), ("motomqa", "one_believer")])
def test_exact_patching_runs_on_the_other_battery_pairs(load_tiny, family, contrast):
    """Every battery family with pairs goes through the patching stage (the gate may withhold on a
    random model; then the run is forced and says so)."""
    from tomlens.runs.base import ModelSpec
    from tomlens.runs.pairs import PairsConfig
    from tomlens.runs.patching import PatchingConfig, run

    tiny = ModelSpec("tiny-llama")
    config = PatchingConfig(model=tiny, pairs=PairsConfig(model=tiny, family=family, n=4, contrasts=(contrast,)),
                            method="exact", sites=("heads",), positions=("final",), top_k=1, n_random=2,
                            ablation="none", force=True)
    result = run(config, model=load_tiny("tiny-llama"), progress=False)
    assert result.summary.pairs.n_aligned >= 2
    cells = result.tables["cells_exact_denoise"]
    assert len(cells) > 0 and cells["effect"].notna().any()
    assert result.forced or result.withheld is None


@pytest.mark.parametrize("family,options", [
    ("kosoy", {"tasks": ["sally-anne", "smarties"], "witnessed": True}),
    ("indirect-request", {"matched_cue": True}),
])
def test_probes_run_on_the_belief_label(load_tiny, tmp_path, family, options):
    """protagonist_belief is the belief-like label of both: where the object (contents) started for
    kosoy's ToM prompts, "the speaker does not know of the obstacle" for indirect requests."""
    from tomlens.probes.targets import label_variation
    from tomlens.runs import probes
    from tomlens.runs.base import ModelSpec, StimuliSpec
    from tomlens.stimuli import generate

    spec = StimuliSpec(family=family, n=8, seed=0, options=options)
    stims = generate(family, n=8, seed=0, **options)
    variation = label_variation(stims, "protagonist_belief")
    assert variation["n"].sum() == len(stims) and set(variation["share_1"]) == {0.0, 1.0}
    config = probes.ProbesConfig(model=ModelSpec("tiny-llama"), stimuli=spec, targets=("protagonist_belief",),
                                 sites=("resid_post",), store=str(tmp_path / "store"), folds=3, inner_folds=2,
                                 c_grid=(1.0,), n_boot=20, n_permutations=9, random_twin=False,
                                 selection=False, controls=False)
    result = probes.run(config, model=load_tiny("tiny-llama"), progress=False)
    table = result.table
    acts = table[table["features"] == "activations"]
    assert len(acts) > 0 and set(acts["target"]) == {"protagonist_belief"}
    assert acts["score"].notna().all()
    bow = table[table["features"] == "bag_of_words"]
    assert len(bow) >= 1 and bow["score"].notna().all()


@pytest.mark.parametrize("family", ["kosoy", "indirect-request"])
def test_the_default_roles_positions_are_all_kept_on_these_pairs(family):
    """`tomlens patch`'s default `roles` positions need `query_protagonist` and `query_object` in
    every story; without them two of four are dropped with a note blaming old pairs."""
    from tomlens.patching.plan import ROLE_POSITIONS, drop_missing_roles, parse_positions

    pairs, _ = make_pairs(family, 8, seed=0, tokenizer=_tok("tiny-llama"))
    stories = [s for p in pairs for s in (p.clean, p.corrupted)]
    pos = drop_missing_roles(parse_positions("roles", ("resid_pre", "head")), stories)
    assert pos.notes == [] and pos.spec["resid_pre"] == ROLE_POSITIONS
    for s in stories:
        q = s.spans["query"]
        assert q.start <= s.spans["query_protagonist"].start and s.spans["query_object"].end <= q.end
        assert s.span_text("query_protagonist") == (s.meta.get("queried") or s.meta.get("speaker"))
        want = {"kosoy": s.meta.get("queried") and re.search(r"the (\w+)", s.span_text("query")).group(1),
                "indirect-request": "request"}[family]
        assert s.span_text("query_object") == want


def test_the_default_pair_count_balances_the_clean_answers_position():
    """n defaults to 24, whole blocks of 8: the clean answer is first in exactly half of each
    contrast's pairs (20 would give 11 and 9)."""
    from collections import Counter

    for pairs in (kosoy_pairs(), ir_minimal_pairs(), ir_minimal_pairs(seed=1)):
        by = Counter((p.contrast, p.clean.answer_index) for p in pairs)
        for contrast in {p.contrast for p in pairs}:
            assert by[(contrast, 0)] == by[(contrast, 1)] == 12, by
