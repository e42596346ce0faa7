"""Stopping `tomlens study`: SIGTERM exits 143 and Ctrl-C 130, each after cancelling the local jobs
and writing `study.json`; an interrupt that arrives while a job is being submitted never leaves a
job unrecorded: `study.json` lists it as submitted (with its id) or as not submitted. The executor
is a stand-in (no job runs, no model loads)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import submitit

from tomlens.cli import main
from tomlens.runs import study as study_module
from tomlens.runs.experiment import ExperimentConfig
from tomlens.runs.study import STUDY, ExecutorOptions, StudyTerminated, run_study

pytestmark = pytest.mark.unit

STUDY_TOML = """
name = "signals"
[[models]]
name = "random:tiny-llama"
seeds = [0, 1]

[[behaviour.stimuli]]
family = "unexpected-transfer"
n = 1
"""


def _job(job_id: str, done: Callable[[], bool] = lambda: False) -> Any:
    """A stand-in for a submitted local job (a `LocalJob` to the study's isinstance checks)."""
    job = mock.Mock(spec=submitit.LocalJob)
    job.job_id = job_id
    job.paths.stdout = Path(f"/nowhere/{job_id}.out")
    job.done.side_effect = done
    return job


class FakeExecutor:
    """Submits nothing anywhere: `during_submit(n, job)` runs inside the n-th `submit` after the
    job exists (it was submitted) and before `submit` returns it."""

    def __init__(self, during_submit: Callable[[int, Any], None], done: Callable[[], bool] = lambda: False):
        self.during_submit, self.done = during_submit, done
        self.submitted: list[Any] = []

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        yield

    def submit(self, fn: Any, *args: Any) -> Any:
        job = _job(str(100 + len(self.submitted)), self.done)
        self.submitted.append(job)
        self.during_submit(len(self.submitted) - 1, job)
        return job


@pytest.fixture
def python_ctrl_c() -> Iterator[None]:
    """Python's own Ctrl-C handler for the test, whatever this process inherited: a shell that
    starts a command in the background (no job control) has it ignore SIGINT, and a test that
    sends itself SIGINT would then wait forever."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def study_file(tmp_path: Path) -> Path:
    path = tmp_path / "signals.toml"
    path.write_text(STUDY_TOML, encoding="utf-8")
    return path


def _jobs(out: Path) -> list[tuple[str, str | None, str | None]]:
    rows = json.loads((out / STUDY).read_text())["jobs"]
    return [(r["state"], r["job_id"], r["error"]) for r in rows]


def _kill_self(signum: int) -> Callable[[], bool]:
    def done() -> bool:
        os.kill(os.getpid(), signum)
        return False
    return done


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_exits_143_and_ctrl_c_130_after_recording_every_job(study_file, tmp_path, capsys, monkeypatch,
                                                                    python_ctrl_c, signum, status):
    executor = FakeExecutor(lambda n, job: None, done=_kill_self(signum))
    monkeypatch.setattr(study_module, "make_executor", lambda *a: executor)
    out = tmp_path / "study"
    before = signal.getsignal(signal.SIGTERM)
    assert main(["study", str(study_file), "--out", str(out), "--no-progress"]) == status
    assert signal.getsignal(signal.SIGTERM) == before
    err = capsys.readouterr().err
    assert "cancelled local job 100" in err and "finished work is kept" in err
    executor.submitted[0].cancel.assert_called_once_with(check=False)
    assert _jobs(out) == [("submitted", "100", None), ("missing", None, "never submitted")]


@pytest.mark.parametrize("executor_name", ["local", "slurm"])
def test_ctrl_c_raised_inside_submit_leaves_every_job_recorded_as_not_submitted(study_file, tmp_path, monkeypatch,
                                                                                executor_name):
    """The interrupt escapes `submit` itself (no job handle comes back): the job is on record as
    not submitted, and so is every job after it; for SLURM (one array) that is all of them."""
    def interrupt_second(n: int, job: Any) -> None:
        if n == (0 if executor_name == "slurm" else 1):
            raise KeyboardInterrupt

    monkeypatch.setattr(study_module, "make_executor", lambda *a: FakeExecutor(interrupt_second))
    out = tmp_path / "study"
    out.mkdir()
    (out / STUDY).write_text(json.dumps({"jobs": []}))  # an earlier study's file must not stay as it was
    config = ExperimentConfig.load(study_file)
    with pytest.raises(KeyboardInterrupt):
        run_study(config, out, ExecutorOptions(executor=executor_name, parallel=2 if executor_name == "local" else None),
                  progress=False)
    expected = [("missing", None, "never submitted")] * 2
    if executor_name == "local":
        expected[0] = ("submitted", "100", None)
    assert _jobs(out) == expected


@pytest.mark.parametrize("executor_name, signum, raised", [
    ("local", signal.SIGINT, KeyboardInterrupt), ("slurm", signal.SIGINT, KeyboardInterrupt),
    ("local", signal.SIGTERM, StudyTerminated)])
def test_a_signal_while_a_job_is_submitted_waits_until_it_is_recorded(study_file, tmp_path, monkeypatch,
                                                                       executor_name, signum, raised):
    """The signal arrives after the job was submitted but before `submit` returns its handle: it is
    held until the job is on record as submitted, with its id, then stops the study."""
    def signal_first(n: int, job: Any) -> None:
        if n == 0:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(study_module, "make_executor", lambda *a: FakeExecutor(signal_first))
    out = tmp_path / "study"
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(raised):
        run_study(ExperimentConfig.load(study_file), out, ExecutorOptions(executor=executor_name),
                  progress=False)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    if executor_name == "slurm":  # one array: every job of it was submitted before the signal is raised
        assert _jobs(out) == [("submitted", "100", None), ("submitted", "101", None)]
    else:
        assert _jobs(out) == [("submitted", "100", None), ("missing", None, "never submitted")]

