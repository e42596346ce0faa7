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
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.hooks.logits import keeps_last_logits
from tomlens.hooks.patch import PrefixCache
from tomlens.models.plain import PlainForward, forward_logits, forward_logits_and_cache, plain_forward
from tomlens.models.protocol import Model
from tomlens.models.tokens import _accepts_position_ids, _model_device, encode
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


# A batch's shared prefix runs once only where it is at least this long: a shorter one saves less
# than the extra forward (and the cache it builds) costs.
MIN_SHARED_PREFIX = 16
# What one forward's fixed cost (hooks, kernel launches, building a cache) is worth in token
# positions, for the batch planner: without it, it would run rows one by one to save a little padding.
FORWARD_COST_TOKENS = 64


@dataclass(frozen=True)
class _Row:
    """A forward row: its job, its tokens (the model's tokenizer, with its own BOS rule) and `keep`,
    how many trailing positions' logits its targets read."""

    job: _Job
    ids: tuple[int, ...]
    keep: int


@dataclass(frozen=True)
class _Batch:
    """Rows `[start, end)` of the sorted rows, whose first `prefix` tokens (all alike) run once,
    at batch size 1, before the rest of every row runs against their keys and values; 0: one plain
    forward of the whole rows."""

    start: int
    end: int
    prefix: int


def _keep(job: _Job) -> int:
    """Trailing positions whose logits a job's targets read: an option that ends the text is
    predicted from the position before its first token (its length + 1 from the end, the last
    position unread); options after the text, from the last position."""
    return max(len(toks) + 1 if job.joint else 1 for _, _, toks in job.wants)


def _rows(model: Model, jobs: Sequence[_Job]) -> list[_Row]:
    """Every job tokenized once and sorted by its token ids, so that the rows of one story (its
    questions, both options) sit next to each other and share their leading tokens."""
    if not jobs:
        return []
    n_ctx = getattr(getattr(model, "cfg", None), "n_ctx", None)
    rows = [_Row(job, tuple(ids), _keep(job))
            for job, ids in zip(jobs, model.tokenizer([j.text for j in jobs])["input_ids"], strict=True)]
    for row in rows:
        if n_ctx is not None and len(row.ids) > n_ctx:
            raise TomlensError(f"a prompt with its option is {len(row.ids)} tokens long; the model's context is "
                               f"{n_ctx} ({row.job.text[:60]!r}...)",
                               "shorten the prompt or use a model with a longer context")
    return sorted(rows, key=lambda r: r.ids)


def _common_prefixes(rows: Sequence[_Row]) -> list[int]:
    """`out[k]`: how many leading tokens rows `k` and `k + 1` share. Rows are sorted, so the tokens
    all of rows `[i, j)` share are the fewest of `out[i : j - 1]`."""
    out: list[int] = []
    for a, b in pairwise(rows):
        n, k = min(len(a.ids), len(b.ids)), 0
        while k < n and a.ids[k] == b.ids[k]:
            k += 1
        out.append(k)
    return out


def _plan_batches(rows: Sequence[_Row], common: Sequence[int], batch_size: int, share: bool, first: int = 0
                  ) -> list[_Batch]:
    """Cut the sorted rows from `first` on into consecutive batches of at most `batch_size` rows
    that cost the fewest token positions, by dynamic programming over the cut points.

    A batch of `b` rows of at most `L` tokens costs `b * L` run plainly (left padding included);
    sharing `P` leading tokens, `P + b * (L - P)`, each plus `FORWARD_COST_TOKENS` per forward.
    `P` is the batch's common prefix, cut back so that every position whose logits are read runs
    in the second forward, and is used only from `MIN_SHARED_PREFIX` tokens (and with `share`)."""
    n = len(rows)
    best = {first: 0.0}
    choice: dict[int, _Batch] = {}
    for end in range(first + 1, n + 1):
        shared, room, longest, best[end] = 10**9, 10**9, 0, math.inf
        for start in range(end - 1, max(first, end - batch_size) - 1, -1):
            row = rows[start]
            if start < end - 1:
                shared = min(shared, common[start])
            room, longest = min(room, len(row.ids) - row.keep), max(longest, len(row.ids))
            size = end - start
            prefix = min(shared, room) if share and size > 1 else 0
            prefix = prefix if prefix >= MIN_SHARED_PREFIX else 0
            cost = (2 * FORWARD_COST_TOKENS + prefix + size * (longest - prefix) if prefix
                    else FORWARD_COST_TOKENS + size * longest)
            if best[start] + cost < best[end]:
                best[end], choice[end] = best[start] + cost, _Batch(start, end, prefix)
    batches: list[_Batch] = []
    end = n
    while end > first:
        batches.append(choice[end])
        end = choice[end].start
    return batches[::-1]


def _batch_targets(chunk: Sequence[_Row], keep: int) -> tuple[list[list[int]], list[tuple[int, int, int, int]]]:
    """The host table of a batch's scored tokens, `[rows, positions, tokens]`, positions counted in
    the batch's last `keep` columns (the logits a forward keeps) and predicting the token (one
    before it), and per (stimulus, option) its key, how many tokens it spans and its first token's
    id, in order.

    Rows are left-padded, so every row ends at the last column and where an option sits follows
    from the tokens alone: nothing is read from the device to know it."""
    rows: list[int] = []
    positions: list[int] = []
    tokens: list[int] = []
    spans: list[tuple[int, int, int, int]] = []
    for row, r in enumerate(chunk):
        for i, j, toks in r.job.wants:
            start = keep - len(toks) - 1 if r.job.joint else keep - 1
            rows += [row] * len(toks)
            positions += range(start, start + len(toks))
            tokens += toks
            spans.append((i, j, len(toks), toks[0]))
    return [rows, positions, tokens], spans


def _forward_plain(model: Model, plain: PlainForward | None, chunk: Sequence[_Row], keep: int, trim: bool
                   ) -> Float[Tensor, "batch keep vocab"]:
    """The last `keep` positions' logits of one left-padded forward of the whole rows (with `trim`,
    the model unembeds those positions only)."""
    batch = encode(model, [r.job.text for r in chunk])
    kwargs: dict[str, Any] = {**batch.forward_kwargs(), "use_cache": False}
    if trim:
        kwargs["logits_to_keep"] = keep
    return forward_logits(model, plain, batch.input_ids, **kwargs)[:, -keep:]


def _suffix_batch(chunk: Sequence[_Row], prefix: int, pad_id: int
                  ) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch all"], Int[Tensor, "batch pos"]]:
    """The rows' tokens after their shared `prefix`, left-padded; the attention mask over prefix
    and suffix (pads never attended); positions continuing from the prefix's, counted from each
    row's first real token, so a row computes what it would alone."""
    width = max(len(r.ids) for r in chunk) - prefix
    ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(chunk), prefix + width), dtype=torch.long)
    mask[:, :prefix] = 1
    for row, r in enumerate(chunk):
        tail = r.ids[prefix:]
        ids[row, width - len(tail):] = torch.tensor(tail, dtype=torch.long)
        mask[row, prefix + width - len(tail):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, prefix:]
    return ids, mask, positions


def _forward_shared(model: Model, plain: PlainForward | None, chunk: Sequence[_Row], prefix: int, keep: int,
                    trim: bool) -> Float[Tensor, "batch keep vocab"] | None:
    """The last `keep` positions' logits of the rows, their shared first `prefix` tokens run once
    (batch 1) and every row's rest against those keys and values, expanded to the batch (the same
    numbers as one forward of the whole rows, within float rounding). None where the model's cache
    is not a plain one of full-attention layers (`PrefixCache.from_output`): run it plainly."""
    device = _model_device(model)
    head = torch.tensor([chunk[0].ids[:prefix]], dtype=torch.long)
    # An all-ones mask and plain positions, given: a model checking for unmasked padding and the
    # bridge deriving positions from a mask would each read the device once per forward.
    head_kwargs: dict[str, Any] = {"attention_mask": to_device(torch.ones_like(head), device), "use_cache": True,
                                   "position_ids": to_device(torch.arange(prefix)[None], device)}
    head = to_device(head, device)
    if trim:
        head_kwargs["logits_to_keep"] = 1
    _, hf_cache = forward_logits_and_cache(model, plain, head, **head_kwargs)
    cache = PrefixCache.from_output(hf_cache)
    if cache is None:
        return None
    tok = model.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    ids, mask, positions = _suffix_batch(chunk, prefix, int(pad_id))
    kwargs: dict[str, Any] = {"attention_mask": to_device(mask, device), "position_ids": to_device(positions, device),
                              "past_key_values": cache.select(torch.zeros(len(chunk), dtype=torch.long), prefix)}
    if trim:
        kwargs["logits_to_keep"] = keep
    return forward_logits(model, plain, to_device(ids, device), **kwargs)[:, -keep:]


def score_options(
    model: Model, stimuli: Sequence[Stimulus], *, batch_size: int = 8, progress: bool = True
) -> list[tuple[OptionScore, OptionScore]]:
    """Score both options of every stimulus; returns `(score_a, score_b)` per stimulus, in order.

    Less work for the same numbers: rows are sorted by their tokens and cut into batches whose
    rows share as long a prefix as possible (the same story under several questions and both
    options); a batch's shared prefix runs once and only the rest of each row runs against its
    keys and values (`_forward_shared`), and only the positions whose logits are read are
    unembedded (`logits_to_keep`). Models that cannot share (no position ids, a cache that is not
    plain) run every batch whole. Results come back in input order.
    Out of GPU memory, the batch size halves and the remaining rows are batched again (only a
    finished batch's log-probs are kept, so a retried row is never counted twice). Every batch's
    log-probs stay on the device and come to the host in one move at the end: the GPU never waits.
    """
    rows = _rows(model, _plan(model.tokenizer, stimuli))
    common = _common_prefixes(rows)
    trim, share = keeps_last_logits(model), _accepts_position_ids(model)
    plain = plain_forward(model)  # logits only: the model without the bridge's wrappers, where it can stand in
    batch_size = max(1, int(batch_size))
    batches = _plan_batches(rows, common, batch_size, share)
    logps: list[Tensor] = []  # per finished batch, its targets' log-probs, still on the device
    spans: list[tuple[int, int, int, int]] = []  # (stimulus, option, n tokens, first token), in the order of logps
    bar = tqdm(total=len(rows), desc="scoring", unit="seq", disable=not progress)
    k = 0
    with torch.inference_mode():
        while k < len(batches):
            b = batches[k]
            chunk = rows[b.start : b.end]
            keep = max(r.keep for r in chunk)
            table, chunk_spans = _batch_targets(chunk, keep)
            try:
                logits = _forward_shared(model, plain, chunk, b.prefix, keep, trim) if b.prefix else None
                if logits is None and b.prefix:  # the cache cannot be shared: batch the rest plainly
                    share = False
                    batches[k:] = _plan_batches(rows, common, batch_size, share, first=b.start)
                    continue
                logits = logits if logits is not None else _forward_plain(model, plain, chunk, keep, trim)
                lp = _continuation_logprobs(logits, to_device(table, logits.device))
            except OOM_ERRORS:
                if batch_size == 1:
                    raise TomlensError("out of GPU memory scoring a single prompt",
                                       "use a smaller model, a shorter prompt, or a GPU with more memory") from None
                batch_size //= 2
                logits = None  # let the failed batch's memory go before the retry
                release_memory()
                bar.write(f"out of memory: batch size now {batch_size}", file=sys.stderr)
                batches[k:] = _plan_batches(rows, common, batch_size, share, first=b.start)
                continue
            logps.append(lp)  # only a finished batch is kept, so a retried row is never counted twice
            spans += chunk_spans
            k += 1
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
    model: Model, stimuli: Sequence[Stimulus], *, batch_size: int = 8, progress: bool = True
) -> pd.DataFrame:
    """One row per stimulus: both options' log-probs, the two-way normalised probability of each
    option (whole word and first token), whether the model prefers the correct answer, and the
    option mass (`option_mass_first`, `option_mass`: module docstring)."""
    rows = []
    for s, (a, b) in zip(stimuli, score_options(model, stimuli, batch_size=batch_size, progress=progress), strict=True):
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
