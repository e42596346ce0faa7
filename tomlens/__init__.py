"""tomlens: where open-weight language models keep track of what a protagonist believes or wants."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from tomlens.models import load_model as load_model


def __getattr__(name: str) -> Any:
    # Lazy: `import tomlens` stays fast and torch-free until a model is asked for.
    if name == "load_model":
        from tomlens.models import load_model

        return load_model
    raise AttributeError(name)
