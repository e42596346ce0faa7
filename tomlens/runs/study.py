"""Studies: one experiment over many models, training checkpoints (`revisions = [...]`) or weight
seeds (`seeds = [...]`), run as one independent job per model entry through submitit.

submitit is the engine (its `LocalExecutor` runs each job as a subprocess on this machine, its
`SlurmExecutor` on a cluster), so there is no scheduler here: this module turns an experiment into
one-model experiments, submits those that have not finished, and collects what they left. Each job
runs `run_experiment` into `<out>/<model_slug>/`, the layout a multi-model `tomlens run` writes, and
marks its folder finished with `study-done.json` (job hash, time, provenance) or failed with
`study-failed.json` (the traceback's tail). A job's hash covers its resolved settings and the sha256
of every input file they name, so a job whose folder holds a finished record of the same hash is
reused, never resubmitted, and an edited stimulus file makes it run again. `<out>/study.json` lists
every job (state, hash, the executor options it was submitted with), so a `--no-wait` SLURM study
is collected by running the command again; the comparison is built from the folders that
finished, naming the ones that did not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tomlens.errors import TomlensError
from tomlens.io import file_sha256, read_json, write_json
from tomlens.messages import say, warn
from tomlens.models.registry import local_weights_revision
from tomlens.runs.base import ModelSpec, config_hash
from tomlens.runs.experiment import PROBES_TABLE, ExperimentConfig, input_files, model_slug, run_experiment
from tomlens.vocabulary import one_of

DONE = "study-done.json"  # in a job's model folder: it finished (config hash, time, provenance)
FAILED = "study-failed.json"  # in a job's model folder: it failed (error, traceback tail)
STUDY = "study.json"  # in the study folder: every job, its state, hash, id, folder, executor and seconds
STUDY_VERSION = 1  # of study.json's layout
LOGS = "study-logs"  # submitit's folder: each job's pickled call, stdout and stderr
# What `tomlens sweep` (this command's name before 0.2) wrote: read when the new file is absent, so a
# study begun under the old name reuses its finished jobs instead of running them again.
LEGACY = {DONE: "sweep-done.json", FAILED: "sweep-failed.json", STUDY: "sweep.json"}


def marker(folder: Path, name: str) -> Path:
    """`folder / name`, or the file of the same role an older tomlens wrote, where only that exists."""
    path = folder / name
    old = folder / LEGACY.get(name, name)
    return old if not path.is_file() and old.is_file() else path
STATES = ("done", "reused", "failed", "missing", "submitted")
EXECUTORS = ("local", "slurm")
TRACEBACK_LINES = 30  # lines of a failed job's traceback kept in study-failed.json
LOCAL_TIMEOUT_MIN = 24 * 60  # submitit's local default (2 minutes) would kill a real job


@dataclass(frozen=True)
class ExecutorOptions:
    """Where and how the jobs run. `parallel`: jobs at once (local: default 1; SLURM: the job array's
    `array_parallelism`, default submitit's cap of 256). The SLURM-only options (partition, memory,
    CPUs, sbatch options) are refused for the local executor, which cannot honour them, rather than
    ignored. `gpus_per_job = 0` locally means "no request": a job sees the GPUs this process sees."""

    executor: str = "local"
    parallel: int | None = None
    partition: str | None = None
    gpus_per_job: int = 0
    time_min: int | None = None  # minutes a job may run (local: 24 h unless given)
    mem_gb: float | None = None
    cpus_per_job: int | None = None
    slurm_args: Mapping[str, str | bool] = field(default_factory=dict)  # sbatch options, e.g. {"constraint": "a100"}

    def __post_init__(self) -> None:
        one_of("executor", self.executor, EXECUTORS)
        for name, value, least in (("parallel", self.parallel, 1), ("gpus_per_job", self.gpus_per_job, 0),
                                   ("time_min", self.time_min, 1), ("cpus_per_job", self.cpus_per_job, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise TomlensError(f"{name} = {value!r} must be a whole number of at least {least}",
                                   f"e.g. --{name.replace('_min', '').replace('_', '-')} {max(least, 1)}")
        if self.mem_gb is not None and not self.mem_gb > 0:
            raise TomlensError(f"mem = {self.mem_gb!r} GB must be positive", "e.g. --mem 16")
        if self.executor == "local":
            given = [n for n, v in (("--slurm-partition", self.partition), ("--mem", self.mem_gb),
                                    ("--cpus-per-job", self.cpus_per_job), ("--slurm-arg", self.slurm_args)) if v]
            if given:
                raise TomlensError(f"{', '.join(given)} applies to SLURM jobs, not the local executor",
                                   "add --executor slurm, or drop those options")

    def to_dict(self) -> dict[str, Any]:
        """Plain values for `study.json` (each job records the options it was submitted with)."""
        return {"executor": self.executor, "parallel": self.parallel, "partition": self.partition,
                "gpus_per_job": self.gpus_per_job, "time_min": self.time_min, "mem_gb": self.mem_gb,
                "cpus_per_job": self.cpus_per_job, "slurm_args": dict(self.slurm_args)}


def parse_slurm_args(items: list[str]) -> dict[str, str | bool]:
    """`KEY=VALUE` strings (`--slurm-arg constraint=a100`) as sbatch options (keys without `--`); a
    bare `KEY` is a flag (`--slurm-arg exclusive` -> `#SBATCH --exclusive`)."""
    out: dict[str, str | bool] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not key or (sep and not value):
            raise TomlensError(f"--slurm-arg {item!r} is neither KEY=VALUE nor a bare KEY",
                               "write e.g. --slurm-arg constraint=a100 or --slurm-arg exclusive")
        out[key] = value if sep else True
    return out


def slurm_parameters(options: ExecutorOptions, name: str) -> dict[str, Any]:
    """The `SlurmExecutor.update_parameters` keywords for `options`: one task on one node per job."""
    params: dict[str, Any] = {"job_name": name, "nodes": 1, "ntasks_per_node": 1, "stderr_to_stdout": True,
                              "time": options.time_min or 60}
    if options.gpus_per_job > 0:  # `--gpus-per-node=0` is refused by some clusters' job-submit plugins
        params["gpus_per_node"] = options.gpus_per_job
    if options.partition:
        params["partition"] = options.partition
    if options.mem_gb is not None:  # whole megabytes: sbatch reads no fractions ("1.5GB" is refused)
        params["mem"] = f"{int(options.mem_gb * 1024)}M"
    if options.cpus_per_job is not None:
        params["cpus_per_task"] = options.cpus_per_job
    if options.slurm_args:
        params["additional_parameters"] = dict(options.slurm_args)
    if options.parallel is not None:
        params["array_parallelism"] = options.parallel
    return params


def local_parameters(options: ExecutorOptions, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The `LocalExecutor.update_parameters` keywords for `options`. GPUs asked for are taken from
    those `environ` (this process's environment) makes visible, when it lists them by index."""
    environ = os.environ if environ is None else environ
    params: dict[str, Any] = {"timeout_min": options.time_min or LOCAL_TIMEOUT_MIN, "nodes": 1, "tasks_per_node": 1,
                              "stderr_to_stdout": True}
    if options.gpus_per_job > 0:
        params["gpus_per_node"] = options.gpus_per_job
        visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible and all(v.isdigit() for v in visible):
            if len(visible) < options.gpus_per_job:
                raise TomlensError(f"--gpus-per-job {options.gpus_per_job} but CUDA_VISIBLE_DEVICES makes "
                                   f"{len(visible)} GPU(s) visible", "ask for fewer GPUs per job")
            params["visible_gpus"] = tuple(int(v) for v in visible)
    return params


def job_environment(options: ExecutorOptions, environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """Variables a job must get back from this process's environment (None: unset). submitit's
    LocalExecutor sets CUDA_VISIBLE_DEVICES to the GPUs it hands out, "" (none) when none are asked
    for, which would hide every GPU from a job that asked for no particular number."""
    environ = os.environ if environ is None else environ
    if options.executor != "local" or options.gpus_per_job > 0:
        return {}
    return {"CUDA_VISIBLE_DEVICES": environ.get("CUDA_VISIBLE_DEVICES")}


def in_environment(environment: Mapping[str, str | None], fn: Any, *args: Any) -> Any:
    """Call `fn(*args)` in a job after setting `environment` (None unsets a variable): the job body
    the executor runs, before anything in the job has initialised CUDA."""
    for key, value in environment.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return fn(*args)


def make_executor(options: ExecutorOptions, folder: Path, name: str) -> Any:
    """A submitit executor writing its logs to `folder`."""
    import submitit

    if options.executor == "local":
        local = submitit.LocalExecutor(folder=folder)
        local.update_parameters(**local_parameters(options))
        return local
    try:
        slurm = submitit.SlurmExecutor(folder=folder)
    except RuntimeError as e:
        raise TomlensError(f"--executor slurm: {e}", "run the study on a SLURM login node, or use --executor local") from None
    slurm.update_parameters(**slurm_parameters(options, name))
    return slurm


@dataclass(frozen=True)
class StudyJob:
    """One model entry of a study: the one-model experiment it runs and where it goes."""

    slug: str
    model: ModelSpec
    config: ExperimentConfig
    folder: Path
    hash: str


@dataclass
class JobRecord:
    """What a study knows of one job (a row of `study.json`). `hash`: the job's settings and input
    files; `executor`: the `ExecutorOptions.to_dict()` it was submitted with (None: never submitted
    by a study that recorded them)."""

    slug: str
    state: str
    folder: str
    job_id: str | None = None
    seconds: float | None = None
    log: str | None = None
    error: str | None = None
    hash: str | None = None
    executor: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class StudyResult:
    """Every job's record, and the comparison of those that finished (or why there is none)."""

    out: Path
    jobs: list[JobRecord]
    waited: bool = True
    comparison: Any = None  # tomlens.runs.compare.compare_runs of the finished folders
    comparison_note: str = ""

    @property
    def finished(self) -> list[JobRecord]:
        return [j for j in self.jobs if j.state in ("done", "reused")]

    @property
    def unfinished(self) -> list[JobRecord]:
        return [j for j in self.jobs if j.state not in ("done", "reused")]

    def describe(self) -> str:
        rows = [("job", "state", "id", "seconds", "folder")]
        rows += [(j.slug, j.state, j.job_id or "-", f"{j.seconds:.0f}" if j.seconds is not None else "-", j.folder)
                 for j in self.jobs]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows]
        for j in self.jobs:
            if j.state == "failed":
                lines.append(f"failed: {j.slug}: {j.error or 'no error recorded'}; log {j.log or '(none)'}")
            elif j.state == "missing":
                lines.append(f"missing: {j.slug}: {j.error or 'no result'}; log {j.log or '(none)'}")
        return "\n".join(lines)


def job_inputs(config: ExperimentConfig) -> dict[str, str | None]:
    """The sha256 of every file the experiment's stages name (stimulus files, a BigToM csv, a pairs
    file, a probe table; None: missing), so that editing one makes a finished job stale. The
    probes stage's own table (`probe_table = "probes"`) is the job's output, not an input."""
    files: set[str] = set()
    for stage in config.stages:
        stage_cfg = config.stage_config(stage, config.models[0])
        files.update(p for p in input_files(stage_cfg) if not (stage == "patching" and p == PROBES_TABLE))
    return {p: file_sha256(p) if Path(p).is_file() else None for p in sorted(files)}


def plan_jobs(config: ExperimentConfig, out: str | Path) -> list[StudyJob]:
    """One job per model entry (revisions and seeds already expanded): its one-model experiment,
    folder `<out>/<slug>/` and the hash (settings, input files and, for weights on this machine
    such as a retrained tom-organism, their digest) a finished record must match to be reused."""
    out = Path(out)
    jobs = []
    for spec in config.models:
        one = ExperimentConfig(name=config.name, models=(spec,), seed=config.seed,
                               description=config.description, stages=config.stages)
        slug = model_slug(spec)
        keyed: dict[str, Any] = {"experiment": one.to_dict(), "inputs": job_inputs(one)}
        weights = local_weights_revision(spec.name)
        if weights is not None:  # only then: the hashes of hub and built-in jobs stay as they were
            keyed["weights"] = weights
        hash_ = config_hash(keyed)
        jobs.append(StudyJob(slug, spec, one, out / slug, hash_))
    return jobs


def _logs_of(out: Path, before: Mapping[str, Any]) -> Path:
    """The submitit folder a job submitted earlier wrote to: its recorded log's folder, else this
    command's (`study-logs`), or `sweep-logs` where only the old name's folder exists."""
    if before.get("log"):
        return Path(str(before["log"])).parent
    legacy = out / "sweep-logs"
    return legacy if legacy.is_dir() and not (out / LOGS).is_dir() else out / LOGS


def finished_record(folder: Path, hash_: str) -> dict[str, Any] | None:
    """The folder's `study-done.json` if it records a finished run of config `hash_`."""
    path = marker(folder, DONE)
    if not path.is_file():
        return None
    try:
        record = read_json(path)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("config_hash") == hash_ else None


def run_job(config: dict[str, Any], folder: str, hash_: str) -> dict[str, Any]:
    """The body of one job, in the job's own process: run the one-model experiment into `folder`,
    then write `study-done.json`; on any error write `study-failed.json` and raise, so submitit
    marks the job failed too."""
    from tomlens.provenance import versions

    t0 = time.time()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / DONE).unlink(missing_ok=True)
    (out / FAILED).unlink(missing_ok=True)
    job_id = _job_id()
    try:
        result = run_experiment(ExperimentConfig.from_dict(config), out, progress=False)
    except BaseException as e:
        write_json({"config_hash": hash_, "error": f"{type(e).__name__}: {e}", "job_id": job_id,
                    "traceback": traceback.format_exc().splitlines()[-TRACEBACK_LINES:],
                    "failed": _now(), "seconds": round(time.time() - t0, 2)}, out / FAILED)
        raise
    record = {"config_hash": hash_, "finished": _now(), "seconds": round(time.time() - t0, 2), "job_id": job_id,
              "provenance": {"model": result.manifest["models"][0]["model"], "versions": versions(),
                             "host": os.uname().nodename, "reused": result.runs[0].reused,
                             "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}}
    write_json(record, out / DONE)
    return record


def _job_id() -> str | None:
    try:
        import submitit

        return str(submitit.JobEnvironment().job_id)
    except RuntimeError:  # not inside a submitit job (called directly)
        return None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _failure(folder: Path) -> dict[str, Any]:
    try:
        path = marker(folder, FAILED)
        return read_json(path) if path.is_file() else {}
    except ValueError:
        return {}


def _previous(out: Path) -> dict[str, dict[str, Any]]:
    """The last `study.json`'s rows by slug (a `--no-wait` study's submitted job ids and hashes)."""
    path = marker(out, STUDY)
    try:
        data = read_json(path) if path.is_file() else {}
    except ValueError:
        data = {}
    rows = data.get("jobs", []) if isinstance(data, dict) else []
    return {r["slug"]: r for r in rows if isinstance(r, dict) and "slug" in r}


def _submitted_with(row: Mapping[str, Any]) -> str | None:
    """The executor a `study.json` row's job was submitted to ("local", "slurm"; None: unknown)."""
    options = row.get("executor")
    return options.get("executor") if isinstance(options, Mapping) else None


def _slurm_job(logs: Path, job_id: str) -> Any:
    """A handle on a SLURM job an earlier study submitted (whatever executor this study uses)."""
    import submitit

    return submitit.SlurmJob(folder=logs, job_id=job_id)


class StudyTerminated(KeyboardInterrupt):
    """SIGTERM stopped the study. A `KeyboardInterrupt`, so that everything Ctrl-C does on the way
    out (cancel the local jobs, write `study.json`) happens for it too; its own type lets the CLI
    exit 143 (128 + SIGTERM), the status a scheduler or a shell expects of a terminated command,
    where Ctrl-C exits 130."""


def run_study(config: ExperimentConfig, out: str | Path, options: ExecutorOptions | None = None, *,
              wait: bool = True, progress: bool = True, command: list[str] | None = None) -> StudyResult:
    """Submit every job of `config` that has not finished into `out` and (with `wait`) collect
    them all; write `<out>/study.json` and build the comparison of what finished.

    Jobs an earlier `--no-wait` study submitted to SLURM are reattached (whatever executor this call
    uses) when their recorded hash is the job's current one, else cancelled and submitted again; a
    failure one of them recorded meanwhile is reported as failed, not resubmitted (the next run
    retries it). `command`: the arguments that collect a `--no-wait` study, kept in `study.json`.
    Stopped (Ctrl-C, SIGTERM) at any point after planning, it writes `study.json` first: every job
    is listed as submitted (with its id) or as not submitted, never lost between the two."""
    import submitit  # noqa: F401 - fail here, before any folder is written, if it is missing

    options = options or ExecutorOptions()
    if not wait and options.executor == "local":
        raise TomlensError("--no-wait needs --executor slurm: local jobs are this command's subprocesses "
                           "and stop with it", "drop --no-wait, or submit to SLURM with --executor slurm")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(config.to_dict(), out / "config.json")
    study = _Study(config, out, options, plan_jobs(config, out), command)
    todo = study.triage()
    study.announce(todo)
    study.prepare(todo)
    try:
        if options.executor == "slurm" and todo:
            study.submit_array(todo)
            todo = []
            if wait:  # their ids on disk now: a stopped study's next run reattaches them instead of resubmitting
                study.finish(waited=False)
        if not wait:
            return study.finish(waited=False)
        study.wait_for_all(todo, progress)
    except KeyboardInterrupt:
        study.finish(waited=False)  # what is still running, by id
        raise
    return study.finish(waited=True)


class _Study:
    """One call of `run_study` in steps: sort the jobs (finished, reattached, to submit), submit,
    wait, write `study.json`. It holds what the steps share and change: every job's record, the
    jobs still running and when this call submitted them."""

    def __init__(self, config: ExperimentConfig, out: Path, options: ExecutorOptions, jobs: list[StudyJob],
                 command: list[str] | None):
        self.config, self.out, self.options, self.jobs, self.command = config, out, options, jobs, command
        self.logs = out / LOGS
        self.by_slug = {j.slug: j for j in jobs}
        self.records: dict[str, JobRecord] = {}
        self.running: dict[str, Any] = {}  # slug -> submitit job
        self.started: dict[str, float] = {}  # slug -> when this call submitted it
        self.failed_meanwhile = 0
        self.executor: Any = None
        self.environment = job_environment(options)

    def triage(self) -> list[StudyJob]:
        """Record the jobs that finished before and reattach those an earlier study submitted to
        SLURM with the current hash; return the ones left to submit."""
        previous = _previous(self.out)
        todo = []
        for job in self.jobs:
            before = previous.get(job.slug, {})
            if not (self._reuse(job, before) or self._reattach(job, before)):
                todo.append(job)
        return todo

    def _reuse(self, job: StudyJob, before: Mapping[str, Any]) -> bool:
        """Record `job` as done (collected now) or reused when its folder holds a finished record of
        its hash."""
        done = finished_record(job.folder, job.hash)
        if done is None:
            return False
        collected = before.get("state") == "submitted" and before.get("job_id") == done.get("job_id")
        self.records[job.slug] = JobRecord(job.slug, "done" if collected else "reused", str(job.folder),
                                           done.get("job_id"), done.get("seconds"), before.get("log"),
                                           hash=job.hash, executor=_executor_of(before))
        return True

    def _reattach(self, job: StudyJob, before: Mapping[str, Any]) -> bool:
        """Handle a job an earlier study submitted: failed while unattended (recorded), or on SLURM
        with its current hash (reattached); one with another hash is cancelled (False: resubmit)."""
        if before.get("state") != "submitted" or not before.get("job_id"):
            return False
        job_id = str(before["job_id"])
        current = before.get("hash") == job.hash
        failure = _failure(job.folder)
        if current and failure.get("config_hash") == job.hash:  # it failed while no study watched
            self.records[job.slug] = JobRecord(job.slug, "failed", str(job.folder), job_id, failure.get("seconds"),
                                               before.get("log"), failure.get("error") or "failed",
                                               hash=job.hash, executor=_executor_of(before))
            self.failed_meanwhile += 1
            return True
        if _submitted_with(before) != "slurm":
            return False
        handle = _slurm_job(_logs_of(self.out, before), job_id)
        if current:
            self.running[job.slug] = handle
            self.records[job.slug] = JobRecord(job.slug, "submitted", str(job.folder), job_id,
                                               log=before.get("log") or str(handle.paths.stdout),
                                               hash=job.hash, executor=_executor_of(before))
            return True
        handle.cancel(check=False)  # its settings or inputs changed: its result would be stale
        say(f"{job.slug}: cancelled SLURM job {job_id} (its settings or input files changed since it was "
            "submitted, or a setting it names was renamed since); submitting it again")
        return False

    def announce(self, todo: list[StudyJob]) -> None:
        """Say what this call will do, and roughly how long a job takes."""
        options = self.options
        reused = [r for r in self.records.values() if r.state in ("reused", "done")]
        say(f"study {self.config.name!r}: {len(self.jobs)} jobs, {len(reused)} finished before (not rerun), "
            + (f"{self.failed_meanwhile} failed while unattended (run again to retry), "
               if self.failed_meanwhile else "")
            + f"{len(self.running)} submitted earlier (reattached), {len(todo)} to submit ({options.executor} executor"
            + (f", {options.parallel or 1} at a time)" if options.executor == "local" else ")"))
        took = [r.seconds for r in reused if r.seconds]
        if todo and took:
            each = sorted(took)[len(took) // 2]
            say(f"about {each:.0f} s per job (the median of the finished ones)")
        elif todo:
            say("no finished job to time yet: the progress bar estimates the rest after the first")

    def prepare(self, todo: list[StudyJob]) -> None:
        """Clear the jobs' old markers (an earlier run's would make a queued job look finished or
        failed) and make the executor they go to."""
        for job in todo:
            for name in (DONE, FAILED, *(LEGACY[n] for n in (DONE, FAILED))):
                (job.folder / name).unlink(missing_ok=True)
        self.executor = make_executor(self.options, self.logs, self.config.name) if todo else None

    def _call(self, job: StudyJob) -> tuple[Any, ...]:
        return (in_environment, self.environment, run_job, job.config.to_dict(), str(job.folder), job.hash)

    def _record(self, job: StudyJob, submitted: Any) -> None:
        self.running[job.slug] = submitted
        self.started[job.slug] = time.time()
        self.records[job.slug] = JobRecord(job.slug, "submitted", str(job.folder), str(submitted.job_id),
                                           log=str(submitted.paths.stdout), hash=job.hash,
                                           executor=self.options.to_dict())

    def submit(self, job: StudyJob) -> None:
        """Submit one job and record it, with Ctrl-C and SIGTERM held until it is recorded."""
        with interrupts_held():
            self._record(job, self.executor.submit(*self._call(job)))

    def submit_array(self, todo: list[StudyJob]) -> None:
        """Submit `todo` to SLURM as one job array (the cluster's scheduler runs it) and record
        every job, with Ctrl-C and SIGTERM held until they are recorded."""
        with interrupts_held():
            with self.executor.batch():
                futures = [(job, self.executor.submit(*self._call(job))) for job in todo]
            for job, submitted in futures:
                self._record(job, submitted)
        say(f"submitted {len(futures)} SLURM jobs: {', '.join(str(j.job_id) for _, j in futures)}")

    def wait_for_all(self, queue: list[StudyJob], progress: bool) -> None:
        """Submit the local `queue` (at most `parallel` at once) and collect every running job as
        it stops."""
        from tqdm.auto import tqdm

        cap = self.options.parallel or 1
        bar = tqdm(total=len(queue) + len(self.running), desc="study jobs", unit="job", disable=not progress)
        queue = list(queue)
        local_running = 0
        with jobs_stop_with_this_command(self.running):
            while queue or self.running:
                while queue and (self.options.executor == "slurm" or local_running < cap):
                    self.submit(queue[0])
                    queue.pop(0)
                    local_running += 1
                finished = [slug for slug, j in self.running.items() if j.done()]
                if not finished:
                    time.sleep(0.5)
                    continue
                for slug in finished:
                    local_running -= self._collect_one(slug)
                    bar.update(1)
                    say(f"{slug}: {self.records[slug].state}")
        bar.close()

    def _collect_one(self, slug: str) -> int:
        """Record a job that stopped; 1 if this call submitted it (a local slot is free again)."""
        handle = self.running.pop(slug)
        seconds = time.time() - self.started.get(slug, time.time())
        self.records[slug] = _collect(self.by_slug[slug], handle, seconds, self.records[slug].executor)
        return int(slug in self.started)

    def finish(self, waited: bool) -> StudyResult:
        return _finish(self.out, self.config, self.jobs, self.records, waited=waited, command=self.command)


def _executor_of(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """The executor options a `study.json` row recorded (None: none recorded)."""
    options = row.get("executor")
    return options if isinstance(options, dict) else None


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM while a job is submitted and recorded, then raise them: stopped
    halfway, a submitted job would run with no record of its id (SLURM) or outside the study's
    reach. A second signal while held raises at once (a hung `sbatch` can still be stopped); the
    job is then recorded as not submitted. Outside the main thread signals cannot be caught, and
    nothing is held."""
    caught: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if caught:
            raise _interruption(signum)
        caught.append(signum)

    signals = (signal.SIGINT, signal.SIGTERM)
    try:
        previous = {s: signal.signal(s, hold) for s in signals}
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
    if caught:
        raise _interruption(caught[0])


def _interruption(signum: int) -> KeyboardInterrupt:
    return StudyTerminated() if signum == signal.SIGTERM else KeyboardInterrupt()


@contextlib.contextmanager
def jobs_stop_with_this_command(running: dict[str, Any]) -> Iterator[None]:
    """Ctrl-C or SIGTERM stops the study; local jobs are its subprocesses, so they are cancelled too
    (left alone, one went on writing into the study folder after its study was killed). SLURM jobs
    run on: the same command later reattaches and collects them. SIGTERM raises `StudyTerminated`."""
    def stop(signum: int, frame: Any) -> None:
        raise StudyTerminated

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: signals cannot be caught here
        previous = None
    try:
        yield
    except KeyboardInterrupt:
        _cancel_local_jobs(running)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _cancel_local_jobs(running: dict[str, Any]) -> None:
    """Cancel the local jobs in `running` and name the SLURM jobs left running, on stderr (through
    tqdm, which keeps a progress bar intact)."""
    import submitit

    cluster = []
    for slug, job in running.items():
        if isinstance(job, submitit.LocalJob):
            job.cancel(check=False)
            warn(f"{slug}: cancelled local job {job.job_id} (the study was stopped; run the same command "
                       "to submit it again)")
        else:
            cluster.append(slug)
    if cluster:
        warn(f"{len(cluster)} SLURM jobs keep running ({', '.join(cluster)}); run the same command to "
                   "collect them")


def _collect(job: StudyJob, submitted: Any, seconds: float, executor: dict[str, Any] | None) -> JobRecord:
    """The record of a job that has stopped: done if it left a finished record, else failed with
    the error it recorded (or submitit's, when it died before it could write one)."""
    log = str(submitted.paths.stdout)
    error = None
    try:
        submitted.result()
    except Exception as e:  # noqa: BLE001 - the job's own failure, recorded, not raised
        error = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    done = finished_record(job.folder, job.hash)
    if done is not None and error is None:
        return JobRecord(job.slug, "done", str(job.folder), str(submitted.job_id), done.get("seconds", seconds), log,
                         hash=job.hash, executor=executor)
    failure = _failure(job.folder)
    if not failure:  # killed (timeout, memory) before the job could say why
        failure = {"config_hash": job.hash, "error": error or "the job stopped without a result",
                   "job_id": str(submitted.job_id), "traceback": [], "failed": _now(), "seconds": round(seconds, 2)}
        write_json(failure, job.folder / FAILED)
    return JobRecord(job.slug, "failed", str(job.folder), str(submitted.job_id),
                     failure.get("seconds", seconds), log, failure.get("error") or error, job.hash, executor)


def _finish(out: Path, config: ExperimentConfig, jobs: list[StudyJob], records: dict[str, JobRecord],
            waited: bool, command: list[str] | None = None) -> StudyResult:
    """Write `study.json` (every job, finished or not) and the top-level manifest (the finished
    jobs' model entries, and the unfinished ones by folder and state), and compare what finished."""
    rows = []
    for job in jobs:
        record = records.get(job.slug) or JobRecord(job.slug, "missing", str(job.folder), error="never submitted",
                                                    hash=job.hash)
        if waited and record.state == "submitted":
            record.state = "missing"
        rows.append(record)
    result = StudyResult(out, rows, waited=waited)
    manifests = [read_json(Path(r.folder) / "manifest.json")["models"][0] for r in result.finished
                 if (Path(r.folder) / "manifest.json").is_file()]
    unfinished = [{"slug": r.slug, "state": r.state, "folder": r.folder} for r in result.unfinished]
    write_json({"name": config.name, "argv": list(sys.argv), "models": manifests, "unfinished": unfinished,
                "study": STUDY}, out / "manifest.json")
    write_json({"version": STUDY_VERSION, "name": config.name, "time": _now(), "waited": waited,
                "collect": command, "jobs": [r.to_dict() for r in rows]}, out / STUDY)
    if waited:
        result.comparison, result.comparison_note = compare_finished(result)
    return result


def compare_finished(result: StudyResult) -> tuple[Any, str]:
    """`compare_runs` over the finished folders, naming the jobs that did not finish as missing;
    (None, why) when there is nothing to compare or the comparison module is not installed."""
    folders = [Path(j.folder) for j in result.finished]
    missing = [j.slug for j in result.unfinished]
    if not folders:
        return None, "no job finished: nothing to compare"
    try:
        from tomlens.runs.compare import compare_runs
    except ModuleNotFoundError as e:
        if e.name != "tomlens.runs.compare":
            raise
        return None, "comparison not built: tomlens.runs.compare is not available in this install"
    return compare_runs(folders, missing=missing), ""
