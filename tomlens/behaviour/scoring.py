"""Behavioural scoring: log-probability of each answer option as a continuation of the prompt.

Both options are scored as `text + " " + option`; the continuation tokens are found through the
tokenizer's character offsets (every token starting at or after the end of the prompt), so the
leading space and multi-token words are handled the same way for every tokenizer.

p(a) / (p(a) + p(b)) says which option a model prefers, not whether it would say either: a model
that puts 2% of its next-token mass on the two options looks as decided as one that puts 95% there.
So every row also records the *option mass*, how much of the model's probability the two options
get: `option_mass_first`, the next-token probability of the options' first tokens (a token two
options share counted once), which is what decides the first word the model would write, and
`option_mass`, the probability of the two whole continuations (exp of each option's summed token
log-probs, added). Both are exp of the log-probs the one move per call already brings to the host,
so they cost the GPU no extra wait.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass
from typing import Sequence

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.models.tokens import encode
from tomlens.oom import OOM_ERRORS, release_memory
from tomlens.stimuli.records import Stimulus

# Family-specific labels copied from `meta` into the table when present.
META_COLUMNS: tuple[str, ...] = (
    "k", "test_case", "target_type", "anim_denotation", "object_target", "location_target",
    "prefix_index", "n_sentences", "story_family", "world_state_t", "belief_t", "order",
    "knowledge_state", "first_mention", "recent_mention", "knowledge_cue",
    "level", "mental", "story_format", "question_format", "speaker_aware", "experiment", "timing", "access",
    "said",  # EPITOME's recursive mindreading, indirect request and scalar implicature
    "subject_type", "keyed_polarity", "violated_link", "cue_frame", "obstacle_kind",
    "stmt_type", "order_or_level", "prompt_style", "options_order", "last_1_true", "last_2_true",  # MoToMQA (Street et al.)
    "first_1_true", "world_true", "least_informed_true", "missed_change_true",  # ... and its other shortcuts
    "question",  # Kosoy et al.'s battery: "test" or "control" (the gate)
)


def story_id(s: Stimulus) -> str | None:
    """A short hash of the story a prompt asks about (family, task and the text before the `query`
    span), shared by the reality and belief prompts of one story so that belief answers can be gated
    on reality answers; None without a `query` span."""
    q = s.spans.get("query")
    if q is None:
        return None
    key = f"{s.family}\x1f{s.task_id}\x1f{s.text[: q.start]}"
    return hashlib.sha1(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class OptionScore:
    """Log-probabilities of one continuation: summed over its tokens and of its first token, whose
    id is `first_token` (-1 where unknown), so two options that begin alike are not counted twice."""

    logp_sum: float
    logp_first: float
    n_tokens: int
    first_token: int = -1


def _continuation_logprobs(
    logits: Float[Tensor, "batch pos vocab"], targets: Int[Tensor, "3 n"]
) -> Float[Tensor, " n"]:
    """Log-probs of the target tokens, left on the device: column `k` of `targets` is
    (row, position, token), the log-probability of `token` predicted at `position` of `row`.

    One gather for the whole batch, indexed by a table built on the host: no value is read back
    here, so a batch costs the GPU no wait (the caller moves every batch's log-probs to the host once)."""
    rows, positions, tokens = targets
    lp = torch.log_softmax(logits[rows, positions].float(), dim=-1)
    return lp.gather(-1, tokens[:, None])[:, 0]


@dataclass(frozen=True)
class _Job:
    """One forward row: a text and, per (stimulus, option) it serves, the tokens to score."""

    text: str
    wants: tuple[tuple[int, int, tuple[int, ...]], ...]  # (stimulus index, option index, token ids)
    joint: bool  # True: the option's tokens end the text; False: they follow the text


def _plan(tokenizer, stimuli: Sequence[Stimulus]) -> list[_Job]:
    """Score single-token options from one forward of the prompt; others as prompt + option.

    An option's tokens are those of `text + " " + option` that start at or after the end of the
    prompt (found through the offsets), so the leading space is part of the first token exactly as
    the tokenizer would merge it. When the prompt's own tokens are a prefix of the joint
    tokenization and the option is one token, the prompt's last-position logits score it.
    """
    jobs: list[_Job] = []
    for i, s in enumerate(stimuli):
        if s.text != s.text.rstrip():
            raise TomlensError(
                f"stimulus {s.id}: the prompt ends in whitespace ({s.text[-3:]!r}), so each option would be "
                "scored after an extra space or line break",
                "end the prompt right before the answer (tomlens adds the space before each option)",
            )
        prompt_ids = tokenizer(s.text)["input_ids"]
        shared: list[tuple[int, int, tuple[int, ...]]] = []
        for j, opt in enumerate(s.options):
            enc = tokenizer(f"{s.text} {opt}", return_offsets_mapping=True)
            ids, offs = enc["input_ids"], enc["offset_mapping"]
            first = next((t for t, (cs, ce) in enumerate(offs)
                          if ce > cs and (cs >= len(s.text) or ce > len(s.text))), None)
            if first is None or first == 0:
                raise TomlensError(f"stimulus {s.id}: option {opt!r} could not be located in the tokens",
                                   "check that the text does not end with whitespace")
            cont = tuple(ids[first:])
            if len(cont) == 1 and list(ids[:first]) == list(prompt_ids):
                shared.append((i, j, cont))
            else:
                jobs.append(_Job(f"{s.text} {opt}", ((i, j, cont),), joint=True))
        if shared:
            jobs.append(_Job(s.text, tuple(shared), joint=False))
    return jobs


def _batch_targets(chunk: Sequence[_Job], pad: Sequence[int], lengths: Sequence[int]
                   ) -> tuple[list[list[int]], list[tuple[int, int, int, int]]]:
    """The host table of a batch's scored tokens, `[rows, positions, tokens]` (positions predict the
    token: one before it), and per (stimulus, option) its key, how many tokens it spans and its
    first token's id, in order.

    Built from the tokenizer's pads and lengths alone (a left-padded row ends at `pad + length`),
    so nothing is read from the device to know where an option sits."""
    rows: list[int] = []
    positions: list[int] = []
    tokens: list[int] = []
    spans: list[tuple[int, int, int, int]] = []
    for row, job in enumerate(chunk):
        end = pad[row] + lengths[row]
        for i, j, toks in job.wants:
            start = end - len(toks) if job.joint else end
            rows += [row] * len(toks)
            positions += range(start - 1, start - 1 + len(toks))
            tokens += toks
            spans.append((i, j, len(toks), toks[0]))
    return [rows, positions, tokens], spans


def score_options(
    model, stimuli: Sequence[Stimulus], *, batch_size: int = 8, progress: bool = True
) -> list[tuple[OptionScore, OptionScore]]:
    """Score both options of every stimulus; returns `(score_a, score_b)` per stimulus, in order.

    Rows are sorted by length so batches carry little padding; results come back in input order.
    Out of GPU memory, the batch halves and the same rows run again (only a finished batch's
    log-probs are kept, so a retried row is never counted twice). Every batch's log-probs stay on
    the device and come to the host in one move at the end: the GPU never waits on a batch.
    """
    jobs = sorted(_plan(model.tokenizer, stimuli), key=lambda j: len(j.text))
    logps: list[Tensor] = []  # per finished batch, its targets' log-probs, still on the device
    spans: list[tuple[int, int, int, int]] = []  # (stimulus, option, n tokens, first token), in the order of logps
    batch_size = max(1, int(batch_size))
    bar = tqdm(total=len(jobs), desc="scoring", unit="seq", disable=not progress)
    done = 0
    with torch.inference_mode():
        while done < len(jobs):
            chunk = jobs[done : done + batch_size]
            batch = encode(model, [j.text for j in chunk])
            table, chunk_spans = _batch_targets(chunk, batch.pad, batch.lengths)
            try:
                logits = model(batch.input_ids, **batch.forward_kwargs())
                lp = _continuation_logprobs(logits, to_device(table, logits.device))
            except OOM_ERRORS:
                if batch_size == 1:
                    raise TomlensError("out of GPU memory scoring a single prompt",
                                       "use a smaller model, a shorter prompt, or a GPU with more memory") from None
                batch_size //= 2
                logits = None  # let the failed batch's memory go before the retry
                release_memory()
                bar.write(f"out of memory: batch size now {batch_size}", file=sys.stderr)
                continue
            logps.append(lp)  # only a finished batch is kept, so a retried row is never counted twice
            spans += chunk_spans
            done += len(chunk)
            bar.update(len(chunk))
    bar.close()
    scores = _option_scores(torch.cat(logps).tolist() if logps else [], spans)
    return [(scores[(i, 0)], scores[(i, 1)]) for i in range(len(stimuli))]


def _option_scores(logps: list[float], spans: Sequence[tuple[int, int, int, int]]
                   ) -> dict[tuple[int, int], OptionScore]:
    """Each (stimulus, option)'s `OptionScore` from the flat host list of token log-probs, cut at
    `spans` (stimulus, option, n tokens, first token id) in order."""
    scores: dict[tuple[int, int], OptionScore] = {}
    at = 0
    for i, j, n, first in spans:
        lps = logps[at : at + n]
        scores[(i, j)] = OptionScore(sum(lps), lps[0], n, first)
        at += n
    return scores


def _p_first_of_two(la: float, lb: float) -> float:
    """p(a) / (p(a) + p(b)) computed stably from log-probabilities."""
    return 1.0 / (1.0 + math.exp(lb - la))


def option_mass_first(a: OptionScore, b: OptionScore) -> float:
    """Next-token probability of the two options' first tokens: what share of the model's next word
    goes to either option. A first token both options share is one event, counted once."""
    if a.first_token >= 0 and a.first_token == b.first_token:
        return math.exp(a.logp_first)
    return math.exp(a.logp_first) + math.exp(b.logp_first)


def option_mass(a: OptionScore, b: OptionScore) -> float:
    """Probability of the two whole continuations, p(" " + a) + p(" " + b) (each the product of its
    tokens' probabilities). Multi-token options get less of it than their first tokens do, so it is
    no threshold's input; it says how much of what the model would write the options spell out."""
    return math.exp(a.logp_sum) + math.exp(b.logp_sum)


def score(
    model, stimuli: Sequence[Stimulus], *, batch_size: int = 8, progress: bool = True
) -> pd.DataFrame:
    """One row per stimulus: both options' log-probs, the two-way normalised probability of each
    option (whole word and first token), whether the model prefers the correct answer, and the
    option mass (`option_mass_first`, `option_mass`: module docstring)."""
    rows = []
    for s, (a, b) in zip(stimuli, score_options(model, stimuli, batch_size=batch_size, progress=progress)):
        p_a = _p_first_of_two(a.logp_sum, b.logp_sum)
        p_a_first = _p_first_of_two(a.logp_first, b.logp_first)
        ans = s.answer_index
        p_answer = p_a if ans == 0 else 1 - p_a
        p_answer_first = p_a_first if ans == 0 else 1 - p_a_first
        row = {
            "id": s.id, "family": s.family, "task_id": s.task_id, "template_id": s.template_id,
            "condition": s.condition, "reversed": s.reversed, "prompt_type": s.prompt_type,
            "option_a": s.options[0], "option_b": s.options[1], "answer": s.answer,
            "world_state": s.world_state, "protagonist_belief": s.protagonist_belief,
            "reference_state": s.reference_state, "belief_differs": s.belief_differs,
            "logp_a": a.logp_sum, "logp_b": b.logp_sum,
            "logp_a_first": a.logp_first, "logp_b_first": b.logp_first,
            "n_tokens_a": a.n_tokens, "n_tokens_b": b.n_tokens,
            "p_a": p_a, "p_a_first": p_a_first,
            "p_answer": p_answer, "p_answer_first": p_answer_first,
            "correct": p_answer > 0.5, "correct_first": p_answer_first > 0.5,
            "option_mass_first": option_mass_first(a, b), "option_mass": option_mass(a, b),
            "story_id": story_id(s),
        }
        for key in META_COLUMNS:
            if key in s.meta:
                row[key] = s.meta[key]
        rows.append(row)
    return _one_type_per_column(pd.DataFrame(rows))


def _one_type_per_column(df: pd.DataFrame) -> pd.DataFrame:
    """A meta label that two families give different types (order-only's event `order` is a list,
    a statement's `order` a number) becomes text in every row, so the table stays one Parquet type
    per column; a column of one type is left as it is."""
    for key in META_COLUMNS:
        if key not in df:
            continue
        present = df[key].dropna()
        kinds = {"list" if isinstance(v, (list, tuple)) else "number" if isinstance(v, (int, float)) and
                 not isinstance(v, bool) else type(v).__name__ for v in present}
        if len(kinds) > 1:
            df[key] = [None if v is None or (isinstance(v, float) and math.isnan(v)) else
                       " ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for v in df[key]]
    return df
