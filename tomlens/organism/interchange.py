"""Interchange intervention training: the organism's belief variable, put in one known head.

Why: a positive control for `tomlens validate` must hold belief where the checks look, and we must
know where that is. Answer-only training lets the model solve order-only stories without ever
forming a false-versus-true-belief variable at the question's last token (it can copy the
believed place straight from the story). Interchange intervention training (Geiger et al., 2022)
fixes the place: on a base story, one head's output at the final token is replaced by the same
head's output on a source story, and the answer must then be the base story's place that the
*source* protagonist's belief picks (the start when the source protagonist missed the move, the
current place when they saw it). The head can only help by carrying the source's
belief-is-the-start bit and nothing about its words. (The source run has no gradient: the loss
teaches the later layers to read the head, and the answer loss teaches the head to write it.
Whether it does is measured, not assumed: the held-out swap accuracy in the model card, and
`tomlens validate`'s head ranking and ablation.) A head that carries the bit may only relay it from
an earlier head at the same token; the upstream invariance (every head of the earlier layers at the
final token taken from the story of the other belief, the story's own answer still asked for) keeps
the answer from using what the final token holds before the planted head.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.stimuli.records import Stimulus


def site_check(layer: int, head: int, n_layers: int, n_heads: int, role: str = "interchange") -> None:
    """One clear error for a head that the model does not have (`role`: what the head is for)."""
    if not (0 <= layer < n_layers and 0 <= head < n_heads):
        raise TomlensError(f"{role} head L{layer}H{head} is not in a model of {n_layers} layers x {n_heads} heads",
                           f"choose a layer from 0 to {n_layers - 1} and a head from 0 to {n_heads - 1}")


def usable(s: Stimulus) -> bool:
    """A belief prompt whose belief is either the reference (start, label) or the world, and differs
    between the two (the swapped bit must change the answer)."""
    return (s.prompt_type == "belief" and s.reference_state is not None and s.world_state is not None
            and s.reference_state != s.world_state and s.belief_is_reference is not None)


@contextmanager
def _o_proj_hook(model: Any, layer: int, fn: Any) -> Iterator[None]:
    """`fn(heads_in)` sees (and may replace) the input of layer `layer`'s output projection:
    every head's output, concatenated ([batch, pos, n_heads * d_head])."""
    handle = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(lambda _m, args: fn(args[0]))
    try:
        yield
    finally:
        handle.remove()


def padding_mask(ids: Tensor, lengths: Tensor) -> Tensor:
    """The attention mask of right-padded rows ([n, width])."""
    return (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()


def _final(x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    return torch.arange(x.shape[0]), lengths - 1


def head_outputs(model: Any, ids: Tensor, lengths: Tensor, layer: int, head: int, d_head: int) -> Tensor:
    """Head `head` of layer `layer` at each row's last real token ([n, d_head]); no gradient."""
    return layer_outputs(model, ids, lengths, range(layer, layer + 1))[layer][:, head * d_head:(head + 1) * d_head]


def patched_final_logits(model: Any, ids: Tensor, lengths: Tensor, layer: int, head: int, d_head: int,
                         values: Tensor) -> Tensor:
    """Logits at each row's last real token ([n, vocab]) with the head's output there set to
    `values` ([n, d_head])."""
    return _final_logits_with(model, ids, lengths, {layer: (slice(head * d_head, (head + 1) * d_head), values)})


def layer_outputs(model: Any, ids: Tensor, lengths: Tensor, layers: range) -> dict[int, Tensor]:
    """Every head's output of each layer in `layers` at each row's last real token, concatenated
    ({layer: [n, n_heads * d_head]}); no gradient."""
    got: dict[int, Tensor] = {}

    def grabber(layer: int) -> Any:
        def grab(x: Tensor) -> None:
            rows, cols = _final(x, lengths)
            got[layer] = x[rows, cols].detach().clone()
        return grab

    with torch.no_grad(), ExitStack() as stack:
        for layer in layers:
            stack.enter_context(_o_proj_hook(model, layer, grabber(layer)))
        model(input_ids=ids, attention_mask=padding_mask(ids, lengths))
    return got


def layers_patched_final_logits(model: Any, ids: Tensor, lengths: Tensor, values: Mapping[int, Tensor]) -> Tensor:
    """Logits at each row's last real token ([n, vocab]) with every head of each layer in `values`
    set there to its value ([n, n_heads * d_head])."""
    return _final_logits_with(model, ids, lengths, {layer: (slice(None), v) for layer, v in values.items()})


def _final_logits_with(model: Any, ids: Tensor, lengths: Tensor,
                       patches: Mapping[int, tuple[slice, Tensor]]) -> Tensor:
    """Logits at each row's last real token ([n, vocab]), with the output-projection input of each
    patched layer set to its values in its columns at that token."""

    def putter(cols: slice, values: Tensor) -> Any:
        def put(x: Tensor) -> tuple[Tensor]:
            rows, pos = _final(x, lengths)
            x = x.clone()
            x[rows, pos, cols] = values.to(x.dtype)
            return (x,)
        return put

    with ExitStack() as stack:
        for layer, (cols, values) in patches.items():
            stack.enter_context(_o_proj_hook(model, layer, putter(cols, values)))
        logits = model(input_ids=ids, attention_mask=padding_mask(ids, lengths)).logits
    return logits[torch.arange(len(ids)), lengths - 1]
