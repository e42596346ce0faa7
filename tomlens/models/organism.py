"""`tom-organism`: the model organism shipped with tomlens (trained by `tomlens train-organism`).

A small Llama with a word-level tokenizer, trained on tomlens's own false-belief stories: the model
on which the methods are checked (`tomlens validate`). Interchange training put its order-only
belief variable in head L2H0 at the question's final token; its model card says so and gives its
held-out accuracy per condition (every order-only and contents cell 1.00, every factorial cell
0.986 or more: every cell meets the 0.97 target). Its
folder (weights, config, tokenizer, training record, model card) is package data; it loads offline
like any local model folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tomlens.errors import TomlensError
from tomlens.io import file_sha256

ORGANISM_NAME = "tom-organism"
DESCRIPTION = ("the model organism: a small Llama trained by tomlens on its belief stories (every order-only "
               "and contents cell right held out, the factorial's 0.986 or more; its order-only belief "
               "variable put in head L2H0; see its MODEL_CARD.md), shipped")


def organism_dir() -> Path:
    """The shipped folder; an error that says how to rebuild it when it is missing."""
    folder = Path(__file__).resolve().parent / "weights" / ORGANISM_NAME
    if not (folder / "model.safetensors").is_file():
        raise TomlensError(
            f"the shipped {ORGANISM_NAME} weights are missing from {folder}",
            f"reinstall tomlens, or rebuild them: tomlens train-organism --out {folder}",
        )
    return folder


def organism_revision(folder: Path) -> str:
    """The weights' digest: a retrained organism is a new revision."""
    return "sha256:" + file_sha256(folder / "model.safetensors")[:16]


def load_organism(dtype: Any) -> tuple[Any, Any, dict[str, Any]]:
    """(hf_model, tokenizer, provenance info) of the shipped organism."""
    from tomlens.models.hub import load_local

    folder = organism_dir()
    hf_model, tokenizer, _ = load_local(str(folder), dtype)
    info = {"source": "organism", "revision": organism_revision(folder), "seed": None, "path": str(folder),
            "tokenizer": ORGANISM_NAME}
    return hf_model, tokenizer, info
