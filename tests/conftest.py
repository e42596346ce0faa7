"""Shared test fixtures: offline Hugging Face, tiny models built once per session, the embedded model;
test tiers; tomlens's annotations checked at run time.

The offline switches are set, and the annotation checker installed, before anything imports
transformers or tomlens, so no test can reach the hub and every tomlens call is type-checked.
"""

from __future__ import annotations

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# The tests compare with numbers computed on the CPU in fp32; on a machine with CUDA, a `load_model`
# or probe fit that names no device would take CUDA and bf16. tomlens's default device is pinned to
# the CPU here, before tomlens is imported, so every subprocess (CLI tests) inherits it; the gpu tier
# sets it to CUDA for its own tests (`_tier_guard`).
os.environ["TOMLENS_DEVICE"] = "cpu"
# Every finished save appends its folder to the run index (`tomlens runs`); the suite's thousands of
# temporary runs go to an index of its own, not the user's `$TOMLENS_HOME/runs.jsonl`.
os.environ["TOMLENS_RUN_INDEX"] = os.path.join(tempfile.mkdtemp(prefix="tomlens-runs-"), "runs.jsonl")

import jaxtyping  # noqa: E402

# Every function and dataclass of the packages tensors flow through is wrapped in
# `jaxtyped(typechecker=beartype)`: argument and return annotations, tensor shapes included, are
# checked on every call made during the tests. tomlens.stimuli (no tensors) is left out: its story
# builders make ~1,000 small calls per story, and checking them made those tests 2.5x slower.
# `is_pep484_tower`: an int is a valid `float` (PEP 484), as type checkers read the annotations.
CHECKED_PACKAGES: tuple[str, ...] = tuple(f"tomlens.{p}" for p in (
    "models", "hooks", "activations", "behaviour", "probes", "patching", "runs"))
jaxtyping.install_import_hook(
    CHECKED_PACKAGES, "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))")

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

TINY_NAMES: tuple[str, ...] = ("tiny-gpt2", "tiny-llama", "tiny-neox")


def pytest_sessionstart(session: pytest.Session) -> None:
    """CI runs the tests on 1 and on 2 threads per process (`make test THREADS=n`, .ci/run); a run
    that silently used another count would test one reduction order twice."""
    import torch

    want = os.environ.get("OMP_NUM_THREADS")
    if want and want.isdigit() and torch.get_num_threads() != int(want):
        raise pytest.UsageError(f"OMP_NUM_THREADS={want} but torch runs on {torch.get_num_threads()} threads")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say what the numbers were computed on (printed under -q too): threads and CPU kernels."""
    import torch

    terminalreporter.write_line(
        f"torch {torch.__version__}: {torch.get_num_threads()} threads "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
        f"CPU kernels {torch.backends.cpu.get_cpu_capability()}"
    )


from helpers import clean_model as _clean  # noqa: E402  (also used by the gpu tier's own fixtures)


@pytest.fixture(scope="session")
def load_tiny() -> Callable[..., Any]:
    """Factory `load_tiny(name="tiny-gpt2", seed=0)`: one fp32 bridge per (name, seed) per session.

    Tests must not change the returned model's weights or settings (use `load_model` for a private
    copy); hooks are cleared on every call.
    """
    from tomlens.models import load_model

    cache: dict[tuple[str, int], Any] = {}

    def _load(name: str = "tiny-gpt2", seed: int = 0) -> Any:
        key = (name, seed)
        if key not in cache:
            cache[key] = load_model(name, device="cpu", dtype="float32", seed=seed)  # also in the gpu tier
        return _clean(cache[key])

    return _load


@pytest.fixture
def gpt2_pairs(load_tiny: Callable[..., Any]) -> tuple[Any, list[Any]]:
    """(tiny-gpt2, 4 unexpected-transfer pairs aligned for it) with every role span (contrast, the
    question's protagonist and object): the pairs the patching plan and position tests share."""
    from tomlens.stimuli.pairs import make_pairs

    model = load_tiny("tiny-gpt2")
    pairs, report = make_pairs("unexpected-transfer", n=2, seed=0, tokenizer=model.tokenizer, contrasts=("present",))
    assert len(pairs) == 4, report.summary()
    return model, pairs


@pytest.fixture(params=TINY_NAMES)
def tiny_model(request: pytest.FixtureRequest, load_tiny: Callable[..., Any]) -> Any:
    """Each tiny model in turn; narrow with `@pytest.mark.parametrize("tiny_model", [...], indirect=True)`."""
    return load_tiny(request.param)


@pytest.fixture(scope="session")
def embedded_model() -> Any:
    """The real embedded SmolLM2-135M in fp32 (converted once into the tomlens cache); slow tests only."""
    from tomlens.models import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture
def smollm2(embedded_model: Any) -> Any:
    return _clean(embedded_model)


# ---- Tiers: every test is exactly one of unit / integration / acceptance / gpu -----------------
# unit: no model is booted (pure functions, files, tokenizers, the shortcut audits).
# integration: tiny random models and several modules together.
# acceptance: the embedded model, subprocess CLIs, the demo, kill -9 fault tests.
# gpu: results on CUDA against the CPU's (tiny models and random-llama-1b); `make test-gpu` runs it,
#   `make test` leaves it out, and where CUDA is absent it skips, said in one line.
TIERS: tuple[str, ...] = ("unit", "integration", "acceptance", "gpu")

# A module's tier, or one test's (`module.py::test_name`, parameters ignored). A module may instead
# set `pytestmark = pytest.mark.<tier>`; a test using a model fixture is raised to its floor below.
TIER_TABLE: dict[str, str] = {
    "test_aggregates.py": "unit",
    "test_bigtom.py": "unit",
    "test_belief_state.py": "unit",
    "test_cli_stimuli.py": "unit",
    "test_cues.py": "unit",
    "test_false_belief.py": "unit",
    "test_factorial.py": "unit",
    "test_epitome.py": "unit",  # its tiny-llama tests are integration through load_tiny
    "test_freetext_cli.py": "integration",
    "test_timing.py": "unit",
    "test_factorial.py::test_location_words_are_single_distinct_smollm2_tokens": "integration",
    "test_gate.py": "unit",
    "test_goal_encoding.py": "unit",
    "test_hooks.py": "unit",
    "test_hooks.py::test_output_bias_is_added_once_not_per_head": "integration",
    "test_pairs.py": "unit",
    "test_probe_baselines.py": "unit",
    "test_probe_solver.py": "unit",
    "test_probe_solver.py::test_probe_command_on_scaled_tiny_llama_activations_prints_a_table": "integration",
    "test_probes.py": "unit",
    "test_report.py": "unit",
    "test_findings.py": "unit",
    "test_report_browser.py": "integration",
    "test_statements.py": "unit",
    "test_kosoy.py": "unit", "test_kosoy.py::test_end_to_end_on_tiny_llama_the_summary_is_the_gate_of_the_scored_table": "integration",
    "test_motomqa.py": "unit",  # its tiny-llama tests are raised to integration by load_tiny
    "test_study.py": "unit",  # its two local-executor studies are marked integration
    "test_steering_unit.py": "unit",
    "test_organism.py": "unit",
    "test_organism_train.py": "integration",
    "test_organism_model.py": "integration",
    "test_steering.py": "integration",
    "test_tracking.py": "unit",
    "test_user_files.py": "unit",
    "test_validate_unit.py": "unit",
    "test_validate.py": "integration",
    "test_batteries.py": "integration",
    "test_battery_pairs.py": "integration",
    "test_compare.py": "integration",
    "test_activations.py": "integration",
    "test_attribution.py": "integration",
    "test_behaviour.py": "integration",
    "test_bos.py": "integration",
    "test_heads.py": "integration",
    "test_models.py": "integration",
    "test_models.py::test_builtin_models_never_reach_the_network_even_without_the_offline_switches": "acceptance",
    "test_patch_plan.py": "integration",
    "test_patch_plan.py::test_a_killed_run_resumes_to_the_same_tables": "acceptance",
    "test_patching.py": "integration",
    "test_patching_cli.py": "integration",
    "test_positions.py": "integration",
    "test_probes_sweep.py": "integration",
    "test_runs_patching.py": "integration",
    "test_runs_stages.py": "integration",
    "test_search.py": "integration",
    "test_selection.py": "integration",
    "test_role_views.py": "integration",
    "test_tokens.py": "integration",
    "test_export.py": "integration",
    "test_export.py::test_stimuli_round_trip_keeps_spans_labels_and_hash": "unit",
    "test_export.py::test_bigtom_rows_carry_its_licence_and_citation": "unit",
    "test_export.py::test_unknown_format_and_a_non_empty_folder_are_refused": "unit",
    "test_export.py::test_cli_bad_input_exits_2_with_the_fix": "unit",
    "test_demo.py": "acceptance",
    "test_gemma.py": "integration",  # its unit and acceptance tests carry their own markers
    "test_faults.py": "acceptance",
    "test_shipped_tokenizer.py": "unit",
    "test_shipped_tokenizer.py::test_a_tiny_model_loads_and_runs_without_the_gguf_package": "integration",
    "test_default_device.py": "unit",
}

# The lowest tier a test that uses a fixture can have (fixtures used indirectly count too).
FIXTURE_FLOOR: dict[str, str] = {
    "load_tiny": "integration", "tiny_model": "integration",
    "embedded_model": "acceptance", "smollm2": "acceptance",
}


def tier_of(nodeid: str, fixtures: list[str], explicit: list[str], slow: bool = False) -> str:
    """The one tier of a test; raises ValueError saying what to add when it has none or two.

    `explicit`: tier markers on the test or its module; `slow`: marked `slow` (the embedded model)."""
    path, _, name = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1]
    func = name.split("[", 1)[0].split("::")[-1]
    floors = [FIXTURE_FLOOR[f] for f in fixtures if f in FIXTURE_FLOOR] + (["acceptance"] if slow else [])
    floor = max(floors, key=TIERS.index, default="unit")
    if len(set(explicit)) > 1:
        raise ValueError(f"{nodeid}: more than one tier marker {sorted(set(explicit))}")
    base = explicit[0] if explicit else TIER_TABLE.get(f"{module}::{func}", TIER_TABLE.get(module))
    if base is None:
        raise ValueError(f"{nodeid}: no tier: add {module!r} to TIER_TABLE in tests/conftest.py "
                         f"or set `pytestmark = pytest.mark.unit` (or integration, acceptance) in it")
    if explicit and TIERS.index(base) < TIERS.index(floor):
        raise ValueError(f"{nodeid}: marked {base} but its fixtures make it at least {floor}")
    return max(base, floor, key=TIERS.index)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every collected test exactly one tier marker; a test without one fails the run."""
    problems = []
    for item in items:
        explicit = [m.name for m in item.iter_markers() if m.name in TIERS]
        try:
            tier = tier_of(item.nodeid, list(getattr(item, "fixturenames", ())), explicit,
                           slow=item.get_closest_marker("slow") is not None)
        except ValueError as e:
            problems.append(str(e))
            continue
        if not explicit:
            item.add_marker(getattr(pytest.mark, tier))
        item.stash[TIER_KEY] = tier
    if problems:
        raise pytest.UsageError("tests without exactly one tier:\n  " + "\n  ".join(problems))


TIER_KEY = pytest.StashKey[str]()


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hold a test to its tier: a unit test that boots any model, an integration test that boots
    one bigger than the tiny ones, or a gpu test one bigger than random-llama-1b, fails with what to
    change. A gpu test runs with CUDA as tomlens's default device, or skips where there is none."""
    tier = request.node.stash.get(TIER_KEY, None)
    if tier == "acceptance":
        return
    if tier == "gpu":
        request.getfixturevalue("cuda")  # skips, said once for the whole tier, where CUDA is absent
        monkeypatch.setenv("TOMLENS_DEVICE", "cuda")
    import tomlens.models.registry as registry

    boot = registry._boot  # the one place every model source goes through
    limit = MAX_GPU_PARAMS if tier == "gpu" else MAX_INTEGRATION_PARAMS

    def guarded(name: str, hf_model: Any, *args: Any, **kwargs: Any) -> Any:
        size = hf_model.num_parameters()
        if tier == "unit" or size > limit:
            fix = ("keep gpu tests to the tiny models and random-llama-1b" if tier == "gpu" else
                   f"tier it {'integration' if size <= MAX_INTEGRATION_PARAMS else 'acceptance'} "
                   f"in TIER_TABLE (tests/conftest.py)")
            pytest.fail(f"a {tier} test booted model {name!r} ({size:,} parameters): {fix}", pytrace=False)
        return boot(name, hf_model, *args, **kwargs)

    monkeypatch.setattr(registry, "_boot", guarded)


MAX_INTEGRATION_PARAMS = 20_000_000  # the tiny models have about 2M; SmolLM2-135M has 135M
MAX_GPU_PARAMS = 2_000_000_000  # random-llama-1b has 1.2B (with its 128k-row tied embedding)


NO_CUDA = "gpu tier: CUDA is not available here"


@pytest.fixture(scope="session")
def cuda(request: pytest.FixtureRequest) -> Any:
    """The CUDA device for the gpu tier (every gpu test asks for it, through `_tier_guard` or its
    module's fixtures); where there is none, every gpu test skips with the same reason."""
    import torch

    if not torch.cuda.is_available():
        n = sum(item.stash.get(TIER_KEY, None) == "gpu" for item in request.session.items)
        pytest.skip(f"{NO_CUDA}, {n} tests skipped")
    return torch.device("cuda")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Any:
    """The gpu tier's no-CUDA skips reported at one place, so `-ra` folds them into ONE line (pytest
    reports a skip from a fixture at each test's own line, one summary line per test)."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and item.stash.get(TIER_KEY, None) == "gpu" and isinstance(report.longrepr, tuple) \
            and str(report.longrepr[2]).startswith(f"Skipped: {NO_CUDA}"):
        report.longrepr = (__file__, None, report.longrepr[2])
