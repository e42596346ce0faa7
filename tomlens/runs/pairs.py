"""The pairs stage: clean/corrupted minimal pairs of a family, kept where they are token-aligned for a
model's tokenizer (no weights are loaded), with the report of every pair left out and why.

`PairsResult.write_file(path)` writes the pairs file and `<stem>.report.json` beside it, as
`tomlens pairs --out` always has; `save(dir)` writes a run directory: `pairs.jsonl`,
`pairs.report.json`, `config.json`, `manifest.json` and, last, `result.json` (the report).
Both hold the typed `PairsSummary`, under the keys they held before it was typed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tomlens.errors import TomlensError
from tomlens.messages import say
from tomlens.models.protocol import Model
from tomlens.runs.base import ModelSpec
from tomlens.runs.files import summary_from_dict, summary_to_dict
from tomlens.stimuli.pairs import USER  # pairs of a user's own stories (tomlens.stimuli.user_pairs), role-aligned
from tomlens.vocabulary import one_of

__all__ = ["BosRule", "PairsConfig", "PairsResult", "PairsSummary", "report_path", "run"]

FILE_FAMILIES: tuple[str, ...] = ("bigtom", USER)  # families read from `path`


@dataclass(frozen=True)
class PairsConfig:
    """Which pairs: a family (`n` tasks or items, default 20; BigToM: the first `n` stories of
    `path`, default all; `user`: the first `n` tasks of the user's stimulus file `path`, default
    all), the controls to pair with (`contrasts`, default the family's own; for `user` the file's
    conditions, default true_belief) and generator `options`; `model` decides alignment through its
    tokenizer and BOS rule. `max_pairs` keeps the first that many aligned pairs (a task gives
    several, one per contrast)."""

    model: ModelSpec = field(default_factory=ModelSpec)
    family: str = "unexpected-transfer"
    n: int | None = None
    seed: int = 0
    path: str | None = None
    contrasts: tuple[str, ...] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    max_pairs: int | None = None

    def __post_init__(self) -> None:
        from tomlens.stimuli.pairs import CONTRASTS, PAIR_FAMILIES

        one_of("pairs family", self.family, PAIR_FAMILIES)
        if self.family == "bigtom" and not self.path:
            raise TomlensError("`tomlens pairs bigtom` needs --path", "give the BigToM csv with --path (path = ...)")
        if self.family == USER and not self.path:
            raise TomlensError("`tomlens pairs user` needs --path: the stimulus file with your stories",
                               "give your JSONL or CSV file with --path (TOML: path = \"my.jsonl\" in [pairs]); "
                               "see docs/stimulus-format.md, 'Your own stories as minimal pairs'")
        if self.family not in FILE_FAMILIES and self.path:
            raise TomlensError(f"--path is for `bigtom` and `user`, not {self.family!r}", "drop --path (path = ...)")
        if self.family == USER and self.options:
            raise TomlensError(f"user pairs take no generator options (got {sorted(self.options)})",
                               "drop --set (options = ...): the stories come from your file as written")
        if self.n is not None and self.n < 1:
            raise TomlensError(f"--n {self.n} must be at least 1", "pass --n 1 or more")
        if self.max_pairs is not None and self.max_pairs < 1:
            raise TomlensError(f"max_pairs = {self.max_pairs} must be at least 1", "use 1 or more, or leave it out")
        if isinstance(self.contrasts, str):
            object.__setattr__(self, "contrasts", (self.contrasts,))
        elif self.contrasts is not None:
            object.__setattr__(self, "contrasts", tuple(self.contrasts))
        for contrast in self.contrasts or ():
            # a user's contrasts are the conditions of their file, checked when it is read
            if self.family != USER and self.family in CONTRASTS:
                one_of("contrast", contrast, CONTRASTS[self.family])

    @property
    def n_resolved(self) -> int | None:
        """Tasks or items asked for (20 unless given); BigToM: stories, user: tasks (None = all)."""
        if self.family in FILE_FAMILIES:
            return self.n
        return 20 if self.n is None else self.n

    def generator_options(self) -> dict[str, Any]:
        """Keyword arguments of `make_pairs` beyond family, n, seed and path."""
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(self.options).items()}
        if self.contrasts:
            options["contrasts"] = tuple(self.contrasts)
        return options


def report_path(out: str | Path) -> Path:
    """The report beside a pairs file: `pairs.jsonl` -> `pairs.report.json`."""
    out = Path(out)
    return out.with_name(out.stem + ".report.json")


@dataclass(frozen=True, kw_only=True)
class BosRule:
    """The BOS rule the pairs were aligned with (`tomlens.models.tokens.bos_record`): whether a BOS
    token is prepended, who said so ("tokenizer" or "user") and the token."""

    prepend: bool
    source: str
    token: str | None


@dataclass(frozen=True, kw_only=True)
class PairsSummary:
    """The pairs' report as written (pairs.report.json, result.json): the alignment counts
    (`tomlens.stimuli.pairs.PairReport`) with each dropped (pair id, reason), then what made them:
    the model whose tokenizer aligned them, seed, tasks asked for, BOS rule, generator options,
    the pairs' stimuli hash, and the BigToM `path` and `max_pairs` (None: not given, and then not
    written, as before the summary was typed)."""

    family: str
    total: int
    aligned: int
    dropped: int
    checked_with: str
    dropped_pairs: tuple[list[str], ...]  # [pair id, reason], as JSON holds it
    model: str
    seed: int
    n: int | None
    bos: BosRule
    options: dict[str, Any]
    stimuli_hash: str
    path: str | None = None
    max_pairs: int | None = None

    @property
    def contrasts(self) -> tuple[str, ...]:
        """The controls the pairs were asked with (empty: the family's own)."""
        return tuple(self.options.get("contrasts", ()))

    def to_json(self) -> dict[str, Any]:
        """The report's JSON record: `path` and `max_pairs` only when given."""
        data = summary_to_dict(self)
        for key in ("path", "max_pairs"):
            if data[key] is None:
                del data[key]
        return data

    def pair_report(self) -> Any:
        """The alignment report (`tomlens.stimuli.pairs.PairReport`) these counts came from."""
        from tomlens.stimuli.pairs import PairReport

        return PairReport(self.family, self.total, self.aligned, [(pid, why) for pid, why in self.dropped_pairs],
                          self.checked_with)

    def pairs_config(self) -> PairsConfig:
        """The settings that made the pairs, for a pairs file written without its config.json."""
        return PairsConfig(model=ModelSpec(name=self.model), family=self.family, n=self.n, seed=self.seed,
                           options={k: v for k, v in self.options.items() if k != "contrasts"},
                           contrasts=self.contrasts or None, path=self.path, max_pairs=self.max_pairs)


@dataclass
class PairsResult:
    """The aligned pairs, the alignment report, and `summary` (the report's record, without the file
    it was written beside)."""

    config: PairsConfig
    pairs: list[Any]  # tomlens.stimuli.pairs.MinimalPair
    report: Any  # tomlens.stimuli.pairs.PairReport
    summary: PairsSummary

    def describe(self) -> str:
        """How many pairs aligned, and why each other pair was dropped; for role-aligned pairs (a
        user's own stories) also how they are patched and which role spans they carry."""
        text = self.report.summary()
        roles = [p for p in self.pairs if getattr(p, "alignment", "tokens") == "roles"]
        return text + "\n" + "\n".join(role_aligned_lines(roles)) if roles else text

    def write_file(self, path: str | Path) -> Path:
        """The pairs as JSON lines at `path` and the report beside them (`report_path`), as
        `tomlens pairs --out` writes them. Returns the pairs file."""
        from tomlens.io import write_atomic
        from tomlens.stimuli.pairs import write_pairs

        pairs_file = write_pairs(self.pairs, path)
        rpath = report_path(pairs_file)
        write_atomic(json.dumps({**self.summary.to_json(), "pairs_file": str(pairs_file)}, indent=2), rpath)
        return pairs_file

    def save(self, out: str | Path) -> Path:
        """A run directory: pairs.jsonl with pairs.report.json, config.json, manifest.json and,
        last, result.json (the report)."""
        from tomlens.provenance import run_manifest
        from tomlens.runs.files import begin_save, finish_save

        out = begin_save(out)
        self.write_file(out / "pairs.jsonl")
        s = self.summary
        manifest = run_manifest(None, self.config, stimuli_hash=s.stimuli_hash,
                                 extra={"tokenizer": s.checked_with, "bos": summary_to_dict(s.bos)})
        return finish_save(out, self.config, manifest, s.to_json())

    @classmethod
    def load(cls, out: str | Path) -> PairsResult:
        """Read back a run directory written by `save`, or a pairs file with its report."""
        from tomlens.runs.files import read_finished
        from tomlens.stimuli.pairs import read_pairs

        out = Path(out)
        in_folder = out.is_dir()
        pairs_file = out / "pairs.jsonl" if in_folder else out
        rpath = report_path(pairs_file)
        if not rpath.is_file():
            raise TomlensError(f"no pairs report at {rpath}", "write the pairs with `tomlens pairs` (or PairsResult.save)")
        data = json.loads(rpath.read_text())
        data.pop("pairs_file", None)
        summary = summary_from_dict(PairsSummary, data, folder=out, stage="pairs")
        config = read_finished(out, PairsConfig)[1] if in_folder else None
        if config is None:  # a pairs file written by the CLI: its settings from the report
            config = summary.pairs_config()
        return cls(config, read_pairs(pairs_file), summary.pair_report(), summary)


def role_aligned_lines(pairs: list[Any]) -> list[str]:
    """What a person needs to know about role-aligned pairs before patching them: how many, that
    they are patched at role positions (not token by token), and which role spans were given,
    filled by tomlens or are missing (`tomlens.stimuli.user_pairs.role_span_report`)."""
    from tomlens.patching.plan import ROLE_POSITIONS
    from tomlens.stimuli.user_pairs import role_span_report

    head = (f"{len(pairs)} pair{'s' if len(pairs) != 1 else ''} role-aligned: the two stories of a pair may differ "
            f"in length and wording, so `tomlens patch` patches them at role positions ({', '.join(ROLE_POSITIONS)}), "
            "each resolved in its own story; not at --positions all or each, and with exact patching only "
            "(attribution patching needs token-aligned pairs)")
    return [head, *role_span_report(pairs).lines()]


# The fix for the commonest reason no pair was kept (PairReport reason categories).
REASON_FIXES: dict[str, str] = {
    "missing_span": "add the span the reason names to those rows (docs/stimulus-format.md)",
    "options": "give both versions of a story the same two options",
    "options_share_first_token": "choose options whose first tokens differ (e.g. drop a word both start with)",
    "identical": "make the control story differ from the false-belief story",
    "token_count": "try another --contrast or family, or pairs that differ by words of equal token length",
    "outside_contrast": "try another --contrast or family",
    "query": "ask the same question, in the same words, at the end of both versions of the story",
}


def _no_pairs_error(config: PairsConfig, report: Any, name: str) -> TomlensError:
    """The error for a run that kept no pair: the commonest reason, and the fix for that reason."""
    counts = report.reason_counts().most_common()
    top = counts[0][0] if counts else ""
    what = "usable" if config.family == USER else "token-aligned"
    source = f" from {config.path}" if config.path else ""
    reasons = "; ".join(f"{n} x {category}" for category, n in counts) or "no candidate pairs"
    return TomlensError(f"no {config.family} pair{source} is {what} for {name}'s tokenizer ({reasons})",
                        "see the reasons above; " + REASON_FIXES.get(top, "try another --contrast or family"))


def run(config: PairsConfig, *, model: Model | None = None, progress: bool = True) -> PairsResult:
    """Build and check the candidate pairs, then align them for the tokenizer of `model` (a loaded
    model) or of `config.model` (tokenizer only). No aligned pair is an error, after the report
    (with the reasons) is printed."""
    from tomlens.models.tokens import bos_record
    from tomlens.stimuli.pairs import align_pairs, make_pairs
    from tomlens.stimuli.records import stimuli_hash

    n = config.n_resolved
    options = config.generator_options()
    # Build and check the candidates before loading anything heavy, then align for the model.
    candidates, report = make_pairs(config.family, n, config.seed, tokenizer=None, path=config.path, **options)
    # No weights: alignment only tokenizes, with the BOS rule `tomlens patch` will use.
    tokenizer = model.tokenizer if model is not None else config.model.load_tokenizer()
    name = config.model.name
    source = "tokenizer" if config.model.prepend_bos is None else "user"
    pairs, token_report = align_pairs(candidates, tokenizer)
    report.merge(token_report)
    if config.max_pairs is not None:
        pairs = pairs[: config.max_pairs]
    if not pairs:
        say(report.summary())
        raise _no_pairs_error(config, report, name)
    summary = PairsSummary(
        family=report.family, total=report.total, aligned=report.aligned, dropped=report.dropped,
        checked_with=report.checked_with, dropped_pairs=tuple(list(x) for x in report.dropped_pairs), model=name, seed=config.seed,
        n=n, bos=BosRule(**bos_record(tokenizer, source)),
        options={k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        stimuli_hash=stimuli_hash([s for p in pairs for s in (p.clean, p.corrupted)]),
        path=config.path, max_pairs=config.max_pairs)
    return PairsResult(config, pairs, report, summary)
