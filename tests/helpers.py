"""Test data and reference computations shared by several test modules (test modules never import
each other: a shared helper lives here, imported as `from helpers import ...`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:  # imported where used, so a module needing only the data imports no tomlens package
    import torch

    from tomlens.stimuli.pairs import MinimalPair
    from tomlens.stimuli.records import Stimulus

# Names of different token lengths, so a batch of pairs is left-padded.
NAMES = ("Ann", "Maximilian", "Bo", "Kate")


def short_pairs(tokenizer: Any, n: int = 3, objects: tuple[str, ...] = ("ball", "coin", "key", "cup"),
                ) -> list[MinimalPair]:
    """Short false-belief / present pairs (about 25 tokens) differing in one word of the contrast."""
    from tomlens.stimuli.pairs import MinimalPair, align_pairs
    from tomlens.stimuli.records import Span, Stimulus

    pairs = []
    for i in range(n):
        name, obj = NAMES[i % len(NAMES)], objects[i % len(objects)]
        stories = []
        for cond, word, answer in (("false_belief", "away", "box"), ("present", "there", "bag")):
            head = f"{name} put the {obj} in the box. "
            contrast = f"While {name} was {word}, Tom moved the {obj} to the bag."
            query = f" {name} will look for the {obj} in the"
            text = head + contrast + query
            spans = {
                "protagonist": Span(0, len(name)),
                "contrast": Span(len(head), len(head) + len(contrast)),
                "query": Span(len(head) + len(contrast) + 1, len(text)),
            }
            stories.append(Stimulus(id=f"p{i}-{cond}", text=text, options=("box", "bag"), answer=answer,
                                    condition=cond, spans=spans))
        pairs.append(MinimalPair(f"p{i}", stories[0], stories[1], "unexpected-transfer", "present"))
    aligned, report = align_pairs(pairs, tokenizer)
    assert len(aligned) == n, report.summary()
    return aligned


def tl_metric(model: Any, pair: MinimalPair) -> Callable[[torch.Tensor], torch.Tensor]:
    """The clean-answer-minus-other logit difference at the last position, as TransformerLens's
    patching functions take a metric (logits -> scalar)."""
    from tomlens.models.tokens import option_first_tokens
    from tomlens.patching.metric import logit_diff

    tok = option_first_tokens(model, [pair.clean], [(pair.clean.answer, pair.other_answer)])
    return lambda logits: logit_diff(logits[:, -1], tok.expand(logits.shape[0], 2)).mean()


def probe_table() -> pd.DataFrame:
    """Rows in the schema `tomlens probe` writes, with decoys the per-head table must skip."""
    rows = []
    base = dict(kind="head_out", position="final", target="protagonist_belief", probe="logistic", train_on="all",
                eval_set="all", metric="accuracy", ci_low=0.0, ci_high=1.0, selectivity=0.2)
    for layer in range(2):
        for head in range(4):
            acc = 0.5 + 0.05 * (4 * layer + head)
            at = dict(base, layer=layer, head=head)
            rows += [dict(at, score=acc), dict(at, eval_set="false_belief", score=acc / 2),
                     dict(at, position="protagonist", score=0.1), dict(at, metric="auc", score=0.0),
                     dict(at, train_on="true_belief", eval_set="false_belief", score=0.0),
                     dict(at, target="world_state", score=0.0), dict(at, probe="mass_mean", score=0.0)]
    rows.append(dict(base, kind="resid_post", layer=0, head=-1, score=0.0))
    return pd.DataFrame(rows)


# One row of our own in BigToM's format (19 ';'-separated fields).
BIGTOM_ROW = ";".join([
    "Mina is a gardener in a walled garden. Mina wants to water the roses with rainwater. "
    "Mina fills the green can with rainwater. Mina believes the green can holds rainwater. "
    "A neighbour empties the can and refills it with tap water.",
    "Mina sees the neighbour refilling the can.",
    "Mina does not see the neighbour refilling the can.",
    "Mina fetches rainwater from the barrel.",
    "Mina waters the roses with the can.",
    "Does Mina believe the green can holds rainwater or tap water?",
    "Does Mina want to water the roses with rainwater?",
    "What will Mina do?",
    "Mina believes the green can holds tap water.",
    "Mina wants to water the roses with rainwater.",
    "Mina will fetch rainwater from the barrel.",
    "Mina believes the green can holds rainwater.",
    "Mina wants to water the roses with rainwater.",
    "Mina will water the roses with the can.",
    "A bird lands on the garden wall.",
    "Mina sees the bird landing.",
    "Mina does not see the bird landing.",
    "auto",
    "0",
])


@dataclass
class TensorActivations:
    """In-memory activations with what the sweep needs of an ActivationSet: `get(kind, position)`
    ([n, layer, d] or [n, layer, head, d]) and `layers(kind)`."""

    stimuli: list[Stimulus]
    tensors: dict[tuple[str, str], torch.Tensor]
    manifest: dict[str, Any]

    def get(self, kind: str, position: str) -> torch.Tensor:
        return self.tensors[(kind, position)]

    def layers(self, kind: str) -> list[int]:
        return next(list(range(t.shape[1])) for (k, _), t in self.tensors.items() if k == kind)


def clean_model(model: Any) -> Any:
    """A shared model handed to a test: no hooks left by an earlier test, eval mode, left padding."""
    model.reset_hooks(including_permanent=True)
    model.eval()
    model.tokenizer.padding_side = "left"
    return model
