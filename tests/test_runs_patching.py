"""The patching and pairs runs: configs that round-trip through plain dicts, results that save and
load to the same tables, dry runs that write nothing, and sweep results left as the sweeps made them."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.patching.exact import ExactSweep
from tomlens.patching.gate import FORCED_PREFIX
from tomlens.patching.plan import AttributionSweep
from tomlens.runs.base import ModelSpec, config_from_dict, config_hash, config_to_dict
from tomlens.runs.pairs import PairsConfig, PairsResult
from tomlens.runs.pairs import run as run_pairs
from tomlens.runs.patching import PatchingConfig, PatchingRunResult, parse_ks, run

pytestmark = pytest.mark.integration  # tiny models
TINY = ModelSpec("tiny-llama")
PAIRS = PairsConfig(model=TINY, n=1, contrasts=("present",))  # 2 pairs, aligned for tiny-llama's tokenizer


def test_config_round_trip_and_errors():
    config = PatchingConfig(model=TINY, pairs=PairsConfig(model=TINY, n=3, seed=2, contrasts=("present",),
                                                           options={"ks": [0, 6]}),
                            method="exact", sites=("heads", "mlp"), positions=("roles", "heads=contrast"),
                            direction="both", top_k=3, n_random=4, ablation="none", seed=5, memory_mb=256.0,
                            max_runs=None, search_threshold=0.25, graddrop="off", format="csv", ks=(3, 1),
                            force=True, solved_only=True, select_fraction=0.25)
    as_dict = json.loads(json.dumps(config_to_dict(config)))  # what config.json holds
    back = config_from_dict(PatchingConfig, as_dict)
    assert back == config and config_hash(back) == config_hash(config)
    assert back.ks == (1, 3) and back.force and back.solved_only and back.select_fraction == 0.25
    assert PatchingConfig().n_random == 200 and PatchingConfig().ks == (1, 2, 3, 5, 10)
    assert PatchingConfig(ks=parse_ks("5,1 2")).ks == (1, 2, 5)
    with pytest.raises(TomlensError, match="whole numbers"):
        parse_ks("1,two")
    assert config_hash(PatchingConfig(force=True)) != config_hash(PatchingConfig())
    with pytest.raises(TomlensError, match="--ks"):
        PatchingConfig(ks=(0, 2))
    with pytest.raises(TomlensError, match="--select-fraction"):
        PatchingConfig(select_fraction=1.0)
    assert back.methods == ["exact"] and back.directions == ["denoise", "noise"]
    assert back.search_options() == {"budget": None, "threshold": 0.25, "fn_samples": 10, "graddrop": False}
    assert PatchingConfig().positions == ("roles",) and PatchingConfig().sites == ("heads", "resid")
    # presentation settings do not change the hash; a setting that changes the numbers does
    assert config_hash(PatchingConfig(dry_run=True, max_runs=5)) == config_hash(PatchingConfig())
    assert config_hash(PatchingConfig(seed=1)) != config_hash(PatchingConfig())
    with pytest.raises(TomlensError, match="did you mean 'top_k'"):
        config_from_dict(PatchingConfig, {"topk": 3})
    with pytest.raises(TomlensError, match="unknown method 'exakt'"):
        PatchingConfig(method="exakt")
    with pytest.raises(TomlensError, match="both `pairs`"):
        PatchingConfig(pairs=PAIRS, pairs_path="p.jsonl")
    with pytest.raises(TomlensError, match="needs --path"):
        PairsConfig(family="bigtom")


def test_run_save_load_gives_the_same_tables(load_tiny, tmp_path, capsys):
    model = load_tiny("tiny-llama")
    config = PatchingConfig(model=TINY, pairs=PAIRS, method="both", sites=("heads", "resid"), positions=("final",),
                            top_k=2, n_random=2, seed=1, force=True)  # 2 pairs of one task: no split, forced
    result = run(config, model=model, out=tmp_path, progress=False)
    printed = capsys.readouterr().out
    assert "plan (2 pairs" in printed and "the SAME pairs" in printed and result.forced
    assert set(result.sweeps) == {("exact", "denoise"), ("attribution", "denoise")}
    assert all(r.seed == 1 for r in result.sweeps.values())
    assert result.summary.pairs.n_aligned == 2 and len(result.heads) == 8
    result.save(tmp_path)
    assert not (tmp_path / ".partial").exists()  # checkpoints go once the outputs are written
    for name in ("config.json", "manifest.json", "summary.json", "result.json", "heads.parquet", "topk.parquet",
                 "ablation_random.parquet", "cells_exact_denoise.parquet", "pairs_attribution_denoise.parquet"):
        assert (tmp_path / name).is_file(), name

    loaded = PatchingRunResult.load(tmp_path)
    assert loaded.config == config and loaded.sweeps == {}
    assert list(loaded.tables) == list(result.tables)
    for stem, table in result.tables.items():
        pd.testing.assert_frame_equal(loaded.tables[stem].reset_index(drop=True), table.reset_index(drop=True),
                                      check_dtype=False, obj=stem)
    assert loaded.summary == result.summary  # the typed summary round-trips through result.json
    assert loaded.describe() == result.describe() and "top heads" in result.describe()
    assert loaded.manifest["model"]["model"] == "tiny-llama" and loaded.manifest["seed"] == 1
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads((tmp_path / "result.json").read_text())

    from tomlens.report.patching import write_patching_figures

    figures = write_patching_figures(result, tmp_path)
    assert sorted(figures) == ["attribution_vs_exact_denoise", "heads_attribution_denoise", "heads_exact_denoise",
                               "resid_pre_positions_attribution_denoise", "resid_pre_positions_exact_denoise",
                               "topk_recovery"]
    assert sorted(p.stem for p in (tmp_path / "figures").iterdir()) == sorted(figures)
    with pytest.raises(TomlensError, match="no sweeps"):
        write_patching_figures(loaded, tmp_path / "again")


def test_dry_run_returns_the_plan_and_saves_nothing(load_tiny, tmp_path, capsys):
    model = load_tiny("tiny-llama")
    pairs = run_pairs(PAIRS, model=model).pairs
    result = run(PatchingConfig(model=TINY, method="exact", top_k=0, dry_run=True, force=True), model=model, pairs=pairs,
                 out=tmp_path / "out", progress=False)
    assert result.dry_run and result.plan.total_runs > 0 and not result.tables
    assert "nothing written" in capsys.readouterr().out
    with pytest.raises(TomlensError, match="dry run"):
        result.save(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_run_leaves_the_sweep_results_as_made(load_tiny, tmp_path, monkeypatch):
    """The run's bootstrap seed goes into copies: the objects the sweeps return keep their own."""
    model = load_tiny("tiny-llama")
    made = []
    for cls in (ExactSweep, AttributionSweep):
        real = cls.result

        def record(self, *args, _real=real, **kwargs):
            res = _real(self, *args, **kwargs)
            made.append(res)
            return res
        monkeypatch.setattr(cls, "result", record)
    result = run(PatchingConfig(model=TINY, pairs=PAIRS, sites=("heads",), positions=("final",), top_k=0, seed=7,
                                force=True),
                 model=model, progress=False)
    assert len(made) == 2 and all(r.seed == 0 and r._summaries == {} for r in made)
    assert all(r.seed == 7 for r in result.sweeps.values())
    assert all(a is not b for a in made for b in result.sweeps.values())
    summary = result.sweeps[("exact", "denoise")].summary()
    assert summary.effect.tolist() == pytest.approx(made[0].summary(seed=7).effect.tolist(), nan_ok=True)


UT = PairsConfig(model=TINY, n=3, contrasts=("present",))  # 6 unexpected-transfer pairs of 3 tasks


def test_a_random_models_gap_is_withheld_and_force_flags_every_output(load_tiny, tmp_path, capsys):
    """tiny-llama is random: its false-minus-true-belief gap is noise, so the gate fails and nothing
    that divides by the gap runs; --force runs it all, flagged; heads are ranked on selection pairs
    and validated on held-out pairs of other tasks."""
    model = load_tiny("tiny-llama")
    config = PatchingConfig(model=TINY, pairs=UT, sites=("heads",), positions=("final",), top_k=3, n_random=30,
                            ks=(1, 3))
    held = run(config, model=model, progress=False)
    printed = capsys.readouterr().out
    assert held.withheld and held.withheld.startswith("withheld:") and "plan (" not in printed
    assert "lower bound" in held.describe() and "power" in held.describe()
    assert not held.summary.gate.passed and not held.sweeps and set(held.tables) == {"gate", "base"}
    base = held.tables["base"]
    assert len(base) == 6 and {"clean_logit_diff", "corrupted_logit_diff", "gap", "solved"} <= set(base.columns)
    gate = held.tables["gate"].iloc[0]
    assert gate.contrast == "present" and gate["n"] == 3 and gate["n_pairs"] == 6  # 3 tasks are the unit
    assert gate["mean"] == pytest.approx(base.gap.groupby(base.task_id).mean().mean())
    assert not gate.passed and gate.lower <= 0
    folder = held.save(tmp_path / "held")
    back = PatchingRunResult.load(folder)
    assert back.withheld == held.withheld and held.withheld in back.describe()
    assert "unpatched logit diff" in back.describe() and "lower bound" in back.describe()
    from tomlens.report.patching import write_patching_figures

    assert write_patching_figures(held, folder) == {}

    forced = run(replace(config, force=True), model=model, progress=False)
    assert forced.forced and forced.summary.forced_message.startswith(FORCED_PREFIX)
    assert {"cells_exact_denoise", "heads", "topk", "topk_random", "ablation", "ablation_random", "gate",
            "base"} <= set(forced.tables)
    for stem, table in forced.tables.items():
        assert "forced" in table and table["forced"].all(), stem
    sel, ev = forced.summary.pairs.selection, forced.summary.pairs.evaluation
    assert sel.n + ev.n == 6 and not ev.same_as_selection
    assert sel.hash != ev.hash
    sel_ids = set(forced.tables["pairs_exact_denoise"].pair_id)
    tasks = dict(zip(base.pair_id, base.task_id, strict=True))
    assert len(sel_ids) == sel.n
    held_tasks = set(base.task_id) - {tasks[i] for i in sel_ids}
    assert held_tasks and len(held_tasks) == ev.tasks  # no task on both sides
    topk = forced.tables["topk"]
    assert topk.k.tolist() == [1, 3] and (topk.n_random == topk.n_distinct.clip(upper=30)).all()
    assert ((topk.random_reach >= 0) & (topk.random_reach <= 1)).all()
    draws = forced.tables["topk_random"]
    for k, top in zip(topk.k, topk.heads, strict=True):
        layers = sorted(h.split("H")[0] for h in top.split(";"))
        assert all(sorted(h.split("H")[0] for h in d.split(";")) == layers for d in draws[draws.k == k].heads)
    figures = write_patching_figures(forced, tmp_path / "forced")
    assert figures and all(f.layout.title.text.startswith(FORCED_PREFIX) for f in figures.values())
    assert "FORCED" in forced.describe() and "held-out" in forced.describe()

    solved = run(replace(config, solved_only=True), model=model, progress=False)
    assert solved.withheld and solved.summary.gate.n_gated == 6  # the gate still sees every pair
    forced_solved = run(replace(config, solved_only=True, force=True), model=model, progress=False)
    n_solved = int(base.solved.sum())
    assert forced_solved.summary.pairs.n_kept == n_solved
    assert f"of the 6 pairs it let through, kept {n_solved}" in " ".join(forced_solved.summary.notes)


def _fake_base(monkeypatch, gap_of):
    """Stand-in unpatched logit differences: pair i of the aligned pairs gets (clean, corrupted) =
    gap_of(i, pairs)."""
    import tomlens.patching.gate as gate

    def fake(model, prepared):
        values = [gap_of(i, prepared.pairs) for i in range(len(prepared.pairs))]
        return (torch.tensor([v[0] for v in values], dtype=torch.float64),
                torch.tensor([v[1] for v in values], dtype=torch.float64))
    monkeypatch.setattr(gate, "base_logit_diffs", fake)


def test_a_wrong_sign_gap_fails_the_gate_with_and_without_solved_only(load_tiny, monkeypatch):
    """Each task: one pair answered right both ways (gap +2), one wrong way round (gap -6). Filtering to
    solved pairs first would leave gaps of +2 only and pass; the gate sees every pair and fails."""
    def wrong_sign(i, pairs):
        first = [p.clean.task_id for p in pairs].index(pairs[i].clean.task_id) == i
        return (1.0, -1.0 + 0.1 * i) if first else (-3.0, 3.0 + 0.1 * i)
    _fake_base(monkeypatch, wrong_sign)
    model = load_tiny("tiny-llama")
    config = PatchingConfig(model=TINY, pairs=UT, sites=("heads",), positions=("final",), top_k=1, n_random=2)
    for solved_only in (False, True):
        result = run(replace(config, solved_only=solved_only), model=model, progress=False)
        gate = result.tables["gate"].iloc[0]
        assert result.withheld and not gate.passed and gate.n_pairs == 6 and gate["mean"] < 0, solved_only
        assert "--solved-only" not in result.withheld
        assert result.tables["base"].solved.sum() == 3


def test_a_half_with_a_non_positive_gap_withholds_the_ranking(load_tiny, monkeypatch):
    """The pooled gate passes (stubbed) but the held-out pairs' own gap is negative: ranking and
    validation (normalised by each half's gap) are withheld, naming the half; --force flags them."""
    import tomlens.patching.gate as gate

    real = gate.gate_pairs
    monkeypatch.setattr(gate, "gate_pairs", lambda clean, corrupted, contrasts, **kw: real(
        clean + 10 + torch.arange(len(clean)), corrupted, contrasts))
    model = load_tiny("tiny-llama")
    pairs = run_pairs(UT, model=model).pairs
    select, _ = gate.split_selection(pairs, 0.5, 0)
    _fake_base(monkeypatch, lambda i, ps: (2.0, -1.0) if i in select else (-1.0, 1.0))
    config = PatchingConfig(model=TINY, sites=("heads",), positions=("final",), top_k=1, n_random=2, ablation="none")
    result = run(config, model=model, pairs=pairs, progress=False)
    assert result.summary.gate.passed == ("present",) and not result.sweeps
    assert result.withheld and "evaluation pairs' mean gap is -2.000" in result.withheld
    assert "selection" not in result.withheld.split("Reason:")[1].split("(")[0]
    halves = result.summary.gate.half_gaps
    assert halves["selection"] == pytest.approx(3.0) and halves["evaluation"] == pytest.approx(-2.0)
    forced = run(replace(config, force=True), model=model, pairs=pairs, progress=False)
    assert forced.forced and "evaluation pairs' mean gap" in forced.summary.forced_message
    assert forced.tables["topk"]["forced"].all()


def test_too_few_pairs_for_a_split_are_refused_unless_forced(load_tiny, monkeypatch):
    """With a gate that passes (stubbed), 2 pairs of one task still cannot be split: withheld."""
    import tomlens.patching.gate as gate

    model = load_tiny("tiny-llama")
    real = gate.gate_pairs

    def passing(clean, corrupted, contrasts, **kw):  # every pair its own task: 2 pairs can pass
        return real(clean + 10 + torch.arange(len(clean)), corrupted, contrasts)
    monkeypatch.setattr(gate, "gate_pairs", passing)
    config = PatchingConfig(model=TINY, pairs=PAIRS, sites=("heads",), positions=("final",), top_k=1, n_random=2)
    result = run(config, model=model, progress=False)
    assert result.summary.gate.passed == ("present",)
    assert result.withheld and "cannot be split" in result.withheld and not result.sweeps
    forced = run(replace(config, force=True), model=model, progress=False)
    assert forced.forced and forced.summary.pairs.evaluation.same_as_selection
    assert "topk" in forced.tables and forced.tables["topk"]["forced"].all()


def test_pairs_run_saves_and_loads(tmp_path, capsys):
    result = run_pairs(PAIRS)
    assert len(result.pairs) == 2 and "2 of 2 pairs aligned" in result.describe()
    folder = result.save(tmp_path / "run")
    assert {p.name for p in folder.iterdir()} == {"pairs.jsonl", "pairs.report.json", "config.json",
                                                  "manifest.json", "result.json"}
    back = PairsResult.load(folder)
    assert back.config == PAIRS and back.summary == result.summary
    assert [p.to_dict() for p in back.pairs] == [p.to_dict() for p in result.pairs]
    single = result.write_file(tmp_path / "p.jsonl")
    report = json.loads((tmp_path / "p.report.json").read_text())
    assert report["pairs_file"] == str(single) and report["aligned"] == 2 and report["model"] == "tiny-llama"
    again = PairsResult.load(single)
    assert again.config.family == PAIRS.family and again.config.contrasts == ("present",)
    assert [p.to_dict() for p in again.pairs] == [p.to_dict() for p in result.pairs]


def test_max_pairs_keeps_exactly_that_many_aligned_pairs_and_is_hashed(tmp_path):
    three = PairsConfig(model=TINY, n=2, contrasts=("present",), max_pairs=3)
    result = run_pairs(three)
    full = run_pairs(PairsConfig(model=TINY, n=2, contrasts=("present",)))
    assert len(full.pairs) == 4 and len(result.pairs) == 3
    assert [p.to_dict() for p in result.pairs] == [p.to_dict() for p in full.pairs[:3]]
    assert config_hash(three) != config_hash(PairsConfig(model=TINY, n=2, contrasts=("present",)))
    assert PairsResult.load(result.save(tmp_path / "run")).config == three
    assert PairsResult.load(result.write_file(tmp_path / "p.jsonl")).config.max_pairs == 3  # from the report
    with pytest.raises(TomlensError, match="max_pairs"):
        PairsConfig(model=TINY, max_pairs=0)


def test_loading_an_unfinished_or_unrecorded_folder_is_a_clear_error(tmp_path):
    folder = run_pairs(PAIRS).save(tmp_path / "pairs")
    (folder / "result.json").unlink()  # a save stopped half-way
    with pytest.raises(TomlensError, match="no finished run"):
        PairsResult.load(folder)
    (tmp_path / "patching").mkdir()
    (tmp_path / "patching" / "result.json").write_text(json.dumps({"files": []}))
    with pytest.raises(TomlensError, match="config.json"):
        PatchingRunResult.load(tmp_path / "patching")
    with pytest.raises(TomlensError, match="no finished run"):
        PatchingRunResult.load(tmp_path / "nothing")


def test_positions_take_the_one_list_syntax():
    from tomlens.patching.plan import parse_positions
    from tomlens.runs import base
    from tomlens.syntax import split_items

    assert base.split_items is split_items  # one parser, below patching and runs
    kinds = ["head", "resid_pre"]
    commas = parse_positions("roles,heads=contrast,resid=object:first", kinds).spec
    assert parse_positions("roles heads=contrast, resid=object:first", kinds).spec == commas
    assert parse_positions(["roles", "heads=contrast resid=object:first"], kinds).spec == commas
    assert PatchingConfig(pairs=PAIRS, positions=("roles heads=final",)).positions == ("roles", "heads=final")


def _passing_gate(monkeypatch):
    """The pooled gate passes (stubbed): what follows it is what is tested."""
    import tomlens.patching.gate as gate

    real = gate.gate_pairs
    monkeypatch.setattr(gate, "gate_pairs", lambda clean, corrupted, contrasts, **kw: real(
        clean + 10 + torch.arange(len(clean)), corrupted, contrasts))


def test_solved_only_reads_each_halfs_gap_over_all_its_gated_pairs(load_tiny, monkeypatch):
    """Held-out tasks: one pair solved (gap +2), one wrong way round (gap -6), so the half's gap is -2.
    Read over the solved pairs only it would be +2 and pass; --solved-only must not hide it."""
    import tomlens.patching.gate as gate

    _passing_gate(monkeypatch)
    model = load_tiny("tiny-llama")
    pairs = run_pairs(UT, model=model).pairs
    select, _ = gate.split_selection(pairs, 0.5, 0)

    def gaps(i, ps):
        if i in select:
            return (2.0, -1.0)
        first = [p.clean.task_id for p in ps].index(ps[i].clean.task_id) == i
        return (1.0, -1.0) if first else (-3.0, 3.0)
    _fake_base(monkeypatch, gaps)
    config = PatchingConfig(model=TINY, sites=("heads",), positions=("final",), top_k=1, n_random=2,
                            ablation="none", solved_only=True)
    result = run(config, model=model, pairs=pairs, progress=False)
    assert result.withheld and "evaluation pairs' mean gap is -2.000" in result.withheld and not result.sweeps
    assert result.summary.gate.half_gaps["evaluation"] == pytest.approx(-2.0)
    # the same pairs with the held-out half's wrong-way pairs put right: it runs, patching solved pairs only
    _fake_base(monkeypatch, lambda i, ps: (2.0, -1.0) if i in select or
               [p.clean.task_id for p in ps].index(ps[i].clean.task_id) == i else (-0.5, -1.0))
    ok = run(config, model=model, pairs=pairs, progress=False)
    assert not ok.withheld and ok.summary.pairs.evaluation.n == len(pairs) - len(select) - 1


def test_the_plan_counts_n_random_head_sets_per_k_and_rechecks_max_runs_once_ranked(load_tiny, monkeypatch,
                                                                                       tmp_path, capsys):
    """tiny-llama has 4 heads per layer: a one-head stand-in has 3 layer-matched sets, fewer than
    --n-random. The plan counts --n-random per k (the upper bound), so the recount can only shrink it;
    a recount over --max-runs is refused as the plan is, with the finished chunks kept."""
    import tomlens.patching.heads as patching

    _passing_gate(monkeypatch)
    _fake_base(monkeypatch, lambda i, ps: (2.0, -1.0))
    model = load_tiny("tiny-llama")
    pairs = run_pairs(UT, model=model).pairs
    base = PatchingConfig(model=TINY, sites=("heads",), positions=("final",), top_k=1, ks=(1,), ablation="none",
                          dry_run=True)

    def topk_runs(n_random):
        plan = run(replace(base, n_random=n_random), model=model, pairs=pairs, progress=False).summary.plan
        return next(s.runs for s in plan.stages if s.name == "top-k recovery")
    r10, r20 = topk_runs(10), topk_runs(20)
    assert r10 * 21 == r20 * 11  # 1 top + n_random random sets, whatever the stand-in's layers allow
    # a ranking whose layer-matched sets outnumber the plan's (stubbed): refused after the recount
    real = patching.topk_settings

    def more(model, ranking, ks, n_random, seed):
        out = real(model, ranking, ks, n_random, seed)
        return out if ranking is None else out + [s for s in out if s[0] == "random"] * 3
    monkeypatch.setattr(patching, "topk_settings", more)
    full = run(replace(base, n_random=2, dry_run=False), model=model, pairs=pairs, progress=False,
               out=tmp_path / "a").summary
    planned = replace(base, n_random=2, dry_run=True)
    total = run(planned, model=model, pairs=pairs, progress=False).summary.plan.total_runs
    assert full.plan.total_runs > total  # the stub grew the recount
    capsys.readouterr()
    with pytest.raises(TomlensError, match=f"more than --max-runs {total:,}"):
        run(replace(base, n_random=2, dry_run=False, max_runs=total), model=model, pairs=pairs, progress=False,
            out=tmp_path / "b")
    assert "kept under" in capsys.readouterr().err and any((tmp_path / "b").rglob("*.safetensors"))
