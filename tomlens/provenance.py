"""What a result was computed with, collected in one place so every run directory says it the same way.

`versions()` is the one library-version collector; `run_manifest(...)` is the one provenance
manifest of a run (model, config, seed, stimuli hash, versions, command line, time).
"""

from __future__ import annotations

import dataclasses
import platform
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a type only: tomlens.models.registry imports this module, so no import at run time
    from tomlens.models.protocol import Model

# Distribution name -> key in `versions()`; the keys are the import names.
_DISTRIBUTIONS: dict[str, str] = {
    "torch": "torch",
    "transformers": "transformers",
    "transformer-lens": "transformer_lens",
    "numpy": "numpy",
    "scikit-learn": "sklearn",  # the reference the probes are checked against
}


def versions() -> dict[str, str]:
    """Versions of tomlens, torch, transformers, transformer_lens, numpy, sklearn and python ("not installed"
    for a missing one), so a number can be traced to the code that made it."""
    from importlib.metadata import PackageNotFoundError, version

    import tomlens

    out = {"tomlens": tomlens.__version__}
    for dist, key in _DISTRIBUTIONS.items():
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            out[key] = "not installed"
    out["python"] = platform.python_version()
    return out


def plain_values(value: Any) -> Any:
    """`value` as plain JSON/TOML values: dataclasses as tables (dicts), tuples as lists, paths as
    strings. A config written this way reads back through `tomlens.runs.base.config_from_dict`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_values(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [plain_values(x) for x in value]
    if isinstance(value, Mapping):
        return {str(k): plain_values(x) for k, x in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def _config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return plain_values(config)
    if isinstance(config, Mapping):
        return {str(k): v for k, v in config.items()}
    raise TypeError(f"config must be a dataclass instance or a mapping, not {type(config).__name__}")


def _seed(config: Any, as_dict: dict[str, Any]) -> int | None:
    """`config.seed`, else `config.model.seed` (the seed of random-init weights), else None."""
    if "seed" in as_dict and as_dict["seed"] is not None:
        return as_dict["seed"]
    model = as_dict.get("model")
    if isinstance(model, Mapping) and model.get("seed") is not None:
        return model["seed"]
    return getattr(config, "seed", None)


def run_manifest(model: Model | None, config: Any, *, stimuli_hash: str | None = None,
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The provenance manifest of one run: `model` (tomlens.models.provenance of the loaded model, or
    None for a run without one), `config` (as plain values), `seed`, `stimuli_hash`, `versions`,
    `argv` and `time` (UTC, ISO 8601); `extra` keys are added last and may not override these."""
    from tomlens.models import provenance

    as_dict = _config_dict(config)
    manifest: dict[str, Any] = {
        "model": provenance(model) if model is not None else None,
        "config": as_dict,
        "seed": _seed(config, as_dict),
        "stimuli_hash": stimuli_hash,
        "versions": versions(),
        "argv": list(sys.argv),
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    for key, value in (extra or {}).items():
        if key in manifest:
            raise ValueError(f"extra key {key!r} would override the manifest's own {key!r}")
        manifest[key] = value
    return manifest
