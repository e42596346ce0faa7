"""The audit as a stage of `tomlens run` and in the report: which sets it audits, what it saves, and
the findings it withholds."""

from __future__ import annotations

import pytest

from tomlens.audit import AuditReport, AuditRow
from tomlens.errors import TomlensError
from tomlens.report.audit import audit_sections, withhold_explained
from tomlens.report.findings import Finding
from tomlens.runs.audit import AuditConfig, AuditResult, run
from tomlens.runs.base import StimuliSpec
from tomlens.runs.experiment import ExperimentConfig

pytestmark = pytest.mark.unit


def _row(family: str, verdict: str, acc: float = 1.0) -> AuditRow:
    return AuditRow(family, "condition", "2-gram bag (story)", "generic", acc, acc - 0.05, min(acc + 0.05, 1.0),
                    0.5, 128, 64, verdict)


def test_an_audit_section_of_an_experiment_audits_the_behaviour_and_probe_sets():
    config = ExperimentConfig.from_dict({
        "name": "audit-sets", "model": {"name": "tiny-llama"}, "audit": {},
        "behaviour": {"stimuli": [{"family": "order-only", "n": 4}, {"family": "indirect-request", "n": 4}]},
        "probes": {"stimuli": {"family": "order-only", "n": 8, "seed": 1}},
    })
    audit = config.stage_config("audit", config.models[0])
    assert [(s.family, s.n, s.seed) for s in audit.stimuli] == [
        ("order-only", 4, 0), ("indirect-request", 4, 0), ("order-only", 8, 1)]
    # generated families are audited at min_tasks at least; one entry per family x seed x options
    assert [(s.family, s.n, s.seed) for s in audit.audited_specs()] == [
        ("order-only", 64, 0), ("indirect-request", 64, 0), ("order-only", 64, 1)]


def test_the_stage_runs_without_a_model_and_round_trips(tmp_path):
    config = AuditConfig(stimuli=(StimuliSpec(family="order-only", n=4),), min_tasks=16, per_task=2)
    result = run(config, progress=False)
    assert result.report.families == ("order-only",)
    assert result.report.rows and max(r.n_tasks for r in result.report.rows) == 16  # min_tasks, not n
    again = AuditResult.load(result.save(tmp_path / "audit"))
    assert again.report.frame().equals(result.report.frame()) and again.config == config
    assert "no shortcut found" in again.describe() or "SHORTCUTS" in again.describe()


def test_a_saved_audit_is_stale_when_its_rows_change(tmp_path):
    from tomlens.runs.audit import changed_since

    config = AuditConfig(stimuli=(StimuliSpec(family="order-only", n=4),), min_tasks=8, per_task=1)
    folder = run(config, progress=False).save(tmp_path / "audit")
    assert changed_since(folder, config) is None
    other = AuditConfig(stimuli=(StimuliSpec(family="order-only", n=4, seed=9),), min_tasks=8, per_task=1)
    assert "changed" in changed_since(folder, other)


def test_two_sets_of_one_family_and_seed_with_other_options_are_audited_as_their_own_tasks():
    """`decoys = false` and the default tell other stories under the same task ids: merged, the
    audit held them out as one task and counted 16 tasks as 8."""
    config = AuditConfig(stimuli=(StimuliSpec(family="unexpected-transfer", n=8),
                                  StimuliSpec(family="unexpected-transfer", n=8, options={"decoys": False})),
                         min_tasks=8, per_task=2)
    rows = config.audited_rows()
    assert len({s.task_id for s in rows}) == 16 and len({s.id for s in rows}) == len(rows)
    assert {s.task_id for s in rows if s.task_id.endswith("@1")} == {f"{s.task_id}@1" for s in rows if "@" not in s.task_id}
    report = run(config, progress=False).report
    assert max(r.n_tasks for r in report.rows) == 16
    # a set alone keeps its ids
    assert not any("@" in s.task_id for s in AuditConfig(stimuli=config.stimuli[:1], min_tasks=8).audited_rows())


def test_one_family_and_seed_at_two_sizes_is_audited_once_per_story():
    """A behaviour set of 8 tasks and a probe set of 12 of one generator and seed share their first 8
    stories word for word: each is audited once (suffixed, the copies would sit in training and
    held-out folds both, and count twice)."""
    config = AuditConfig(stimuli=(StimuliSpec(family="order-only", n=8), StimuliSpec(family="order-only", n=12)),
                         min_tasks=8, per_task=None)
    rows = config.audited_rows()
    alone = AuditConfig(stimuli=config.stimuli[1:], min_tasks=8, per_task=None).audited_rows()
    assert [(s.id, s.task_id, s.text) for s in rows] == [(s.id, s.task_id, s.text) for s in alone]
    assert len({s.task_id for s in rows}) == 12


def test_a_suffix_never_takes_an_id_a_set_already_has():
    from tomlens.runs.audit import _distinct_tasks
    from tomlens.stimuli import generate

    first = generate("order-only", n=1, seed=0)
    taken = [s.with_(task_id=f"{s.task_id}@1", id=f"{s.id}@1") for s in first]
    retold = [s.with_(text=s.text + " Then it rains.") for s in first]
    tasks = {s.task_id for s in _distinct_tasks([first, taken, retold])}
    assert tasks == {first[0].task_id, f"{first[0].task_id}@1", f"{first[0].task_id}@2"}


def test_a_probe_finding_on_a_file_is_withheld_by_the_set_s_families():
    report = AuditReport((_row("my-family", "shortcut"),), families=("my-family",))
    found = Finding("belief is linearly decodable at 0.9 on held-out mine.jsonl stories", "found", "t", "m", "probes")
    assert withhold_explained([found], report)[0].status == "found"  # the sentence names the file
    assert withhold_explained([found], report, ["my-family"])[0].status == "withheld"


@pytest.mark.parametrize("bad,words", [({"min_tasks": 4}, "below 8"), ({"per_task": 0}, "at least 1"),
                                       ({"alpha": 1.5}, "not in")])
def test_bad_settings_are_named(bad, words):
    with pytest.raises(TomlensError, match=words):
        AuditConfig(stimuli=(StimuliSpec(family="order-only"),), **bad)


def test_a_stage_without_stimuli_says_what_to_add():
    with pytest.raises(TomlensError, match="no stimuli"):
        run(AuditConfig(), progress=False)


def test_a_found_claim_on_an_explained_family_is_withheld_naming_the_heuristic():
    report = AuditReport((_row("unexpected-contents", "shortcut"), _row("order-only", "at chance", 0.5)),
                         families=("unexpected-contents", "order-only"))
    findings = [
        Finding("the model answers the belief question of unexpected-contents false-belief stories right 0.9",
                "found", "interval above chance", "m", "behaviour"),
        Finding("protagonist belief is linearly decodable at 0.8 on held-out order-only stories", "found",
                "above baselines", "m", "probes"),
        Finding("heads L1H2 carry unexpected-contents belief", "found", "recovery", "m", "patching"),
    ]
    out = withhold_explained(findings, report)
    assert out[0].status == "withheld" and out[0].claim.startswith("whether the model answers")
    assert "2-gram bag (story) tells condition apart at 1.00" in out[0].test and "was: interval" in out[0].test
    assert out[1] == findings[1]  # its family is at chance
    assert out[2] == findings[2]  # patching is not judged by the text audit


def test_the_report_section_states_the_verdict_and_shows_only_rows_off_chance():
    report = AuditReport((_row("unexpected-contents", "shortcut"), _row("order-only", "at chance", 0.5)),
                         families=("unexpected-contents", "order-only"))
    [section] = audit_sections(AuditResult(AuditConfig(), report))
    assert "SHORTCUTS: 1 of 2 rows" in section.text
    [(summary, [rows])] = section.collapsed  # the rows off chance, folded under one line
    assert list(rows["family"]) == ["unexpected-contents"]
