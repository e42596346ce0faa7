"""The README's layout section and glossary name what the code has: every package the layout lists
exists and none is missing from it, and every dotted name the two cite resolves to a module or
object. A rename that forgets the README fails here."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import tomlens

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[1] / "README.md"


def _section(start: str, end: str | None) -> str:
    text = README.read_text(encoding="utf-8")
    body = text[text.index(start):]
    return body[: body.index(end)] if end and end in body else body


def _resolves(name: str) -> bool:
    name = name.removeprefix("tomlens.")
    packages = [""] + [f"{m.name}." for m in pkgutil.iter_modules(tomlens.__path__) if m.ispkg]
    for prefix in packages:
        parts = f"tomlens.{prefix}{name}".split(".")
        for cut in range(len(parts), 1, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return True
    return False


def test_the_layout_lists_every_package_and_only_those() -> None:
    layout = _section("## Layout", "### Glossary")
    listed = set(re.findall(r"^tomlens/(\w+)\s", layout, flags=re.M))
    actual = {m.name for m in pkgutil.iter_modules(tomlens.__path__) if m.ispkg}
    assert listed == actual


def test_every_dotted_name_of_the_layout_and_glossary_exists() -> None:
    text = _section("## Layout", None)
    names = set(re.findall(r"`([a-z_]+\.[A-Za-z_][\w.]*)`", text)) - {"demo.toml"}
    assert names, "the glossary cites module names"
    missing = sorted(n for n in names if not n.endswith((".py", ".toml", ".json")) and not _resolves(n))
    assert not missing, f"README names that do not exist: {missing}"


def test_every_command_the_layout_names_exists() -> None:
    from tomlens.cli import COMMANDS

    layout = _section("## Layout", "### Glossary")
    cli_line = layout[layout.index("tomlens/cli"):layout.index("tomlens/io.py")]
    named = set(re.findall(r"`([a-z-]+)`", cli_line)) - {"tomlens"}
    assert named <= set(COMMANDS) | {"train-organism"}, named - set(COMMANDS)
