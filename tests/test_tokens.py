"""encode(): left padding with mask and positions reproduces one-prompt-at-a-time numbers (to fp32
rounding: a padded batch is another matmul shape, which BLAS may reduce in another order)."""

from __future__ import annotations

import pytest
import torch
from jaxtyping import Int
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.models import EncodedBatch, encode

TEXTS = [
    "Sally puts the marble in the basket and leaves the room.",
    "Anne moves it.",
    "Where will Sally look for her marble when she comes back?",
    "Hi",
]


def _single_logits(model, text: str) -> Tensor:
    one = encode(model, [text])
    assert one.pad == [0]
    return model(one.input_ids, **one.forward_kwargs())[0]


@torch.inference_mode()
def test_left_padded_batch_matches_single_prompts(tiny_model):
    batch = encode(tiny_model, TEXTS)
    logits = tiny_model(batch.input_ids, **batch.forward_kwargs()).float()
    assert batch.pad[3] > 0 and batch.pad[1] > 0  # padding really happens on the short rows
    for row, text in enumerate(TEXTS):
        single = _single_logits(tiny_model, text).float()
        # padded batch vs one prompt (logits ~1, 3e-7 seen): fp32 tolerance; unmasked padding moves them > 1e-3
        torch.testing.assert_close(logits[row, batch.pad[row]:], single, atol=1e-4, rtol=1e-5)


@torch.inference_mode()
def test_without_mask_the_padded_rows_differ(tiny_model):
    """Guards the test above: padding must matter, so the kwargs are what makes rows exact."""
    batch = encode(tiny_model, TEXTS)
    logits = tiny_model(batch.input_ids).float()
    single = _single_logits(tiny_model, TEXTS[3]).float()
    assert (logits[3, batch.pad[3]:] - single).abs().max() > 1e-3


@torch.inference_mode()
def test_run_with_hooks_takes_the_same_kwargs(tiny_model):
    batch = encode(tiny_model, TEXTS)
    name = f"blocks.{tiny_model.cfg.n_layers - 1}.hook_resid_post"
    seen: list[Tensor] = []

    def grab(x, hook):
        seen.append(x.clone())

    logits = tiny_model.run_with_hooks(batch.input_ids, fwd_hooks=[(name, grab)], **batch.forward_kwargs())
    plain = tiny_model(batch.input_ids, **batch.forward_kwargs())
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)  # a second forward, with hooks: fp32 tolerance
    assert len(seen) == 1 and seen[0].shape == (len(TEXTS), batch.input_ids.shape[1], tiny_model.cfg.d_model)
    for row, text in enumerate(TEXTS):
        one = encode(tiny_model, [text])
        _, cache = tiny_model.run_with_cache(one.input_ids, names_filter=[name], **one.forward_kwargs())
        # padded batch vs one prompt (values ~0.1): fp32 tolerance
        torch.testing.assert_close(seen[0][row, batch.pad[row]:].float(), cache[name][0].float(), atol=1e-5,
                                   rtol=1e-5)


def test_batch_fields(load_tiny):
    model = load_tiny("tiny-gpt2")
    batch = encode(model, TEXTS)
    assert isinstance(batch, EncodedBatch) and len(batch) == len(TEXTS)
    assert isinstance(batch.input_ids, Int[Tensor, "batch pos"])
    assert isinstance(batch.attention_mask, Int[Tensor, "batch pos"])
    assert isinstance(batch.last, Int[Tensor, " batch"])
    width = batch.input_ids.shape[1]
    assert width == max(batch.lengths)
    assert batch.attention_mask.sum(1).tolist() == batch.lengths
    assert batch.pad == [width - n for n in batch.lengths]
    assert batch.last.tolist() == [width - 1] * len(TEXTS)
    pad_id = model.tokenizer.pad_token_id
    for row, text in enumerate(TEXTS):
        p = batch.pad[row]
        assert batch.input_ids[row, :p].eq(pad_id).all()
        assert batch.attention_mask[row, :p].eq(0).all() and batch.attention_mask[row, p:].eq(1).all()
        ids = model.tokenizer(text)["input_ids"]
        assert batch.input_ids[row, p:].tolist() == ids
        assert len(batch.offsets[row]) == batch.lengths[row]
        # positions count from the first real token of each row
        assert batch.position_ids[row, p:].tolist() == list(range(batch.lengths[row]))
    kwargs = batch.forward_kwargs()
    assert kwargs["attention_mask"] is batch.attention_mask
    assert torch.equal(kwargs["position_ids"], batch.position_ids)


def test_bos_follows_the_tokenizer_and_a_prepended_one_covers_no_character(load_tiny):
    from tomlens.models import load_model

    model = load_tiny("tiny-llama")
    batch = encode(model, ["The cat"])
    assert batch.input_ids[0, 0].item() != model.tokenizer.bos_token_id  # SmolLM2's tokenizer adds none
    assert batch.offsets[0][0] == (0, 3)
    forced = load_model("tiny-llama", prepend_bos=True)
    batch = encode(forced, ["The cat"])
    assert batch.input_ids[0, 0].item() == forced.tokenizer.bos_token_id
    assert batch.offsets[0][0] == (0, 0)
    assert batch.offsets[0][1] == (0, 3)  # the BOS covers no character; "The" follows it


def test_offsets_name_each_token_s_characters(load_tiny):
    model = load_tiny("tiny-neox")
    batch = encode(model, TEXTS)
    tok = model.tokenizer
    for row, text in enumerate(TEXTS):
        covered = 0
        for t, (start, end) in enumerate(batch.offsets[row]):
            if start == end:
                continue
            position = batch.pad[row] + t
            assert tok.decode([batch.input_ids[row, position].item()]).strip() == text[start:end].strip()
            covered += end - start
        assert covered >= len(text.replace(" ", ""))
        assert all(a[1] <= b[0] for a, b in zip(batch.offsets[row], batch.offsets[row][1:], strict=False))  # in text order
    # "marble" in row 0: the token covering its last character ends the word
    last = TEXTS[0].index("marble") + len("marble") - 1
    (t,) = [t for t, (start, end) in enumerate(batch.offsets[0]) if start <= last < end]
    assert "marble".endswith(tok.decode([batch.input_ids[0, batch.pad[0] + t].item()]).strip())


def test_encode_rejects_bad_input(load_tiny):
    model = load_tiny("tiny-gpt2")
    with pytest.raises(TypeError):
        encode(model, "a single string")
    with pytest.raises(TomlensError, match="no texts"):
        encode(model, [])
    with pytest.raises(TomlensError, match="context"):
        encode(model, ["word " * 600])


def test_tensors_live_on_the_model_device(load_tiny):
    model = load_tiny("tiny-gpt2")
    batch = encode(model, TEXTS[:2])
    device = next(model.parameters()).device
    for tensor in (batch.input_ids, batch.attention_mask, batch.last, batch.position_ids):
        assert tensor.device == device
