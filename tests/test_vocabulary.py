"""One word per idea: the settings every stage shares have one name in every config and on every
command line, and an old name still reads for one release, saying the new one."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tomlens.cli import build_parser
from tomlens.errors import TomlensError
from tomlens.runs.base import config_from_dict
from tomlens.runs.patching import PatchingConfig
from tomlens.runs.probes import ProbesConfig
from tomlens.runs.steering import SteeringConfig
from tomlens.runs.validate import ValidateConfig

pytestmark = pytest.mark.unit

SPLIT_CONFIGS = (ProbesConfig, SteeringConfig, PatchingConfig, ValidateConfig)  # each keeps selection apart
RETIRED_FLAGS = ("--selection-fraction",)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _visible_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}


def test_every_stage_with_a_selection_half_names_its_size_alike() -> None:
    for cls in SPLIT_CONFIGS:
        names = {f.name for f in dataclasses.fields(cls)}
        assert "select_fraction" in names and "selection_fraction" not in names, cls.__name__


def test_no_command_shows_a_retired_flag_and_each_split_command_takes_the_one_name() -> None:
    commands = _subparsers(build_parser())
    for name, parser in commands.items():
        assert not _visible_flags(parser) & set(RETIRED_FLAGS), name
    for name in ("probe", "patch", "steer", "validate"):
        assert "--select-fraction" in _visible_flags(commands[name]), name


def test_an_old_setting_name_reads_once_with_a_line_naming_the_new(capsys: pytest.CaptureFixture[str]) -> None:
    config = config_from_dict(ProbesConfig, {"stimuli": {"family": "order-only"}, "selection_fraction": 0.3})
    assert config.select_fraction == 0.3
    assert "'selection_fraction' is now 'select_fraction'" in capsys.readouterr().err
    with pytest.raises(TomlensError, match="both"):
        config_from_dict(ProbesConfig, {"stimuli": {"family": "order-only"},
                                        "selection_fraction": 0.3, "select_fraction": 0.4})


def test_an_old_flag_still_parses_and_says_the_new_one(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["probe", "--stimuli", "s.jsonl", "--out", "o", "--selection-fraction", "0.4"])
    assert args.select_fraction == 0.4
    assert "--select-fraction" in capsys.readouterr().err
