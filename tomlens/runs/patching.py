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
everything anyway and flags every output (`summary.forced`, a `forced` column in every table,
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
`summary.json` (provenance, the plan, the comparisons) and, last, `result.json` (= the summary, a
`tomlens.runs.patching_summary.PatchingSummary`).
Figures are the report layer's: `tomlens.report.patching.write_patching_figures`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tomlens.errors import TomlensError
from tomlens.messages import say
from tomlens.models.protocol import Model
from tomlens.runs.base import ModelSpec, split_items
from tomlens.runs.pairs import REASON_FIXES, PairsConfig
from tomlens.runs.patching_summary import (
    CORRUPTION,
    NORMALISATION,
    AblationBaseline,
    AblationRow,
    AblationSummary,
    Baseline,
    BaseLogitDiffs,
    Comparison,
    ContrastGate,
    GateSummary,
    PairCounts,
    PairHalf,
    PatchingSummary,
    PlanSummary,
    SearchReport,
    TopKRow,
    build,
    num,
    records,
    summary_dict,
)
from tomlens.vocabulary import one_of, unknown

if TYPE_CHECKING:
    import pandas as pd


__all__ = ["DEFAULT_CHUNK_RUNS", "DEFAULT_KS", "DEFAULT_MAX_RUNS", "DIRECTIONS", "METHODS",
           "PatchingConfig", "PatchingRunResult", "pairs_hash", "parse_ks", "run"]

METHODS = ("exact", "attribution", "both", "search")
DEFAULT_ATTRIBUTION_STEPS = 8  # integrated gradients: find the organism's planted head, which plain attribution misses
# What integrated gradients move (= tomlens.patching.attribution.IG_PATHS, kept here: no torch to read a
# config): each patched site, as exact patching does; the embeddings split a chain of heads' effect.
ATTRIBUTION_PATHS = ("sites", "embeddings")
DEFAULT_ATTRIBUTION_PATH = "sites"
DIRECTIONS = ("denoise", "noise", "both")
ABLATIONS = ("final", "all", "none")

# The checked settings as the Literal types tomlens.patching takes (the same values as its Direction,
# IGPath and ablation mode; that package, and torch with it, is imported only when a run starts).
_Direction = Literal["denoise", "noise"]
_DIRECTION_LISTS: dict[str, list[_Direction]] = {"denoise": ["denoise"], "noise": ["noise"],
                                                 "both": ["denoise", "noise"]}
_IG_PATHS: dict[str, Literal["embeddings", "sites"]] = {"sites": "sites", "embeddings": "embeddings"}
_ABLATION_MODES: dict[str, Literal["final", "all"] | None] = {"final": "final", "all": "all", "none": None}
GRADDROP = {"auto": None, "on": True, "off": False}
FORMATS = ("parquet", "csv")
DEFAULT_MAX_RUNS = 100_000  # = tomlens.patching.plan.DEFAULT_MAX_RUNS (kept here: no torch to read a config)
DEFAULT_CHUNK_RUNS = 1024  # = tomlens.patching.engine.DEFAULT_CHUNK_RUNS
DEFAULT_KS = (1, 2, 3, 5, 10)


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
            one_of(name, value, allowed)
        if self.pairs is not None and self.pairs_path is not None:
            raise TomlensError("patching has both `pairs` (a table) and `pairs_path` (a file)",
                               "keep one: the pairs to build, or the file written by `tomlens pairs`")
        if not self.sites:
            raise TomlensError("no patching sites given", "pass e.g. --sites heads,resid")
        check_patching_words(self.sites, self.positions)  # pairs come from the families (known roles)
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
    def directions(self) -> list[_Direction]:
        return list(_DIRECTION_LISTS[self.direction])

    @property
    def ig_path(self) -> Literal["embeddings", "sites"]:
        """`attribution_path`, as attribution patching's path type."""
        return _IG_PATHS[self.attribution_path]

    @property
    def ablation_mode(self) -> Literal["final", "all"] | None:
        """`ablation` as mean ablation's mode; None for "none" (no ablation)."""
        return _ABLATION_MODES[self.ablation]

    def search_options(self) -> dict[str, Any]:
        """Keyword arguments of `tomlens.patching.search` beyond the sweep's own."""
        return {"budget": self.search_budget, "threshold": self.search_threshold,
                "fn_samples": self.search_samples, "graddrop": GRADDROP[self.graddrop]}


POSITION_KEYWORDS = ("roles", "all", "each", "mentions")


def check_patching_words(sites: Sequence[str], positions: Sequence[str], *, user_spans: bool = False) -> None:
    """Refuse a misspelt site or position before any model loads, naming the nearest word: sites are
    the site kinds of `tomlens cache` and `tomlens probe` (resid_pre, resid_post, head_out, ...) or
    their shorthands (heads, resid, attn, mlp); a position is a keyword, a selector or SITE=POSITION."""
    from tomlens.models.positions import parse_selectors, refuse_near_misses
    from tomlens.patching.cells import KIND_ALIASES

    for site in (*sites, *(p.rpartition("=")[0] for p in positions if "=" in p)):
        if site.strip() not in KIND_ALIASES:
            raise unknown("patching site", site, KIND_ALIASES)
    selectors = [p.rpartition("=")[2] for p in positions]
    selectors = [p for p in selectors if p and p not in POSITION_KEYWORDS]
    if selectors:
        refuse_near_misses(parse_selectors(selectors), user_spans=user_spans)


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
    validations (these three only on the run that made them, not after `load`); `summary` the typed
    summary (`PatchingSummary`, result.json). A dry run holds its `plan` and nothing else (`dry_run=True`)."""

    config: PatchingConfig
    summary: PatchingSummary
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
    def plan(self) -> PlanSummary | None:
        return self.summary.plan

    @property
    def withheld(self) -> str | None:
        """Why the sweeps, ranking and validations were not run (the gate failed, or no split), or None."""
        return self.summary.withheld

    @property
    def forced(self) -> bool:
        """Whether the run went past a failed gate or a refused split (`force`): every output is flagged."""
        return self.summary.forced

    @property
    def heads(self) -> pd.DataFrame | None:
        """The per-head table (patch and attribution effects, probe accuracy), if heads were ranked."""
        return self.tables.get("heads")

    def compare(self, direction: str, *, kind: str = "head", position: str | None = None, k: int = 10
                ) -> dict[str, Any]:
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
            if s.withheld:
                return f"dry run: {s.withheld}; nothing written"
            return f"dry run: a plan of {s.plan.total_runs if s.plan else 0:,} patched runs; nothing run, nothing written"
        lines = []
        if "base" in self.tables:  # raw logit differences first: what every effect below is a share of
            base = self.tables["base"]
            lines.append(f"{s.pairs.n_aligned} pairs; unpatched logit diff (belief - world) clean "
                         f"{base.clean_logit_diff.mean():.3f}, corrupted {base.corrupted_logit_diff.mean():.3f}")
        lines += [g.message for g in s.gate.contrasts.values()]
        lines += list(s.notes)
        if s.withheld:
            return "\n".join([*lines, s.withheld])
        if s.forced:
            lines.append(s.forced_message or "")
        elif s.gate.dropped_contrasts:
            lines.append(s.gate.message)
        return "\n".join(lines + _describe_findings(s))

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
        summary = summary_dict(self.summary)
        write_json(summary, out / "summary.json")
        finish_save(out, self.config, self.manifest, summary)
        if self.checkpoints is not None:
            self.checkpoints.clear()
        return out

    @classmethod
    def load(cls, out: str | Path) -> PatchingRunResult:
        """The tables, summary, config and manifest of a finished run (`save`); no sweep objects. A
        folder whose result.json does not fit `PatchingSummary` says to rerun the stage."""
        from tomlens.io import read_table
        from tomlens.runs.files import CONFIG, read_finished, summary_from_dict

        out, config, manifest, data = read_finished(out, PatchingConfig)
        if config is None:
            raise TomlensError(f"{out} holds a patching result but no {CONFIG}",
                               "run the patching again into that folder (its settings are not recorded)")
        summary = summary_from_dict(PatchingSummary, data, folder=out, stage="patching")
        tables = {}
        for name in summary.files:
            path = out / name
            if path.suffix in (".parquet", ".csv"):
                tables[path.stem] = read_table(path)
        return cls(config, summary, tables, manifest=manifest)


def _describe_findings(s: PatchingSummary) -> list[str]:
    """`describe`'s lines for a run that patched: the split, baselines, top heads, search bounds,
    attribution against exact at the ranking position, and top-k recovery."""
    sel, ev = s.pairs.selection, s.pairs.evaluation
    assert sel is not None and ev is not None and s.baselines
    lines = [f"heads ranked on {sel.n} selection pairs ({sel.tasks} tasks), validated on "
             f"{ev.n} held-out pairs ({ev.tasks} tasks)" + (": the SAME pairs" if ev.same_as_selection else "")]
    b = next(iter(s.baselines.values()))
    lines.append(f"selection pairs: logit diff clean {b.clean_logit_diff:.3f}, corrupted {b.corrupted_logit_diff:.3f}")
    if s.top_heads is not None:
        lines.append(f"top heads ({s.ranked_by}): {', '.join(s.top_heads[:10])}")
    for d, rep in (s.search or {}).items():
        for fn in rep.false_negatives:
            lines.append(f"search ({d}, {fn.kind} at {fn.position}): {fn.n_verified_rule} of "
                         f"{fn.n_cells} cells patched by the rule, {fn.n_sampled} sampled; "
                         f"false negatives: {fn.meaning}")
    for c in s.head_comparisons():
        active = (f" (over the {c.n_active} heads moving the metric by >= {c.active:g} of the gap: "
                  f"{num(c.spearman_active):.2f})")
        first = f", exact's top head {c.exact_top} is attribution's #{c.exact_top_rank}" if c.exact_top_rank else ""
        lines.append(f"attribution vs exact ({c.direction}): Spearman {num(c.spearman):.2f}{active}, "
                     f"top-{c.k} overlap {num(c.topk_overlap):.2f}{first}")
    for r in s.topk or ():
        lines.append(f"top-{r.k} recovery {num(r.top_effect):.3f} vs layer-matched random "
                     f"{num(r.random_mean):.3f} [{num(r.random_low):.3f}, {num(r.random_high):.3f}], share of "
                     f"draws reaching it {num(r.random_reach):.3f} (p {num(r.p_random):.3f}, "
                     f"{r.n_random} of {r.n_distinct} distinct sets)")
    return lines


def _with_seed(result: Any, seed: int) -> Any:
    """The sweep's result with the bootstrap seed of the run: a copy (with its own summary cache),
    so the sweep's object is left as it was made."""
    return result if result.seed == seed else replace(result, seed=seed, _summaries={})

def _load_pairs(config: PatchingConfig, pairs: Sequence[Any] | None, model: Model | None) -> list[Any]:
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




def run(config: PatchingConfig, *, model: Model | None = None, pairs: Sequence[Any] | None = None,
        out: str | Path | None = None, progress: bool = True) -> PatchingRunResult:
    """Run the whole patching experiment (module docstring): prints the plan first, refuses a plan
    of more than `config.max_runs` patched runs, and with `config.dry_run` returns after the plan.
    `model`: a loaded model (else `config.model` is loaded); `pairs`: MinimalPairs already built
    (else from `config.pairs` or `config.pairs_path`); `out`: the run directory whose `.partial/`
    keeps finished chunks, so running again resumes (None: a scratch folder, removed on return). An unstable clean -
    corrupted gap is said once, at the end (and in the summary's baselines)."""
    import tempfile

    from tomlens.patching.metric import gap_warnings_silenced

    with gap_warnings_silenced():
        if out is not None:
            return _run(config, model=model, pairs=pairs, out=out, progress=progress, resumable=True)
        with tempfile.TemporaryDirectory(prefix="tomlens-patching-") as scratch:  # chunks of this call only
            result = _run(config, model=model, pairs=pairs, out=scratch, progress=progress, resumable=False)
            result.checkpoints = None
            return result


def _run(config: PatchingConfig, *, model: Model | None, pairs: Sequence[Any] | None, out: str | Path,
         progress: bool, resumable: bool) -> PatchingRunResult:
    """prepare -> gate -> plan -> sweep -> validate -> summarise (each step below)."""
    ready = _prepare(config, model, pairs)
    config = _methods_for_pairs(config, ready)
    gates, decision = _gate(config, ready)
    if decision.withheld and config.dry_run:
        return _withheld_dry_run(config, ready, gates, decision, out)
    if decision.withheld:
        return _withheld_result(config, ready, gates, decision)
    layout = _plan(config, ready, decision, out)
    if config.dry_run:
        return PatchingRunResult(config, _summarise(config, ready, gates, decision, layout, None, files=(),
                                                    dry_run=True), dry_run=True)
    try:
        results = _sweep(config, ready, layout, progress=progress)
        validated = _validate(config, ready, layout, results, progress=progress, resumable=resumable)
    except KeyboardInterrupt:
        if resumable:
            _to_stderr(f"stopped: {layout.checkpoints.count()} finished chunks kept under "
                       f"{layout.checkpoints.folder}; run the same command again to resume")
        raise
    tables = _tables(config, ready, gates, decision, results, validated)
    summary = _summarise(config, ready, gates, decision, layout, (results, validated), files=_files(config, tables))
    if decision.forced:
        _flag(tables)
    manifest = _manifest(config, ready, layout)
    return PatchingRunResult(config, summary, tables, dict(results), validated.recovery, validated.ablation,
                             manifest, checkpoints=layout.checkpoints, pairs=list(layout.selection),
                             tokenizer=ready.model.tokenizer)


def _role_aligned(pairs: Sequence[Any]) -> int:
    """How many pairs are role-aligned (a user's own stories, worded differently in the two versions)."""
    return sum(getattr(p, "alignment", "tokens") == "roles" for p in pairs)


def _methods_for_pairs(config: PatchingConfig, ready: _Ready) -> PatchingConfig:
    """The config to run with role-aligned pairs among the pairs: exact patching only (attribution,
    and search built on it, multiply gradients by clean minus corrupted column by column, which
    needs the same token in both stories), at role positions only (`all`, `each` index columns).
    `method = "both"` runs its exact half with a note; asking for attribution or search alone is refused."""
    n_roles = _role_aligned(ready.aligned)
    if not n_roles:
        return config
    columns = sorted({p for ps in ready.pos.spec.values() for p in ps if p in ("all", "each")})
    if columns:
        raise TomlensError(
            f"{n_roles} of the pairs are role-aligned (their stories are worded differently), and position(s) "
            f"{columns} patch by column, which is not the same token in both stories",
            "patch them at role positions: --positions roles (the default), mentions, or selectors such as final",
        )
    if config.method in ("attribution", "search"):
        raise TomlensError(
            f"--method {config.method} needs token-aligned pairs; {n_roles} of these pairs are role-aligned "
            "(their stories are worded differently)",
            "use --method exact (or both, which then runs exact patching alone), or pairs token-aligned for this model",
        )
    if config.method == "both":
        ready.pos.notes.append(f"{n_roles} of {len(ready.aligned)} pairs are role-aligned (stories worded differently): "
                               "exact patching only, at role positions resolved in each story; attribution "
                               "patching needs token-aligned pairs and was not run")
        say(ready.pos.notes[-1])
        return replace(config, method="exact")
    return config


def _to_stderr(text: str) -> None:
    """A stop message, on stderr as before (the run is being refused or interrupted, not reporting)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@dataclass
class _Ready:
    """What `_prepare` hands on: the model, the pairs given and those token-aligned (with the pairs
    report), the sites and positions, the probe table, every aligned pair prepared once, and their
    unpatched clean and corrupted metric (what the gate reads)."""

    model: Model
    n_given: int
    aligned: list[Any]
    report: Any  # tomlens.stimuli.pairs.PairsReport
    kinds: list[str]
    pos: Any  # tomlens.patching.plan.Positions
    probe: pd.DataFrame | None
    everything: Any  # tomlens.patching.pairs.PreparedPairs of every aligned pair
    clean: Any  # Float[Tensor, " pair"]
    corrupted: Any
    started: float


def _prepare(config: PatchingConfig, model: Model | None, pairs: Sequence[Any] | None) -> _Ready:
    """Settings first (no model needed), then the pairs (a file is read before any weights load),
    the model, the token-aligned pairs, the positions they share, and one plain forward per story."""
    import torch

    from tomlens.io import read_table
    from tomlens.patching import prepare_pairs
    from tomlens.patching.cells import canonical_kind
    from tomlens.patching.gate import base_logit_diffs
    from tomlens.patching.plan import (
        drop_missing_roles,
        expand_mentions,  # `mentions`: the role mentions these pairs share
        parse_positions,
    )
    from tomlens.stimuli.pairs import check_pairs

    kinds = list(dict.fromkeys(canonical_kind(s) for s in config.sites))
    pos = parse_positions(config.positions, kinds)
    probe = None
    if config.probe_table is not None:
        if not Path(config.probe_table).is_file():
            raise TomlensError(f"probe table {config.probe_table!r} does not exist",
                               "pass the table written by `tomlens probe`")
        probe = read_table(config.probe_table)
    if config.pairs is None or pairs is not None:
        pairs = _load_pairs(config, pairs, model)
    if model is None:
        model = config.model.load()
    if pairs is None:  # built for the loaded model's tokenizer
        pairs = _load_pairs(config, None, model)

    started = time.time()
    torch.manual_seed(config.seed)
    aligned, report = check_pairs(list(pairs), model.tokenizer)
    if report.dropped:
        say(report.summary())
    if not aligned:
        raise _no_pairs_error(report)
    pos = drop_missing_roles(expand_mentions(pos, aligned, model.tokenizer),
                             [s for p in aligned for s in (p.clean, p.corrupted)])
    everything = prepare_pairs(model, aligned, selectors=pos.selectors, batch_pairs=config.batch_pairs)
    clean, corrupted = base_logit_diffs(model, everything)
    return _Ready(model, len(pairs), aligned, report, kinds, pos, probe, everything, clean, corrupted, started)


def _no_pairs_error(report: Any) -> TomlensError:
    """Why no pair can be patched, by its commonest reasons (a missing span is not a tokenizer
    problem, and its fix is not re-aligning), with the fix for the commonest."""
    counts = report.reason_counts().most_common()
    first = counts[0][0] if counts else ""
    example = next((f"{pid}: {why}" for pid, why in report.dropped_pairs if why.startswith(first)), "")
    problem = (f"none of the {report.total} pairs can be patched with this model's tokenizer ("
               + ", ".join(f"{n} x {category}" for category, n in counts) + f"; e.g. {example})")
    fixes = {
        "missing_span": "give each row the span named (docs/stimulus-format.md), or build pairs of your own stories "
                        "with `tomlens pairs user --path FILE`, which finds the question and the role mentions itself",
        "token_count": "write the pairs with `tomlens pairs --model` set to this model; stories worded differently "
                       "are role-aligned pairs (`tomlens pairs user --path FILE`)",
        "outside_contrast": "widen the contrast span to every word the two stories differ in, or build role-aligned "
                            "pairs with `tomlens pairs user --path FILE`",
        "query": REASON_FIXES["query"],
    }
    return TomlensError(problem, fixes.get(first, "write the pairs with `tomlens pairs --model` set to this model "
                                                  "(the report above lists every pair left out and why)"))


def _gate(config: PatchingConfig, ready: _Ready) -> tuple[dict[str, Any], Any]:
    """The gate per contrast over EVERY aligned pair, and what it decides (`tomlens.patching.gate.decide`);
    a run that goes on says the gate's lines (a withheld one says them in `describe`)."""
    from tomlens.patching.gate import decide, gate_pairs

    gates = gate_pairs(ready.clean, ready.corrupted, [p.contrast for p in ready.aligned],
                       task_ids=[p.clean.task_id for p in ready.aligned])
    decision = decide(gates, ready.clean, ready.corrupted, ready.aligned, force=config.force,
                      solved_only=config.solved_only, select_fraction=config.select_fraction, seed=config.seed)
    if not decision.withheld:
        say("\n".join([*(g.message for g in gates.values()), *decision.notes, f"gate: {decision.message}"]))
    return gates, decision


def _withheld_result(config: PatchingConfig, ready: _Ready, gates: dict[str, Any], decision: Any
                     ) -> PatchingRunResult:
    """A withheld run: the gate table, the per-pair logit differences and why nothing was swept."""
    from tomlens.patching.gate import gate_table

    tables = {"gate": gate_table(gates), "base": _base_table(ready.aligned, ready.clean, ready.corrupted,
                                                            set(decision.kept))}
    summary = _summarise(config, ready, gates, decision, None, None, files=_files(config, tables))
    return PatchingRunResult(config, summary, tables, manifest=_manifest(config, ready, None))


def _withheld_dry_run(config: PatchingConfig, ready: _Ready, gates: dict[str, Any], decision: Any,
                      out: str | Path) -> PatchingRunResult:
    """A dry run the gate withholds: the gate's lines and its verdict with the reason, then the plan
    `--force` would run (the same pairs, gated anyway), so the person sees both before choosing; the
    result's `plan` is that plan (None where even `--force` has nothing to patch)."""
    from tomlens.patching.gate import decide

    say("\n".join([*(g.message for g in gates.values()), *decision.notes, f"gate: {decision.reason}"]))
    forced = decide(gates, ready.clean, ready.corrupted, ready.aligned, force=True, solved_only=config.solved_only,
                    select_fraction=config.select_fraction, seed=config.seed)
    layout = None
    if not forced.withheld and forced.split is not None:
        say("the plan with --force (the gate overridden, every result flagged):")
        layout = _plan(replace(config, force=True), ready, forced, out)  # ends "dry run: nothing else run, ..."
    else:
        say("dry run: nothing else run, nothing written")
    summary = _summarise(config, ready, gates, decision, layout, None, files=(), dry_run=True)
    return PatchingRunResult(config, summary, dry_run=True)


@dataclass
class _Layout:
    """What `_plan` lays out: the selection and held-out evaluation pairs (prepared), the ranking
    position and the k of the validations, the checkpoints, the sweeps (with what the checkpoints
    already hold) and the plan with its stand-in head sets (same counts as the ranked ones)."""

    selection: list[Any]
    evaluation: list[Any]
    same: bool
    prepared: Any
    held: Any
    rank_position: str | None
    k_max: int
    ks: list[int]
    checkpoints: Any  # tomlens.patching.checkpoints.Checkpoints
    exact: dict[str, Any] = field(default_factory=dict)
    attribution: dict[str, Any] = field(default_factory=dict)
    topk_plan: Any = None
    ablation_plan: Any = None
    stand_in: list[Any] = field(default_factory=list)
    plan: Any = None  # tomlens.patching.plan.Plan


def _plan(config: PatchingConfig, ready: _Ready, decision: Any, out: str | Path) -> _Layout:
    """Every stage laid out before anything runs, the plan said, refused past `max_runs` (unless a
    dry run), and timed on one chunk of real runs (kept, unless a dry run)."""
    from tomlens.patching.plan import Plan, calibrate

    layout = _split(config, ready, decision, out)
    _lay_out_sweeps(config, ready, layout)
    n_sel, n_eval = len(layout.selection), len(layout.evaluation)
    plan = Plan(_stages(config, layout), n_sel + (0 if layout.same else n_eval), config.max_runs,
                notes=list(ready.pos.notes))
    plan.notes.append(f"selection pairs (cells patched, heads ranked): {n_sel}; held-out evaluation pairs (top-k "
                      f"recovery, ablation): {n_eval}" + (" (the SAME pairs: forced)" if layout.same else ""))
    if layout.rank_position is None and config.top_k > 0:
        plan.notes.append("top-k recovery and ablation need --sites to include heads; skipped")
    if "search" in config.methods:
        plan.notes.append("search (not counted above): attribution estimates of every cell, then exact patching of "
                          "the top-k per site and position, of every cell they cannot rule out (--search-budget) "
                          "and of --search-samples random others")
    over = config.max_runs is not None and plan.total_runs > config.max_runs
    if not config.dry_run and over:
        say("\n".join(plan.lines()))
        plan.check_budget()
    calibrate(plan, layout.exact, layout.attribution, layout.checkpoints, keep=not config.dry_run)
    if not config.dry_run:  # the timed chunk is part of the run: count it as done
        plan.stages = _stages(config, layout)
    say("\n".join(plan.lines()))
    if config.dry_run:
        if config.max_runs is not None and plan.total_runs > config.max_runs:
            say(f"note: over --max-runs {config.max_runs:,}: without --dry-run this plan stops before running")
        say("dry run: nothing else run, nothing written")
    layout.plan = plan
    return layout


def _split(config: PatchingConfig, ready: _Ready, decision: Any, out: str | Path) -> _Layout:
    """The selection and evaluation pairs prepared, the k of the validations and the checkpoints."""
    from tomlens.patching import prepare_pairs
    from tomlens.patching.checkpoints import Checkpoints

    assert decision.split is not None
    aligned, selectors, batch_pairs = ready.aligned, ready.pos.selectors, config.batch_pairs
    selection, evaluation = [aligned[i] for i in decision.split[0]], [aligned[i] for i in decision.split[1]]
    same = decision.split[0] == decision.split[1]
    prepared = (ready.everything if len(selection) == len(aligned)
                else prepare_pairs(ready.model, selection, selectors=selectors, batch_pairs=batch_pairs))
    held = prepared if same else prepare_pairs(ready.model, evaluation, selectors=selectors, batch_pairs=batch_pairs)
    k_max = min(config.top_k, ready.model.cfg.n_layers * ready.model.cfg.n_heads)
    ks = sorted({k for k in config.ks if k <= k_max}) or ([k_max] if k_max > 0 else [])
    layout = _Layout(selection, evaluation, same, prepared, held, ready.pos.rank_position(), k_max, ks, None)
    layout.checkpoints = Checkpoints(out, _resume_settings(config, ready, layout))
    return layout


def _resume_settings(config: PatchingConfig, ready: _Ready, layout: _Layout) -> dict[str, Any]:
    """What decides whether a finished chunk under `.partial/` is reused: the model (its provenance
    and weights), the pairs and their split, the token ids every story runs on, and the settings.
    The BOS rule enters through the token ids it makes, not as a setting: a `bos.source` that changes
    nothing (the tokenizer already does what was asked) keeps the chunks, a real change does not."""
    from tomlens.activations.cache import weights_fingerprint
    from tomlens.models import provenance
    from tomlens.patching.pairs import tokens_hash

    model_record = {k: v for k, v in provenance(ready.model).items() if k != "bos"}
    return {
        "provenance": model_record, "weights": weights_fingerprint(ready.model), "tokens": tokens_hash(ready.everything),
        "pairs": pairs_hash(ready.aligned), "selection": pairs_hash(layout.selection),
        "evaluation": pairs_hash(layout.evaluation), "positions": ready.pos.spec, "methods": config.methods,
        "directions": config.directions, "top_k": config.top_k, "ks": layout.ks, "n_random": config.n_random,
        "ablation": config.ablation, "seed": config.seed, "batch_pairs": config.batch_pairs,
        "chunk_runs": config.chunk_runs, "search": config.search_options(),
    }


def _lay_out_sweeps(config: PatchingConfig, ready: _Ready, layout: _Layout) -> None:
    """Exact sweeps and attribution on the selection pairs (loading what the checkpoints hold), and
    top-k recovery / ablation on the evaluation pairs with stand-in top sets (same counts)."""
    from tomlens.patching.cells import plan_cells
    from tomlens.patching.exact import ExactSweep
    from tomlens.patching.heads import AblationSweep, HeadSetSweep, topk_settings
    from tomlens.patching.plan import AttributionSweep

    model, spec, chunk_runs = ready.model, ready.pos.spec, config.chunk_runs
    cells = plan_cells(model, spec, n_aligned=layout.prepared.n_aligned)
    if "exact" in config.methods:
        layout.exact = {d: ExactSweep(model, layout.prepared, cells, d, memory_mb=config.memory_mb,
                                      chunk_runs=chunk_runs) for d in config.directions}
    if "attribution" in config.methods:
        layout.attribution = {d: AttributionSweep(model, layout.prepared, spec, d, steps=config.attribution_steps,
                                                  path=config.ig_path) for d in config.directions}
    for sweep in [*layout.exact.values(), *layout.attribution.values()]:
        sweep.load(layout.checkpoints)
    if layout.rank_position is None or not layout.ks:
        return
    # Planned at the upper bound, n_random draws per k: how many distinct layer-matched sets a k has
    # depends on the ranked heads' layers (a uniform stand-in in one layer may have fewer than a real
    # top set spread over two), so the recount once heads are ranked can only shrink the plan.
    ks, n_random = layout.ks, config.n_random
    settings = topk_settings(model, None, ks, n_random, config.seed)
    stand_in = [s[3] for s in settings if s[0] == "top"]
    for k, top in zip(ks, list(stand_in), strict=True):
        draws = [s[3] for s in settings if s[0] == "random" and s[1] == k]
        stand_in += draws + [top] * (n_random - len(draws))  # same size, so the same runs per set
    layout.stand_in = stand_in
    layout.topk_plan = HeadSetSweep(model, layout.held, stand_in, position=layout.rank_position,
                                    direction=config.directions[0], chunk_runs=chunk_runs)
    if config.ablation_mode is not None:
        layout.ablation_plan = AblationSweep(model, layout.held, stand_in, mode=config.ablation_mode,
                                             chunk_runs=chunk_runs)


def _stages(config: PatchingConfig, layout: _Layout) -> list[Any]:
    """The plan's stages; the validations run on the held-out pairs, at the k of `ks` only."""
    from tomlens.patching.plan import plan_stages

    ks, n_random = layout.ks, config.n_random
    out = plan_stages(layout.exact, layout.attribution, layout.topk_plan, layout.ablation_plan,
                      n_pairs=len(layout.selection), k_max=layout.k_max, n_random=n_random)
    for st in out:
        if st.name == "top-k recovery":
            st.what = f"{len(ks)} top + up to {len(ks) * n_random} layer-matched random head sets (k = {ks})"
        if st.name.startswith(("top-k recovery", "mean ablation")):
            st.pairs = len(layout.evaluation)
    return out


def _sweep(config: PatchingConfig, ready: _Ready, layout: _Layout, *, progress: bool
           ) -> dict[tuple[str, str], Any]:
    """Every (method, direction) sweep on the selection pairs, resumed from the checkpoints."""
    results: dict[tuple[str, str], Any] = {}
    for d in config.directions:
        for m in config.methods:
            if m == "exact":
                layout.exact[d].run(checkpoints=layout.checkpoints, progress=progress)
                res = layout.exact[d].result()
            elif m == "attribution":
                res = layout.attribution[d].result(layout.checkpoints, progress=progress)
            else:  # search
                from tomlens.patching import search

                res = search(ready.model, layout.prepared, sites=ready.pos.spec, direction=d, k=config.top_k or 10,
                             seed=config.seed, batch_pairs=config.batch_pairs, memory_mb=config.memory_mb,
                             progress=progress, **config.search_options())
            results[(m, d)] = _with_seed(res, config.seed)
    return results


@dataclass
class _Validated:
    """The ranking (the sweep it came from, heads in order) and its validations on the held-out pairs."""

    source: Any = None
    ranking: list[tuple[int, int]] | None = None
    recovery: Any = None  # tomlens.patching.heads.Recovery
    ablation: Any = None  # tomlens.patching.heads.Ablation


def _validate(config: PatchingConfig, ready: _Ready, layout: _Layout, results: dict[tuple[str, str], Any], *,
              progress: bool, resumable: bool) -> _Validated:
    """Heads ranked on the main direction's sweep (exact, else attribution, else search), then top-k
    recovery and mean ablation against layer-matched random heads on the held-out pairs, the plan
    recounted first and refused past `max_runs` as the plan check refuses."""
    from tomlens.patching import mean_ablation, rank_heads, topk_recovery
    from tomlens.patching.heads import topk_settings

    main = config.directions[0]
    out = _Validated(results.get(("exact", main)) or results.get(("attribution", main)) or results.get(("search", main)))
    position, ks, plan = layout.rank_position, layout.ks, layout.plan
    if position is None or out.source is None:
        return out
    ranked = rank_heads(out.source, position=position)
    out.ranking = list(zip(*[ranked[c] for c in ("layer", "head")], strict=True))
    if not ks:
        return out
    model, n_random, seed = ready.model, config.n_random, config.seed
    _recount(plan, len(layout.stand_in), len(topk_settings(model, out.ranking, ks, n_random, seed)))
    if config.max_runs is not None and plan.total_runs > config.max_runs:
        say("\n".join(plan.lines()))
        if resumable:
            _to_stderr(f"the sweeps run so far are kept under {layout.checkpoints.folder}: run again (with a larger "
                       "--max-runs) to resume")
        plan.check_budget()
    shared = {"ks": ks, "n_random": n_random, "seed": seed, "memory_mb": config.memory_mb, "progress": progress,
              "checkpoints": layout.checkpoints, "chunk_runs": config.chunk_runs}
    out.recovery = topk_recovery(model, layout.held, out.ranking, k_max=layout.k_max, position=position,
                                 direction=main, **shared)
    if config.ablation_mode is not None:
        out.ablation = mean_ablation(model, layout.held, out.ranking, mode=config.ablation_mode, **shared)
    return out


def _tables(config: PatchingConfig, ready: _Ready, gates: dict[str, Any], decision: Any,
            results: dict[tuple[str, str], Any], validated: _Validated) -> dict[str, pd.DataFrame]:
    """Every table by file stem, in the order they are written."""
    from tomlens.patching import head_table
    from tomlens.patching.gate import gate_table

    tables = {"gate": gate_table(gates),
              "base": _base_table(ready.aligned, ready.clean, ready.corrupted, set(decision.kept))}
    for (m, d), res in results.items():
        tables[f"cells_{m}_{d}"] = res.summary()
        tables[f"pairs_{m}_{d}"] = res.per_pair()
    main = config.directions[0]
    if validated.ranking is not None:
        found = results.get(("search", main))  # its verified cells as exact, its estimates as attribution
        tables["heads"] = head_table(results.get(("exact", main)) or (found and found.exact()),
                                     results.get(("attribution", main)) or (found and found.estimates.result()),
                                     ready.probe, position=ready.pos.rank_position())
    if validated.recovery is not None:
        tables["topk"], tables["topk_random"] = validated.recovery.table, validated.recovery.draws
    if validated.ablation is not None:
        tables["ablation"], tables["ablation_random"] = validated.ablation.table, validated.ablation.draws
    return tables


def _files(config: PatchingConfig, tables: dict[str, pd.DataFrame]) -> tuple[str, ...]:
    ext = ".parquet" if config.format == "parquet" else ".csv"
    return tuple(f"{stem}{ext}" for stem in tables)


def _manifest(config: PatchingConfig, ready: _Ready, layout: _Layout | None) -> dict[str, Any]:
    from tomlens.provenance import run_manifest
    from tomlens.stimuli.records import stimuli_hash

    hashed = stimuli_hash([s for p in ready.aligned for s in (p.clean, p.corrupted)])
    extra = {"pairs_hash": pairs_hash(ready.aligned)}
    if layout is not None:
        extra |= {"selection_hash": pairs_hash(layout.selection), "evaluation_hash": pairs_hash(layout.evaluation)}
    return run_manifest(ready.model, config, stimuli_hash=hashed, extra=extra)


def _summarise(config: PatchingConfig, ready: _Ready, gates: dict[str, Any], decision: Any, layout: _Layout | None,
               swept: tuple[dict[tuple[str, str], Any], _Validated] | None, *, files: tuple[str, ...],
               dry_run: bool = False) -> PatchingSummary:
    """The run's summary, built once: what every run has (the gate, the pairs, the metric), then a
    withheld run's reason and raw numbers, or what a run that patched found (`_findings`)."""
    from tomlens.models import provenance
    from tomlens.patching.metric import METRIC_NAME

    plan = build(PlanSummary, layout.plan.to_dict()) if layout is not None and layout.plan is not None else None
    common: dict[str, Any] = {
        "command": "patch", "provenance": provenance(ready.model), "seed": config.seed,
        "gate": _gate_summary(ready, gates, decision), "notes": decision.notes,
        "pairs": _pair_counts(config, ready, decision, layout), "metric": METRIC_NAME, "dry_run": dry_run,
        "plan": plan, "seconds": round(time.time() - ready.started, 2), "files": files,
    }
    if decision.withheld:
        gap = ready.clean - ready.corrupted
        base = BaseLogitDiffs(clean_logit_diff=float(ready.clean.mean()),
                              corrupted_logit_diff=float(ready.corrupted.mean()), gap=float(gap.mean()))
        return PatchingSummary(**common, withheld=decision.reason, base=base)
    if swept is None:  # a dry run: the plan, nothing found
        return PatchingSummary(**common, forced=decision.forced, forced_message=decision.forced_message)
    assert layout is not None
    return PatchingSummary(**common, **_findings(config, ready, decision, layout, *swept))


def _gate_summary(ready: _Ready, gates: dict[str, Any], decision: Any) -> GateSummary:
    from tomlens.patching.gate import METHOD

    return GateSummary(
        method=METHOD, contrasts={c: build(ContrastGate, g.to_dict()) for c, g in gates.items()},
        passed=decision.passed, dropped_contrasts=decision.dropped_contrasts, message=decision.message,
        forced=decision.forced, n_gated=len(ready.aligned), n_passed_pairs=len(decision.gated),
        n_patched=len(decision.kept), half_gaps=dict(decision.half_gaps),
        power={c: g.power_line for c, g in gates.items()})


def _pair_counts(config: PatchingConfig, ready: _Ready, decision: Any, layout: _Layout | None) -> PairCounts:
    aligned = ready.aligned
    counts: dict[str, Any] = {
        "n_given": ready.n_given, "n_aligned": len(aligned), "n_kept": len(decision.kept),
        "hash": pairs_hash(aligned), "contrasts": tuple(sorted({p.contrast for p in aligned})),
        "dropped": tuple(list(d) for d in ready.report.dropped_pairs)}
    if layout is None:
        return PairCounts(**counts)

    def tasks(pairs: list[Any]) -> int:
        return len({p.clean.task_id or p.id for p in pairs})

    return PairCounts(
        **counts, families=tuple(sorted({p.family for p in aligned})),
        selection=PairHalf(n=len(layout.selection), hash=pairs_hash(layout.selection), tasks=tasks(layout.selection)),
        evaluation=PairHalf(n=len(layout.evaluation), hash=pairs_hash(layout.evaluation),
                            tasks=tasks(layout.evaluation), same_as_selection=layout.same),
        select_fraction=config.select_fraction)


def _findings(config: PatchingConfig, ready: _Ready, decision: Any, layout: _Layout,
              results: dict[tuple[str, str], Any], validated: _Validated) -> dict[str, Any]:
    """The summary fields of a run that patched: what was swept, the baselines and comparisons, the
    ranking, top-k recovery, mean ablation and the search bounds."""
    methods = config.methods
    found: dict[str, Any] = {
        "normalisation": NORMALISATION, "corruption": CORRUPTION, "sites": tuple(ready.kinds),
        "positions": {k: list(v) for k, v in ready.pos.spec.items()}, "methods": tuple(methods),
        "directions": tuple(config.directions),
        "baselines": {f"{m}_{d}": build(Baseline, r.baselines()) for (m, d), r in results.items()},
        "comparisons": _comparisons(config, ready, results), "forced": decision.forced,
        "forced_message": decision.forced_message,
    }
    if "attribution" in methods:
        found |= {"attribution_steps": int(config.attribution_steps), "attribution_path": config.attribution_path}
    found |= _ranking_fields(config, layout, validated)
    if layout.rank_position is None and config.top_k > 0:
        found["topk_skipped"] = "top-k recovery and ablation need --sites to include heads"
    if "search" in methods:
        found["search"] = {d: build(SearchReport, r.report()) for (m, d), r in results.items() if m == "search"}
    return found


def _comparisons(config: PatchingConfig, ready: _Ready, results: dict[tuple[str, str], Any]
                 ) -> tuple[Comparison, ...]:
    """Attribution against exact patching, per direction, site kind and position both swept."""
    from tomlens.patching import compare

    out = []
    for d in config.directions:
        if ("exact", d) not in results or ("attribution", d) not in results:
            continue
        ex, at = results[("exact", d)], results[("attribution", d)]
        for kind in ready.kinds:
            for position in sorted(set(ex.summary().query("kind == @kind").position)):
                cmp = compare(ex, at, kind=kind, position=position, k=min(10, max(1, config.top_k)))
                out.append(build(Comparison, {"direction": d, **cmp}))
    return tuple(out)


def _ranking_fields(config: PatchingConfig, layout: _Layout, validated: _Validated) -> dict[str, Any]:
    """The ranking (what ranked the heads, the top ones) and its validations on the held-out pairs."""
    out: dict[str, Any] = {}
    if validated.ranking is not None:
        src = validated.source
        out["rank_position"] = layout.rank_position
        out["top_heads"] = tuple(f"L{la}H{h}" for la, h in validated.ranking[: max(config.top_k, 10)])
        out["ranked_by"] = (f"{src.method} {src.direction} effect, heads at {layout.rank_position}, "
                            f"on {len(layout.selection)} selection pairs")
    if validated.recovery is not None:
        out["topk"] = records(TopKRow, validated.recovery.table.to_dict(orient="records"))
        out["validated_on"] = (f"{len(layout.evaluation)} held-out evaluation pairs"
                               + (" (the SAME pairs: forced)" if layout.same else ""))
        out["random_heads"] = (f"up to {config.n_random} distinct layer-matched sets per k (the top set's layers, "
                               "its heads left out; every such set where there are no more: an exact p); p_random "
                               "is per k, uncorrected across the ks")
    ab = validated.ablation
    if ab is not None:
        where = "at the final token" if config.ablation == "final" else "at the same right-aligned position"
        out["ablation"] = AblationSummary(
            mode=config.ablation, baseline=build(AblationBaseline, ab.baseline),
            mean=f"each ablated head's z replaced by its mean over all clean and corrupted evaluation stories {where}",
            table=records(AblationRow, ab.table.to_dict(orient="records")))
    return out


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
    say(f"plan recounted once heads were ranked ({sets} head sets, not {planned_sets}: some k have fewer "
        f"distinct layer-matched sets than --n-random, and all of them run): {plan.total_runs:,} patched runs")


def _flag(tables: dict[str, pd.DataFrame]) -> None:
    """A `forced` column (True) in every table of a run that went past a failed gate or split."""
    for df in tables.values():
        df["forced"] = True
