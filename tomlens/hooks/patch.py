"""Batched patch hooks: many patched runs in one forward, each batch row carrying its own patch.

A patched run overwrites chosen (position, head) cells of chosen activations with values taken from
another run (clean, corrupted or a mean). Here a whole chunk of such runs shares one forward: the
hook for an activation receives `[rows, pos, ...]` and writes each row's own cells in one
`index_put`. The values are gathered before the forward, so the hook does no lookups.

Three savings keep the forward small, all exact:
- *Shared prefix.* A patch can change nothing at positions before its first patched position, so a
  chunk whose rows all start at or after column `P` reuses the base run's keys and values for
  columns `< P` (the Hugging Face KV cache the bridge accepts) and recomputes only columns `>= P`.
- *Skipped blocks.* Nothing a patch at block `L` changes reaches blocks below it, so those blocks
  return at once and the base run's residual stream enters block `L` (`skip_blocks`).
- *Last-token logits.* The metric needs the last position only: `logits_to_keep=1` skips the
  unembedding everywhere else (at a 49k vocabulary, a fifth of a small model's compute).

This module and `tomlens.hooks` are the only places that know TransformerLens / HF internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformers.cache_utils import DynamicLayer

from tomlens.hooks.logits import keeps_last_logits
from tomlens.models.protocol import Model

Hook = tuple[str, Callable[..., Any]]


@dataclass
class PatchIndex:
    """The cells one hook overwrites in a chunk: `act[rows, cols - offset, heads] = values`.

    `heads` is None for activations without a head axis (resid, attn_out, mlp_out).
    """

    rows: Int[Tensor, " n"]
    cols: Int[Tensor, " n"]
    heads: Int[Tensor, " n"] | None
    values: Float[Tensor, "n d"]


def patch_hooks(entries: Mapping[str, PatchIndex], offset: int = 0) -> list[Hook]:
    """One forward hook per activation name, writing every row's cells (out of place).

    The index is shifted by `offset` once, here; the hook itself only writes. With the entries on
    the activation's device (as the engine makes them) it moves nothing and never waits for the GPU.
    """
    hooks: list[Hook] = []
    for name, ix in entries.items():
        cols = ix.cols - offset if offset else ix.cols
        index = (ix.rows, cols) if ix.heads is None else (ix.rows, cols, ix.heads)

        def fn(act: Tensor, hook: Any = None, index: tuple[Tensor, ...] = index, values: Tensor = ix.values) -> Tensor:
            if index[0].device != act.device:  # a model split over devices: follow the activation
                index = tuple(i.to(act.device) for i in index)
            return act.index_put(index, values.to(device=act.device, dtype=act.dtype))

        hooks.append((name, fn))
    return hooks


def record_hooks(
    names: Sequence[str], store: dict[str, Tensor], *, requires_grad: bool = False
) -> list[Hook]:
    """Hooks that keep each named activation in `store` (the tensor itself: in a grad-enabled
    forward it stays in the graph, so `torch.autograd.grad` can be taken with respect to it).

    `requires_grad=True` makes an activation that carries no graph (weights frozen) a leaf that
    does, so gradients reach it and every later activation either way.
    """

    def make(name: str) -> Callable[..., Tensor | None]:
        def fn(act: Tensor, hook: Any = None) -> Tensor | None:
            if not requires_grad:
                store[name] = act
                return None
            # Returned, not just kept: some hook points hand the hook a reshaped view and carry on
            # with the original tensor unless the hook returns one, which would leave the kept
            # view outside the graph.
            if not act.requires_grad:
                act.requires_grad_(True)
            store[name] = act
            return act

        return fn

    return [(n, make(n)) for n in names]


class PrefixCache:
    """The base runs' keys and values, from which a chunk takes its shared prefix.

    Only plain `DynamicCache`s of full-attention layers are supported (sliding-window or
    recurrent layers keep state a prefix slice cannot reproduce); `from_output` returns None
    otherwise and the caller runs every position.
    """

    def __init__(self, keys: list[Tensor], values: list[Tensor]):
        self.keys = keys
        self.values = values

    @classmethod
    def from_output(cls, cache: Any) -> PrefixCache | None:
        try:
            from transformers.cache_utils import DynamicCache, DynamicLayer
        except ImportError:  # pragma: no cover - transformers without the layered cache
            return None
        if type(cache) is not DynamicCache or not cache.layers:
            return None
        keys: list[Tensor] = []
        values: list[Tensor] = []
        for layer in cache.layers:
            if type(layer) is not DynamicLayer or layer.keys is None or layer.values is None:
                return None
            keys.append(layer.keys)
            values.append(layer.values)
        return cls(keys, values)

    def select(self, rows: Int[Tensor, " r"], length: int, from_layer: int = 0, *, in_place: bool = False) -> Any:
        """A fresh HF cache holding columns `[0, length)` of the given base rows.

        Layers below `from_layer` are skipped by the forward (see `skip_blocks`) and never read
        their cache; they share layer 0's, which the mask code reads for the prefix length.
        `in_place=True`: each layer holds the rows' whole width and takes the run's new columns in
        place (`_InPlaceLayer`), for a forward whose new columns end at the base runs' last column.
        """
        from transformers.cache_utils import DynamicCache

        rows = rows.to(self.keys[0].device)
        if in_place:
            cache = DynamicCache()
            layers: list[Any] = []
            for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
                if 0 < i < from_layer:
                    layers.append(layers[0])
                else:
                    layers.append(_InPlaceLayer(k.index_select(0, rows), v.index_select(0, rows), length))
            cache.layers = layers
            return cache
        data: list[tuple[Tensor, Tensor]] = []
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if 0 < i < from_layer:
                data.append(data[0])
            else:
                data.append((k.index_select(0, rows)[:, :, :length], v.index_select(0, rows)[:, :, :length]))
        return DynamicCache(ddp_cache_data=data)


class _InPlaceLayer(DynamicLayer):
    """A cache layer over a run's whole row of keys and values (`[r, kv, width, d]`, the base run's,
    so columns `[0, length)` are the shared prefix): the forward's new columns are written over the
    base run's in place and the layer hands back the whole row. A plain `DynamicLayer` would copy
    the prefix twice more (once when built, once per update), most of a one-token run's time."""

    def __init__(self, keys: Tensor, values: Tensor, length: int):
        super().__init__()
        self.full_keys, self.full_values, self.length = keys, values, length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        end = self.length + key_states.shape[-2]
        if end > self.full_keys.shape[-2]:
            raise ValueError(f"{end} columns do not fit a cache row of {self.full_keys.shape[-2]}")
        self.full_keys[:, :, self.length : end] = key_states
        self.full_values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.full_keys[:, :, :end], self.full_values[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


@contextmanager
def skip_blocks(model: Model, below: int, resid: Tensor | None) -> Iterator[None]:
    """Run blocks `>= below` only: blocks below return at once, and block `below - 1` hands on
    `resid`, the residual stream entering block `below` (the base run's, for the recomputed
    columns). Exact because nothing a patch changes reaches those blocks.

    The bridge's blocks are the HF model's own layer list, so overriding a block's `forward` for
    the duration of one call is all it takes; it is restored even if the forward fails.
    """
    if below <= 0 or resid is None:
        yield
        return
    blocks = model.blocks
    set_attr, del_attr = object.__setattr__, object.__delattr__  # bypass the bridge's passthrough

    def passthrough(*args: Any, **kwargs: Any) -> Tensor:
        return args[0] if args else kwargs["hidden_states"]

    def handoff(*args: Any, **kwargs: Any) -> Tensor:
        return resid

    done = []
    try:
        for i in range(below):
            set_attr(blocks[i], "forward", handoff if i == below - 1 else passthrough)
            done.append(blocks[i])
        yield
    finally:
        for block in done:
            del_attr(block, "forward")


@contextmanager
def logits_of(model: Model, vocab: Int[Tensor, " v"] | None) -> Iterator[None]:
    """Unembed to the logits of `vocab` only: a metric that reads a few tokens' logits need not
    pay for a vocabulary-wide matmul per row (at a 49k vocabulary, as much as a dozen blocks do for
    one token). The unembedding's own module is narrowed, so its bias and anything the model does
    after it (an elementwise soft-cap) still apply; an unembedding that is not a plain linear layer
    is left whole."""
    lm = getattr(getattr(model, "unembed", None), "original_component", None)
    if vocab is None or type(lm) is not torch.nn.Linear:
        yield
        return
    ids = vocab.to(lm.weight.device)
    weight = lm.weight.index_select(0, ids)
    bias = None if lm.bias is None else lm.bias.index_select(0, ids)

    def forward(hidden: Tensor) -> Tensor:
        return torch.nn.functional.linear(hidden, weight, bias)

    object.__setattr__(lm, "forward", forward)
    try:
        yield
    finally:
        object.__delattr__(lm, "forward")


def _slice_kwargs(
    forward_kwargs: Mapping[str, Any], rows: Int[Tensor, " r"] | None, start: int, n_batch: int
) -> dict[str, Any]:
    """Select batch rows of the forward kwargs and cut position-aligned ones to columns `>= start`.

    The attention mask keeps every column: with a KV prefix it must span prefix and new tokens.
    """
    out: dict[str, Any] = {}
    for key, value in forward_kwargs.items():
        if isinstance(value, Tensor) and value.ndim >= 1:
            if rows is not None and value.shape[0] == n_batch:
                value = value.index_select(0, rows.to(value.device))
            if key != "attention_mask" and value.ndim == 2 and start > 0:
                value = value[:, start:]
        out[key] = value
    return out


def forward_last(
    model: Model,
    input_ids: Int[Tensor, "batch pos"],
    forward_kwargs: Mapping[str, Any],
    hooks: Sequence[Hook] = (),
    *,
    rows: Int[Tensor, " r"] | None = None,
    prefix: PrefixCache | None = None,
    start: int = 0,
    skip: tuple[int, Tensor] | None = None,
    prefix_rows: Int[Tensor, " r"] | None = None,
    keep_cache: bool = False,
    vocab: Int[Tensor, " v"] | None = None,
) -> tuple[Float[Tensor, "r vocab"], PrefixCache | None]:
    """Run (rows of) a left-padded batch and return the last position's logits.

    With `prefix` and `start > 0`, columns `< start` come from the prefix cache (its rows given by
    `prefix_rows`, default `rows`), and only columns `>= start` run: hooks then see
    `[r, pos - start, ...]` tensors.
    `skip=(L, resid)` runs blocks `>= L` only, with `resid` (`[r, new pos, d_model]`) entering block L.
    `keep_cache=True` also returns this run's keys and values as a `PrefixCache` (or None when the
    architecture's cache is not a plain one); with a prefix, all columns (prefix and this run's).
    `vocab`: compute the logits of these token ids only (`[r, v]`, see `logits_of`).
    """
    ids = input_ids if rows is None else input_ids.index_select(0, rows.to(input_ids.device))
    use_prefix = prefix is not None and start > 0
    kwargs = _slice_kwargs(forward_kwargs, rows, start if use_prefix else 0, input_ids.shape[0])
    if keeps_last_logits(model):
        kwargs["logits_to_keep"] = 1
    if use_prefix and prefix is not None:  # (use_prefix implies a prefix; the checker sees it here)
        if prefix_rows is None:
            prefix_rows = rows if rows is not None else torch.arange(ids.shape[0], device=ids.device)
        # A run that keeps its cache gets a plain one; otherwise the new columns go in place.
        kwargs["past_key_values"] = prefix.select(prefix_rows, start, skip[0] if skip else 0, in_place=not keep_cache)
        ids = ids[:, start:]
    cache = None
    below, resid = skip if skip is not None else (0, None)
    with model.hooks(fwd_hooks=list(hooks)), skip_blocks(model, below, resid), logits_of(model, vocab):
        if keep_cache and not use_prefix:
            logits, hf_cache = model(ids, return_type="logits_and_cache", use_cache=True, **kwargs)
            cache = PrefixCache.from_output(hf_cache)
        else:
            if not use_prefix:
                kwargs["use_cache"] = False  # nothing reads this run's keys and values
            logits = model(ids, **kwargs)
            if keep_cache:  # the prefix's copy, extended in place by this run's columns
                cache = PrefixCache.from_output(kwargs["past_key_values"])
    return logits[:, -1], cache
