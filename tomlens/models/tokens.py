"""Text -> left-padded token batch that knows where every character went.

Left padding puts every row's last real token in the last column. A padded row only computes the
same numbers as the unpadded prompt if the forward gets the attention mask (pads are never
attended) AND positions counted from each row's first real token (learned or rotary positions
would otherwise be shifted by the pad count). `forward_kwargs()` carries both, so every forward in
tomlens is `model(batch.input_ids, **batch.forward_kwargs())`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from tomlens.devices import to_device
from tomlens.errors import TomlensError


@dataclass(frozen=True)
class EncodedBatch:
    """A left-padded batch of texts with per-token character offsets (unpadded order; empty for a
    batch `padded` from ids kept earlier, whose positions were resolved when they were made)."""

    input_ids: Int[Tensor, "batch pos"]
    attention_mask: Int[Tensor, "batch pos"]
    offsets: list[list[tuple[int, int]]]
    pad: list[int]
    lengths: list[int]
    last: Int[Tensor, " batch"]
    position_ids: Int[Tensor, "batch pos"]
    pass_position_ids: bool = True
    texts: tuple[str, ...] = field(default=(), repr=False)

    def __len__(self) -> int:
        return len(self.lengths)

    def forward_kwargs(self) -> dict[str, Tensor]:
        """Keyword arguments that make a left-padded forward equal to one prompt at a time."""
        kwargs = {"attention_mask": self.attention_mask}
        if self.pass_position_ids:
            kwargs["position_ids"] = self.position_ids
        return kwargs


def _with_specials(tokenizer: Any) -> list[int] | None:
    """`tokenizer("a")`'s ids when it adds special tokens, else None."""
    ids = tokenizer("a")["input_ids"]
    return ids if len(ids) > len(tokenizer("a", add_special_tokens=False)["input_ids"]) else None


def prepends_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer(text)` starts with the BOS token: read off what it does, not off its
    `add_bos_token` flag (transformers 5 takes the rule from tokenizer.json's post-processor)."""
    ids = _with_specials(tokenizer)
    return ids is not None and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id


def appends_eos(tokenizer: Any) -> bool:
    """Whether `tokenizer(text)` ends with the EOS token (kept as it is when the BOS rule changes)."""
    ids = _with_specials(tokenizer)
    return ids is not None and tokenizer.eos_token_id is not None and ids[-1] == tokenizer.eos_token_id


def bos_record(tokenizer: Any, source: str) -> dict[str, Any]:
    """The BOS rule for provenance: `{"prepend": bool, "source": "tokenizer" | "user", "token": str | None}`."""
    return {"prepend": prepends_bos(tokenizer), "source": source, "token": tokenizer.bos_token}


def set_bos_rule(tokenizer: Any, prepend_bos: bool | None) -> dict[str, Any]:
    """Make `tokenizer` prepend BOS or not (`None`: leave its own rule), in place; return its
    `bos_record`.

    The default is the tokenizer's own rule because that is what a plain transformers run sees
    (SmolLM2-Instruct's BOS `<|im_start|>` opens a chat turn and never starts a document alone);
    `True` is TransformerLens's prepend-BOS convention.
    """
    source = "tokenizer" if prepend_bos is None else "user"
    if prepend_bos is None or bool(prepend_bos) == prepends_bos(tokenizer):
        return bos_record(tokenizer, source)
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    flag = "--prepend-bos" if prepend_bos else "--no-prepend-bos"
    if prepend_bos and tokenizer.bos_token_id is None:
        raise TomlensError(f"the tokenizer of {name!r} has no BOS token to prepend",
                           f"drop {flag} (use the tokenizer's own rule)")
    eos = appends_eos(tokenizer)
    try:
        if hasattr(tokenizer, "add_eos_token"):
            tokenizer.add_eos_token = eos  # rebuilding the post-processor must keep an appended EOS
        tokenizer.add_bos_token = bool(prepend_bos)
    except (AttributeError, ValueError) as e:
        raise TomlensError(f"the tokenizer of {name!r} cannot change its BOS rule ({e})",
                           f"drop {flag} (use the tokenizer's own rule)") from e
    if prepends_bos(tokenizer) != bool(prepend_bos) or appends_eos(tokenizer) != eos:
        raise TomlensError(f"the tokenizer of {name!r} ({type(tokenizer).__name__}) ignores a changed "
                           "BOS rule", f"drop {flag} (use the tokenizer's own rule)")
    return bos_record(tokenizer, source)


def _model_device(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device(getattr(getattr(model, "cfg", None), "device", None) or "cpu")


def _accepts_position_ids(model: Any) -> bool:
    """Whether the wrapped HF model takes `position_ids` (TransformerLens's own check, when present)."""
    check = getattr(model, "_accepts_derived_position_ids", None)
    if callable(check):
        return bool(check())
    return False


def encode(model: Any, texts: Sequence[str]) -> EncodedBatch:
    """Tokenize `texts` with the model's tokenizer (its own BOS rule), left-pad, keep char offsets.

    Tensors are placed on the model's device. Needs a fast tokenizer (for character offsets).
    """
    ids, offsets = tokenize(model, texts)
    return padded(model, ids, offsets=offsets, texts=texts)


def tokenize(model: Any, texts: Sequence[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Each text's token ids and their character offsets, unpadded, on the host (`encode` pads
    them; a caller that sorts rows by length first keeps them, so nothing is tokenized twice)."""
    if isinstance(texts, str):
        raise TypeError("encode takes a sequence of texts, not a single string")
    texts = list(texts)
    if not texts:
        raise TomlensError("no texts to encode", "pass at least one prompt")
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise TomlensError(
            f"the tokenizer of this model ({type(tokenizer).__name__}) gives no character offsets",
            "use a model with a fast (Rust) tokenizer: tomlens maps spans to tokens through offsets",
        )
    enc = tokenizer(texts, return_offsets_mapping=True, padding=False, truncation=False)
    ids: list[list[int]] = [list(x) for x in enc["input_ids"]]
    offsets = [[(int(a), int(b)) for a, b in row] for row in enc["offset_mapping"]]
    _check_lengths(model, [len(x) for x in ids])
    return ids, offsets


def _check_lengths(model: Any, lengths: list[int]) -> None:
    if min(lengths) == 0:
        empty = lengths.index(0)
        raise TomlensError(f"text {empty} tokenizes to nothing", "remove empty prompts")
    n_ctx = getattr(getattr(model, "cfg", None), "n_ctx", None)
    if n_ctx is not None and max(lengths) > n_ctx:
        longest = lengths.index(max(lengths))
        raise TomlensError(
            f"text {longest} is {max(lengths)} tokens long; the model's context is {n_ctx}",
            "shorten the prompt or use a model with a longer context",
        )


def padded(model: Any, ids: Sequence[Sequence[int]], *, offsets: list[list[tuple[int, int]]] | None = None,
           texts: Sequence[str] = ()) -> EncodedBatch:
    """Token ids the model's tokenizer made (`encode`'s, or ones kept from an earlier call),
    left-padded into a batch on the model's device. Without `offsets` the batch has none (`[]`):
    its positions were resolved when the ids were made, and it cannot resolve any of its own."""
    lengths = [len(x) for x in ids]
    _check_lengths(model, lengths)
    width = max(lengths)
    tokenizer = model.tokenizer
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    pads = [width - n for n in lengths]
    input_ids = torch.full((len(ids), width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, (seq, p) in enumerate(zip(ids, pads, strict=True)):
        input_ids[row, p:] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, p:] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    device = _model_device(model)  # built on the host, each moved once without a host sync
    return EncodedBatch(
        input_ids=to_device(input_ids, device),
        attention_mask=to_device(mask, device),
        offsets=[] if offsets is None else offsets,
        pad=pads,
        lengths=lengths,
        last=to_device(torch.full((len(ids),), width - 1, dtype=torch.long), device),
        position_ids=to_device(position_ids, device),
        pass_position_ids=_accepts_position_ids(model),
        texts=tuple(texts),
    )


def option_first_tokens(model: Any, stimuli: Sequence[Any], options: Sequence[tuple[str, str]]) -> Int[Tensor, "n 2"]:
    """First token of `" " + option` for each stimulus and each of its two options, in context.

    Tokenised as a continuation of the stimulus text and located through the tokenizer's offsets,
    so tokenizers that merge the leading space (BPE) or split it off (SentencePiece) both give the
    token the model would actually emit next.

    The table is read from the tokenizer's output, on the host, and returned on the CPU: it never
    touches the device, so building it costs a GPU run no wait; a caller moves it once
    (`tomlens.devices.to_device`) where a forward needs it.
    """
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise TomlensError(
            f"the tokenizer of this model ({type(tokenizer).__name__}) gives no character offsets",
            "use a model with a fast (Rust) tokenizer: tomlens maps spans to tokens through offsets",
        )
    firsts: list[list[int]] = []
    for k, (s, opts) in enumerate(zip(stimuli, options, strict=True)):
        texts = [f"{s.text} {opt}" for opt in opts]
        enc = tokenizer(texts, return_offsets_mapping=True, padding=False, truncation=False)
        end = len(s.text)
        pair: list[int] = []
        for ids, offs in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
            first = next((t for t, (cs, ce) in enumerate(offs) if cs >= end or ce > end), None)
            if first is None or first == 0:
                raise TomlensError(
                    f"stimulus {s.id!r}: option {texts[len(pair)][end:]!r} produced no continuation token",
                    "check the stimulus text and options",
                )
            pair.append(int(ids[first]))
        if pair[0] == pair[1]:
            raise TomlensError(
                f"stimulus {s.id!r}: both options {list(options[k])!r} start with the same token, "
                "so their first-token logit difference is always 0",
                "use options whose first tokens differ (or drop these pairs)",
            )
        firsts.append(pair)
    return torch.tensor(firsts, dtype=torch.long).view(-1, 2)
