"""Models the user names by Hugging Face id or by a local directory.

Loaded with `from_pretrained` (remote code off, the requested revision honoured). Failures are
turned into one message that says what to do: not cached while offline, no such repository,
a folder that is not a model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tomlens.errors import TomlensError


def looks_like_local_dir(name: str) -> bool:
    """A name is a local directory if it exists as one or is written as a path."""
    return Path(name).expanduser().is_dir() or name.startswith((".", "/", "~"))


def _offline() -> bool:
    return any(
        os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def load_local_tokenizer(name: str) -> Any:
    """The tokenizer saved in a model folder."""
    from transformers import AutoTokenizer

    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise TomlensError(
            f"model directory {str(folder)!r} does not exist",
            "pass an existing folder with config.json and weights, a Hugging Face id, or a name from `tomlens models`",
        )
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise TomlensError(
            f"could not read a tokenizer from {str(folder)!r} ({type(e).__name__}: {_first_line(e)})",
            "save the tokenizer into the same folder (tokenizer.save_pretrained(folder))",
        ) from e


def load_hub_tokenizer(name: str, revision: str | None) -> Any:
    """A hub model's tokenizer alone (a few files, not the weights), from the local cache if offline."""
    from transformers import AutoTokenizer

    offline = _offline() or not _hub_reachable()
    local_only = {"local_files_only": True} if offline else {}
    try:
        return AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=False, **local_only)
    except (OSError, ValueError) as e:
        raise _hub_error(name, revision, offline, e) from e


def load_local(name: str, dtype: Any, device_map: Any = None) -> tuple[Any, Any, str]:
    """(hf_model, tokenizer, revision) from a folder written by `save_pretrained`; `device_map`
    (accelerate) places its layers across devices as it loads."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise TomlensError(
            f"model directory {str(folder)!r} does not exist",
            "pass an existing folder with config.json and weights, a Hugging Face id, or a name from `tomlens models`",
        )
    if not (folder / "config.json").is_file():
        raise TomlensError(
            f"{str(folder)!r} is not a model directory: it has no config.json",
            "point at a folder written by transformers' save_pretrained (config.json, *.safetensors, tokenizer files)",
        )
    from transformers import AutoModelForCausalLM

    tokenizer = load_local_tokenizer(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=False,
                                                     **_placement(device_map))
    except (OSError, ValueError) as e:
        raise TomlensError(
            f"could not load model weights from {str(folder)!r} ({type(e).__name__}: {_first_line(e)})",
            "the folder needs config.json plus model weights (*.safetensors) of a causal language model",
        ) from e
    return model, tokenizer, f"local:{folder.resolve()}@{files_digest(folder)}"


def files_digest(folder: Path) -> str:
    """Short digest of the folder's files (name, size, mtime): new weights saved into the same
    folder give a new revision, so caches keyed on it are not reused."""
    from tomlens.io import sha256_hex

    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return sha256_hex("".join(f"{f.relative_to(folder)}:{f.stat().st_size}:{f.stat().st_mtime_ns};" for f in files), 16)


def _placement(device_map: Any) -> dict[str, Any]:
    return {} if device_map is None else {"device_map": device_map}


def load_hub(name: str, dtype: Any, revision: str | None, device_map: Any = None) -> tuple[Any, Any, str]:
    """(hf_model, tokenizer, resolved commit) for a Hugging Face id, from the local cache if offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    offline = _offline() or not _hub_reachable()
    if offline and not _in_local_cache(name, revision):
        raise _hub_error(name, revision, True, OSError("offline and not cached"))
    local_only = {"local_files_only": True} if offline else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=revision, trust_remote_code=False, **local_only
        )
        model = AutoModelForCausalLM.from_pretrained(
            name, revision=revision, dtype=dtype, trust_remote_code=False, **local_only,
            **_placement(device_map),
        )
    except (OSError, ValueError) as e:
        raise _hub_error(name, revision, offline, e) from e
    return model, tokenizer, _resolved_commit(name, revision)


def _cached_config(name: str, revision: str | None) -> str | None:
    """Path of the model's config.json in the local Hugging Face cache, if it is there."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json", revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return found if isinstance(found, str) else None


def _in_local_cache(name: str, revision: str | None) -> bool:
    return _cached_config(name, revision) is not None


def _resolved_commit(name: str, revision: str | None) -> str:
    """The commit the loaded files came from: the snapshot folder holding the cached config."""
    found = _cached_config(name, revision)
    if found is not None:
        return Path(found).parent.name
    return revision or "unknown"


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the hub, so a machine without network fails in seconds, not after
    a minute of download retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _hub_error(name: str, revision: str | None, offline: bool, e: BaseException) -> TomlensError:
    text = str(e)
    at = f" at revision {revision!r}" if revision else ""
    lowered = text.lower()
    if "trust_remote_code" in lowered:
        return TomlensError(
            f"model {name!r} needs custom code from its repository, which tomlens does not run",
            "choose a model whose architecture transformers supports natively",
        )
    if offline or "offline" in lowered or "couldn't connect" in lowered or "connection" in lowered:
        return TomlensError(
            f"model {name!r}{at} is not in the local Hugging Face cache and the hub cannot be reached",
            "download it once with network access (unset HF_HUB_OFFLINE), or pass a local model directory",
        )
    if "not a valid model identifier" in lowered or "repository not found" in lowered or "404" in text:
        return TomlensError(
            f"no model called {name!r} on the Hugging Face hub{at}, and no such local directory",
            "check the spelling, pass a local model directory, or use a name from `tomlens models`",
        )
    return TomlensError(
        f"could not load model {name!r}{at} from the Hugging Face hub ({type(e).__name__}: {_first_line(e)})",
        "check the id and revision, your network and `huggingface-cli login` for gated models",
    )
