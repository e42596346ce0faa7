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

Before any sweep, the gate (`tomlens.patching.gate`): one plain forward per story gives every pair's
clean and corrupted logit differences, and per contrast the false-minus-true-belief gap, averaged
within each task (tasks are the unit), must have a one-sided 95% lower bound above 0. The gate always
sees every aligned pair. When no contrast passes, the cell sweeps, the ranking,
top-k recovery and mean ablation are withheld (not run): the result holds the gate table, the
per-pair logit differences and the message. When some pass, only their pairs go on. `force` runs
everything anyway and flags every output (`summary["forced"]`, a `forced` column in every table,
"FORCED" in figure titles). `solved_only` then keeps, of the pairs the gate let through, those the
model answers right both ways (it never filters what the gate sees: solved pairs have a positive gap by
construction). Each half of the split must also have a positive mean gap (ranking effects are
normalised by the selection pairs' gap, validation by the held-out pairs'): else those are withheld.

Selection is kept apart from evaluation: the pairs are split by task (`select_fraction` of the tasks)
into selection pairs, on which cells are patched and heads ranked, and held-out evaluation pairs, on
which top-k recovery and mean ablation (against layer-matched random heads, at the k of `ks`) test the
ranking. Fewer than 4 pairs or a single task: no split, refused unless forced.

`PatchingRunResult.save(out)` writes the gate (`gate`: one row per contrast), the unpatched logit
differences per pair (`base`), per-cell tables (`cells_<method>_<direction>`), per-pair tables
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

__all__ = ["DEFAULT_CHUNK_RUNS", "DEFAULT_KS", "DEFAULT_MAX_RUNS", "DIRECTIONS", "FORCED_PREFIX", "METHODS",
           "PatchingConfig", "PatchingRunResult", "pairs_hash", "parse_ks", "run"]

METHODS = ("exact", "attribution", "both", "search")
DEFAULT_ATTRIBUTION_STEPS = 8  # integrated gradients: find the organism's planted head, which plain attribution misses
# What integrated gradients move (= tomlens.patching.attribution.IG_PATHS, kept here: no torch to read a
# config): each patched site, as exact patching does; the embeddings split a chain of heads' effect.
ATTRIBUTION_PATHS = ("sites", "embeddings")
DEFAULT_ATTRIBUTION_PATH = "sites"
DIRECTIONS = ("denoise", "noise", "both")
ABLATIONS = ("final", "all", "none")
GRADDROP = {"auto": None, "on": True, "off": False}
FORMATS = ("parquet", "csv")
DEFAULT_MAX_RUNS = 100_000  # = tomlens.patching.plan.DEFAULT_MAX_RUNS (kept here: no torch to read a config)
DEFAULT_CHUNK_RUNS = 1024  # = tomlens.patching.engine.DEFAULT_CHUNK_RUNS
DEFAULT_KS = (1, 2, 3, 5, 10)
FORCED_PREFIX = "FORCED (gate failed): "


@dataclass(frozen=True)
class PatchingConfig:
    """A whole patching run. The pairs come from `pairs` (built for `model`'s tokenizer) or from the
    file `pairs_path` (written by `tomlens pairs`), unless `run` is handed them. `sites` and
    `positions` take the one list syntax (`split_items`); a position item may be `SITE=POSITION`.
    `search_*` and `graddrop` are `method = "search"`'s settings; `max_runs = None` sets no limit.
    `force` runs past a failed gate (or a refused split), flagging every output; `solved_only` patches
    only the pairs (of those the gate passed) answered right both ways; `select_fraction` of the tasks
    select and rank heads, the rest validate them; `ks` are the k (up to `top_k`) of top-k recovery and ablation, each against
    `n_random` layer-matched random head sets. `attribution_steps` > 1 makes attribution integrated
    gradients over that many points between the two stories (plain attribution, 1, reads the
    gradient at the base run only and misses a head whose effect saturates there), moving each
    patched site's activation (`attribution_path = "sites"`) or the token embeddings ("embeddings")."""

    model: ModelSpec = field(default_factory=ModelSpec)
    pairs: PairsConfig | None = None
    pairs_path: str | None = None
    method: str = "both"
    sites: tuple[str, ...] = ("heads", "resid")
    positions: tuple[str, ...] = ("roles",)
    direction: str = "denoise"
    top_k: int = 10
    n_random: int = 200
    ks: tuple[int, ...] = DEFAULT_KS
    force: bool = False
    solved_only: bool = False
    select_fraction: float = 0.5
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
    attribution_steps: int = DEFAULT_ATTRIBUTION_STEPS
    attribution_path: str = DEFAULT_ATTRIBUTION_PATH
    format: str = "parquet"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(split_items(self.sites)))
        object.__setattr__(self, "positions", tuple(split_items(self.positions)))
        ks = parse_ks(self.ks)
        if not ks or any(k < 1 for k in ks):
            raise TomlensError(f"--ks {list(ks)} needs at least one k, each at least 1", "pass e.g. --ks 1,2,3,5,10")
        object.__setattr__(self, "ks", tuple(sorted(set(ks))))
        if int(self.attribution_steps) < 1:
            raise TomlensError(f"attribution_steps = {self.attribution_steps}",
                               "use 1 (plain attribution patching) or more (integrated gradients, e.g. 8)")
        if not 0 < float(self.select_fraction) < 1:
            raise TomlensError(f"--select-fraction {self.select_fraction} is not between 0 and 1",
                               "pass the share of tasks that select heads, e.g. 0.5")
        if self.pairs_path is not None and not isinstance(self.pairs_path, str):
            object.__setattr__(self, "pairs_path", str(self.pairs_path))
        if self.probe_table is not None and not isinstance(self.probe_table, str):
            object.__setattr__(self, "probe_table", str(self.probe_table))
        for name, value, allowed in (("method", self.method, METHODS), ("direction", self.direction, DIRECTIONS),
                                     ("ablation", self.ablation, ABLATIONS), ("graddrop", self.graddrop, tuple(GRADDROP)),
                                     ("format", self.format, FORMATS),
                                     ("attribution_path", self.attribution_path, ATTRIBUTION_PATHS)):
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


def parse_ks(value: str | int | Sequence[int | str]) -> tuple[int, ...]:
    """The k of top-k recovery and ablation from "1,2,3", "1 2 3" or a list of whole numbers."""
    raw = (value,) if isinstance(value, (int, str)) else tuple(value)
    try:
        return tuple(int(k) for v in raw for k in (split_items(v) if isinstance(v, str) else [v]))
    except (TypeError, ValueError):
        raise TomlensError(f"--ks {value!r} is not a list of whole numbers", "pass e.g. --ks 1,2,3,5,10") from None


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
    pairs: Any = field(default=None, repr=False, compare=False)  # the selection pairs (for role-aligned figures)
    tokenizer: Any = field(default=None, repr=False, compare=False)  # the model's (not kept by `load`)

    @property
    def plan(self) -> dict[str, Any]:
        return self.summary["plan"]

    @property
    def withheld(self) -> str | None:
        """Why the sweeps, ranking and validations were not run (the gate failed, or no split), or None."""
        return self.summary.get("withheld")

    @property
    def forced(self) -> bool:
        """Whether the run went past a failed gate or a refused split (`force`): every output is flagged."""
        return bool(self.summary.get("forced"))

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
            if s.get("withheld"):
                return f"dry run: {s['withheld']}; nothing written"
            return f"dry run: a plan of {s['plan']['total_runs']:,} patched runs; nothing run, nothing written"
        lines = []
        if "base" in self.tables:  # raw logit differences first: what every effect below is a share of
            base = self.tables["base"]
            lines.append(f"{s['pairs']['n_aligned']} pairs; unpatched logit diff (belief - world) clean "
                         f"{base.clean_logit_diff.mean():.3f}, corrupted {base.corrupted_logit_diff.mean():.3f}")
        lines += [g["message"] for g in s.get("gate", {}).get("contrasts", {}).values()]
        lines += list(s.get("notes", []))
        if self.withheld:
            lines.append(self.withheld)
            return "\n".join(lines)
        if self.forced:
            lines.append(s["forced_message"])
        elif s.get("gate", {}).get("dropped_contrasts"):
            lines.append(s["gate"]["message"])
        sel, ev = s["pairs"]["selection"], s["pairs"]["evaluation"]
        lines.append(f"heads ranked on {sel['n']} selection pairs ({sel['tasks']} tasks), validated on "
                     f"{ev['n']} held-out pairs ({ev['tasks']} tasks)" + (": the SAME pairs" if ev["same_as_selection"] else ""))
        b = next(iter(s["baselines"].values()))
        lines.append(f"selection pairs: logit diff clean {b['clean_logit_diff']:.3f}, corrupted {b['corrupted_logit_diff']:.3f}")
        if "top_heads" in s:
            lines.append(f"top heads ({s['ranked_by']}): {', '.join(s['top_heads'][:10])}")
        for d, rep in s.get("search", {}).items():
            for fn in rep["false_negatives"]:
                lines.append(f"search ({d}, {fn['kind']} at {fn['position']}): {fn['n_verified_rule']} of "
                             f"{fn['n_cells']} cells patched by the rule, {fn['n_sampled']} sampled; "
                             f"false negatives: {fn['meaning']}")
        for c in s["comparisons"]:
            if c["kind"] == "head" and c["position"] == s.get("rank_position"):
                active = (f" (over the {c['n_active']} heads moving the metric by >= {c['active']:g} of the gap: "
                          f"{c['spearman_active']:.2f})") if "spearman_active" in c else ""
                first = (f", exact's top head {c['exact_top']} is attribution's #{c['exact_top_rank']}"
                         if c.get("exact_top_rank") else "")
                lines.append(f"attribution vs exact ({c['direction']}): Spearman {c['spearman']:.2f}{active}, "
                             f"top-{c['k']} overlap {c['topk_overlap']:.2f}{first}")
        for r in s.get("topk", []):
            lines.append(f"top-{r['k']} recovery {r['top_effect']:.3f} vs layer-matched random "
                         f"{r['random_mean']:.3f} [{r['random_low']:.3f}, {r['random_high']:.3f}], share of "
                         f"draws reaching it {r['random_reach']:.3f} (p {r['p_random']:.3f}, "
                         f"{r['n_random']} of {r.get('n_distinct', '?')} distinct sets)")
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


def _base_table(aligned: Sequence[Any], clean: Any, corrupted: Any, kept: set[int]) -> pd.DataFrame:
    """The unpatched logit differences of every aligned pair (raw numbers, read before any effect)."""
    import pandas as pd

    from tomlens.patching.gate import solved_mask

    solved = solved_mask(clean, corrupted)
    return pd.DataFrame({
        "pair_id": [p.id for p in aligned], "contrast": [p.contrast for p in aligned],
        "task_id": [p.clean.task_id for p in aligned],
        "clean_logit_diff": clean.numpy(), "corrupted_logit_diff": corrupted.numpy(),
        "gap": (clean - corrupted).numpy(), "solved": solved.numpy(),
        "kept": [i in kept for i in range(len(aligned))],
    })


def _recount(plan: Any, planned_sets: int, sets: int) -> None:
    """Top-k recovery and ablation patch every distinct layer-matched set where there are fewer than
    `n_random`, which depends on the ranked heads' layers: once they are known, the plan's counts for
    those stages are set to the head sets that will run (each set costs the same runs) and said. The
    plan counts `n_random` per k, the upper bound, so this only shrinks it."""
    if sets == planned_sets or planned_sets == 0:
        return
    for st in plan.stages:
        if st.name.startswith(("top-k recovery", "mean ablation")):
            st.runs, st.units = st.runs * sets // planned_sets, st.units * sets // planned_sets
            st.cost = st.cost * sets / planned_sets
    print(f"plan recounted once heads were ranked ({sets} head sets, not {planned_sets}: some k have fewer "
          f"distinct layer-matched sets than --n-random, and all of them run): {plan.total_runs:,} patched runs")


def _flag(tables: dict[str, pd.DataFrame]) -> None:
    """A `forced` column (True) in every table of a run that went past a failed gate or split."""
    for df in tables.values():
        df["forced"] = True


def _run(config: PatchingConfig, *, model: Any, pairs: Sequence[Any] | None, out: str | Path,
         progress: bool, resumable: bool) -> PatchingRunResult:
    import torch

    from tomlens.activations.cache import weights_fingerprint
    from tomlens.io import read_table
    from tomlens.models import provenance
    from tomlens.patching import (
        METRIC_NAME, AblationSweep, AttributionSweep, Checkpoints, ExactSweep, HeadSetSweep, Plan, calibrate,
        canonical_kind, compare, drop_missing_roles, head_table, mean_ablation, parse_positions,
        plan_cells, plan_stages, prepare_pairs, rank_heads, topk_recovery, topk_settings,
    )
    from tomlens.patching.gate import (
        METHOD, MIN_SPLIT_PAIRS, base_logit_diffs, gate_message, gate_pairs, gate_table, split_selection,
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
    from tomlens.patching.plan import expand_mentions  # `mentions`: the role mentions these pairs share

    pos = drop_missing_roles(expand_mentions(pos, aligned, model.tokenizer),
                             [s for p in aligned for s in (p.clean, p.corrupted)])

    # The gate, before anything is planned: one plain forward per story.
    everything = prepare_pairs(model, aligned, selectors=pos.selectors, batch_pairs=batch_pairs)
    clean0, corrupted0 = base_logit_diffs(model, everything)
    # The gate sees EVERY aligned pair: filtering to solved pairs first (clean > 0, corrupted < 0) would
    # make every gap positive by construction. --solved-only only picks which pairs are patched after it.
    gates = gate_pairs(clean0, corrupted0, [p.contrast for p in aligned],
                       task_ids=[p.clean.task_id for p in aligned])
    passed = [c for c, g in gates.items() if g.passed]
    gate_failed = len(passed) < len(gates) or not gates
    message = gate_message(gates, forced=cfg.force)
    solved = ((clean0 > 0) & (corrupted0 < 0)).tolist()
    gated = [i for i in range(len(aligned)) if cfg.force or aligned[i].contrast in passed]
    kept = [i for i in gated if solved[i] or not cfg.solved_only]
    notes: list[str] = []
    if cfg.solved_only:
        notes.append(f"--solved-only: the gate ran on all {len(aligned)} pairs; of the {len(gated)} pairs it let "
                     f"through, kept {len(kept)} the model answers right both ways")
    dropped_contrasts = sorted(c for c in gates if c not in passed) if (passed and not cfg.force) else []
    withheld = None
    if not gated:
        withheld = message
    elif not kept:
        withheld = (f"withheld: of the {len(gated)} pairs that passed the gate, none is answered right both ways "
                    "(--solved-only): nothing to patch; run without --solved-only")
    # The split is drawn over EVERY gated pair and each half's gap read over all of its pairs; only then
    # does --solved-only pick, within each half, the pairs that are patched. Reading the gaps after the
    # filter would read only pairs with clean > 0 > corrupted, whose gaps are positive by construction.
    halves_g = split_selection([aligned[i] for i in gated], cfg.select_fraction, seed) if kept else None
    forced = bool(cfg.force and gate_failed)
    if kept and halves_g is None:
        n_tasks = len({aligned[i].clean.task_id or aligned[i].id for i in gated})
        why = (f"{len(gated)} pairs from {n_tasks} task(s) cannot be split into selection and held-out evaluation "
               f"pairs (needs at least {MIN_SPLIT_PAIRS} pairs and 2 tasks)")
        if cfg.force:
            forced = True
            notes.append(f"FORCED: {why}; heads are ranked and validated on the SAME pairs")
            halves_g = (list(range(len(gated))), list(range(len(gated))))
        else:
            withheld = (f"withheld: head ranking, top-k recovery, mean ablation and the cell sweeps. Reason: {why}, "
                        "and heads validated on the pairs that ranked them recover their own noise; use more pairs "
                        "(--force runs everything anyway, flagged)")
    # The pooled gate is not enough: ranking is normalised by the selection pairs' own gap and validation
    # by the held-out pairs'. A half whose mean gap is not positive divides by noise or the wrong sign.
    half_gaps: dict[str, float] = {}
    split: tuple[list[int], list[int]] | None = None  # indices into `aligned` of the pairs patched, per half
    if withheld is None and halves_g is not None:
        for half, idx in (("selection", halves_g[0]), ("evaluation", halves_g[1])):
            ii = torch.tensor([gated[i] for i in idx])
            half_gaps[half] = float((clean0[ii] - corrupted0[ii]).mean())
        bad = [f"the {h} pairs' mean gap is {g:.3f}" for h, g in half_gaps.items() if not g > 0]
        if bad:
            why = ("; ".join(bad) + " (not positive, read over all of the half's gated pairs: heads ranked on the "
                   "selection pairs and validated on the held-out pairs are normalised by that half's own gap)")
            if cfg.force:
                forced = True
                notes.append(f"FORCED: {why}")
            else:
                withheld = ("withheld: head ranking, top-k recovery, mean ablation and the cell sweeps. Reason: "
                            f"{why}; use more tasks or another --seed for the split (--force runs everything "
                            "anyway, flagged)")
        split = ([gated[i] for i in halves_g[0] if solved[gated[i]] or not cfg.solved_only],
                 [gated[i] for i in halves_g[1] if solved[gated[i]] or not cfg.solved_only])
        empty = [h for h, idx in zip(("selection", "evaluation"), split) if not idx]
        if withheld is None and empty:
            withheld = (f"withheld: head ranking, top-k recovery, mean ablation and the cell sweeps. Reason: no "
                        f"{' or '.join(empty)} pair is answered right both ways (--solved-only); run without "
                        "--solved-only, or with another --seed for the split")
    gate_summary = {
        "method": METHOD, "contrasts": {c: g.to_dict() for c, g in gates.items()}, "passed": passed,
        "dropped_contrasts": dropped_contrasts, "message": message, "forced": forced,
        "n_gated": len(aligned), "n_passed_pairs": len(gated), "n_patched": len(kept), "half_gaps": half_gaps,
        "power": {c: g.power_line for c, g in gates.items()},
    }
    base_df = _base_table(aligned, clean0, corrupted0, set(kept))
    if withheld is None:  # a withheld run says all this in `describe` (what the commands print next)
        print("\n".join([*(g.message for g in gates.values()), *notes, f"gate: {message}"]))
    if withheld is not None:
        tables = {"gate": gate_table(gates), "base": base_df}
        summary = {
            "command": "patch", "provenance": provenance(model), "seed": seed, "withheld": withheld,
            "gate": gate_summary, "notes": notes, "metric": METRIC_NAME,
            "pairs": {"n_given": len(pairs), "n_aligned": len(aligned), "n_kept": len(kept),
                      "hash": pairs_hash(aligned), "contrasts": sorted({p.contrast for p in aligned}),
                      "dropped": report.dropped_pairs},
            "base": {"clean_logit_diff": float(clean0.mean()), "corrupted_logit_diff": float(corrupted0.mean()),
                     "gap": float((clean0 - corrupted0).mean())},
        }
        if dry_run:
            print("dry run: nothing else run, nothing written")
            return PatchingRunResult(config, {**summary, "dry_run": True, "plan": {"total_runs": 0}}, dry_run=True)
        summary["seconds"] = round(time.time() - started, 2)
        ext = ".parquet" if cfg.format == "parquet" else ".csv"
        summary["files"] = [f"{stem}{ext}" for stem in tables]
        hashed = stimuli_hash([s for p in aligned for s in (p.clean, p.corrupted)])
        manifest = run_manifest(model, config, stimuli_hash=hashed, extra={"pairs_hash": pairs_hash(aligned)})
        return PatchingRunResult(config, summary, tables, manifest=manifest)

    assert split is not None
    selection = [aligned[i] for i in split[0]]
    evaluation = [aligned[i] for i in split[1]]
    same = split[0] == split[1]
    prepared = (everything if len(selection) == len(aligned)
                else prepare_pairs(model, selection, selectors=pos.selectors, batch_pairs=batch_pairs))
    held = prepared if same else prepare_pairs(model, evaluation, selectors=pos.selectors, batch_pairs=batch_pairs)
    cells = plan_cells(model, pos.spec, n_aligned=prepared.n_aligned)
    rank_position = pos.rank_position()
    methods, directions = cfg.methods, cfg.directions
    main_dir = directions[0]
    search_options = cfg.search_options()
    k_max = min(top_k, model.cfg.n_layers * model.cfg.n_heads)
    ks = sorted({k for k in cfg.ks if k <= k_max}) or ([k_max] if k_max > 0 else [])
    checkpoints = Checkpoints(out, {
        "provenance": provenance(model), "weights": weights_fingerprint(model), "pairs": pairs_hash(aligned),
        "selection": pairs_hash(selection), "evaluation": pairs_hash(evaluation),
        "positions": pos.spec, "methods": methods, "directions": directions, "top_k": top_k, "ks": ks,
        "n_random": n_random, "ablation": ablation, "seed": seed, "batch_pairs": batch_pairs,
        "chunk_runs": chunk_runs, "search": search_options,
    })

    # Every stage laid out before anything runs: exact sweeps and attribution on the selection pairs
    # (with what the checkpoints already hold), and top-k / ablation on the evaluation pairs with
    # stand-in top sets (same counts).
    exact = {d: ExactSweep(model, prepared, cells, d, memory_mb=memory_mb, chunk_runs=chunk_runs)
             for d in directions} if "exact" in methods else {}
    attribution = ({d: AttributionSweep(model, prepared, pos.spec, d, steps=config.attribution_steps,
                                        path=config.attribution_path) for d in directions}
                   if "attribution" in methods else {})
    for sweep in [*exact.values(), *attribution.values()]:
        sweep.load(checkpoints)
    topk_plan = ablation_plan = None
    if rank_position is not None and ks:
        # Planned at the upper bound, n_random draws per k: how many distinct layer-matched sets a k has
        # depends on the ranked heads' layers (a uniform stand-in in one layer may have fewer than a real
        # top set spread over two), so the recount once heads are ranked can only shrink the plan.
        settings = topk_settings(model, None, ks, n_random, seed)
        stand_in = [s[3] for s in settings if s[0] == "top"]
        for k, top in zip(ks, list(stand_in)):
            draws = [s[3] for s in settings if s[0] == "random" and s[1] == k]
            stand_in += draws + [top] * (n_random - len(draws))  # same size, so the same runs per set
        topk_plan = HeadSetSweep(model, held, stand_in, position=rank_position, direction=main_dir,
                                 chunk_runs=chunk_runs)
        if ablation != "none":
            ablation_plan = AblationSweep(model, held, stand_in, mode=ablation, chunk_runs=chunk_runs)

    def stages() -> list[Any]:
        out = plan_stages(exact, attribution, topk_plan, ablation_plan, n_pairs=len(selection), k_max=k_max,
                          n_random=n_random)
        for st in out:  # the validations run on the held-out pairs, at the k of `ks` only
            if st.name == "top-k recovery":
                st.what = f"{len(ks)} top + up to {len(ks) * n_random} layer-matched random head sets (k = {ks})"
            if st.name.startswith(("top-k recovery", "mean ablation")):
                st.pairs = len(evaluation)
        return out
    plan = Plan(stages(), len(selection) + (0 if same else len(evaluation)), max_runs, notes=list(pos.notes))
    plan.notes.append(f"selection pairs (cells patched, heads ranked): {len(selection)}; held-out evaluation "
                      f"pairs (top-k recovery, ablation): {len(evaluation)}" + (" (the SAME pairs: forced)" if same else ""))
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
        return PatchingRunResult(config, {"plan": plan.to_dict(), "dry_run": True, "gate": gate_summary},
                                 dry_run=True)

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
            if ks:
                _recount(plan, len(stand_in), len(topk_settings(model, ranking, ks, n_random, seed)))
                if max_runs is not None and plan.total_runs > max_runs:  # refused as the plan check refuses
                    print("\n".join(plan.lines()))
                    if resumable:
                        print(f"the sweeps run so far are kept under {checkpoints.folder}: run again (with a larger "
                              "--max-runs) to resume", file=sys.stderr)
                    plan.check_budget()
                rec = topk_recovery(model, held, ranking, k_max=k_max, ks=ks, n_random=n_random, seed=seed,
                                    position=rank_position, direction=main_dir, memory_mb=memory_mb,
                                    progress=progress, checkpoints=checkpoints, chunk_runs=chunk_runs)
                if ablation != "none":
                    ab = mean_ablation(model, held, ranking, ks=ks, n_random=n_random,
                                       seed=seed, mode=ablation, memory_mb=memory_mb, progress=progress,
                                       checkpoints=checkpoints, chunk_runs=chunk_runs)
    except KeyboardInterrupt:
        if resumable:
            print(f"stopped: {checkpoints.count()} finished chunks kept under {checkpoints.folder}; "
                  "run the same command again to resume", file=sys.stderr)
        raise

    # Every stage is complete: the tables by file stem, in the order they are written.
    tables: dict[str, pd.DataFrame] = {"gate": gate_table(gates), "base": base_df}
    for (m, d), res in results.items():
        tables[f"cells_{m}_{d}"] = res.summary()
        tables[f"pairs_{m}_{d}"] = res.per_pair()

    summary: dict[str, Any] = {
        "command": "patch",
        "provenance": provenance(model),
        "seed": seed,
        "gate": gate_summary,
        "notes": notes,
        "pairs": {
            "n_given": len(pairs), "n_aligned": len(aligned), "n_kept": len(kept), "hash": pairs_hash(aligned),
            "families": sorted({p.family for p in aligned}), "contrasts": sorted({p.contrast for p in aligned}),
            "dropped": report.dropped_pairs,
            "selection": {"n": len(selection), "hash": pairs_hash(selection),
                          "tasks": len({p.clean.task_id or p.id for p in selection})},
            "evaluation": {"n": len(evaluation), "hash": pairs_hash(evaluation),
                           "tasks": len({p.clean.task_id or p.id for p in evaluation}), "same_as_selection": same},
            "select_fraction": cfg.select_fraction,
        },
        "metric": METRIC_NAME,
        "normalisation": "effect = (patched - corrupted) / mean(clean - corrupted) per pair; 0 = corrupted run, 1 = clean run",
        "corruption": "minimal pairs: clean = false-belief story, corrupted = matched control differing only in the "
        "contrast span (token-aligned); denoise patches clean into corrupted, noise corrupted into clean",
        "sites": kinds, "positions": {k: list(v) for k, v in pos.spec.items()}, "methods": methods,
        "directions": directions,
        **({"attribution_steps": int(config.attribution_steps), "attribution_path": config.attribution_path}
           if "attribution" in methods else {}),
        "baselines": {f"{m}_{d}": r.baselines() for (m, d), r in results.items()},
        "comparisons": [],
    }
    if forced:
        summary["forced"] = True
        summary["forced_message"] = message if gate_failed else notes[-1]
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
        summary["ranked_by"] = (f"{ranking_source.method} {ranking_source.direction} effect, heads at {rank_position}, "
                                f"on {len(selection)} selection pairs")
    if rec is not None:
        tables["topk"] = rec.table
        tables["topk_random"] = rec.draws
        summary["topk"] = rec.table.to_dict(orient="records")
        summary["validated_on"] = f"{len(evaluation)} held-out evaluation pairs" + (" (the SAME pairs: forced)" if same else "")
        summary["random_heads"] = (f"up to {n_random} distinct layer-matched sets per k (the top set's layers, its "
                                   "heads left out; every such set where there are no more: an exact p); p_random "
                                   "is per k, uncorrected across the ks")
    if ab is not None:
        tables["ablation"] = ab.table
        tables["ablation_random"] = ab.draws
        summary["ablation"] = {
            "mode": ablation,
            "mean": "each ablated head's z replaced by its mean over all clean and corrupted evaluation stories "
            + ("at the final token" if ablation == "final" else "at the same right-aligned position"),
            "baseline": ab.baseline, "table": ab.table.to_dict(orient="records"),
        }
    if rank_position is None and top_k > 0:
        summary["topk_skipped"] = "top-k recovery and ablation need --sites to include heads"
    if "search" in methods:
        summary["search"] = {d: r.report() for (m, d), r in results.items() if m == "search"}
    if forced:
        _flag(tables)
    summary["plan"] = plan.to_dict()
    summary["seconds"] = round(time.time() - started, 2)
    ext = ".parquet" if cfg.format == "parquet" else ".csv"
    summary["files"] = [f"{stem}{ext}" for stem in tables]
    hashed = stimuli_hash([s for p in aligned for s in (p.clean, p.corrupted)])
    manifest = run_manifest(model, config, stimuli_hash=hashed,
                            extra={"pairs_hash": pairs_hash(aligned), "selection_hash": pairs_hash(selection),
                                   "evaluation_hash": pairs_hash(evaluation)})
    return PatchingRunResult(config, summary, tables, dict(results), rec, ab, manifest, checkpoints=checkpoints,
                             pairs=list(selection), tokenizer=model.tokenizer)
