"""The patching stage: activation and attribution patching over minimal pairs, and the heads that carry
belief (ranked, then tested together: top-k recovery and mean ablation against random heads).

Before anything runs, `run` prints its plan: every stage (each method x direction sweep, top-k
recovery and mean ablation with their random draws) as sites x positions x pairs x directions =
patched runs, the total, and the time estimated from one timed chunk of real runs (kept, not thrown
away). `dry_run` stops there; `max_runs` refuses a larger plan before any run. Positions default to
the role positions (`tomlens.patching.plan` has the `positions` syntax).

Given `out`, finished chunks are checkpointed under `<out>/.partial/<key>/` (the key hashes the model,
the pairs and the settings), so a stopped run resumes when the same run starts again; `save` writes
the outputs once every stage is complete and then removes the checkpoints.

`PatchingRunResult.save(out)` writes per-cell tables (`cells_<method>_<direction>`), per-pair tables
(`pairs_<method>_<direction>`), the per-head table (`heads`), top-k recovery (`topk`,
`topk_random`), mean ablation (`ablation`, `ablation_random`), `config.json`, `manifest.json`,
`summary.json` (provenance, the plan, the comparisons) and, last, `result.json` (= the summary).
Figures are the report layer's: `tomlens.report.patching.write_patching_figures`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tomlens.errors import TomlensError
from tomlens.runs.base import ModelSpec, split_items
from tomlens.runs.pairs import PairsConfig

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DEFAULT_CHUNK_RUNS", "DEFAULT_MAX_RUNS", "DIRECTIONS", "METHODS", "PatchingConfig",
           "PatchingRunResult", "pairs_hash", "run"]

METHODS = ("exact", "attribution", "both", "search")
DIRECTIONS = ("denoise", "noise", "both")
ABLATIONS = ("final", "all", "none")
GRADDROP = {"auto": None, "on": True, "off": False}
FORMATS = ("parquet", "csv")
DEFAULT_MAX_RUNS = 100_000  # = tomlens.patching.plan.DEFAULT_MAX_RUNS (kept here: no torch to read a config)
DEFAULT_CHUNK_RUNS = 1024  # = tomlens.patching.engine.DEFAULT_CHUNK_RUNS


@dataclass(frozen=True)
class PatchingConfig:
    """A whole patching run. The pairs come from `pairs` (built for `model`'s tokenizer) or from the
    file `pairs_path` (written by `tomlens pairs`), unless `run` is handed them. `sites` and
    `positions` take the one list syntax (`split_items`); a position item may be `SITE=POSITION`.
    `search_*` and `graddrop` are `method = "search"`'s settings; `max_runs = None` sets no limit."""

    model: ModelSpec = field(default_factory=ModelSpec)
    pairs: PairsConfig | None = None
    pairs_path: str | None = None
    method: str = "both"
    sites: tuple[str, ...] = ("heads", "resid")
    positions: tuple[str, ...] = ("roles",)
    direction: str = "denoise"
    top_k: int = 10
    n_random: int = 10
    ablation: str = "final"
    probe_table: str | None = None
    seed: int = 0
    batch_pairs: int = 8
    memory_mb: float = 1024.0
    max_runs: int | None = DEFAULT_MAX_RUNS
    dry_run: bool = False
    chunk_runs: int = DEFAULT_CHUNK_RUNS
    search_budget: int | None = None
    search_threshold: float | None = None
    search_samples: int = 10
    graddrop: str = "auto"
    format: str = "parquet"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(split_items(self.sites)))
        object.__setattr__(self, "positions", tuple(split_items(self.positions)))
        if self.pairs_path is not None and not isinstance(self.pairs_path, str):
            object.__setattr__(self, "pairs_path", str(self.pairs_path))
        if self.probe_table is not None and not isinstance(self.probe_table, str):
            object.__setattr__(self, "probe_table", str(self.probe_table))
        for name, value, allowed in (("method", self.method, METHODS), ("direction", self.direction, DIRECTIONS),
                                     ("ablation", self.ablation, ABLATIONS), ("graddrop", self.graddrop, tuple(GRADDROP)),
                                     ("format", self.format, FORMATS)):
            if value not in allowed:
                raise TomlensError(f"unknown {name} {value!r}", f"use one of {list(allowed)}")
        if self.pairs is not None and self.pairs_path is not None:
            raise TomlensError("patching has both `pairs` (a table) and `pairs_path` (a file)",
                               "keep one: the pairs to build, or the file written by `tomlens pairs`")
        if not self.sites:
            raise TomlensError("no patching sites given", "pass e.g. --sites heads,resid")
        if self.top_k < 0:
            raise TomlensError(f"--top-k {self.top_k} is negative", "pass 0 to skip top-k experiments, or a positive K")
        if self.n_random < 0:
            raise TomlensError(f"--n-random {self.n_random} is negative",
                               "pass 0 for no random baseline, or a positive number")
        if self.max_runs is not None and self.max_runs < 0:
            raise TomlensError(f"--max-runs {self.max_runs} is negative",
                               "pass the largest number of patched runs to allow")
        if self.chunk_runs < 1:
            raise TomlensError(f"--chunk-runs {self.chunk_runs} must be at least 1", "pass e.g. 1024")
        if self.batch_pairs < 1:
            raise TomlensError(f"--batch-pairs {self.batch_pairs} must be at least 1", "pass e.g. 8")

    @property
    def methods(self) -> list[str]:
        return ["exact", "attribution"] if self.method == "both" else [self.method]

    @property
    def directions(self) -> list[str]:
        return ["denoise", "noise"] if self.direction == "both" else [self.direction]

    def search_options(self) -> dict[str, Any]:
        """Keyword arguments of `tomlens.patching.search` beyond the sweep's own."""
        return {"budget": self.search_budget, "threshold": self.search_threshold,
                "fn_samples": self.search_samples, "graddrop": GRADDROP[self.graddrop]}


def pairs_hash(pairs: Sequence[Any]) -> str:
    """Content hash of the pairs in order (clean and corrupted records, ids, contrasts)."""
    from tomlens.io import records_hash

    return records_hash((p.to_dict() for p in pairs), 16)


@dataclass
class PatchingRunResult:
    """What a patching run found. `tables` by file stem (cells_*, pairs_*, heads, topk, topk_random,
    ablation, ablation_random: what `save` writes); `sweeps` every (method, direction) result
    (`PatchingResult`, `SearchResult` for search), `recovery` and `mean_ablation` the head-set
    validations (these three only on the run that made them, not after `load`); `summary` the
    summary dict. A dry run holds its `plan` and nothing else (`dry_run=True`)."""

    config: PatchingConfig
    summary: dict[str, Any]
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    sweeps: dict[tuple[str, str], Any] = field(default_factory=dict)
    recovery: Any = None  # tomlens.patching.heads.Recovery
    mean_ablation: Any = None  # tomlens.patching.heads.Ablation
    manifest: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False
    checkpoints: Any = field(default=None, repr=False, compare=False)  # removed once saved

    @property
    def plan(self) -> dict[str, Any]:
        return self.summary["plan"]

    @property
    def heads(self) -> pd.DataFrame | None:
        """The per-head table (patch and attribution effects, probe accuracy), if heads were ranked."""
        return self.tables.get("heads")

    def compare(self, direction: str, *, kind: str = "head", position: str = "all", k: int = 10) -> dict[str, Any]:
        """Attribution against exact patching in `direction` (`tomlens.patching.compare`)."""
        from tomlens.patching import compare

        if ("exact", direction) not in self.sweeps or ("attribution", direction) not in self.sweeps:
            raise TomlensError(f"no exact and attribution sweeps ({direction}) in this result",
                               "run with method = \"both\" (and the sweeps are not kept by `load`)")
        return compare(self.sweeps[("exact", direction)], self.sweeps[("attribution", direction)],
                       kind=kind, position=position, k=k)

    def describe(self) -> str:
        """What `tomlens patch` prints after a run: baselines, top heads, search bounds, comparisons."""
        s = self.summary
        if self.dry_run:
            return f"dry run: a plan of {s['plan']['total_runs']:,} patched runs; nothing run, nothing written"
        b = next(iter(s["baselines"].values()))
        lines = [f"{s['pairs']['n_aligned']} pairs; logit diff clean {b['clean_logit_diff']:.3f}, "
                 f"corrupted {b['corrupted_logit_diff']:.3f}"]
        if "top_heads" in s:
            lines.append(f"top heads ({s['ranked_by']}): {', '.join(s['top_heads'][:10])}")
        for d, rep in s.get("search", {}).items():
            for fn in rep["false_negatives"]:
                lines.append(f"search ({d}, {fn['kind']} at {fn['position']}): {fn['n_verified_rule']} of "
                             f"{fn['n_cells']} cells patched by the rule, {fn['n_sampled']} sampled; "
                             f"false negatives: {fn['meaning']}")
        for c in s["comparisons"]:
            if c["kind"] == "head" and c["position"] == s.get("rank_position"):
                lines.append(f"attribution vs exact ({c['direction']}): Spearman {c['spearman']:.2f}, "
                             f"top-{c['k']} overlap {c['topk_overlap']:.2f}")
        return "\n".join(lines)

    def save(self, out: str | Path) -> Path:
        """Write the tables, config.json, manifest.json, summary.json and, last, result.json; then
        remove the run's checkpoints. A dry run has nothing to save (an error, nothing written)."""
        from tomlens.io import write_json, write_table
        from tomlens.runs.files import begin_save, finish_save

        if self.dry_run:
            raise TomlensError("a dry run has no results to save",
                               "run again without dry_run (--dry-run) to patch and write the tables")
        out = begin_save(out)
        (out / "summary.json").unlink(missing_ok=True)  # written with the tables, before result.json
        ext = ".parquet" if self.config.format == "parquet" else ".csv"
        for stem, df in self.tables.items():
            write_table(df, out / f"{stem}{ext}")
        write_json(self.summary, out / "summary.json")
        finish_save(out, self.config, self.manifest, self.summary)
        if self.checkpoints is not None:
            self.checkpoints.clear()
        return out

    @classmethod
    def load(cls, out: str | Path) -> PatchingRunResult:
        """The tables, summary, config and manifest of a finished run (`save`); no sweep objects."""
        from tomlens.io import read_table
        from tomlens.runs.files import CONFIG, read_finished

        out, config, manifest, summary = read_finished(out, PatchingConfig)
        if config is None:
            raise TomlensError(f"{out} holds a patching result but no {CONFIG}",
                               "run the patching again into that folder (its settings are not recorded)")
        tables = {}
        for name in summary["files"]:
            path = out / name
            if path.suffix in (".parquet", ".csv"):
                tables[path.stem] = read_table(path)
        return cls(config, summary, tables, manifest=manifest)


def _with_seed(result: Any, seed: int) -> Any:
    """The sweep's result with the bootstrap seed of the run: a copy (with its own summary cache),
    so the sweep's object is left as it was made."""
    return result if result.seed == seed else replace(result, seed=seed, _summaries={})


def _load_pairs(config: PatchingConfig, pairs: Sequence[Any] | None, model: Any) -> list[Any]:
    from tomlens.stimuli.pairs import read_pairs

    if pairs is not None:
        pairs = list(pairs)
        where = "the pairs given"
    elif config.pairs is not None:
        from tomlens.runs.pairs import run as run_pairs

        pairs = run_pairs(config.pairs, model=model).pairs
        where = "the pairs built"
    elif config.pairs_path is not None:
        pairs = read_pairs(config.pairs_path)
        where = f"pairs file {config.pairs_path!r}"
    else:
        raise TomlensError("no minimal pairs to patch",
                           "give a pairs file (--pairs FILE, pairs_path = ...) or a pairs table to build them")
    if not pairs:
        raise TomlensError(f"{where} holds no pairs", "write pairs with `tomlens pairs`")
    return pairs


def run(config: PatchingConfig, *, model: Any = None, pairs: Sequence[Any] | None = None,
        out: str | Path | None = None, progress: bool = True) -> PatchingRunResult:
    """Run the whole patching experiment (module docstring): prints the plan first, refuses a plan
    of more than `config.max_runs` patched runs, and with `config.dry_run` returns after the plan.
    `model`: a loaded model (else `config.model` is loaded); `pairs`: MinimalPairs already built
    (else from `config.pairs` or `config.pairs_path`); `out`: the run directory whose `.partial/`
    keeps finished chunks, so running again resumes (None: a scratch folder, removed on return). An unstable clean -
    corrupted gap is said once, at the end (and in the summary's baselines)."""
    import tempfile

    from tomlens.patching import gap_warnings_silenced

    with gap_warnings_silenced():
        if out is not None:
            return _run(config, model=model, pairs=pairs, out=out, progress=progress, resumable=True)
        with tempfile.TemporaryDirectory(prefix="tomlens-patching-") as scratch:  # chunks of this call only
            result = _run(config, model=model, pairs=pairs, out=scratch, progress=progress, resumable=False)
            result.checkpoints = None
            return result


def _run(config: PatchingConfig, *, model: Any, pairs: Sequence[Any] | None, out: str | Path,
         progress: bool, resumable: bool) -> PatchingRunResult:
    import torch

    from tomlens.activations.cache import weights_fingerprint
    from tomlens.io import read_table
    from tomlens.models import provenance
    from tomlens.patching import (
        METRIC_NAME, AblationSweep, AttributionSweep, Checkpoints, ExactSweep, HeadSetSweep, Plan, calibrate,
        canonical_kind, compare, drop_missing_roles, gap_note, head_table, mean_ablation, parse_positions,
        plan_cells, plan_stages, prepare_pairs, rank_heads, topk_recovery, topk_settings,
    )
    from tomlens.provenance import run_manifest
    from tomlens.stimuli.pairs import check_pairs
    from tomlens.stimuli.records import stimuli_hash

    cfg = config
    seed, top_k, n_random, ablation, chunk_runs = cfg.seed, cfg.top_k, cfg.n_random, cfg.ablation, cfg.chunk_runs
    max_runs, dry_run, memory_mb, batch_pairs = cfg.max_runs, cfg.dry_run, cfg.memory_mb, cfg.batch_pairs
    # Settings first (no model needed), then the pairs (a file is read before any weights load).
    kinds = list(dict.fromkeys(canonical_kind(s) for s in cfg.sites))
    pos = parse_positions(cfg.positions, kinds)
    probe = None
    if cfg.probe_table is not None:
        if not Path(cfg.probe_table).is_file():
            raise TomlensError(f"probe table {cfg.probe_table!r} does not exist", "pass the table written by `tomlens probe`")
        probe = read_table(cfg.probe_table)
    if cfg.pairs is None or pairs is not None:
        pairs = _load_pairs(cfg, pairs, model)
    if model is None:
        model = cfg.model.load()
    if pairs is None:  # built for the loaded model's tokenizer
        pairs = _load_pairs(cfg, None, model)

    started = time.time()
    torch.manual_seed(seed)
    aligned, report = check_pairs(list(pairs), model.tokenizer)
    if report.dropped:
        print(report.summary())
    if not aligned:
        raise TomlensError(
            "no minimal pair is token-aligned for this model's tokenizer",
            "write the pairs with `tomlens pairs --model` set to this model",
        )
    pos = drop_missing_roles(pos, [s for p in aligned for s in (p.clean, p.corrupted)])
    prepared = prepare_pairs(model, aligned, selectors=pos.selectors, batch_pairs=batch_pairs)
    cells = plan_cells(model, pos.spec, n_aligned=prepared.n_aligned)
    rank_position = pos.rank_position()
    methods, directions = cfg.methods, cfg.directions
    main_dir = directions[0]
    search_options = cfg.search_options()
    checkpoints = Checkpoints(out, {
        "provenance": provenance(model), "weights": weights_fingerprint(model), "pairs": pairs_hash(aligned),
        "positions": pos.spec, "methods": methods, "directions": directions, "top_k": top_k,
        "n_random": n_random, "ablation": ablation, "seed": seed, "batch_pairs": batch_pairs,
        "chunk_runs": chunk_runs, "search": search_options,
    })

    # Every stage laid out before anything runs: exact sweeps and attribution (with what the
    # checkpoints already hold), and top-k / ablation with stand-in top sets (same counts).
    exact = {d: ExactSweep(model, prepared, cells, d, memory_mb=memory_mb, chunk_runs=chunk_runs)
             for d in directions} if "exact" in methods else {}
    attribution = ({d: AttributionSweep(model, prepared, pos.spec, d) for d in directions}
                   if "attribution" in methods else {})
    for sweep in [*exact.values(), *attribution.values()]:
        sweep.load(checkpoints)
    topk_plan = ablation_plan = None
    k_max = min(top_k, model.cfg.n_layers * model.cfg.n_heads)
    if rank_position is not None and top_k > 0:
        stand_in = [s[3] for s in topk_settings(model, None, list(range(1, k_max + 1)), n_random, seed)]
        topk_plan = HeadSetSweep(model, prepared, stand_in, position=rank_position, direction=main_dir,
                                 chunk_runs=chunk_runs)
        if ablation != "none":
            ablation_plan = AblationSweep(model, prepared, stand_in, mode=ablation, chunk_runs=chunk_runs)

    def stages() -> list[Any]:
        return plan_stages(exact, attribution, topk_plan, ablation_plan, n_pairs=len(aligned), k_max=k_max,
                           n_random=n_random)
    plan = Plan(stages(), len(aligned), max_runs, notes=list(pos.notes))
    if rank_position is None and top_k > 0:
        plan.notes.append("top-k recovery and ablation need --sites to include heads; skipped")
    if "search" in methods:
        plan.notes.append("search (not counted above): attribution estimates of every cell, then exact patching of "
                          "the top-k per site and position, of every cell they cannot rule out (--search-budget) "
                          "and of --search-samples random others")
    if not dry_run and max_runs is not None and plan.total_runs > max_runs:
        print("\n".join(plan.lines()))
        plan.check_budget()
    calibrate(plan, exact, attribution, checkpoints, keep=not dry_run)
    if not dry_run:  # the timed chunk is part of the run: count it as done
        plan.stages = stages()
    print("\n".join(plan.lines()))
    if dry_run:
        if max_runs is not None and plan.total_runs > max_runs:
            print(f"note: over --max-runs {max_runs:,}: without --dry-run this plan stops before running")
        print("dry run: nothing else run, nothing written")
        return PatchingRunResult(config, {"plan": plan.to_dict(), "dry_run": True}, dry_run=True)

    try:
        results: dict[tuple[str, str], Any] = {}
        for d in directions:
            for m in methods:
                if m == "exact":
                    exact[d].run(checkpoints=checkpoints, progress=progress)
                    res = exact[d].result()
                elif m == "attribution":
                    res = attribution[d].result(checkpoints, progress=progress)
                elif m == "search":
                    from tomlens.patching import search

                    res = search(model, prepared, sites=pos.spec, direction=d, k=top_k or 10, seed=seed,
                                 batch_pairs=batch_pairs, memory_mb=memory_mb, progress=progress,
                                 **search_options)
                results[(m, d)] = _with_seed(res, seed)
        ranking_source = (results.get(("exact", main_dir)) or results.get(("attribution", main_dir))
                          or results.get(("search", main_dir)))
        rec = ab = ranking = None
        if rank_position is not None and ranking_source is not None:
            ranking = list(zip(*[rank_heads(ranking_source, position=rank_position)[c] for c in ("layer", "head")]))
            if top_k > 0:
                rec = topk_recovery(model, prepared, ranking, k_max=top_k, n_random=n_random, seed=seed,
                                    position=rank_position, direction=main_dir, memory_mb=memory_mb,
                                    progress=progress, checkpoints=checkpoints, chunk_runs=chunk_runs)
                if ablation != "none":
                    ab = mean_ablation(model, prepared, ranking, ks=list(range(1, top_k + 1)), n_random=n_random,
                                       seed=seed, mode=ablation, memory_mb=memory_mb, progress=progress,
                                       checkpoints=checkpoints, chunk_runs=chunk_runs)
    except KeyboardInterrupt:
        if resumable:
            print(f"stopped: {checkpoints.count()} finished chunks kept under {checkpoints.folder}; "
                  "run the same command again to resume", file=sys.stderr)
        raise

    # Every stage is complete: the tables by file stem, in the order they are written.
    tables: dict[str, pd.DataFrame] = {}
    for (m, d), res in results.items():
        tables[f"cells_{m}_{d}"] = res.summary()
        tables[f"pairs_{m}_{d}"] = res.per_pair()

    summary: dict[str, Any] = {
        "command": "patch",
        "provenance": provenance(model),
        "seed": seed,
        "pairs": {
            "n_given": len(pairs), "n_aligned": len(aligned), "hash": pairs_hash(aligned),
            "families": sorted({p.family for p in aligned}), "contrasts": sorted({p.contrast for p in aligned}),
            "dropped": report.dropped_pairs,
        },
        "metric": METRIC_NAME,
        "normalisation": "effect = (patched - corrupted) / mean(clean - corrupted) per pair; 0 = corrupted run, 1 = clean run",
        "corruption": "minimal pairs: clean = false-belief story, corrupted = matched control differing only in the "
        "contrast span (token-aligned); denoise patches clean into corrupted, noise corrupted into clean",
        "sites": kinds, "positions": {k: list(v) for k, v in pos.spec.items()}, "methods": methods,
        "directions": directions,
        "baselines": {f"{m}_{d}": r.baselines() for (m, d), r in results.items()},
        "comparisons": [],
    }
    for d in directions:
        if ("exact", d) in results and ("attribution", d) in results:
            ex, at = results[("exact", d)], results[("attribution", d)]
            for kind in kinds:
                for position in sorted(set(ex.summary().query("kind == @kind").position)):
                    cmp = compare(ex, at, kind=kind, position=position, k=min(10, max(1, top_k)))
                    summary["comparisons"].append({"direction": d, **cmp})

    if ranking is not None:
        found = results.get(("search", main_dir))  # its verified cells as exact, its estimates as attribution
        tables["heads"] = head_table(results.get(("exact", main_dir)) or (found and found.exact()),
                                     results.get(("attribution", main_dir)) or (found and found.estimates.result()),
                                     probe, position=rank_position)
        summary["rank_position"] = rank_position
        summary["top_heads"] = [f"L{l}H{h}" for l, h in ranking[: max(top_k, 10)]]
        summary["ranked_by"] = f"{ranking_source.method} {ranking_source.direction} effect, heads at {rank_position}"
    if rec is not None:
        tables["topk"] = rec.table
        tables["topk_random"] = rec.draws
        summary["topk"] = rec.table.to_dict(orient="records")
    if ab is not None:
        tables["ablation"] = ab.table
        tables["ablation_random"] = ab.draws
        summary["ablation"] = {
            "mode": ablation,
            "mean": "each ablated head's z replaced by its mean over all clean and corrupted stories "
            + ("at the final token" if ablation == "final" else "at the same right-aligned position"),
            "baseline": ab.baseline, "table": ab.table.to_dict(orient="records"),
        }
    if rank_position is None and top_k > 0:
        summary["topk_skipped"] = "top-k recovery and ablation need --sites to include heads"
    if "search" in methods:
        summary["search"] = {d: r.report() for (m, d), r in results.items() if m == "search"}
    summary["plan"] = plan.to_dict()
    summary["seconds"] = round(time.time() - started, 2)
    ext = ".parquet" if cfg.format == "parquet" else ".csv"
    summary["files"] = [f"{stem}{ext}" for stem in tables]
    hashed = stimuli_hash([s for p in aligned for s in (p.clean, p.corrupted)])
    manifest = run_manifest(model, config, stimuli_hash=hashed, extra={"pairs_hash": pairs_hash(aligned)})
    note = gap_note(summary["baselines"][f"{ranking_source.method}_{main_dir}"] if ranking_source is not None
                    else next(iter(summary["baselines"].values())))
    if note:
        print(f"note: {note}")
    return PatchingRunResult(config, summary, tables, dict(results), rec, ab, manifest, checkpoints=checkpoints)
