"""Attention routes: where the organism's question token must look, supervised while it trains.

Why: trained on answers alone, the organism stays on a plateau for the factorial's and the
contents' cue-driven beliefs (false-belief answers near 0.2 after thousands of steps, in every
earlier run): each needs a name bound to a cue sentence 30 to 60 tokens back and read at the
question, several look-ups composed, and none of them gets a gradient until all of them work.
Supervising the look-ups gives each its own gradient, so the answer loss only has to learn to use
them. The targets come from each stimulus's role spans, so they exist for every generated story:

- routes, at the belief question's final token, one head each at layer `route_layer`: `cue`, the
  word after the protagonist's name in their cue sentence (the factorial: "X closes ..." for
  absence, "X watches ..." for presence); `told`, the verb that says whether the contents story's
  protagonist is told: in the frame that names them ("As for Sam, Jane then <verb> ..."), the word
  after the adverb, a telling ("writes", "phones", ...) or "tells (him) nothing"; `seen`, the verb
  that says whether they looked into the labelled container: in the frame that names it ("As for
  the crate, Sam then <verb> ..."), the word after the adverb, a looking ("peeks", "glances", ...)
  or a leaving shut ("leaves", "keeps"). Both frames hold the same words whichever way the story
  goes (the generator swaps names and containers between them, issue #27), so only this word, read
  in the right frame, decides. Without decoys: the hearer ("Sam" or "nobody") after the telling
  verb, and the verb after the protagonist's name in the look sentence. `label` and `fill`, at
  every contents question, the two
  candidate answers: the label's word in the label sentence, and the contents where the container
  is filled (the same word when the label is right). With `cue_sentence`, the cue route keys its
  whole sentence after the name. With `cue_families` naming order-only, the cue route also reads
  the sentence where the protagonist leaves, which the layers below can mark as coming after the
  move or not (make the cue head the interchange head, and the head that must carry order-only's
  belief is told where to read it);
- the mover, at the final token of every prompt of those families, one head at a later layer: every
  mention of the answer's word (the head that copies the answer);
- echo, at every token of those families' prompts: a training-only linear readout of the
  residual stream entering layer `echo_layer` names the first person of the token's sentence
  (each token knows whose sentence it is in, which the cue route's key and the question's query
  both need). Not on
  order-only stories, which need no binding and where interchange training puts the belief
  variable: their training stays as it was in the runs that learnt the swap.

The route loss is minus the log of the attention on the target (the mover's: on all its
target tokens), averaged over the prompts that have one. What is learnt is measured, not assumed:
held-out accuracy per condition in the model card, and `tomlens validate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from tomlens.stimuli.false_belief import NOBODY
from tomlens.stimuli.records import Stimulus

ROUTES: tuple[str, ...] = ("cue", "told", "seen", "label", "fill")
ROUTE_FAMILIES: tuple[str, ...] = ("false-belief-factorial", "unexpected-contents")
_NAME_FIELDS = ("protagonist", "other_agent", "bystander")
NO_TARGET = -100  # cross-entropy's ignore index


@dataclass
class RouteTargets:
    """Per prompt: each route's key tokens (none: the route does not apply), the mover's key tokens
    (likewise), and per token the echo target (NO_TARGET: none)."""

    keys: Tensor   # [n, len(ROUTES), width] bool
    mover: Tensor  # [n, width] bool
    echo: Tensor   # [n, width] long


def names_of(stimuli: Sequence[Stimulus]) -> set[str]:
    """Every person's name in the stimuli's labels (lower-cased, as the tokenizer writes them)."""
    return {str(s.meta[k]).lower() for s in stimuli for k in _NAME_FIELDS if s.meta.get(k)}


def route_targets(tokenizer: Any, stimuli: Sequence[Stimulus], names: set[str],
                  mover_families: Sequence[str] = ROUTE_FAMILIES,
                  cue_families: Sequence[str] = ("false-belief-factorial",), cue_sentence: bool = False,
                  echo_containers: bool = False) -> RouteTargets:
    """The targets of `stimuli` under the organism's word-level `tokenizer`; `names`: the words that
    are people (the echo's answers); `mover_families`: the families whose prompts the mover serves;
    `cue_families`: those whose belief questions the cue route serves (order-only's cue sentence is
    the protagonist's leaving: the word after their name is read where the move came before or not);
    `cue_sentence`: the cue route's keys are every token after the name in the cue sentence, not the
    first (in 2 of the factorial's 10 phrasing pairs the first word is the same for both);
    `echo_containers`: a contents story's containers count as its sentences' subjects too, so the
    verb of a look frame ("As for the crate, Sam then leaves it shut") names the crate, which the
    seen route must tell from the other frame's container (both frames name the same person)."""
    enc = tokenizer([s.text for s in stimuli], add_special_tokens=True, return_offsets_mapping=True)
    width = max(len(ids) for ids in enc["input_ids"])
    keys = torch.zeros(len(stimuli), len(ROUTES), width, dtype=torch.bool)
    cue_at = ROUTES.index("cue")
    mover = torch.zeros(len(stimuli), width, dtype=torch.bool)
    echo = torch.full((len(stimuli), width), NO_TARGET, dtype=torch.long)
    name_ids = {tokenizer.convert_tokens_to_ids(n) for n in names}
    stop = tokenizer.convert_tokens_to_ids(".")
    for i, (s, ids, offsets) in enumerate(zip(stimuli, enc["input_ids"], enc["offset_mapping"], strict=True)):
        if s.family in cue_families and s.prompt_type == "belief":
            keys[i, cue_at, _after_name(s, ids, offsets, tokenizer, cue_sentence)] = True
        if s.family not in ROUTE_FAMILIES:
            continue
        subjects = name_ids | _container_ids(s, tokenizer) if echo_containers else name_ids
        echo[i, : len(ids)] = torch.tensor(_sentence_subjects(ids, subjects, stop))
        if s.family in mover_families:
            mover[i, : len(ids)] = torch.tensor(ids) == tokenizer.convert_tokens_to_ids(s.answer.lower())
        if s.family != "unexpected-contents":
            continue
        # both candidates, at every question: what the label says, what is inside
        keys[i, ROUTES.index("label"), _first_word_in(s, "contrast_label", "label", ids, offsets, tokenizer)] = True
        keys[i, ROUTES.index("fill"), _first_word_in(s, "object", "contents", ids, offsets, tokenizer)] = True
        if s.prompt_type == "belief":
            keys[i, ROUTES.index("told"), _told_key(s, ids, offsets, tokenizer)] = True
            keys[i, ROUTES.index("seen"), _seen_key(s, ids, offsets, tokenizer)] = True
    return RouteTargets(keys, mover, echo)


# A decoy frame's words from its subject (the person or container it is about) to its verb:
# subject, comma, the actor's name, the adverb, the verb ("Sam , Jane then writes", "crate , Sam
# then leaves"), in every contents template (`false_belief.CONTENTS_TEMPLATES` and `UNTOLD`).
_FRAME_TO_VERB = 4


def _first_word_in(s: Stimulus, role: str, field: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]],
                   tokenizer: Any) -> list[int]:
    """The first token in `role`'s span that is the word `s.meta[field]` (none: an empty list)."""
    word = tokenizer.convert_tokens_to_ids(str(s.meta.get(field, "")).lower())
    return [j for j in _tokens_in(s, role, offsets) if ids[j] == word][:1]


def _id(tokenizer: Any, word: object) -> int:
    return tokenizer.convert_tokens_to_ids(str(word).lower())


def _frame_verb(s: Stimulus, role: str, subject: int, ids: Sequence[int], offsets: Sequence[tuple[int, int]],
                comma: int) -> list[int]:
    """In the `role` span's decoy frames, the verb of the frame about `subject` (the word after the
    adverb); none when no frame there is about it."""
    span = _tokens_in(s, role, offsets)
    inside = set(span)
    for j in span:
        if ids[j] == subject and j + 1 in inside and ids[j + 1] == comma and j + _FRAME_TO_VERB in inside:
            return [j + _FRAME_TO_VERB]
    return []


def _told_key(s: Stimulus, ids: Sequence[int], offsets: Sequence[tuple[int, int]], tokenizer: Any) -> list[int]:
    """The token that says whether the protagonist is told: with decoys, the verb of the frame that
    names them (a telling, or "tells ... nothing"); without, the hearer (their name or "nobody")."""
    protagonist = _id(tokenizer, s.meta.get("protagonist", ""))
    if s.meta.get("decoy"):
        return _frame_verb(s, "contrast_told", protagonist, ids, offsets, _id(tokenizer, ","))
    hearers = {protagonist, _id(tokenizer, NOBODY)}
    return [j for j in _tokens_in(s, "contrast_told", offsets) if ids[j] in hearers][:1]


def _seen_key(s: Stimulus, ids: Sequence[int], offsets: Sequence[tuple[int, int]], tokenizer: Any) -> list[int]:
    """The token that says whether the protagonist looked into the labelled container: with decoys,
    the verb of the frame that names it (a looking, or leaving it shut); without, the verb after the
    protagonist's name in the look sentence."""
    if s.meta.get("decoy"):
        return _frame_verb(s, "contrast_seen", _id(tokenizer, s.meta.get("container", "")), ids, offsets,
                           _id(tokenizer, ","))
    span = _tokens_in(s, "contrast_seen", offsets)
    protagonist = _id(tokenizer, s.meta.get("protagonist", ""))
    return [span[1]] if len(span) > 1 and ids[span[0]] == protagonist else []


def _after_name(s: Stimulus, ids: Sequence[int], offsets: Sequence[tuple[int, int]], tokenizer: Any,
                sentence: bool) -> list[int]:
    """Where the protagonist's cue sentence opens with their name: the token after it, or (`sentence`)
    every token after it in the sentence; else none."""
    cue = _tokens_in(s, "cue", offsets)
    name = tokenizer.convert_tokens_to_ids(str(s.meta.get("protagonist", "")).lower())
    if len(cue) < 2 or ids[cue[0]] != name:
        return []
    return cue[1:] if sentence else cue[1:2]


def _container_ids(s: Stimulus, tokenizer: Any) -> set[int]:
    """A contents story's two containers' token ids (none for other stories)."""
    if s.family != "unexpected-contents":
        return set()
    return {_id(tokenizer, s.meta[k]) for k in ("container", "second_container") if s.meta.get(k)}


def _tokens_in(s: Stimulus, role: str, offsets: Sequence[tuple[int, int]]) -> list[int]:
    """The tokens (by their character offsets) that lie inside the stimulus's `role` span; none
    when it has no such span."""
    span = s.spans.get(role)
    return [] if span is None else [j for j, (a, b) in enumerate(offsets) if b > a and a >= span.start and b <= span.end]


def _sentence_subjects(ids: Sequence[int], name_ids: set[int], stop: int) -> list[int]:
    """Per token: the first name of its sentence if the sentence has named one by then."""
    out, current = [], NO_TARGET
    for j, t in enumerate(ids):
        if j and ids[j - 1] == stop:
            current = NO_TARGET
        if current == NO_TARGET and t in name_ids:
            current = t
        out.append(current)
    return out


def keyed_attention(attention: Tensor, head: int, keys: Tensor, lengths: Tensor) -> Tensor:
    """The attention that `head` puts, at each prompt's final token, on that prompt's keys, for the
    prompts that have keys ([m]). `attention`: one layer's probabilities [n, n_heads, query, key];
    `keys`: [n, width >= key] bool; `lengths`: [n]."""
    keys = keys[:, : attention.shape[-1]]
    keep = keys.any(dim=-1)
    probs = attention[torch.arange(attention.shape[0])[keep], head, lengths[keep] - 1]  # [m, key]
    return (probs * keys[keep]).sum(dim=-1)


def _minus_log(got: Tensor, like: Tensor) -> Tensor:
    return -torch.log(got + 1e-6).mean() if len(got) else like.new_zeros(())


def route_loss(attention: Tensor, heads: Sequence[int], keys: Tensor, lengths: Tensor) -> Tensor:
    """Minus the log of the attention that each route's head puts, at each prompt's final token, on
    its keys (summed over routes, each averaged over the prompts that have keys). `attention`: one
    layer's probabilities [n, n_heads, query, key]; `keys`: [n, len(heads), width >= key] bool;
    `lengths`: [n]."""
    return sum((_minus_log(keyed_attention(attention, head, keys[:, r], lengths), attention)
                for r, head in enumerate(heads)), attention.new_zeros(()))


def mover_loss(attention: Tensor, head: int, targets: Tensor, lengths: Tensor) -> Tensor:
    """Minus the log of the attention that the mover head puts, at each prompt's final token, on
    its target tokens, averaged over the prompts that have some. `attention` [n, n_heads, query,
    key], `targets` [n, width >= key] bool, `lengths` [n]."""
    return _minus_log(keyed_attention(attention, head, targets, lengths), attention)


def echo_loss(hidden: Tensor, readout: torch.nn.Module, embedding: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of naming each token's sentence subject from `hidden` [n, width, d_model]
    through the training-only `readout` and the (tied) embedding [vocab, d_model]; `targets`
    [n, width] with NO_TARGET where there is none."""
    logits = readout(hidden) @ embedding.T
    if not (targets != NO_TARGET).any():
        return logits.new_zeros(())
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=NO_TARGET)
