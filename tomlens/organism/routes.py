"""Attention routes: where the organism's question token must look, supervised while it trains.

Why: trained on answers alone, the organism stays on a plateau for the factorial's and the
contents' cue-driven beliefs (false-belief answers near 0.2 after thousands of steps, in every
earlier run): each needs a name bound to a cue sentence 30 to 60 tokens back and read at the
question, several look-ups composed, and none of them gets a gradient until all of them work.
Supervising the look-ups gives each its own gradient, so the answer loss only has to learn to use
them. The targets come from each stimulus's role spans, so they exist for every generated story:

- routes, at the belief question's final token, one head each at layer `route_layer`: `cue`, the
  word after the protagonist's name in their cue sentence (the factorial: "X closes ..." for
  absence, "X watches ..." for presence); `told`, the protagonist's name in the contents story's
  "tells X, but not Y" sentence (told or not); `seen`, the container's word in the look sentence
  (looked in or at the glass one);
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

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from tomlens.stimuli.records import Stimulus

ROUTES: tuple[str, ...] = ("cue", "told", "seen")
ROUTE_FAMILIES: tuple[str, ...] = ("false-belief-factorial", "unexpected-contents")
_NAME_FIELDS = ("protagonist", "other_agent", "bystander")
NO_TARGET = -100  # cross-entropy's ignore index


@dataclass
class RouteTargets:
    """Per prompt: each route's key position (-1: none), the mover's key positions (none: the mover
    does not apply), and per token the echo target (NO_TARGET: none)."""

    positions: Tensor  # [n, len(ROUTES)] long
    mover: Tensor      # [n, width] bool
    echo: Tensor       # [n, width] long


def names_of(stimuli: Sequence[Stimulus]) -> set[str]:
    """Every person's name in the stimuli's labels (lower-cased, as the tokenizer writes them)."""
    return {str(s.meta[k]).lower() for s in stimuli for k in _NAME_FIELDS if s.meta.get(k)}


def route_targets(tokenizer: Any, stimuli: Sequence[Stimulus], names: set[str]) -> RouteTargets:
    """The targets of `stimuli` under the organism's word-level `tokenizer`; `names`: the words that
    are people (the echo's answers)."""
    enc = tokenizer([s.text for s in stimuli], add_special_tokens=True, return_offsets_mapping=True)
    width = max(len(ids) for ids in enc["input_ids"])
    positions = torch.full((len(stimuli), len(ROUTES)), -1, dtype=torch.long)
    mover = torch.zeros(len(stimuli), width, dtype=torch.bool)
    echo = torch.full((len(stimuli), width), NO_TARGET, dtype=torch.long)
    name_ids = {tokenizer.convert_tokens_to_ids(n) for n in names}
    stop = tokenizer.convert_tokens_to_ids(".")
    for i, (s, ids, offsets) in enumerate(zip(stimuli, enc["input_ids"], enc["offset_mapping"])):
        if s.family not in ROUTE_FAMILIES:
            continue
        echo[i, : len(ids)] = torch.tensor(_sentence_subjects(ids, name_ids, stop))
        answer = tokenizer.convert_tokens_to_ids(s.answer.lower())
        mover[i, : len(ids)] = torch.tensor(ids) == answer
        if s.prompt_type != "belief":
            continue
        word = {k: tokenizer.convert_tokens_to_ids(str(s.meta.get(k, "")).lower()) for k in ("protagonist", "container")}

        def tokens_in(role: str) -> list[int]:
            span = s.spans.get(role)
            return [] if span is None else [j for j, (a, b) in enumerate(offsets)
                                            if b > a and a >= span.start and b <= span.end]

        if s.family == "false-belief-factorial":
            cue = tokens_in("cue")
            if len(cue) > 1 and ids[cue[0]] == word["protagonist"]:
                positions[i, ROUTES.index("cue")] = cue[1]
        else:
            told = [j for j in tokens_in("contrast_told") if ids[j] == word["protagonist"]]
            seen = [j for j in tokens_in("contrast_seen") if ids[j] == word["container"]]
            if told:
                positions[i, ROUTES.index("told")] = told[0]
            if seen:
                positions[i, ROUTES.index("seen")] = seen[0]
    return RouteTargets(positions, mover, echo)


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


def route_loss(attention: Tensor, heads: Sequence[int], positions: Tensor, lengths: Tensor) -> Tensor:
    """Minus the log attention of each route's head, at each prompt's final token, on its target
    (summed over routes, each averaged over the prompts that have one). `attention`: one layer's
    probabilities [n, n_heads, query, key]; `positions`: [n, len(heads)]; `lengths`: [n]."""
    rows = torch.arange(attention.shape[0])
    total = attention.new_zeros(())
    for r, head in enumerate(heads):
        keep = positions[:, r] >= 0
        if keep.any():
            got = attention[rows[keep], head, lengths[keep] - 1, positions[keep, r]]
            total = total - torch.log(got + 1e-6).mean()
    return total


def mover_loss(attention: Tensor, head: int, targets: Tensor, lengths: Tensor) -> Tensor:
    """Minus the log of the attention that the mover head puts, at each prompt's final token, on
    its target tokens, averaged over the prompts that have some. `attention` [n, n_heads, query,
    key], `targets` [n, width >= key] bool, `lengths` [n]."""
    targets = targets[:, : attention.shape[-1]]
    keep = targets.any(dim=-1)
    if not keep.any():
        return attention.new_zeros(())
    rows = torch.arange(attention.shape[0])[keep]
    probs = attention[rows, head, lengths[keep] - 1]  # [m, key]
    return -torch.log((probs * targets[keep]).sum(dim=-1) + 1e-6).mean()


def echo_loss(hidden: Tensor, readout: torch.nn.Module, embedding: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of naming each token's sentence subject from `hidden` [n, width, d_model]
    through the training-only `readout` and the (tied) embedding [vocab, d_model]; `targets`
    [n, width] with NO_TARGET where there is none."""
    logits = readout(hidden) @ embedding.T
    if not (targets != NO_TARGET).any():
        return logits.new_zeros(())
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=NO_TARGET)
