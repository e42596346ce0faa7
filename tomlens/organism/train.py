"""Train the model organism: a small Llama that answers belief and reality questions.

The loss is cross-entropy on the answer's first token at the end of each prompt, plus the
next-word loss on the story (`story_loss`), the interchange losses that put the order-only belief
variable in one known head (`tomlens.organism.interchange`), the attention routes and echo that
supervise the factorial's and contents' look-ups (`tomlens.organism.routes`), a training-only
belief readout, and a group lasso on the heads' outputs (each can be switched off).
Everything is seeded (data, split, initialisation, batch order), so the same config, thread count
and machine give the same weights. `train` writes a model
folder that `tomlens.models.load_model` boots like any local model: config.json,
model.safetensors, the tokenizer files, `training.json` (config, split, accuracy per condition,
versions) and `MODEL_CARD.md`.
"""

from __future__ import annotations

import functools
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.errors import TomlensError
from tomlens.organism.data import FAMILIES, Split, make_split
from tomlens.organism.interchange import (
    head_outputs,
    layer_outputs,
    layers_patched_final_logits,
    padding_mask,
    patched_final_logits,
    site_check,
    usable,
)
from tomlens.organism.routes import (
    ROUTE_FAMILIES,
    ROUTES,
    RouteTargets,
    echo_loss,
    keyed_attention,
    mover_loss,
    names_of,
    route_loss,
    route_targets,
)
from tomlens.organism.vocab import build_tokenizer
from tomlens.stimuli.records import Stimulus

ACCURACY_TARGET = 0.97  # held-out accuracy the shipped organism must reach in every condition


@dataclass(frozen=True)
class OrganismConfig:
    """Model shape, data sizes and optimiser settings of one organism."""

    seed: int = 1  # the shipped organism's (seed 0 left contents false belief one prompt under the target)
    n_layers: int = 5
    d_model: int = 64
    n_heads: int = 8  # 40 heads: k = 5% of heads is 2
    d_mlp: int = 256
    train_tasks: dict[str, int] = field(default_factory=lambda: {
        "order-only": 6000, "false-belief-factorial": 800, "unexpected-contents": 1000})
    test_tasks: dict[str, int] = field(default_factory=lambda: {
        "order-only": 2000, "false-belief-factorial": 400, "unexpected-contents": 800})
    held_out_share: float = 0.3
    steps: int = 3500
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.01
    # group lasso on each head's output weights: heads the answers do not need fade, so a ranking of
    # heads has few small ones to reshuffle (at 0, validate's attribution check failed, 0.67)
    head_lasso: float = 5e-4
    story_loss: float = 1.0  # weight of a next-word loss on the story itself (0: the answer only)
    contents_decoys: bool = True  # unexpected-contents stories with their decoy sentences
    # interchange intervention training (tomlens.organism.interchange): weight of the swapped-head
    # loss (0: off), the head (layer, head) that must carry the belief bit at the final token, and
    # the families whose belief prompts are swapped
    interchange: float = 1.0
    interchange_head: tuple[int, int] = (2, 0)
    interchange_families: tuple[str, ...] = ("order-only",)
    # with the head mean-ablated, answer the current place; this loss starts once the swap is
    # learnt (running swap accuracy on the training batches >= `knockout_after`): before that the
    # head carries nothing yet, and answering the current place would only teach a reality bias
    interchange_knockout: bool = True
    knockout_after: float = 0.95
    # weight of a loss that keeps the answer from taking the belief from a head *before* the
    # interchange head at the final token (0: off; it runs with the interchange, on its base stories,
    # and not without): with every head of the layers below it there taken from the same task's story
    # of the other belief, the base story's own answer is still asked for. Without it a retrain (3500
    # steps) formed the belief in L1H6 and had L2H0 relay it: patching either alone restored the gap,
    # so the planted head was no longer where the belief enters the answer (a probe may still read
    # the story's order at the final token before it: the loss constrains use, not presence)
    upstream_invariance: float = 1.0
    # a curriculum: for the first `first_share` of the steps, the answer batches come from these
    # families only (order-only first: its interchange is learnt within a few hundred steps alone,
    # and not within a thousand among the factorial's and contents' stories), then from all
    first_families: tuple[str, ...] = ("order-only",)
    first_share: float = 0.25
    # after the curriculum (from the start without one): the share of each answer batch drawn from
    # each family (None: in proportion to the training prompts), and the interchange's pairs a step
    # (None: batch_size)
    family_mix: dict[str, float] | None = field(default_factory=lambda: {
        "order-only": 0.3, "false-belief-factorial": 0.3, "unexpected-contents": 0.4})
    later_interchange_batch: int | None = 32
    curriculum_until_swap: bool = False  # end the curriculum early, once the swap is learnt (the knockout gate)
    # attention routes (tomlens.organism.routes): weight of the supervised look-ups of the
    # factorial's and contents' questions (0: off), the layer of their heads (cue, told, seen,
    # label, fill: ROUTES order), the mover head (layer, head) that attends to the answer's word,
    # and the weight and layer of the echo readout (each token names its sentence's first person).
    # Without them the factorial's and contents' false beliefs stay near chance (README)
    routes: float = 1.0
    route_layer: int = 2
    route_heads: tuple[int, ...] = (1, 2, 3, 4, 5)
    mover_head: tuple[int, int] = (3, 1)
    mover_families: tuple[str, ...] = ROUTE_FAMILIES
    cue_families: tuple[str, ...] = ("false-belief-factorial",)
    cue_sentence: bool = True  # the cue route attends to its whole sentence after the name, not the first word
    echo: float = 1.0
    echo_layer: int = 2
    # the echo also names a contents story's containers where one comes before any person ("As for
    # the crate, Sam then leaves it shut"): the seen route's two look frames have the same person,
    # so without it the verb does not know which container its frame is about (on the issue-27
    # wording the seen route stayed at 0.58-0.65 attention and contents false belief near chance)
    echo_containers: bool = True
    # a training-only linear readout of the residual stream entering layer `belief_layer`, at each
    # belief question's final token, asked whether the protagonist believes the reference (weight
    # `belief_readout`; 0: off): the belief variable the answer needs, given its own gradient
    belief_readout: float = 1.0
    belief_layer: int = 3
    threads: int | None = 2  # torch threads while training: a fixed count, so the weights do not depend on the core count

    @property
    def keeps_upstream(self) -> bool:
        """Whether the upstream-invariance loss trains (it swaps heads of the interchange's bases, so
        it needs the interchange), and so whether its held-out accuracy is logged and recorded."""
        return bool(self.interchange and self.upstream_invariance)

    def __post_init__(self) -> None:
        """Check every setting (one TomlensError for the first bad one, in a fixed order) and turn
        lists from a TOML file or the command line into the tuples the fields are."""
        self._check_shape()
        self._check_interchange_and_curriculum()
        self._check_batches()
        if self.routes:
            self._check_routes()
        self._check_layers_and_weights()

    def _check_shape(self) -> None:
        if self.d_model % self.n_heads:
            raise TomlensError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}",
                               "choose n_heads dividing d_model")
        for name in ("n_layers", "d_model", "n_heads", "d_mlp", "steps", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise TomlensError(f"{name} = {getattr(self, name)} must be at least 1", f"pass a positive {name}")
        head = self.interchange_head
        if not (isinstance(head, (tuple, list)) and len(head) == 2 and all(isinstance(v, int) for v in head)):
            raise TomlensError(f"interchange_head = {head!r} is not a (layer, head) pair of integers",
                               "give two integers, e.g. interchange_head = [2, 0]")
        object.__setattr__(self, "interchange_head", tuple(head))
        for name in ("interchange_families", "first_families", "mover_families", "cue_families"):
            v = getattr(self, name)
            object.__setattr__(self, name, (v,) if isinstance(v, str) else tuple(v))

    def _check_interchange_and_curriculum(self) -> None:
        for name, value, low, high in (("interchange", self.interchange, 0.0, math.inf),
                                       ("knockout_after", self.knockout_after, 0.0, 1.0),
                                       ("upstream_invariance", self.upstream_invariance, 0.0, math.inf)):
            if not _number_in(value, low, high):
                raise TomlensError(f"{name} = {value!r} is out of range", f"use a finite number from {low} to {high}")
        if set(self.first_families) - set(FAMILIES) or not 0.0 <= self.first_share < 1.0:
            raise TomlensError(f"curriculum first_families {list(self.first_families)}, first_share {self.first_share}",
                               f"choose families from {list(FAMILIES)} and a share in [0, 1)")
        if self.interchange:
            site_check(*self.interchange_head, self.n_layers, self.n_heads)
            if self.upstream_invariance and self.interchange_head[0] < 1:
                raise TomlensError(f"upstream_invariance needs heads before the interchange head "
                                   f"L{self.interchange_head[0]}H{self.interchange_head[1]}, which is in the first layer",
                                   "put the interchange head in layer 1 or later, or set upstream_invariance = 0")
            unknown = set(self.interchange_families) - set(FAMILIES)
            if unknown or not self.interchange_families:
                raise TomlensError(f"interchange families {sorted(unknown) or '(none)'} are not the organism's",
                                   f"choose from {list(FAMILIES)}")

    def _check_batches(self) -> None:
        mix = self.family_mix
        if mix is not None and (set(mix) - set(FAMILIES) or not all(_number_in(v, 0.0, math.inf) for v in mix.values())
                                or not sum(mix.values()) > 0):
            raise TomlensError(f"family_mix {mix} is not a set of shares of {list(FAMILIES)}",
                               "give each family a finite share of 0 or more, summing to more than 0")
        least = 2 if self.interchange_knockout else 1  # the knockout's mean over one source is that source
        if self.later_interchange_batch is not None and self.later_interchange_batch < least:
            raise TomlensError(f"later_interchange_batch = {self.later_interchange_batch} must be at least {least}",
                               f"pass {least} or more, or None for batch_size")
        if self.curriculum_until_swap and not self.interchange:
            raise TomlensError("curriculum_until_swap needs the interchange (the swap it waits for)",
                               "set interchange above 0, or curriculum_until_swap = false")

    def _check_routes(self) -> None:
        heads = self.route_heads
        if isinstance(heads, int) or len(heads) != len(ROUTES) or not all(isinstance(h, int) for h in heads):
            raise TomlensError(f"route_heads {heads!r} needs one integer head per route {list(ROUTES)}",
                               f"give {len(ROUTES)} heads, e.g. route_heads = [1, 2, 3, 4, 5]")
        mover = self.mover_head
        if isinstance(mover, int) or len(mover) != 2 or not all(isinstance(v, int) for v in mover):
            raise TomlensError(f"mover_head = {mover!r} is not a (layer, head) pair of integers",
                               "give two integers, e.g. mover_head = [3, 1]")
        if set(self.cue_families) - {"order-only", "false-belief-factorial"}:
            raise TomlensError(f"cue_families {list(self.cue_families)} are not families with a cue sentence",
                               "choose from ['order-only', 'false-belief-factorial'], or none")
        if not self.mover_families or set(self.mover_families) - set(ROUTE_FAMILIES):
            raise TomlensError(f"mover_families {list(self.mover_families)} are not families with routes",
                               f"choose one or more of {list(ROUTE_FAMILIES)}")
        object.__setattr__(self, "route_heads", tuple(heads))
        object.__setattr__(self, "mover_head", tuple(mover))
        sites = [(self.route_layer, h) for h in self.route_heads] + [self.mover_head]
        for site, role in zip(sites, [*(f"{r} route" for r in ROUTES), "mover"], strict=True):
            site_check(*site, self.n_layers, self.n_heads, role)
        if self.interchange and self.interchange_head != sites[ROUTES.index("cue")]:
            sites.append(self.interchange_head)  # the cue head may be it: it reads the belief cue it must carry
        if len(set(sites)) != len(sites):
            raise TomlensError(f"the route, mover and interchange heads {sites} are not all different",
                               "give each look-up its own (layer, head)")

    def _check_layers_and_weights(self) -> None:
        if self.echo and not 1 <= self.echo_layer < self.n_layers:  # hidden_states[n_layers] is after the final norm
            raise TomlensError(f"echo_layer = {self.echo_layer} is not the input of a layer of a "
                               f"{self.n_layers}-layer model",
                               f"choose a layer from 1 to {self.n_layers - 1}")
        for name in ("cue_sentence", "curriculum_until_swap", "interchange_knockout", "contents_decoys",
                     "echo_containers"):
            if not isinstance(getattr(self, name), bool):  # "False" from the command line would count as on
                raise TomlensError(f"{name} = {getattr(self, name)!r} is not true or false",
                                   f"give {name} = true or {name} = false")
        for name in ("route_layer", "echo_layer", "belief_layer"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise TomlensError(f"{name} = {getattr(self, name)!r} is not a layer number",
                                   f"give {name} as an integer")
        if self.belief_readout and not 1 <= self.belief_layer < self.n_layers:
            raise TomlensError(f"belief_layer = {self.belief_layer} is not the input of a layer of a "
                               f"{self.n_layers}-layer model",
                               f"choose a layer from 1 to {self.n_layers - 1}")
        for name in ("routes", "echo", "belief_readout"):
            if not _number_in(getattr(self, name), 0.0, math.inf):  # "1" from the command line is not a weight
                raise TomlensError(f"{name} = {getattr(self, name)!r} is out of range",
                                   "use a finite weight of 0 or more")
        for sizes in (self.train_tasks, self.test_tasks):
            missing = set(FAMILIES) - set(sizes)
            if missing:
                raise TomlensError(f"task counts lack {sorted(missing)}", f"give a count for each of {list(FAMILIES)}")

def _number_in(value: Any, low: float, high: float) -> bool:
    """A finite number (not a bool) from `low` to `high`; NaN, infinities and text are not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        return False
    return math.isfinite(number) and low <= number <= high


def llama_config(cfg: OrganismConfig, vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_mlp,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=2, eos_token_id=3, pad_token_id=0,
        architectures=["LlamaForCausalLM"],
    )


@dataclass
class Encoded:
    """Prompts as right-padded ids with the answer's token id and the option that is not the answer."""

    ids: Tensor      # [n, width]
    lengths: Tensor  # [n]
    answer: Tensor   # [n]
    other: Tensor    # [n]
    reference: Tensor  # [n] the reference place's (start, label) token, -1 where a prompt has none
    world: Tensor      # [n] the world's (current place, contents) token, -1 where none
    believes_reference: Tensor  # [n] bool: the protagonist believes the reference
    swappable: Tensor  # [n] bool: a belief prompt an interchange can use (interchange.usable)
    partner: Tensor    # [n] the same task's swappable prompt of the other belief, -1 where none


def encode(tokenizer: Any, stimuli: Sequence[Stimulus]) -> Encoded:
    rows = tokenizer([s.text for s in stimuli], add_special_tokens=True)["input_ids"]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)

    def first(word: str) -> int:
        return tokenizer(word, add_special_tokens=False)["input_ids"][0]

    answer = torch.tensor([first(s.answer) for s in stimuli])
    other = torch.tensor([first(next(o for o in s.options if o != s.answer)) for s in stimuli])
    reference = torch.tensor([first(s.reference_state) if s.reference_state else -1 for s in stimuli])
    world = torch.tensor([first(s.world_state) if s.world_state else -1 for s in stimuli])
    return Encoded(ids, torch.tensor([len(r) for r in rows]), answer, other, reference, world,
                   torch.tensor([bool(s.belief_is_reference) for s in stimuli]),
                   torch.tensor([usable(s) for s in stimuli]), partners(stimuli))


def partners(stimuli: Sequence[Stimulus]) -> Tensor:
    """For each swappable prompt, the swappable prompt of its task asked the same way (the same id
    but for its condition code: the factorial's factor levels and question form, the contents'
    version) whose protagonist believes the other thing, the first such where there are several;
    else -1 ([n]). In order-only, the minimal pair patching compares."""
    by_question: dict[tuple[str, str], list[int]] = {}
    for i, s in enumerate(stimuli):
        if usable(s):
            by_question.setdefault((s.task_id, _asked_as(s)), []).append(i)
    out = torch.full((len(stimuli),), -1, dtype=torch.long)
    for rows in by_question.values():
        for i in rows:
            other = [j for j in rows if stimuli[j].belief_is_reference != stimuli[i].belief_is_reference]
            if other:
                out[i] = other[0]
    return out


def _asked_as(s: Stimulus) -> str:
    """The part of a prompt's id after its task id and condition code ("fs-rs-imp-belief",
    "rev-belief", "belief")."""
    if not s.id.startswith(s.task_id + "-"):
        raise TomlensError(f"prompt {s.id!r} does not begin with its task id {s.task_id!r}, so its story of the "
                           "other belief cannot be found", "give the organism's generators' stimuli, whose ids do")
    rest = s.id[len(s.task_id) + 1:]
    return rest.split("-", 1)[1] if "-" in rest else rest


def swap_rows(enc: Encoded, stimuli: Sequence[Stimulus], families: Sequence[str]) -> Tensor:
    """Indices of the prompts an interchange may use as base or source ([m])."""
    keep = [i for i, s in enumerate(stimuli) if s.family in families and bool(enc.swappable[i])]
    return torch.tensor(keep, dtype=torch.long)


def swap_targets(enc: Encoded, base: Tensor, source: Tensor) -> tuple[Tensor, Tensor]:
    """The token each base prompt must answer with the source's belief swapped in (the base's
    reference place if the source protagonist believes the reference, else the base's current
    place), and the base's other option ([len(base)] each)."""
    picks_reference = enc.believes_reference[source]
    return (torch.where(picks_reference, enc.reference[base], enc.world[base]),
            torch.where(picks_reference, enc.world[base], enc.reference[base]))


def swap_loss_and_right(model: Any, enc: Encoded, base: Tensor, source: Tensor, cfg: OrganismConfig,
                        *, knockout: bool = False) -> tuple[Tensor, Tensor]:
    """Cross-entropy of the swapped answer with the interchange head's final-token output taken from
    `source`, and whether that answer outscores the base's other place ([len(base)] bool).
    `knockout`: also the loss of answering the base's current place (a reality bias) when the
    head's output is its mean over the sources, added to the first."""
    layer, head = cfg.interchange_head
    d_head = cfg.d_model // cfg.n_heads
    ws, wb = int(enc.lengths[source].max()), int(enc.lengths[base].max())
    values = head_outputs(model, enc.ids[source, :ws], enc.lengths[source], layer, head, d_head)
    ids, lengths = enc.ids[base, :wb], enc.lengths[base]
    logits = patched_final_logits(model, ids, lengths, layer, head, d_head, values)
    target, wrong = swap_targets(enc, base, source)
    rows = torch.arange(len(base))
    loss = torch.nn.functional.cross_entropy(logits, target)
    if knockout:
        mean = values.mean(dim=0, keepdim=True).expand_as(values)
        ablated = patched_final_logits(model, ids, lengths, layer, head, d_head, mean)
        loss = loss + torch.nn.functional.cross_entropy(ablated, enc.world[base])
    return loss, logits[rows, target] > logits[rows, wrong]


def upstream_loss_and_right(model: Any, enc: Encoded, base: Tensor, cfg: OrganismConfig) -> tuple[Tensor, Tensor]:
    """Cross-entropy of each base prompt's own answer with every head of the layers before the
    interchange head's, at the final token, taken from the base's partner (the same task's story
    of the other belief), and whether that answer outscores the other option ([m] bool, m: the
    bases with a partner). Zero loss and no rows where none has one."""
    base = base[enc.partner[base] >= 0]
    if not len(base):
        return torch.zeros(()), torch.zeros(0, dtype=torch.bool)
    source = enc.partner[base]
    ws, wb = int(enc.lengths[source].max()), int(enc.lengths[base].max())
    values = layer_outputs(model, enc.ids[source, :ws], enc.lengths[source], range(cfg.interchange_head[0]))
    logits = layers_patched_final_logits(model, enc.ids[base, :wb], enc.lengths[base], values)
    rows = torch.arange(len(base))
    loss = torch.nn.functional.cross_entropy(logits, enc.answer[base])
    return loss, logits[rows, enc.answer[base]] > logits[rows, enc.other[base]]


@torch.no_grad()
def upstream_accuracy(model: Any, enc: Encoded, stimuli: Sequence[Stimulus], cfg: OrganismConfig,
                      batch: int = 256) -> dict[str, float]:
    """Per interchange family: the share of held-out belief prompts that keep their own answer when
    every head before the interchange head's layer, at the final token, comes from the same task's
    story of the other belief (1.0: the answer does not use what the final token holds before that
    head)."""
    model.eval()
    out: dict[str, float] = {}
    for family in cfg.interchange_families:
        rows = swap_rows(enc, stimuli, (family,))
        rows = rows[enc.partner[rows] >= 0]
        if len(rows):
            out[family] = _share_right(lambda b: upstream_loss_and_right(model, enc, b, cfg)[1], batch, rows)
    return out


def _share_right(right_of: Callable[..., Tensor], batch: int, *rows: Tensor) -> float:
    """The share of rows that `right_of` calls right ([m] bool), given `batch` of them at a time: the
    same slice of each tensor in `rows` (each [n])."""
    n = len(rows[0])
    return float(torch.cat([right_of(*(r[i:i + batch] for r in rows)) for i in range(0, n, batch)]).float().mean())


@torch.no_grad()
def swap_accuracy(model: Any, enc: Encoded, stimuli: Sequence[Stimulus], cfg: OrganismConfig,
                  batch: int = 256) -> dict[str, float]:
    """Per family: the share of held-out base prompts that answer the source's belief when the
    interchange head's output comes from another held-out prompt whose protagonist believes the
    other thing (a fixed seeded pairing, kept where the beliefs differ: there the swap must change
    the answer)."""
    model.eval()
    out: dict[str, float] = {}
    for family in cfg.interchange_families:
        rows = swap_rows(enc, stimuli, (family,))
        if len(rows) < 2:
            continue
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        source = rows[torch.randperm(len(rows), generator=gen)]
        differ = enc.believes_reference[rows] != enc.believes_reference[source]  # the pairs a swap changes
        rows, source = rows[differ], source[differ]
        if len(rows):
            out[family] = _share_right(lambda b, s: swap_loss_and_right(model, enc, b, s, cfg)[1], batch, rows, source)
    return out


def mixed_batch(by_family: Sequence[Tensor], mix: Tensor, size: int, gen: torch.Generator) -> Tensor:
    """`size` training rows: each slot's family drawn with the shares `mix` ([n_families]), then a
    row of that family ([size])."""
    family = torch.multinomial(mix, size, replacement=True, generator=gen)
    out = torch.empty(size, dtype=torch.long)
    for f, rows in enumerate(by_family):
        slots = family == f
        if slots.any():
            out[slots] = rows[torch.randint(0, len(rows), (int(slots.sum()),), generator=gen)]
    return out


@torch.no_grad()
def route_attention(model: Any, enc: Encoded, targets: RouteTargets, cfg: OrganismConfig,
                    batch: int = 256) -> dict[str, float]:
    """Per route: the mean attention its head puts on the target at the final token, over the
    prompts that have one; "mover": the mover head's attention on its targets (the answer's word). Needs
    eager attention (the probabilities)."""
    model.eval()
    sums = {name: [0.0, 0] for name in (*ROUTES, "mover")}
    for i in range(0, len(enc.ids), batch):
        sl = slice(i, i + batch)
        width = int(enc.lengths[sl].max())
        ids, lengths = enc.ids[sl, :width], enc.lengths[sl]
        mask = padding_mask(ids, lengths)
        att = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        looks = [(name, att[cfg.route_layer], head, targets.keys[sl, r]) for r, (name, head) in
                 enumerate(zip(ROUTES, cfg.route_heads, strict=True))]
        looks.append(("mover", att[cfg.mover_head[0]], cfg.mover_head[1], targets.mover[sl]))
        for name, layer, head, keys in looks:
            got = keyed_attention(layer, head, keys, lengths)
            sums[name][0] += float(got.sum())
            sums[name][1] += len(got)
    return {name: total / n for name, (total, n) in sums.items() if n}


def final_logits(model: Any, ids: Tensor, lengths: Tensor) -> Tensor:
    """Logits at each row's last real token ([n, vocab]); rows right-padded."""
    return model(input_ids=ids, attention_mask=padding_mask(ids, lengths)).logits[torch.arange(len(ids)), lengths - 1]


def story_loss(logits: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
    """Mean next-word cross-entropy inside the prompt (each real token predicting the next one)."""
    pred, target, keep = logits[:, :-1], ids[:, 1:], mask[:, 1:].bool()
    return torch.nn.functional.cross_entropy(pred[keep], target[keep])


def head_group_norms(model: Any, n_heads: int) -> Tensor:
    """Frobenius norm of each head's slice of each layer's output projection ([layer * head])."""
    norms = []
    for layer in model.model.layers:
        w = layer.self_attn.o_proj.weight  # [d_model, n_heads * d_head]
        norms.append(w.view(w.shape[0], n_heads, -1).pow(2).sum(dim=(0, 2)).add(1e-12).sqrt())
    return torch.cat(norms)


@torch.no_grad()
def accuracy_by_condition(model: Any, enc: Encoded, stimuli: Sequence[Stimulus], batch: int = 256) -> dict[str, float]:
    """Share of prompts whose answer outscores the other option, per family/condition/prompt type."""
    model.eval()
    right = []
    for i in range(0, len(stimuli), batch):
        sl = slice(i, i + batch)
        width = int(enc.lengths[sl].max())
        logits = final_logits(model, enc.ids[sl, :width], enc.lengths[sl])
        rows = torch.arange(logits.shape[0])
        right.append(logits[rows, enc.answer[sl]] > logits[rows, enc.other[sl]])
    ok = torch.cat(right)
    groups: dict[str, list[bool]] = {}
    for s, r in zip(stimuli, ok.tolist(), strict=True):
        groups.setdefault(f"{s.family}/{s.condition}/{s.prompt_type}", []).append(r)
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def train(cfg: OrganismConfig, *, progress: bool = True, log_every: int = 250) -> tuple[Any, Any, dict[str, Any]]:
    """Train one organism; returns (hf_model, tokenizer, record). Deterministic given `cfg` (on one
    machine: `cfg.threads` torch threads, restored afterwards)."""
    before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, progress=progress, log_every=log_every)
    finally:
        torch.set_num_threads(before)


def _train(cfg: OrganismConfig, *, progress: bool, log_every: int) -> tuple[Any, Any, dict[str, Any]]:
    """Prepare the data, build the model and its optimiser, take `cfg.steps` steps (logging the
    held-out accuracies every `log_every`), and describe the result. Every random draw happens in
    the same order as always (global seed, then the model's and the readouts' initialisation, then
    the batch generator: answer rows, then interchange pairs, each step), so the weights of a given
    config do not change with how this is split into steps."""
    started = time.time()
    data = _prepare_data(cfg)
    learner = _Learner.build(cfg, len(data.tokenizer), data.split.train)
    batches = _Batches.build(cfg, data)
    watch = _Watch()
    bar = tqdm(range(cfg.steps), desc="training tom-organism", disable=not progress)
    for step in bar:
        loss = _training_step(cfg, data, learner, batches, watch, step)
        watch.running = 0.98 * watch.running + 0.02 * loss if step else loss
        bar.set_postfix(loss=f"{watch.running:.3f}")
        if log_every and ((step + 1) % log_every == 0 or step + 1 == cfg.steps):
            _log_held_out(cfg, data, learner.model, watch, step, progress)
    return learner.model, data.tokenizer, _training_record(cfg, data, learner, watch, started)


@dataclass(frozen=True)
class _Data:
    """The split, its tokenizer, both halves encoded, and the attention routes' targets (None where
    the losses that read them are off)."""

    split: Split
    tokenizer: Any
    train_enc: Encoded
    test_enc: Encoded
    train_routes: RouteTargets | None
    test_routes: RouteTargets | None


def _prepare_data(cfg: OrganismConfig) -> _Data:
    options = {"unexpected-contents": {"decoys": cfg.contents_decoys}}
    split = make_split(cfg.train_tasks, cfg.test_tasks, share=cfg.held_out_share, seed=cfg.seed, options=options)
    if not split.test:
        raise TomlensError("the held-out split has no test tasks", "raise test_tasks or held_out_share")
    tokenizer = build_tokenizer(split.words)
    train_enc, test_enc = encode(tokenizer, split.train), encode(tokenizer, split.test)
    names = names_of(split.train)
    routed = bool(cfg.routes or cfg.echo)
    train_routes = route_targets(tokenizer, split.train, names, cfg.mover_families, cfg.cue_families,
                                 cfg.cue_sentence, cfg.echo_containers) if routed else None
    test_routes = route_targets(tokenizer, split.test, names, cfg.mover_families, cfg.cue_families,
                                cfg.cue_sentence, cfg.echo_containers) if cfg.routes else None
    return _Data(split, tokenizer, train_enc, test_enc, train_routes, test_routes)


@dataclass
class _Learner:
    """The model, the training-only readouts (echo, belief; never saved), the optimiser and its
    warm-up-then-cosine schedule. `attention_before`: the model's attention implementation, put
    back after training (the route loss trains with eager attention, which returns probabilities)."""

    model: Any
    readout: torch.nn.Linear | None
    belief_probe: torch.nn.Linear | None
    is_belief: Tensor  # [n_train] bool: a belief prompt with a belief to read out
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    attention_before: str

    @classmethod
    def build(cls, cfg: OrganismConfig, vocab_size: int, train: Sequence[Stimulus]) -> _Learner:
        from transformers import LlamaForCausalLM

        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(llama_config(cfg, vocab_size))
        attention_before = model.config._attn_implementation
        if cfg.routes:  # the route loss needs the attention probabilities, which only eager attention returns
            model.config._attn_implementation = "eager"
        readout = torch.nn.Linear(cfg.d_model, cfg.d_model) if cfg.echo else None
        belief_probe = torch.nn.Linear(cfg.d_model, 1) if cfg.belief_readout else None
        params = [*model.parameters(), *(readout.parameters() if readout is not None else ()),
                  *(belief_probe.parameters() if belief_probe is not None else ())]
        is_belief = torch.tensor([s.prompt_type == "belief" and s.belief_is_reference is not None for s in train],
                                 dtype=torch.bool)
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(_lr_factor, cfg))
        return cls(model, readout, belief_probe, is_belief, params, opt, sched, attention_before)

    def update(self, total: Tensor) -> None:
        """One optimiser step on `total` (gradients clipped to norm 1)."""
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.sched.step()


def _lr_factor(cfg: OrganismConfig, step: int) -> float:
    """Linear warm-up over `cfg.warmup` steps, then a cosine down to 0 at `cfg.steps`."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    return 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)))


@dataclass(frozen=True)
class _Batches:
    """Where each step's rows come from: the curriculum's first families for `first_steps` steps,
    then all rows (uniformly, or by `mix`'s family shares); `pool`: the prompts the interchange
    pairs up (None: interchange off). One seeded generator draws them all."""

    gen: torch.Generator
    n: int
    first: Tensor
    first_steps: int
    by_family: list[Tensor]
    mix: Tensor | None
    pool: Tensor | None

    @classmethod
    def build(cls, cfg: OrganismConfig, data: _Data) -> _Batches:
        train = data.split.train
        first = torch.tensor([i for i, s in enumerate(train) if s.family in cfg.first_families], dtype=torch.long)
        by_family = [torch.tensor([i for i, s in enumerate(train) if s.family == f], dtype=torch.long)
                     for f in FAMILIES]
        mix = None if cfg.family_mix is None else torch.tensor(
            [float(cfg.family_mix.get(f, 0.0)) if len(rows) else 0.0 for f, rows in zip(FAMILIES, by_family, strict=True)])
        if mix is not None and not mix.sum() > 0:
            raise TomlensError(f"family_mix {cfg.family_mix} gives no share to a family with training stories",
                               "give a share to a family whose train_tasks kept some stories")
        pool = swap_rows(data.train_enc, train, cfg.interchange_families) if cfg.interchange else None
        if pool is not None and len(pool) < 2:
            raise TomlensError(f"no belief prompts to swap in {list(cfg.interchange_families)}",
                               "raise train_tasks for those families, or set interchange = 0")
        first_steps = int(cfg.first_share * cfg.steps) if len(first) else 0
        return cls(torch.Generator().manual_seed(cfg.seed), len(train), first, first_steps, by_family, mix, pool)

    def answer_rows(self, in_first: bool, size: int) -> Tensor:
        if in_first:
            return self.first[torch.randint(0, len(self.first), (size,), generator=self.gen)]
        if self.mix is None:
            return torch.randint(0, self.n, (size,), generator=self.gen)
        return mixed_batch(self.by_family, self.mix, size, self.gen)


@dataclass
class _Watch:
    """What the run has seen so far: the running answer loss, the running swap accuracy and the
    steps (1-based, as in the history) where the swap was learnt, the knockout began and the
    curriculum ended, and the held-out history."""

    running: float = 0.0
    running_swap: float = 0.0
    learnt_step: int | None = None
    knockout_step: int | None = None
    mixed_from: int | None = None
    history: list[dict[str, float]] = field(default_factory=list)


def _training_step(cfg: OrganismConfig, data: _Data, learner: _Learner, batches: _Batches, watch: _Watch,
                   step: int) -> float:
    """One optimiser step on every loss that is switched on; returns the answer loss."""
    learner.model.train()
    in_first = step < batches.first_steps and not (cfg.curriculum_until_swap and watch.learnt_step is not None)
    if not in_first and watch.mixed_from is None:
        watch.mixed_from = step + 1  # 1-based, as in the history
    idx = batches.answer_rows(in_first, cfg.batch_size)
    loss, total = _answer_and_readout_losses(cfg, data, learner, idx)
    if batches.pool is not None:
        total = total + cfg.interchange * _interchange_loss(cfg, data, learner.model, batches, watch, step, in_first)
    if cfg.head_lasso:
        total = total + cfg.head_lasso * head_group_norms(learner.model, cfg.n_heads).sum()
    learner.update(total)
    return loss.item()


def _answer_and_readout_losses(cfg: OrganismConfig, data: _Data, learner: _Learner,
                               idx: Tensor) -> tuple[Tensor, Tensor]:
    """The answer's cross-entropy on rows `idx`, and it plus the story, route, echo and belief
    readout losses of the same forward."""
    enc, routes = data.train_enc, data.train_routes
    width = int(enc.lengths[idx].max())
    ids, lengths = enc.ids[idx, :width], enc.lengths[idx]
    mask = padding_mask(ids, lengths)
    run = learner.model(input_ids=ids, attention_mask=mask, output_attentions=bool(cfg.routes),
                        output_hidden_states=bool(cfg.echo or cfg.belief_readout))
    out = run.logits
    loss = torch.nn.functional.cross_entropy(out[torch.arange(len(idx)), lengths - 1], enc.answer[idx])
    total = loss
    if cfg.story_loss:
        total = total + cfg.story_loss * story_loss(out, ids, mask)
    if routes is not None and cfg.routes:
        mover_layer, mover_head = cfg.mover_head
        total = total + cfg.routes * (
            route_loss(run.attentions[cfg.route_layer], cfg.route_heads, routes.keys[idx, :, :width], lengths)
            + mover_loss(run.attentions[mover_layer], mover_head, routes.mover[idx], lengths))
    if routes is not None and learner.readout is not None:
        total = total + cfg.echo * echo_loss(run.hidden_states[cfg.echo_layer], learner.readout,
                                             learner.model.model.embed_tokens.weight, routes.echo[idx, :width])
    if learner.belief_probe is not None and learner.is_belief[idx].any():
        rows = learner.is_belief[idx]
        final = run.hidden_states[cfg.belief_layer][torch.arange(len(idx))[rows], lengths[rows] - 1]
        total = total + cfg.belief_readout * torch.nn.functional.binary_cross_entropy_with_logits(
            learner.belief_probe(final).squeeze(-1), enc.believes_reference[idx][rows].float())
    return loss, total


def _interchange_loss(cfg: OrganismConfig, data: _Data, model: Any, batches: _Batches, watch: _Watch, step: int,
                      in_first: bool) -> Tensor:
    """The swapped-head loss on pairs drawn from the pool (with the knockout once the swap is
    learnt), updating the running swap accuracy that decides when that is."""
    assert batches.pool is not None
    pool = batches.pool
    pairs = cfg.later_interchange_batch if not in_first and cfg.later_interchange_batch else cfg.batch_size
    pick = torch.randint(0, len(pool), (2, pairs), generator=batches.gen)
    knockout = cfg.interchange_knockout and watch.knockout_step is not None
    swap, right = swap_loss_and_right(model, data.train_enc, pool[pick[0]], pool[pick[1]], cfg, knockout=knockout)
    watch.running_swap = 0.95 * watch.running_swap + 0.05 * float(right.float().mean())
    if watch.learnt_step is None and watch.running_swap >= cfg.knockout_after:
        watch.learnt_step = step + 2  # 1-based, as in the history: the next step is the first after it
        watch.knockout_step = watch.learnt_step if cfg.interchange_knockout else None
    if cfg.upstream_invariance:  # the same bases, so no random draw is added
        swap = swap + cfg.upstream_invariance * upstream_loss_and_right(model, data.train_enc, pool[pick[0]], cfg)[0]
    return swap


def _log_held_out(cfg: OrganismConfig, data: _Data, model: Any, watch: _Watch, step: int, progress: bool) -> None:
    """Add the held-out accuracies (answers, swaps, route attention) at `step` to the history, and
    write the lowest ones under the progress bar."""
    acc = accuracy_by_condition(model, data.test_enc, data.split.test)
    swaps = swap_accuracy(model, data.test_enc, data.split.test, cfg) if cfg.interchange else {}
    upstream = upstream_accuracy(model, data.test_enc, data.split.test, cfg) \
        if cfg.keeps_upstream else {}
    looks = route_attention(model, data.test_enc, data.test_routes, cfg) \
        if data.test_routes is not None and cfg.routes else {}
    watch.history.append({"step": step + 1, "loss": watch.running, "min_test_accuracy": min(acc.values()),
                          **{f"swap_accuracy/{k}": v for k, v in swaps.items()},
                          **{f"upstream_accuracy/{k}": v for k, v in upstream.items()},
                          **{f"route_attention/{k}": v for k, v in looks.items()}})
    if progress:
        worst = sorted(acc.items(), key=lambda kv: kv[1])[:3]
        tqdm.write(f"step {step + 1}: loss {watch.running:.4f}, lowest held-out accuracy "
                   + ", ".join(f"{k} {v:.3f}" for k, v in worst)
                   + "".join(f"; swapped-head accuracy {k} {v:.3f}" for k, v in swaps.items())
                   + "".join(f"; upstream-swapped accuracy {k} {v:.3f}" for k, v in upstream.items())
                   + ("; route attention " + ", ".join(f"{k} {v:.2f}" for k, v in looks.items()) if looks else ""))


def _training_record(cfg: OrganismConfig, data: _Data, learner: _Learner, watch: _Watch,
                     started: float) -> dict[str, Any]:
    """`training.json`'s record: the config, split, final accuracies and the run's history. Puts
    the model's own attention implementation back."""
    model, split = learner.model, data.split
    model.eval()
    looks = route_attention(model, data.test_enc, data.test_routes, cfg) \
        if data.test_routes is not None and cfg.routes else {}
    model.config._attn_implementation = learner.attention_before
    return {
        "config": asdict(cfg),
        "split": split.summary(),
        "vocab_size": len(data.tokenizer),
        "n_parameters": sum(p.numel() for p in model.parameters()),
        "test_accuracy": accuracy_by_condition(model, data.test_enc, split.test),
        "train_accuracy": accuracy_by_condition(model, data.train_enc, split.train),
        "test_swap_accuracy": swap_accuracy(model, data.test_enc, split.test, cfg) if cfg.interchange else {},
        "test_upstream_accuracy": upstream_accuracy(model, data.test_enc, split.test, cfg)
        if cfg.keeps_upstream else {},
        "test_route_attention": looks,
        "knockout_from_step": watch.knockout_step,
        "swap_learnt_step": watch.learnt_step,
        "mixed_from_step": watch.mixed_from,
        "history": watch.history,
        "train_seconds": round(time.time() - started, 1),
        "threads": torch.get_num_threads(),
    }


def quick_config(seed: int = 0) -> OrganismConfig:
    """A reduced run that exercises the whole script in seconds (tests; not the shipped organism)."""
    return OrganismConfig(seed=seed, n_layers=2, d_model=32, n_heads=8, d_mlp=64, steps=20, batch_size=16, warmup=5,
                          interchange=1.0, interchange_head=(1, 0),
                          routes=1.0, route_layer=0, mover_head=(1, 1), echo=1.0, echo_layer=1, cue_sentence=True,
                          belief_readout=1.0, belief_layer=1,
                          train_tasks={"order-only": 60, "false-belief-factorial": 20, "unexpected-contents": 40},
                          test_tasks={"order-only": 300, "false-belief-factorial": 150, "unexpected-contents": 100})
