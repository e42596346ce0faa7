"""The tier rule of tests/conftest.py: every test gets exactly one of unit / integration / acceptance,
model fixtures set a floor, and a test the table does not cover is named with what to add."""

from __future__ import annotations

import pytest
from conftest import TIER_TABLE, TIERS, tier_of

pytestmark = pytest.mark.unit


def test_table_module_fixture_floor_and_overrides():
    assert tier_of("tests/test_probes.py::test_x[1]", ["tmp_path"], []) == "unit"
    assert tier_of("tests/test_probes.py::test_x", ["load_tiny"], []) == "integration"
    assert tier_of("tests/test_probes.py::test_x", ["smollm2", "load_tiny"], []) == "acceptance"
    assert tier_of("tests/test_probes.py::test_x", [], [], slow=True) == "acceptance"
    assert tier_of("tests/test_new.py::test_x", [], ["integration"]) == "integration"  # pytestmark
    one = "test_probe_solver.py::test_probe_command_on_scaled_tiny_llama_activations_prints_a_table"
    assert TIER_TABLE[one] == "integration" and tier_of(f"tests/{one}[a]", [], []) == "integration"


@pytest.mark.parametrize("nodeid,fixtures,explicit,words", [
    ("tests/test_new.py::test_x", [], [], "no tier"),
    ("tests/test_new.py::test_x", ["load_tiny"], [], "no tier"),
    ("tests/test_new.py::test_x", [], ["unit", "acceptance"], "more than one"),
    ("tests/test_new.py::test_x", ["tiny_model"], ["unit"], "at least integration"),
])
def test_a_test_without_exactly_one_tier_is_refused(nodeid, fixtures, explicit, words):
    with pytest.raises(ValueError, match=words):
        tier_of(nodeid, fixtures, explicit)


def test_every_tier_in_the_table_is_known():
    assert set(TIER_TABLE.values()) <= set(TIERS)
