"""A word-level tokenizer over the generators' vocabulary.

One token per word or punctuation mark, lower-cased, so every location, object and name is one
token: the answer is a single next-token prediction and a head that copies it copies one token.
Words outside the vocabulary map to [UNK]; a BOS token starts every text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

SPECIALS: tuple[str, ...] = ("[PAD]", "[UNK]", "[BOS]", "[EOS]")
_WORD = re.compile(r"\w+|[^\w\s]+")  # = the Whitespace pre-tokenizer's split


def words(text: str) -> list[str]:
    """The tokens of `text` as the tokenizer splits it (lower-cased)."""
    return [w.lower() for w in _WORD.findall(text)]


def vocabulary(texts: Iterable[str]) -> list[str]:
    """Every word in `texts`, sorted (so the token ids do not depend on story order)."""
    seen: set[str] = set()
    for text in texts:
        seen.update(words(text))
    return sorted(seen)


def build_tokenizer(vocab: Iterable[str]) -> Any:
    """A `PreTrainedTokenizerFast` over `vocab` with offsets (role spans map to tokens) and BOS."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    table = {tok: i for i, tok in enumerate(SPECIALS)}
    for w in vocab:
        table.setdefault(w, len(table))
    tok = Tokenizer(WordLevel(table, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", pair="[BOS] $A $B", special_tokens=[("[BOS]", table["[BOS]"])]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]",
                                   pad_token="[PAD]", unk_token="[UNK]")
    fast.padding_side = "left"
    return fast
