"""The typed-summary codec (`tomlens.runs.files.summary_to_dict` / `summary_from_dict`): a frozen
dataclass tree goes to result.json and back unchanged, NaN included, and an old folder says to rerun."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest

from tomlens.errors import TomlensError
from tomlens.io import jsonable
from tomlens.runs.files import summary_from_dict, summary_to_dict

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Row:
    k: int
    score: float = 0.0
    note: str | None = None
    heads: tuple[str, ...] = ()


@dataclass(frozen=True)
class Summary:
    rows: tuple[Row, ...] = ()
    by_direction: dict[str, Row] = field(default_factory=dict)
    chosen: Row | None = None
    gap: float = 0.0
    maybe: float | None = None
    norms: dict[str, float] = field(default_factory=dict)
    alphas: tuple[float, ...] = ()


def _through_json(summary: Summary) -> dict:
    return json.loads(json.dumps(jsonable(summary_to_dict(summary))))


def test_a_summary_tree_round_trips_with_nan_where_a_number_was_not_measured() -> None:
    s = Summary((Row(1, math.nan, heads=("L0H1",)),), {"denoise": Row(2, 0.5)}, Row(3, math.nan), math.nan, None,
                {"0": math.nan, "1": 2.0}, (math.nan, 1.0))
    back = summary_from_dict(Summary, _through_json(s), folder="run", stage="patching")
    assert math.isnan(back.norms["0"]) and back.norms["1"] == 2.0
    assert math.isnan(back.alphas[0]) and back.alphas[1] == 1.0
    assert back.rows[0].heads == ("L0H1",) and math.isnan(back.rows[0].score)
    assert back.by_direction == {"denoise": Row(2, 0.5)}
    assert math.isnan(back.chosen.score) and math.isnan(back.gap) and back.maybe is None


def test_a_folder_from_another_version_says_to_rerun_the_stage() -> None:
    with pytest.raises(TomlensError, match="rerun the patching stage") as e:
        summary_from_dict(Summary, {"rowz": []}, folder="old-run", stage="patching")
    assert "old-run" in e.value.problem and "rowz" in e.value.problem
