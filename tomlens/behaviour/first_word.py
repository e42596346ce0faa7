"""Kosinski's scoring: the first word of the model's greedy completion, right only when it is the
keyed option's first word.

Why a second scoring: p(a) / (p(a) + p(b)) asks which of two offered answers the model prefers,
and always gets one; Kosinski (2024) let the model write and read its first word, so a model that
would write neither option ("the", "nothing", a line break) is wrong, as it would be with a person.
That is his scoring of the unexpected-transfer and unexpected-contents tasks, and his strict rule
(a task counts only when all of its prompts are right) is applied to it by
`tomlens.behaviour.aggregates.strict_task_pass(..., "correct_first_word")`.

How: greedy decoding (argmax each step, as at temperature 0) of a whole batch at once, until every
row's first word has ended (a character that cannot continue a word follows it), the model's end
token, `max_new_tokens` or the context window. Each step reads the batch's new tokens to the host
once (whether a row's word has ended depends on them): one wait per generated token for the whole
batch, none per row; a finished row leaves the batch (rows are picked by a host-built index, no
read). Like `tomlens.behaviour.generate`, a step re-runs the whole sequence (no cache), so hooks and
patches apply unchanged; first words are a few tokens, so this is cheap.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.behaviour.aggregates import MIN_OPTION_MASS, accuracy_table
from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.models.protocol import Model
from tomlens.models.tokens import encode
from tomlens.oom import OOM_ERRORS, release_memory
from tomlens.stimuli.records import Stimulus

# Kosinski's battery: the families his first-word scoring and strict rule are defined on.
KOSINSKI_FAMILIES: tuple[str, ...] = ("unexpected-transfer", "unexpected-contents")
# First words are one to three tokens in common tokenizers, plus the token that ends them.
MAX_NEW_TOKENS = 8
# A word: letters or digits, joined by an apostrophe or a hyphen ("Sam's", "jack-in-the-box").
WORD = re.compile(r"[^\W_]+(?:['\u2019-][^\W_]+)*")
# What may still continue a word when a completion ends in it.
_JOINERS = frozenset({"'", "\u2019", "-"})
# Why a row stopped decoding; the last two mean the first word may be cut short.
ENDED, NOT_A_WORD, EOS, MAX_TOKENS, CONTEXT = "word ended", "not a word", "eos", "max_new_tokens", "context"
CUT_OFF = frozenset({MAX_TOKENS, CONTEXT})
# Columns `first_word_columns` adds to a behaviour table (None on rows it does not score).
COLUMNS: tuple[str, ...] = ("completion", "first_word", "first_word_option", "correct_first_word", "off_key",
                            "first_word_stop", "first_word_cut_off")


def first_word(text: str) -> str:
    """The first word of `text` after leading whitespace, "" when it starts with anything else."""
    m = WORD.match(text.lstrip())
    return m.group() if m else ""


def word_status(text: str) -> str | None:
    """Whether a completion's first word is settled: ENDED (a non-word character follows it),
    NOT_A_WORD (the completion starts with punctuation or a symbol), or None (nothing but space
    yet, or the text ends inside a word that the next token may continue)."""
    head = text.lstrip()
    if not head:
        return None
    m = WORD.match(head)
    if m is None:
        return NOT_A_WORD
    rest = head[m.end():]
    return None if not rest or rest in _JOINERS else ENDED


@dataclass(frozen=True)
class Completion:
    """One greedy completion, decoded as far as its first word: the text, the word, how many
    tokens were generated and why decoding stopped (ENDED, NOT_A_WORD, EOS, MAX_TOKENS, CONTEXT)."""

    text: str
    first_word: str
    n_new_tokens: int
    stop: str

    @property
    def cut_off(self) -> bool:
        return self.stop in CUT_OFF


def _stop_ids(tokenizer: Any) -> frozenset[int]:
    eos = tokenizer.eos_token_id
    return frozenset() if eos is None else frozenset({int(eos)})


def _completion(tokenizer: Any, tokens: list[int], stop: str) -> Completion:
    text = tokenizer.decode(tokens)
    return Completion(text.strip(), first_word(text), len(tokens), stop)


def _keep_rows(tensors: dict[str, Tensor], keep: list[int]) -> dict[str, Tensor]:
    """The rows `keep` of every tensor, picked by an index built on the host (no device read)."""
    index = to_device(torch.tensor(keep, dtype=torch.long), next(iter(tensors.values())).device)
    return {k: v.index_select(0, index) for k, v in tensors.items()}


def _decode_batch(model: Model, texts: Sequence[str], max_new_tokens: int) -> list[Completion]:
    """Greedy first words of one batch: one forward and one host read of the new tokens per step."""
    tokenizer = model.tokenizer
    batch = encode(model, texts)
    seq = {"ids": batch.input_ids, "mask": batch.attention_mask, "pos": batch.position_ids}
    n_ctx = getattr(getattr(model, "cfg", None), "n_ctx", None)
    stops = _stop_ids(tokenizer)
    active = list(range(len(texts)))  # batch rows still decoding, in the order of seq's rows
    new: list[list[int]] = [[] for _ in texts]
    done: dict[int, Completion] = {}
    for _ in range(max_new_tokens):
        if n_ctx is not None and seq["ids"].shape[1] >= n_ctx:
            break
        kwargs = {"attention_mask": seq["mask"]}
        if batch.pass_position_ids:
            kwargs["position_ids"] = seq["pos"]
        logits = model(seq["ids"], **kwargs)
        picked = logits[:, -1].float().argmax(-1)  # [active rows], on the device
        keep: list[int] = []
        for r, tok in enumerate(picked.tolist()):  # the one host read of the step, for the whole batch
            row = active[r]
            if tok in stops:
                done[row] = _completion(tokenizer, new[row], EOS)
                continue
            new[row].append(tok)
            status = word_status(tokenizer.decode(new[row]))
            if status is not None:
                done[row] = _completion(tokenizer, new[row], status)
            else:
                keep.append(r)
        if not keep:
            active = []
            break
        if len(keep) < len(active):
            seq = _keep_rows(seq, keep)
            picked = _keep_rows({"t": picked}, keep)["t"]
            active = [active[r] for r in keep]
        seq = {"ids": torch.cat([seq["ids"], picked[:, None].to(seq["ids"].dtype)], dim=1),
               "mask": torch.cat([seq["mask"], torch.ones_like(seq["mask"][:, :1])], dim=1),
               "pos": torch.cat([seq["pos"], seq["pos"][:, -1:] + 1], dim=1)}
    reason = CONTEXT if n_ctx is not None and seq["ids"].shape[1] >= n_ctx else MAX_TOKENS
    for row in active:
        done[row] = _completion(tokenizer, new[row], reason)
    return [done[row] for row in range(len(texts))]


def greedy_first_words(model: Model, prompts: Sequence[str], *, batch_size: int = 8,
                       max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = True) -> list[Completion]:
    """The greedy completion of every prompt, decoded until its first word has ended; in input order.

    Prompts run in batches sorted by length (little padding); out of GPU memory a batch halves and
    runs again. A prompt that already fills the context window is a TomlensError, never an empty
    answer counted wrong."""
    if max_new_tokens < 1:
        raise TomlensError(f"max_new_tokens = {max_new_tokens} must be at least 1", f"use e.g. {MAX_NEW_TOKENS}")
    n_ctx = getattr(getattr(model, "cfg", None), "n_ctx", None)
    lengths = [len(model.tokenizer(p)["input_ids"]) for p in prompts]
    if n_ctx is not None and lengths and max(lengths) >= n_ctx:
        i = lengths.index(max(lengths))
        raise TomlensError(f"prompt {i} is {lengths[i]} tokens and fills the model's context window ({n_ctx}): "
                           "no first word can be generated", "use a model with a longer context or shorter prompts")
    order = sorted(range(len(prompts)), key=lambda i: lengths[i])
    out: dict[int, Completion] = {}
    batch_size = max(1, int(batch_size))
    bar = tqdm(total=len(order), desc="first words", unit="prompt", disable=not progress)
    done = 0
    with torch.inference_mode():
        while done < len(order):
            chunk = order[done : done + batch_size]
            try:
                got = _decode_batch(model, [prompts[i] for i in chunk], max_new_tokens)
            except OOM_ERRORS:
                if batch_size == 1:
                    raise TomlensError("out of GPU memory decoding a single prompt",
                                       "use a smaller model, a shorter prompt, or a GPU with more memory") from None
                batch_size //= 2
                release_memory()
                bar.write(f"out of memory: batch size now {batch_size}", file=sys.stderr)
                continue
            out.update(zip(chunk, got, strict=True))
            done += len(chunk)
            bar.update(len(chunk))
    bar.close()
    return [out[i] for i in range(len(prompts))]


def option_first_words(s: Stimulus) -> tuple[str, str]:
    """Each option's first word, casefolded; a TomlensError when they are the same (the first word
    could not tell the answers apart) or an option has none."""
    words = tuple(first_word(o).casefold() for o in s.options)
    if not all(words) or words[0] == words[1]:
        raise TomlensError(f"stimulus {s.id}: options {s.options!r} do not start with two different words, "
                           "so a first word cannot tell them apart",
                           "score this set with --scoring logprob, or give its options different first words")
    return words  # type: ignore[return-value]


def is_scored(s: Stimulus) -> bool:
    """Whether first-word scoring answers `s`: Kosinski's two families, whole stories only (a
    belief-tracking prefix is a point on a curve, not a trial). `scored_rows` is the same rule on a table."""
    return s.family in KOSINSKI_FAMILIES and s.meta.get("prefix_index") is None


def scored_rows(table: pd.DataFrame) -> pd.Series:
    """`is_scored` on a behaviour table's rows."""
    rows = table["family"].astype(str).isin(KOSINSKI_FAMILIES)
    if "prefix_index" in table:
        rows &= table["prefix_index"].isna()
    return rows


def check_set(stimuli: Sequence[Stimulus]) -> list[Stimulus]:
    """The stimuli first-word scoring answers; a TomlensError, before any model runs, when there are
    none (the scoring is Kosinski's, for his two families) or two options share a first word."""
    chosen = [s for s in stimuli if is_scored(s)]
    if not chosen:
        raise TomlensError("first-word scoring is Kosinski's, defined on the unexpected-transfer and "
                           "unexpected-contents families, and this set has no whole-story prompt of either",
                           "score it with --scoring logprob, or add unexpected-transfer or unexpected-contents stimuli")
    for s in chosen:
        option_first_words(s)
    return chosen


def first_word_columns(model: Any, stimuli: Sequence[Stimulus], table: pd.DataFrame, *, batch_size: int = 8,
                       max_new_tokens: int = MAX_NEW_TOKENS, progress: bool = False) -> pd.DataFrame:
    """`table` (one row per stimulus, as `score` returns it) with the first-word columns (COLUMNS) on
    Kosinski's rows and None elsewhere: the completion and its first word, the option whose first
    word it is (None: off-key), `correct_first_word` (the keyed option's first word; an off-key
    answer is wrong), `off_key`, why decoding stopped and whether it was cut short.

    A set without Kosinski rows is a TomlensError (`check_set`): the scoring is his, for his two families."""
    check_set(stimuli)  # refused before any decoding
    by_id = {s.id: s for s in stimuli}
    rows = scored_rows(table)
    chosen = [by_id[i] for i in table.loc[rows, "id"]]
    keys = [option_first_words(s) for s in chosen]
    completions = greedy_first_words(model, [s.text for s in chosen], batch_size=batch_size,
                                     max_new_tokens=max_new_tokens, progress=progress)
    values: dict[str, list[Any]] = {c: [None] * len(table) for c in COLUMNS}
    positions = [table.index.get_loc(i) for i in table.index[rows]]
    for at, s, words, c in zip(positions, chosen, keys, completions, strict=True):
        said = c.first_word.casefold()
        picked = words.index(said) if said in words else None
        values["completion"][at] = c.text
        values["first_word"][at] = c.first_word
        values["first_word_option"][at] = None if picked is None else s.options[picked]
        values["correct_first_word"][at] = picked == s.answer_index
        values["off_key"][at] = picked is None
        values["first_word_stop"][at] = c.stop
        values["first_word_cut_off"][at] = c.cut_off
    return table.assign(**values)


def first_word_accuracy(table: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0,
                        min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """First-word accuracy per family x condition x prompt type with task-bootstrap intervals (as
    `accuracy_table`), the share of off-key answers and of answers cut short, and the cell's option
    mass; empty for a table without first-word answers."""
    if "correct_first_word" not in table:
        return pd.DataFrame()
    d = table[table["correct_first_word"].notna()]
    if d.empty:
        return pd.DataFrame()
    d = d.assign(correct_first_word=d["correct_first_word"].astype(bool))
    acc = accuracy_table(d, column="correct_first_word", n_boot=n_boot, seed=seed, min_mass=min_mass)
    by = ["family", "condition", "prompt_type"]
    shares = d.groupby(by, sort=True, dropna=False).agg(
        off_key=("off_key", lambda x: float(x.astype(bool).mean())),
        cut_off=("first_word_cut_off", lambda x: float(x.astype(bool).mean()))).reset_index()
    acc = acc.merge(shares, on=by, how="left", validate="one_to_one")
    return acc.assign(scoring="first word (greedy)")
