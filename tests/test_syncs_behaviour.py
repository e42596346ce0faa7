"""Behaviour scoring makes no host sync per row, per option or per batch: every batch's option
log-probs stay on the device and come to the host in one move per call, so the count of sync ops
does not grow with the number of prompts or the depth of the model.

Before the change, `score_options` read each option's log-probs back with one `.tolist()`:
16 syncs for 8 stimuli, 32 for 16 (2 options each), on every tiny model. Recording the option mass
(issue 27) added none: it is exp of the log-probs that one move brings back.

Kosinski's first-word decoding reads the batch's new tokens once per generated token (whether a
row's word has ended depends on them), for the whole batch: the count is the number of decoding
steps, whatever the number of rows."""

from __future__ import annotations

import pytest
from syncs import count_syncs, tiny_with_layers

from tomlens.behaviour.first_word import greedy_first_words
from tomlens.behaviour.scoring import score, score_options
from tomlens.models.tokens import option_first_tokens
from tomlens.stimuli.records import Stimulus

pytestmark = pytest.mark.integration

# One `.tolist()` of the stacked log-probs at the end of the call; nothing else reads the device.
SCORING_SYNCS = 1

STORIES = [
    ("Anna puts the ring in the drawer and leaves. She will look for the ring in the", ("drawer", "jewelry box")),
    ("The cat jumps out of the", ("basket", "box")),
    ("Tom puts his ball in the cupboard and goes out to play. Tom looks in the", ("cupboard", "garden shed")),
    ("Sally will look for her marble in the", ("basket", "box")),
]


def _stimuli(n: int) -> list[Stimulus]:
    """`n` prompts cycling through stories with one- and multi-token options (shared and joint rows)."""
    return [Stimulus(id=f"s{i}", text=STORIES[i % 4][0], options=STORIES[i % 4][1], answer=STORIES[i % 4][1][i % 2])
            for i in range(n)]


def _scoring_syncs(model, n: int, batch_size: int = 8) -> int:
    score_options(model, _stimuli(n), batch_size=batch_size, progress=False)  # warm-up outside the count
    with count_syncs() as c:
        score_options(model, _stimuli(n), batch_size=batch_size, progress=False)
    return c.total


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_scoring_syncs_do_not_grow_with_prompts(name, load_tiny):
    model = load_tiny(name)
    n8, n16 = _scoring_syncs(model, 8), _scoring_syncs(model, 16)
    assert n8 == n16 <= SCORING_SYNCS, (n8, n16)
    # one batch of 16 or sixteen batches of 1: the same single move
    assert _scoring_syncs(model, 16, batch_size=1) == n16


def test_scoring_syncs_do_not_grow_with_layers(tmp_path):
    shallow = _scoring_syncs(tiny_with_layers("tiny-llama", 2, tmp_path / "l2"), 8)
    deep = _scoring_syncs(tiny_with_layers("tiny-llama", 6, tmp_path / "l6"), 8)
    assert shallow == deep <= SCORING_SYNCS, (shallow, deep)


STORY = ("Anna and her brother Tom are in the kitchen. Anna puts the ring in the drawer and goes out to water "
         "the flowers in the garden. While she is out, Tom moves the ring from the drawer to the box. ")
QUESTIONS = ("Anna will look for the ring in the", "The ring is now in the", "Tom thinks the ring is in the",
             "Anna thinks the ring is in the")


def _one_story(n: int) -> list[Stimulus]:
    """`n` questions on one long story (cycling): their rows share the story, so batches run it once
    and the rest of each row against its keys and values."""
    opts = (("drawer", "box"), ("drawer", "jewelry box"))
    return [Stimulus(id=f"q{i}", text=STORY + QUESTIONS[i % 4], options=opts[i // 4 % 2],
                     answer=opts[i // 4 % 2][i % 2]) for i in range(n)]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_shared_prefix_scoring_adds_no_sync(name, load_tiny, monkeypatch):
    """A batch's shared prefix runs in a forward of its own and its cache is expanded to the batch
    on the device: still the one move per call, for 8 or 16 prompts, in batches of 4 or 8."""
    from tomlens.behaviour import scoring

    model = load_tiny(name)
    prefixes: list[int] = []
    shared = scoring._forward_shared
    monkeypatch.setattr(scoring, "_forward_shared",
                        lambda m, plain, chunk, prefix, *a: prefixes.append(prefix) or shared(m, plain, chunk, prefix, *a))
    score_options(model, _one_story(8), batch_size=4, progress=False)  # warm-up outside the count
    for n, batch_size in ((8, 4), (16, 4), (16, 8)):
        prefixes.clear()
        with count_syncs() as c:
            score_options(model, _one_story(n), batch_size=batch_size, progress=False)
        assert prefixes, "no batch took the shared path"
        assert c.total <= SCORING_SYNCS, c.summary()


def test_option_first_tokens_reads_only_the_tokenizer(load_tiny):
    """The table comes from the tokenizer's output: no device read, no sync, at any size."""
    model = load_tiny("tiny-llama")
    for n in (8, 16):
        stimuli = _stimuli(n)
        with count_syncs() as c:
            table = option_first_tokens(model, stimuli, [s.options for s in stimuli])
        assert c.total == 0, c.summary()
        assert table.shape == (n, 2) and table.device.type == "cpu"


def test_score_with_option_mass_adds_no_sync(load_tiny):
    """The per-prompt table (option mass included) costs the same one move as the scores alone."""
    model = load_tiny("tiny-llama")
    score(model, _stimuli(8), progress=False)
    for n in (8, 16):
        with count_syncs() as c:
            table = score(model, _stimuli(n), progress=False)
        assert c.total <= SCORING_SYNCS, c.summary()
        assert table["option_mass_first"].between(0, 1).all()


def _decoding_syncs(model, prompts: list[str], batch_size: int) -> tuple[int, int]:
    """(syncs of one `greedy_first_words` call, its decoding steps: the most tokens any row took,
    plus one where a row stopped at its end token, which is read but not kept)."""
    greedy_first_words(model, prompts, batch_size=batch_size, progress=False)  # warm-up outside the count
    with count_syncs() as c:
        got = greedy_first_words(model, prompts, batch_size=batch_size, progress=False)
    steps = max(g.n_new_tokens + (g.stop == "eos") for g in got)
    return c.total, steps


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_first_word_decoding_reads_once_per_step_for_the_whole_batch(name, load_tiny):
    model = load_tiny(name)
    prompts = [text for text, _ in STORIES]
    few, steps = _decoding_syncs(model, prompts, batch_size=16)
    many, steps_many = _decoding_syncs(model, prompts * 4, batch_size=16)  # 4x the rows, the same steps
    assert steps == steps_many and few == many == steps, (few, many, steps)
