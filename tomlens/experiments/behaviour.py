"""Behavioural scoring: log-probability of each answer option as a continuation of the prompt.

Both options are scored as `text + " " + option`; the continuation tokens are found through the
tokenizer's character offsets (every token starting at or after the end of the prompt), so the
leading space and multi-token words are handled the same way for every tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.models.tokens import encode
from tomlens.stimuli.records import Stimulus

# Family-specific labels copied from `meta` into the table when present.
META_COLUMNS: tuple[str, ...] = (
    "k", "test_case", "target_type", "anim_denotation", "object_target", "location_target",
    "prefix_index", "n_prefix_sentences", "world_state_t", "belief_t", "order",
)


@dataclass(frozen=True)
class OptionScore:
    """Log-probabilities of one continuation: summed over its tokens and of its first token."""

    logp_sum: float
    logp_first: float
    n_tokens: int


def _continuation_logprobs(
    logits: Float[Tensor, "batch pos vocab"],
    input_ids: Tensor,
    starts: Sequence[int],
    ends: Sequence[int],
) -> list[list[float]]:
    """Log-probs of tokens `[start, end)` (padded indices) of each row, from the previous position."""
    out: list[list[float]] = []
    for row, (s, e) in enumerate(zip(starts, ends)):
        lp = torch.log_softmax(logits[row, s - 1 : e - 1].float(), dim=-1)
        tok = input_ids[row, s:e].to(lp.device)
        out.append(lp.gather(-1, tok[:, None])[:, 0].tolist())
    return out


def score_options(
    model, stimuli: Sequence[Stimulus], *, batch_size: int = 8, progress: bool = True
) -> list[tuple[OptionScore, OptionScore]]:
    """Score both options of every stimulus; returns `(score_a, score_b)` per stimulus, in order.

    Sequences are sorted by length so batches carry little padding; results come back in input order.
    """
    texts: list[str] = []
    prompt_ends: list[int] = []
    for s in stimuli:
        for opt in s.options:
            texts.append(f"{s.text} {opt}")
            prompt_ends.append(len(s.text))
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    scores: list[OptionScore | None] = [None] * len(texts)
    bar = tqdm(total=len(stimuli), desc="scoring", unit="prompt", disable=not progress)
    with torch.inference_mode():
        for b0 in range(0, len(order), batch_size):
            idx = order[b0 : b0 + batch_size]
            batch = encode(model, [texts[i] for i in idx])
            starts, ends = [], []
            for row, i in enumerate(idx):
                offs = batch.offsets[row]
                first = next(t for t, (cs, ce) in enumerate(offs) if cs >= prompt_ends[i] or ce > prompt_ends[i])
                if first == 0:
                    raise ValueError(f"prompt of {texts[i][:40]!r} tokenised to nothing")
                starts.append(batch.pad[row] + first)
                ends.append(batch.pad[row] + len(offs))
            logits = model(batch.input_ids, **batch.forward_kwargs())
            for row, lps in enumerate(_continuation_logprobs(logits, batch.input_ids, starts, ends)):
                scores[idx[row]] = OptionScore(sum(lps), lps[0], len(lps))
            bar.update(len(idx) / 2)
    bar.close()
    return [(scores[2 * j], scores[2 * j + 1]) for j in range(len(stimuli))]  # type: ignore[misc]


def _p_first_of_two(la: float, lb: float) -> float:
    """p(a) / (p(a) + p(b)) computed stably from log-probabilities."""
    return 1.0 / (1.0 + math.exp(lb - la))


def score(
    model, stimuli: Sequence[Stimulus], *, batch_size: int = 8, progress: bool = True
) -> pd.DataFrame:
    """One row per stimulus: both options' log-probs, the two-way normalised probability of each
    option (whole word and first token) and whether the model prefers the correct answer."""
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
        }
        for key in META_COLUMNS:
            if key in s.meta:
                row[key] = s.meta[key]
        rows.append(row)
    return pd.DataFrame(rows)
