"""The README's own-stories walk-through, run as written: a JSONL of five stories told twice (the two
versions worded differently) through `tomlens pairs user` and `tomlens patch` to a head ranking on
the model organism (the gate passes, the planted head comes first) and to a withheld ranking with
its reason on the embedded model."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[1]


def _walkthrough_commands() -> list[list[str]]:
    """The four commands of the README's "Your own stories" block, as argument lists."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Your own stories, from a JSONL to a head ranking", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the walk-through's command block is gone from the README"
    commands = [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["tomlens", "pairs"], ["tomlens", "patch"]] * 2
    return commands


def _in(tmp_path: Path, command: list[str]) -> list[str]:
    """The command with the example file read from the checkout and its outputs under tmp_path."""
    return [str(ROOT / a) if a.startswith("examples/") else str(tmp_path / a) if a.startswith("runs/") else a
            for a in command[1:]]


def test_the_readme_walkthrough_ranks_the_planted_head_and_withholds_on_smollm2(tmp_path, capsys):
    from tomlens.cli import main

    for command in _walkthrough_commands():
        assert main(_in(tmp_path, command)) == 0, command
    out = capsys.readouterr().out
    assert "5 pairs role-aligned" in out and "attribution patching needs token-aligned pairs" in out

    organism = json.loads((tmp_path / "runs/own/organism/summary.json").read_text())
    assert not organism.get("withheld"), organism.get("withheld")
    assert organism["top_heads"][0] == "L2H0"  # the head the organism was trained to need
    recovery = {r["k"]: r for r in organism["topk"]}
    assert recovery[1]["top_effect"] > 0.8 and recovery[1]["random_mean"] < 0.2
    assert (tmp_path / "runs/own/organism/report.html").is_file()

    smollm2 = json.loads((tmp_path / "runs/own/smollm2/summary.json").read_text())
    assert "lower bound of the paired gap is not above 0" in smollm2["withheld"] and "true_belief" in smollm2["withheld"]
    assert (tmp_path / "runs/own/smollm2/report.html").is_file()
