"""The model organism: its tokenizer, its held-out split and its training script (a reduced run)."""

from __future__ import annotations

from tomlens.organism.data import by_task, cast_key, make_split, story_words, template_key
from tomlens.organism.vocab import build_tokenizer, vocabulary, words

QUICK_TRAIN = {"order-only": 60, "false-belief-factorial": 20, "unexpected-contents": 40}
QUICK_TEST = {"order-only": 300, "false-belief-factorial": 150, "unexpected-contents": 100}


def test_every_word_is_one_token_with_offsets_and_bos() -> None:
    text = "Sam puts the ball in the basket. Sam thinks that the ball is in the"
    tok = build_tokenizer(vocabulary([text]))
    enc = tok(text, return_offsets_mapping=True)
    ids = enc["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len(words(text))
    assert tok.unk_token_id not in ids
    for (a, b), w in zip(enc["offset_mapping"][1:], words(text), strict=True):
        assert text[a:b].lower() == w  # role spans map to tokens through the offsets
    assert tok("basket", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids("basket")]
    assert tok("the unheard word", add_special_tokens=False)["input_ids"].count(tok.unk_token_id) == 2


def test_held_out_split_shares_no_template_or_cast_and_no_unseen_word() -> None:
    split = make_split(QUICK_TRAIN, QUICK_TEST, share=0.3, seed=0)
    assert split.train and split.test
    train_tasks, test_tasks = by_task(split.train), by_task(split.test)
    train_templates = {template_key(t) for t in train_tasks}
    train_casts = {cast_key(t) for t in train_tasks}
    assert not train_templates & {template_key(t) for t in test_tasks}
    assert not train_casts & {cast_key(t) for t in test_tasks}
    seen = {w for s in split.train for w in story_words(s)}
    assert all(w in seen for s in split.test for w in story_words(s))
    assert {s.family for s in split.test} == {s.family for s in split.train}
    # whole tasks on each side: every condition and prompt type of a test task is there
    assert all(len({(s.condition, s.prompt_type) for s in t}) >= 4 for t in test_tasks)
    again = make_split(QUICK_TRAIN, QUICK_TEST, share=0.3, seed=0)
    assert [s.id for s in again.test] == [s.id for s in split.test]
