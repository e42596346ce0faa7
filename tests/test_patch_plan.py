"""Patch sweeps with a plan, a budget and a resume: the plan counts the runs that are made, a dry run
writes nothing, an over-budget plan is refused, a killed run resumes to the same tables, and an
out-of-memory forward shrinks its batch and gives the same numbers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import BIGTOM_ROW, short_pairs
from safetensors import safe_open

import tomlens.patching.engine as patching
from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.hooks.patch import logits_of
from tomlens.models import encode
from tomlens.models.positions import resolve_positions
from tomlens.patching.cells import plan_cells
from tomlens.patching.checkpoints import Checkpoints
from tomlens.patching.engine import Stage
from tomlens.patching.exact import ExactSweep, exact_patching
from tomlens.patching.pairs import prepare_pairs
from tomlens.patching.plan import parse_positions
from tomlens.runs.base import ModelSpec
from tomlens.runs.patching import PatchingConfig
from tomlens.runs.patching import run as run_patching
from tomlens.runs.patching_summary import summary_dict
from tomlens.stimuli import generate
from tomlens.stimuli.pairs import make_pairs, write_pairs


def patch_and_save(model, pairs, out, **settings):
    """A patching run on a loaded tiny-gpt2 with its checkpoints under `out`, saved there; its summary."""
    config = PatchingConfig(model=ModelSpec("tiny-gpt2"), **{"force": True, **settings})  # random model: gate fails
    result = run_patching(config, model=model, pairs=pairs, out=out, progress=False)
    result.save(out)
    return summary_dict(result.summary)  # as result.json holds it


@pytest.fixture
def ut_pairs(load_tiny):
    """Four generated unexpected-transfer pairs (they carry the query role spans)."""
    model = load_tiny("tiny-gpt2")
    pairs, report = make_pairs("unexpected-transfer", n=2, seed=0, tokenizer=model.tokenizer, contrasts=("present",))
    assert len(pairs) == 4, report.summary()
    return model, pairs


class RunCounter:
    """Counts the patched runs each stage sends through the engine."""

    def __init__(self, monkeypatch):
        self.by_stage: dict[str, int] = {}
        self.current = ""
        real_run, real_patched = Stage.run, patching.run_patched

        def stage_run(stage, *args, **kwargs):
            self.current = stage.name
            return real_run(stage, *args, **kwargs)

        def run_patched(model, group, runs, *args, **kwargs):
            self.by_stage[self.current] = self.by_stage.get(self.current, 0) + len(runs)
            return real_patched(model, group, runs, *args, **kwargs)

        monkeypatch.setattr(Stage, "run", stage_run)
        monkeypatch.setattr(patching, "run_patched", run_patched)


# ---- role positions ---------------------------------------------------------------------------


def test_query_role_spans_point_at_the_question(load_tiny):
    tok = load_tiny("tiny-gpt2").tokenizer
    for s in generate("unexpected-transfer", n=2, seed=1) + generate("unexpected-contents", n=2, seed=1):
        q = s.spans["query"]
        obj = s.meta["object"] if s.family == "unexpected-transfer" else s.meta["container"]
        assert s.span_text("query_object") == obj and q.start <= s.spans["query_object"].start < q.end
        if "query_protagonist" in s.spans:
            assert s.span_text("query_protagonist") == s.meta["protagonist"]
            assert q.start <= s.spans["query_protagonist"].start and s.spans["protagonist"].start < q.start
        else:  # only the transfer reality prompt ("The notebook is now in the") names no one
            assert s.family == "unexpected-transfer" and s.prompt_type == "reality"
    belief = [s for s in generate("unexpected-transfer", n=1, seed=1) if s.prompt_type == "belief"][:2]
    batch = encode(load_tiny("tiny-gpt2"), [s.text for s in belief])
    pos = resolve_positions(belief, batch, ["protagonist", "query_protagonist", "query_object", "final"])
    for row, s in enumerate(belief):
        ids = batch.input_ids[row]
        assert tok.decode(ids[pos[row, 1]]).strip() in s.meta["protagonist"]
        assert tok.decode(ids[pos[row, 2]]).strip() in s.meta["object"]
        assert pos[row, 0] < pos[row, 1] < pos[row, 3] and pos[row, 2] < pos[row, 3]


def test_bigtom_pairs_have_the_question_protagonist(load_tiny, tmp_path):
    csv = tmp_path / "mini.csv"
    csv.write_text(BIGTOM_ROW + "\n", encoding="utf-8")
    pairs, _ = make_pairs("bigtom", None, 0, tokenizer=load_tiny("tiny-gpt2").tokenizer, path=csv)
    for s in (pairs[0].clean, pairs[0].corrupted):
        span = s.spans["query_protagonist"]
        assert s.span_text("query_protagonist") == "Mina" and span.start > s.text.rindex("Answer:")


def test_positions_syntax():
    kinds = ["head", "resid_pre"]
    default = parse_positions("", kinds)
    assert default.spec == {"head": ("final", "query_protagonist", "query_object"),
                            "resid_pre": ("final", "contrast", "query_protagonist", "query_object")}
    assert default.rank_position() == "final"
    old = parse_positions("all", kinds)
    assert old.spec == {"head": ("all",), "resid_pre": ("each",)} and old.rank_position() == "all"
    mixed = parse_positions("roles,heads=contrast,resid=object:first", kinds)
    assert mixed.spec["head"] == ("final", "query_protagonist", "query_object", "contrast")
    assert mixed.spec["resid_pre"][-1] == "object:first"
    assert parse_positions("heads=each,resid=final", kinds).spec == {"head": ("each",), "resid_pre": ("final",)}
    with pytest.raises(TomlensError, match=r"site\(s\) \['resid_pre'\] no position"):
        parse_positions("heads=each", kinds)
    with pytest.raises(TomlensError, match="does not include"):
        parse_positions("mlp=final", kinds)
    with pytest.raises(TomlensError, match="not first or last"):
        parse_positions("object:middle", kinds)


# ---- the plan -----------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["roles", "all"])
def test_plan_counts_equal_the_runs_made(ut_pairs, tmp_path, monkeypatch, capsys, positions):
    model, pairs = ut_pairs
    counter = RunCounter(monkeypatch)
    summary = patch_and_save(model, pairs, tmp_path / "out", method="both", positions=(positions,), top_k=2,
                             n_random=2, format="csv", chunk_runs=40)
    plan = {s["name"]: s for s in summary["plan"]["stages"]}
    assert counter.by_stage == {
        "exact-denoise": plan["exact denoise"]["runs"],
        f"topk-denoise-{summary['rank_position']}": plan["top-k recovery"]["runs"],
        "ablation-final": plan["mean ablation (final)"]["runs"],
    }
    assert plan["attribution denoise"]["runs"] == 0
    assert sum(counter.by_stage.values()) == summary["plan"]["total_runs"]
    cells = pd.read_csv(tmp_path / "out" / "cells_exact_denoise.csv")
    assert plan["exact denoise"]["units"] == len(cells)
    n_select = summary["pairs"]["selection"]["n"]  # cells are patched on the selection pairs only
    if positions == "all":  # cells patched only before the first differing token need no run
        assert plan["exact denoise"]["runs"] < len(cells) * n_select
        assert set(cells.position) == {"all", "each"}
    else:  # every role position lies after the first differing token: every cell and pair runs
        assert plan["exact denoise"]["runs"] == len(cells) * n_select
        assert set(cells.position) == {"final", "contrast", "query_protagonist", "query_object"}
        assert set(cells[cells.kind == "head"].position) == {"final", "query_protagonist", "query_object"}
    printed = capsys.readouterr().out
    assert "plan (4 pairs" in printed and f"{summary['plan']['total_runs']:,} patched runs" in printed
    assert "estimated" in printed and "timed:" in printed
    assert not (tmp_path / "out" / ".partial").exists()  # checkpoints go once the outputs are written


def test_dry_run_prints_the_plan_and_writes_nothing(ut_pairs, tmp_path, capsys):
    model, pairs = ut_pairs
    pairs_file = write_pairs(pairs, tmp_path / "pairs.jsonl")
    out = tmp_path / "out"
    code = main(["patch", "--model", "tiny-gpt2", "--pairs", str(pairs_file), "--out", str(out), "--dry-run",
                 "--no-progress", "--max-runs", "10", "--force"])
    printed = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert "exact denoise" in printed and "top-k recovery" in printed and "mean ablation" in printed
    assert "estimated" in printed and "over --max-runs 10" in printed and "nothing written" in printed


def test_max_runs_refuses_before_running(ut_pairs, tmp_path, monkeypatch, capsys):
    model, pairs = ut_pairs
    pairs_file = write_pairs(pairs, tmp_path / "pairs.jsonl")
    counter = RunCounter(monkeypatch)
    out = tmp_path / "out"
    code = main(["patch", "--model", "tiny-gpt2", "--pairs", str(pairs_file), "--out", str(out),
                 "--positions", "all", "--max-runs", "100", "--no-progress", "--force"])
    captured = capsys.readouterr()
    assert code == 2 and counter.by_stage == {} and not out.exists()
    total = int(captured.out.split("total")[1].split("patched runs")[0].replace(",", ""))
    assert total > 100 and f"needs {total:,} patched runs, more than --max-runs 100" in captured.err
    for flag in ("--sites", "--positions", "--top-k", "--n-random", "fewer pairs", "--method"):
        assert flag in captured.err


def test_missing_role_spans_fall_back_with_a_note(load_tiny, tmp_path, capsys):
    model = load_tiny("tiny-gpt2")
    pairs = short_pairs(model.tokenizer, 2)  # hand-made stories: no query_protagonist / query_object spans
    summary = patch_and_save(model, pairs, tmp_path / "out", method="exact", top_k=0, format="csv")
    assert summary["positions"] == {"head": ["final"], "resid_pre": ["final", "contrast"]}
    printed = capsys.readouterr().out
    assert "'query_protagonist' left out: 4 of 4 stories" in printed and "'query_object' left out" in printed
    with pytest.raises(TomlensError, match="no span 'query_object'"):  # asked for by name: an error
        patch_and_save(model, pairs, tmp_path / "o2", method="exact", positions=("query_object",), top_k=0)


# ---- resume -------------------------------------------------------------------------------------

ARGS = ["--model", "tiny-gpt2", "--method", "both", "--positions", "all", "--top-k", "2", "--n-random", "2",
        "--chunk-runs", "24", "--no-progress", "--format", "csv", "--force"]


def test_a_killed_run_resumes_to_the_same_tables(ut_pairs, tmp_path, monkeypatch):
    model, pairs = ut_pairs
    pairs_file = write_pairs(pairs, tmp_path / "pairs.jsonl")
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    args = ARGS + ["--pairs", str(pairs_file)]
    # The real command in a subprocess, each batched forward slowed down so the kill lands mid-run.
    script = textwrap.dedent(f"""
        import sys, time
        import tomlens.patching.engine as p
        real = p.run_patched
        def slow(*a, **k):
            time.sleep(0.3)
            return real(*a, **k)
        p.run_patched = slow
        from tomlens.cli import main
        sys.exit(main({["patch", *args, "--out", str(killed)]!r}))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    partial = killed / ".partial"
    deadline = time.time() + 300
    while len(list(partial.glob("*/*.safetensors"))) < 4 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Nothing that looks finished: no summary, no tables; every chunk on disk is whole or refused.
    assert not (killed / "summary.json").exists() and not list(killed.glob("*.csv"))
    store = Checkpoints.at(next(partial.iterdir()))
    victim = next(c for c in sorted(store.folder.glob("exact-*.safetensors")) if "-base-" not in c.name)
    with safe_open(str(victim), framework="pt") as f:
        shape = {"values": tuple(f.get_slice("values").get_shape())}
    name = victim.name[: -len(".safetensors")]
    assert store.load(name, shape) is not None
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # as if a write had not been atomic
    assert store.load(name, shape) is None
    # The same command again finishes from the chunks that are whole (and redoes the damaged one).
    counter = RunCounter(monkeypatch)
    assert main(["patch", *args, "--out", str(killed)]) == 0
    resumed_runs = sum(counter.by_stage.values())
    assert main(["patch", *args, "--out", str(whole)]) == 0
    assert resumed_runs < sum(counter.by_stage.values()) - resumed_runs
    assert not partial.exists()
    # Same tables as the uninterrupted run. Raw logit differences (~0.1) from the same forwards
    # in another process: fp32 tolerance; normalised columns divide by the gap (~1e-3 here).
    for name in ("cells_exact_denoise", "pairs_exact_denoise", "cells_attribution_denoise", "topk", "ablation"):
        a, b = pd.read_csv(killed / f"{name}.csv"), pd.read_csv(whole / f"{name}.csv")
        assert list(a.columns) == list(b.columns) and len(a) == len(b), name
        for col in a.columns:
            if a[col].dtype.kind == "f":
                scale = 1.0 if "logit_diff" in col else 1e3
                np.testing.assert_allclose(a[col], b[col], rtol=1e-5, atol=1e-5 * scale, err_msg=f"{name}.{col}")
            else:
                assert a[col].tolist() == b[col].tolist(), f"{name}.{col}"


def test_a_changed_command_never_reuses_chunks(ut_pairs, tmp_path):
    model, pairs = ut_pairs
    prepared = prepare_pairs(model, pairs, selectors=["final"])
    store = Checkpoints(tmp_path, {"pairs": "x", "positions": ["final"]})
    first = exact_patching(model, prepared, sites={"heads": ["final"]}, checkpoints=store, chunk_runs=8, progress=False)
    assert store.saved == 4 + 1  # 4 chunks of 8 runs (8 heads x 4 pairs), one base metric
    again = exact_patching(model, prepared, sites={"heads": ["final"]}, checkpoints=store, chunk_runs=8, progress=False)
    assert store.saved == 5 and store.loaded >= 5
    torch.testing.assert_close(first.values, again.values, rtol=0, atol=0)  # the very same numbers, read back
    # other cells in the same folder: the chunks' run hashes differ, nothing is reused
    other = exact_patching(model, prepared, sites={"resid": ["final"]}, checkpoints=store, chunk_runs=8, progress=False)
    assert store.saved == 5 + 1 and other.values.shape == (2, 4)
    assert Checkpoints(tmp_path, {"pairs": "y", "positions": ["final"]}).key != store.key


def test_chunks_cover_the_runs_and_the_plan_prices_what_is_left(ut_pairs):
    model, pairs = ut_pairs
    prepared = prepare_pairs(model, pairs, selectors=["final"], batch_pairs=2)
    cells = [c for c in plan_cells(model, {"heads": ["all", "final"]}, n_aligned=prepared.n_aligned)]
    stage = ExactSweep(model, prepared, cells, chunk_runs=5).stage
    for gi, runs in enumerate(stage.runs):  # consecutive, complete, at most chunk_runs each
        mine = [c for c in stage.chunks if c.group == gi]
        assert [c.lo for c in mine] == [0] + [c.hi for c in mine[:-1]] and mine[-1].hi == len(runs)
        assert all(1 <= c.n_runs <= 5 for c in mine)
    base = [patching.forward_cost(model, 2 * g.g, g.width) for g in prepared.groups]
    assert stage.cost() == pytest.approx(sum(c.cost for c in stage.chunks))
    assert stage.forward_cost() == pytest.approx(sum(base))
    stage.run(chunks=[c for c in stage.chunks if c.group == 0])  # group 0 done: its base pass is not needed again
    assert stage.cost() == pytest.approx(sum(c.cost for c in stage.chunks if c.group != 0))
    assert stage.forward_cost() == pytest.approx(sum(base[1:]))


# ---- out of memory ------------------------------------------------------------------------------


def test_out_of_memory_shrinks_the_batch_with_identical_results(ut_pairs, monkeypatch):
    model, pairs = ut_pairs
    prepared = prepare_pairs(model, pairs, selectors=["final"])
    sites = {"heads": ["all", "final"], "resid": ["final"]}
    want = exact_patching(model, prepared, sites=sites, progress=False)
    calls = {"n": 0, "raised": 0, "rows": []}

    def oom_once(act, hook=None):
        calls["n"] += 1
        if calls["n"] > 1 and act.shape[0] > 1 and not calls["raised"]:  # a patched forward (1: the base run)
            calls["raised"] = act.shape[0]
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        calls["rows"].append(act.shape[0])

    model.add_hook("ln_final.hook_normalized", oom_once)
    try:
        with pytest.warns(UserWarning, match="out of memory"):
            got = exact_patching(model, prepared, sites=sites, progress=False)
    finally:
        model.reset_hooks(including_permanent=True)
        patching._MEMORY_CAP.pop(model, None)
    assert calls["raised"] > 1 and max(calls["rows"][1:]) <= calls["raised"] // 2
    # the same runs in smaller forwards: fp32 rounding at most (raw logit differences ~0.1)
    torch.testing.assert_close(got.values, want.values, rtol=1e-5, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(got.clean, want.clean, rtol=1e-5, atol=1e-6)  # the base pass may rerun in smaller batches


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-neox"])
def test_logits_of_a_few_tokens_equal_the_full_unembedding(load_tiny, name):
    model = load_tiny(name)
    ids = torch.randint(100, 1000, (3, 9), generator=torch.Generator().manual_seed(0))
    vocab = torch.tensor([7, 901, 42, 3])
    with torch.inference_mode():
        full = model(ids)[:, -1]
        with logits_of(model, vocab):
            few = model(ids)[:, -1]
        again = model(ids)[:, -1]  # the unembedding is whole again afterwards
    assert few.shape == (3, 4) and again.shape == full.shape
    torch.testing.assert_close(few, full[:, vocab], rtol=1e-5, atol=1e-5)  # a narrower matmul: fp32 rounding
