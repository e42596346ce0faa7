"""Studies through submitit: `revisions` / `seeds` lists expand to one model entry per value; a local
study runs one subprocess job per entry into the multi-model layout, is reused on a second
invocation, records a failed job while the others finish (exit 1); SLURM options map onto
submitit's SlurmExecutor parameters; bad input exits 2."""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.models.registry import local_weights_revision
from tomlens.runs.experiment import ExperimentConfig, expand_model_entry, model_slug
from tomlens.runs.study import (
    DONE,
    FAILED,
    LOGS,
    STUDY,
    ExecutorOptions,
    finished_record,
    in_environment,
    job_environment,
    local_parameters,
    make_executor,
    parse_slurm_args,
    plan_jobs,
    slurm_parameters,
)

STUDY_TOML = """
name = "seed-study"
description = "two weight seeds of a tiny random model"
[[models]]
name = "random:tiny-llama"
seeds = [0, 1]

[[behaviour.stimuli]]
family = "unexpected-transfer"
n = 1

[probes]
stimuli = {family = "order-only", n = 4, seed = 1}
targets = ["protagonist_belief"]
sites = ["resid_post"]
positions = ["final"]
folds = 2
inner_folds = 2
c_grid = [1.0]
n_boot = 20
n_permutations = 9
random_twin = false
format = "csv"
"""
STAGES = {"behaviour": {"stimuli": [{"family": "unexpected-transfer", "n": 1}]}}


@pytest.fixture(scope="module")
def study_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("study") / "study.toml"
    path.write_text(STUDY_TOML, encoding="utf-8")
    return path


# -- expansion (unit) ------------------------------------------------------------------------------
def test_revisions_and_seeds_expand_to_one_model_per_value():
    config = ExperimentConfig.from_dict({"name": "x", **STAGES, "models": [
        {"name": "random:tiny-llama", "seeds": [0, 3]},
        {"name": "smollm2-135m", "revisions": ["step100", "step200"], "dtype": "float32"}]})
    got = [(m.name, m.revision, m.seed, m.dtype) for m in config.models]
    assert got == [("random:tiny-llama", None, 0, None), ("random:tiny-llama", None, 3, None),
                   ("smollm2-135m", "step100", 0, "float32"), ("smollm2-135m", "step200", 0, "float32")]
    assert [model_slug(m) for m in config.models] == ["random-tiny-llama", "random-tiny-llama-seed3",
                                                      "smollm2-135m@step100-float32", "smollm2-135m@step200-float32"]
    both = expand_model_entry({"name": "random:tiny-llama", "revisions": ["a", "b"], "seeds": [1, 2]}, "models[0]")
    assert [(e["revision"], e["seed"]) for e, _ in both] == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    assert both[3][1] == "models[0].revisions[1].seeds[1]"
    # a single [model] table with a list is several models; the resolved config reads back the same
    one = ExperimentConfig.from_dict({"name": "x", **STAGES, "model": {"name": "tiny-gpt2", "seeds": [1, 2]}})
    assert [m.seed for m in one.models] == [1, 2]
    assert ExperimentConfig.from_dict(one.to_dict()).models == one.models


@pytest.mark.parametrize("entry, says", [
    ({"name": "tiny-llama", "seeds": []}, "not a non-empty list"),
    ({"name": "tiny-llama", "seeds": 3}, "not a non-empty list"),
    ({"name": "tiny-llama", "seeds": [1, 1]}, "twice"),
    ({"name": "tiny-llama", "seeds": [1, 2], "seed": 1}, "both `seed` and `seeds`"),
    ({"name": "smollm2-135m", "revisions": ["a"], "revision": "b"}, "both `revision` and `revisions`"),
    ({"name": "smollm2-135m", "seeds": [0, 1]}, "has trained weights"),
])
def test_bad_lists_are_one_clear_error(entry, says):
    with pytest.raises(TomlensError, match=says) as e:
        ExperimentConfig.from_dict({"name": "x", **STAGES, "models": [entry]})
    assert "models[0]" in e.value.problem and e.value.fix


def test_a_list_that_repeats_another_entry_is_refused():
    with pytest.raises(TomlensError, match="share a folder name"):
        ExperimentConfig.from_dict({"name": "x", **STAGES, "models": [
            {"name": "tiny-llama", "seeds": [0, 1]}, {"name": "tiny-llama", "seed": 1}]})


def test_plan_gives_one_one_model_job_per_entry_with_a_hash_that_follows_the_settings(study_file, tmp_path):
    config = ExperimentConfig.load(study_file)
    jobs = plan_jobs(config, tmp_path)
    assert [j.slug for j in jobs] == ["random-tiny-llama", "random-tiny-llama-seed1"]
    assert all(len(j.config.models) == 1 and j.folder == tmp_path / j.slug for j in jobs)
    assert jobs[0].hash != jobs[1].hash
    changed = plan_jobs(ExperimentConfig.load(study_file, ["probes.n_boot=30"]), tmp_path)
    assert changed[0].hash != jobs[0].hash
    presentation = plan_jobs(ExperimentConfig.load(study_file, ["probes.format=parquet"]), tmp_path)
    assert presentation[0].hash == jobs[0].hash  # where output goes does not make a job stale


def test_editing_a_stimulus_file_makes_its_finished_job_stale(tmp_path):
    """The hash covers each input file's content, not only its path: a finished job whose stimuli
    file was edited is not reused (it is resubmitted)."""
    stimuli = tmp_path / "stories.jsonl"
    stimuli.write_text('{"story": "first version"}\n', encoding="utf-8")
    config = ExperimentConfig.from_dict({"name": "x", "models": [{"name": "tiny-llama"}],
                                         "behaviour": {"stimuli": [{"path": str(stimuli)}]}})
    job = plan_jobs(config, tmp_path / "out")[0]
    job.folder.mkdir(parents=True)
    (job.folder / DONE).write_text(json.dumps({"config_hash": job.hash, "job_id": "1"}))
    assert finished_record(job.folder, plan_jobs(config, tmp_path / "out")[0].hash) is not None  # unchanged: reused
    stimuli.write_text('{"story": "second version"}\n', encoding="utf-8")
    again = plan_jobs(config, tmp_path / "out")[0]
    assert again.hash != job.hash and finished_record(again.folder, again.hash) is None  # stale: resubmitted
    stimuli.unlink()
    assert plan_jobs(config, tmp_path / "out")[0].hash not in (job.hash, again.hash)  # a missing file too


def test_new_weights_under_the_same_name_make_a_finished_job_stale(tmp_path):
    """A folder model (or a retrained tom-organism) keeps its name when its weights change: the
    job hash follows the weights' digest, while a hub or tiny model's hash does not get the key."""
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    (folder / "model.safetensors").write_bytes(b"first weights")
    config = ExperimentConfig.from_dict({"name": "x", "models": [{"name": str(folder)}, {"name": "tiny-llama"}],
                                         **STAGES})
    first = plan_jobs(config, tmp_path / "out")
    (folder / "model.safetensors").write_bytes(b"retrained weights, longer")
    second = plan_jobs(config, tmp_path / "out")
    assert second[0].hash != first[0].hash  # new weights: not reused
    assert second[1].hash == first[1].hash
    assert local_weights_revision("tiny-llama") is None and local_weights_revision("org/some-hub-model") is None
    assert local_weights_revision("tom-organism").startswith("sha256:")
    assert local_weights_revision("random:tom-organism").startswith("config:")


# -- local GPUs (unit: one real submitit subprocess each) -------------------------------------------
def test_local_jobs_see_the_gpus_this_process_sees(tmp_path, monkeypatch):
    """submitit's LocalExecutor sets CUDA_VISIBLE_DEVICES="" unless GPUs are asked for; a job that
    asked for none must see this process's GPUs (any format: indices, UUIDs, MIG), or none if unset."""
    options = ExecutorOptions()
    assert "gpus_per_node" not in local_parameters(options)
    executor = make_executor(options, tmp_path / "logs", "gpu-check")
    assert executor.submit(os.getenv, "CUDA_VISIBLE_DEVICES", "unset").result() == ""  # the defect, unguarded
    for value in ("GPU-5f1c9e0a", "1,3", None):
        if value is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        env = job_environment(options)
        assert env == {"CUDA_VISIBLE_DEVICES": value}
        seen = executor.submit(in_environment, env, os.getenv, "CUDA_VISIBLE_DEVICES", "unset").result()
        assert seen == (value if value is not None else "unset"), value
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5,7")  # GPUs asked for come from the visible ones
    two = ExecutorOptions(gpus_per_job=2)
    assert local_parameters(two)["gpus_per_node"] == 2 and local_parameters(two)["visible_gpus"] == (2, 5, 7)
    assert job_environment(two) == {}  # submitit hands out "2,5"
    with pytest.raises(TomlensError, match="makes 3 GPU"):
        local_parameters(ExecutorOptions(gpus_per_job=4))


# -- SLURM parameters (unit, no cluster) ------------------------------------------------------------
def test_slurm_options_map_onto_submitits_slurm_executor(tmp_path):
    options = ExecutorOptions(executor="slurm", parallel=3, partition="gpu", gpus_per_job=1, time_min=90,
                              mem_gb=16, cpus_per_job=4, slurm_args=parse_slurm_args(["constraint=a100", "--qos=high"]))
    params = slurm_parameters(options, "study")
    assert params == {"job_name": "study", "nodes": 1, "ntasks_per_node": 1, "stderr_to_stdout": True, "time": 90,
                      "gpus_per_node": 1, "partition": "gpu", "mem": "16384M", "cpus_per_task": 4,
                      "additional_parameters": {"constraint": "a100", "qos": "high"}, "array_parallelism": 3}
    with mock.patch("submitit.slurm.slurm.SlurmExecutor.affinity", return_value=1):  # pretend srun is here
        executor = make_executor(options, tmp_path, "study")
    assert {k: executor.parameters[k] for k in params} == params  # submitit accepted every key
    sbatch = executor._make_submission_file_text("python -m x", "uid")  # the script sbatch would get
    for line in ("--partition=gpu", "--gpus-per-node=1", "--time=90", "--mem=16384M", "--cpus-per-task=4",
                 "--constraint=a100", "--qos=high", "--job-name=study"):
        assert line in sbatch, line
    # no GPU: no --gpus-per-node line at all; fractional memory in whole megabytes; a bare KEY is a flag
    plain = ExecutorOptions(executor="slurm", mem_gb=1.5, slurm_args=parse_slurm_args(["exclusive"]))
    params = slurm_parameters(plain, "study")
    assert "gpus_per_node" not in params and params["mem"] == "1536M"
    with mock.patch("submitit.slurm.slurm.SlurmExecutor.affinity", return_value=1):
        sbatch = make_executor(plain, tmp_path, "study")._make_submission_file_text("python -m x", "uid")
    assert "gpus-per-node" not in sbatch and "#SBATCH --mem=1536M" in sbatch and "#SBATCH --exclusive\n" in sbatch
    with mock.patch("submitit.slurm.slurm.SlurmExecutor.affinity", return_value=0):  # no srun: not a cluster
        with pytest.raises(TomlensError, match="slurm"):
            make_executor(options, tmp_path, "study")


@pytest.mark.parametrize("argv, says", [
    (["--no-wait"], "--no-wait needs --executor slurm"),
    (["--slurm-partition", "gpu"], "applies to SLURM jobs"),
    (["--cpus-per-job", "4"], "applies to SLURM jobs"),
    (["--parallel", "0"], "parallel = 0"),
    (["--executor", "slurm", "--slurm-arg", "constraint="], "neither KEY=VALUE nor a bare KEY"),
    (["--set", "models.0.seeds=[]"], "not a non-empty list"),
])
def test_bad_input_exits_2_with_the_problem(study_file, tmp_path, capsys, argv, says):
    assert main(["study", str(study_file), "--out", str(tmp_path / "out"), *argv]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out" / STUDY).exists()


def test_a_missing_file_exits_2(tmp_path, capsys):
    assert main(["study", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- local executor (subprocess jobs on tiny models) -----------------------------------------------
def _study(study_file: Path, out: Path, *extra: str) -> int:
    return main(["study", str(study_file), "--out", str(out), "--parallel", "2", "--no-progress", *extra])


@pytest.mark.integration
def test_local_study_runs_each_seed_as_a_job_then_reuses_them(study_file, tmp_path, capsys):
    out = tmp_path / "study"
    assert _study(study_file, out) == 0
    printed = capsys.readouterr().out
    jobs = json.loads((out / STUDY).read_text())["jobs"]
    assert [(j["slug"], j["state"]) for j in jobs] == [("random-tiny-llama", "done"), ("random-tiny-llama-seed1", "done")]
    for job in jobs:
        folder = out / job["slug"]
        assert folder.is_dir() and Path(job["folder"]) == folder and job["job_id"] and job["seconds"] > 0
        assert (folder / "behaviour" / "result.json").is_file() and (folder / "probes" / "result.json").is_file()
        done = json.loads((folder / DONE).read_text())
        assert done["job_id"] == job["job_id"] and done["config_hash"] and done["finished"]
        assert done["provenance"]["model"]["model"] == "random:tiny-llama" and "torch" in done["provenance"]["versions"]
        assert done["provenance"]["cuda_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES")  # not hidden
        assert job["hash"] == done["config_hash"] and job["executor"]["executor"] == "local"
        assert Path(job["log"]).is_file() and Path(job["log"]).parent == out / LOGS
    seeds = [json.loads((out / j["slug"] / DONE).read_text())["provenance"]["model"]["seed"] for j in jobs]
    assert seeds == [0, 1]  # each job loaded its own weights
    assert json.loads((out / "config.json").read_text())["models"][1]["seed"] == 1  # the multi-model layout
    assert "random-tiny-llama-seed1" in printed and "done" in printed
    logs = sorted((out / LOGS).iterdir())

    assert _study(study_file, out) == 0  # again: nothing is resubmitted
    printed = capsys.readouterr().out
    again = json.loads((out / STUDY).read_text())["jobs"]
    assert [j["state"] for j in again] == ["reused", "reused"]
    assert [j["job_id"] for j in again] == [j["job_id"] for j in jobs]
    assert sorted((out / LOGS).iterdir()) == logs  # no new job was submitted
    assert "0 to submit" in printed

    record = json.loads((out / STUDY).read_text())  # as a `--no-wait` study leaves it: submitted
    record["jobs"] = [{**j, "state": "submitted"} for j in record["jobs"]]
    (out / STUDY).write_text(json.dumps(record))
    assert _study(study_file, out) == 0  # collecting: the jobs it submitted finished, so "done"
    assert [j["state"] for j in json.loads((out / STUDY).read_text())["jobs"]] == ["done", "done"]
    assert sorted((out / LOGS).iterdir()) == logs


@pytest.mark.integration
def test_a_failed_job_is_recorded_and_the_other_finishes(study_file, tmp_path, capsys):
    out = tmp_path / "study"
    models = 'models=[{name = "no-such-model"}, {name = "random:tiny-llama", seed = 2}]'
    assert _study(study_file, out, "--set", models) == 1
    printed = capsys.readouterr().out
    jobs = {j["slug"]: j for j in json.loads((out / STUDY).read_text())["jobs"]}
    assert jobs["no-such-model"]["state"] == "failed" and jobs["random-tiny-llama-seed2"]["state"] == "done"
    failed = json.loads((out / "no-such-model" / FAILED).read_text())
    assert "no-such-model" in failed["error"] and failed["traceback"] and failed["job_id"] == jobs["no-such-model"]["job_id"]
    assert "no-such-model" in jobs["no-such-model"]["error"]
    assert not (out / "no-such-model" / DONE).exists() and (out / "random-tiny-llama-seed2" / DONE).is_file()
    assert "not finished: no-such-model (failed; log " in printed and jobs["no-such-model"]["log"] in printed
    assert "1/2 jobs finished" in printed
    manifest = json.loads((out / "manifest.json").read_text())  # finished models, and what did not finish
    assert [m["model"]["model"] for m in manifest["models"]] == ["random:tiny-llama"]
    assert manifest["unfinished"] == [{"slug": "no-such-model", "state": "failed", "folder": str(out / "no-such-model")}]
    missing = (out / "compare" / "missing.csv").read_text()  # the comparison of what finished says what is not
    assert "no-such-model" in missing and "random-tiny-llama-seed2" not in missing


def _stand_in_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stand-in `sbatch` (job 4242, then 4243, ...) and `scancel` on PATH, each logging its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/sh\nd="$(dirname "$0")"\necho "$@" >> "$d/calls"\n'
                                    'echo "Submitted batch job $((4241 + $(wc -l < "$d/calls")))"\n')
    (bin_dir / "scancel").write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/cancelled"\n')
    for name in ("sbatch", "scancel"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def test_slurm_no_wait_submits_one_array_then_collects_reattaches_or_resubmits(study_file, tmp_path, capsys,
                                                                               monkeypatch):
    """`--executor slurm --no-wait` against stand-in `sbatch`/`scancel` (no cluster here): one job array
    with the options passed through, every job recorded as submitted with its hash and options; the
    same command again reattaches (nothing resubmitted); changed settings cancel and resubmit; failures
    recorded while unattended are collected as failed, whatever executor the collecting command names."""
    bin_dir = _stand_in_slurm(tmp_path, monkeypatch)
    out = tmp_path / "study"
    argv = ["study", str(study_file), "--out", str(out), "--executor", "slurm",
            "--slurm-partition", "gpu", "--gpus-per-job", "1", "--time", "30", "--mem", "8",
            "--slurm-arg", "constraint=a100", "--no-progress"]
    with mock.patch("submitit.slurm.slurm.SlurmExecutor.affinity", return_value=1):
        assert main([*argv, "--no-wait"]) == 0
    printed = capsys.readouterr().out
    study = json.loads((out / STUDY).read_text())
    jobs = study["jobs"]
    assert [(j["state"], j["job_id"]) for j in jobs] == [("submitted", "4242_0"), ("submitted", "4242_1")]
    assert len(_lines(bin_dir / "calls")) == 1  # one array, not one sbatch per job
    script = next((out / LOGS).glob("*.sh")).read_text()
    for line in ("--partition=gpu", "--gpus-per-node=1", "--time=30", "--mem=8192M", "--constraint=a100", "--array=0-1"):
        assert line in script, line
    assert not any((out / j["slug"] / DONE).exists() for j in jobs)
    hashes = [j["hash"] for j in jobs]
    assert [h for h in hashes if len(h) == 16] == hashes and hashes == [j.hash for j in plan_jobs(
        ExperimentConfig.load(study_file), out)]
    assert jobs[0]["executor"] == {"executor": "slurm", "parallel": None, "partition": "gpu", "gpus_per_job": 1,
                                   "time_min": 30, "mem_gb": 8.0, "cpus_per_job": None,
                                   "slurm_args": {"constraint": "a100"}}
    collect = ["tomlens", *argv]  # the full command without --no-wait
    assert study["collect"] == collect and f"collect with: {' '.join(collect)}" in printed and "--no-wait" not in \
        printed.split("collect with:")[1]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["models"] == [] and [(u["slug"], u["state"]) for u in manifest["unfinished"]] == [
        (j["slug"], "submitted") for j in jobs]

    assert main([*argv, "--no-wait"]) == 0  # the same settings: reattached, nothing resubmitted or cancelled
    assert "2 submitted earlier (reattached), 0 to submit" in capsys.readouterr().out
    assert [j["job_id"] for j in json.loads((out / STUDY).read_text())["jobs"]] == ["4242_0", "4242_1"]
    assert len(_lines(bin_dir / "calls")) == 1 and not _lines(bin_dir / "cancelled")

    changed = [*argv, "--set", "probes.n_boot=30"]  # another hash: the queued jobs would be stale
    with mock.patch("submitit.slurm.slurm.SlurmExecutor.affinity", return_value=1):
        assert main([*changed, "--no-wait"]) == 0
    assert "cancelled SLURM job 4242_0" in capsys.readouterr().out
    assert sorted(_lines(bin_dir / "cancelled")) == ["4242_0", "4242_1"] and len(_lines(bin_dir / "calls")) == 2
    jobs = json.loads((out / STUDY).read_text())["jobs"]
    assert [j["job_id"] for j in jobs] == ["4243_0", "4243_1"] and all(j["hash"] not in hashes for j in jobs)

    for j in jobs:  # both fail on the cluster while no study watches
        (out / j["slug"]).mkdir(exist_ok=True)
        (out / j["slug"] / FAILED).write_text(json.dumps({"config_hash": j["hash"], "error": "CUDA out of memory",
                                                          "job_id": j["job_id"], "seconds": 3.0}))
    collect_locally = ["study", str(study_file), "--out", str(out), "--set", "probes.n_boot=30", "--no-progress"]
    assert main(collect_locally) == 1  # collected with the default (local) executor: reported, not resubmitted
    printed = capsys.readouterr().out
    jobs = json.loads((out / STUDY).read_text())["jobs"]
    assert [(j["state"], j["job_id"], j["error"]) for j in jobs] == [("failed", "4243_0", "CUDA out of memory"),
                                                                     ("failed", "4243_1", "CUDA out of memory")]
    assert all((out / j["slug"] / FAILED).is_file() for j in jobs) and len(_lines(bin_dir / "calls")) == 2
    assert "2 failed while unattended" in printed and "0 to submit" in printed and "0/2 jobs finished" in printed
    assert [u["state"] for u in json.loads((out / "manifest.json").read_text())["unfinished"]] == ["failed", "failed"]


def _sleep_then_write(path: str) -> None:
    import time as _time

    _time.sleep(3)
    Path(path).write_text("the job outlived its study")


def test_stopping_the_study_cancels_its_local_jobs_and_leaves_cluster_jobs(tmp_path, capsys):
    """SIGTERM (or Ctrl-C) on `tomlens study`: its local jobs are its subprocesses and stop with it
    (one left running went on writing into the study folder); a SLURM job (reattached by a local
    study) is not cancelled; the interruption propagates and the SIGTERM handler is restored."""
    import signal
    import time

    import submitit

    from tomlens.runs.study import jobs_stop_with_this_command

    executor = submitit.LocalExecutor(folder=tmp_path / "logs")
    executor.update_parameters(timeout_min=2)
    marker = tmp_path / "written"
    job = executor.submit(_sleep_then_write, str(marker))
    cluster = mock.Mock(spec=["cancel", "job_id"], job_id="123")
    running = {"job-a": job, "job-b": cluster}
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with jobs_stop_with_this_command(running):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    deadline = time.time() + 20
    while not job.done() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(4)  # past the job's 3 s: had it run on, it would have written by now
    assert job.done() and not marker.exists()
    cluster.cancel.assert_not_called()
    err = capsys.readouterr().err
    assert "job-a: cancelled local job" in err and "1 SLURM jobs keep running (job-b)" in err
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is the study's only while it waits


def test_the_old_command_name_still_parses_to_a_study() -> None:
    from tomlens.cli import build_parser
    from tomlens.cli import study as study_cli

    args = build_parser().parse_args(["sweep", "examples/family-study.toml"])
    assert args.command == "sweep" and args.func is study_cli.run  # run() prints the rename line for it


def test_a_folder_the_old_name_wrote_reads_as_a_study(tmp_path) -> None:
    from tomlens.runs.study import DONE, FAILED, STUDY, finished_record, marker

    (tmp_path / "sweep-done.json").write_text(json.dumps({"config_hash": "abc"}))
    (tmp_path / "sweep.json").write_text(json.dumps({"jobs": []}))
    assert marker(tmp_path, DONE).name == "sweep-done.json" and marker(tmp_path, STUDY).name == "sweep.json"
    assert finished_record(tmp_path, "abc") == {"config_hash": "abc"}  # a finished job is reused, not rerun
    assert marker(tmp_path, FAILED).name == "study-failed.json"  # neither exists: the new name
    (tmp_path / "study-done.json").write_text(json.dumps({"config_hash": "new"}))
    assert finished_record(tmp_path, "new") is not None  # the new file wins once written
