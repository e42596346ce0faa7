"""EPITOME's free-text tasks (Short Story, Strange Stories) as a stage: greedy answers, a coding sheet
for a human, and the scores from the filled sheet.

Why two steps: no judge model runs, so the scores need a person between generation and scoring.
`run(FreeTextConfig(...))` answers and `FreeTextResult.save(out)` writes `answers.csv` (every
answer with why decoding stopped), `coding.csv` (the sheet a coder fills: answer, `cut_off`, rubric,
allowed values, an empty `code`), then the runs layer's `config.json`, `manifest.json` (model,
revision, dtype, seed, versions, the items' hash) and, last, `result.json`, like every stage.
`score_sheet(path)` reads the filled sheet back (checked against the items of the `config.json`
beside it, when there is one) and computes `free_text_summary`; `save_scores` writes it with
`score.json` (the sheet's sha256, the items' hash and the answering model from the folder's
manifest). The CLI (`tomlens freetext answer|score|items`) calls these same functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from tomlens.behaviour.epitome import export_for_coding, free_text_summary, import_codes
from tomlens.behaviour.generate import generate_answers
from tomlens.errors import TomlensError
from tomlens.io import file_sha256, read_json, read_table, records_hash, write_json, write_table
from tomlens.models.protocol import Model
from tomlens.provenance import run_manifest, versions
from tomlens.runs.base import ModelSpec, config_from_dict
from tomlens.runs.files import (
    CONFIG,
    MANIFEST,
    RESULT,
    begin_save,
    finish_save,
    read_finished,
    summary_from_dict,
    summary_to_dict,
)
from tomlens.stimuli.epitome import (
    SHORT_STORY_FAMILY,
    STRANGE_STORIES_FAMILY,
    FreeTextItem,
    free_text_items,
)
from tomlens.vocabulary import one_of

FAMILIES: tuple[str, ...] = (SHORT_STORY_FAMILY, STRANGE_STORIES_FAMILY, "all")
ANSWERS = "answers.csv"
CODING = "coding.csv"
SUMMARY = "summary.csv"
SCORE = "score.json"


def items_hash(items: Sequence[FreeTextItem]) -> str:
    """A hash of what was asked and how it is scored (each item's id, prompt and rubric), so a score
    names the exact items and rubrics behind it."""
    return records_hash([{"id": it.id, "prompt": it.prompt, "rubric": {str(k): v for k, v in sorted(it.rubric.items())}}
                         for it in items])


def family_items(family: str) -> list[FreeTextItem]:
    """The items of one free-text family, or of both ("all": short story first)."""
    if family == "all":
        return free_text_items(SHORT_STORY_FAMILY) + free_text_items(STRANGE_STORIES_FAMILY)
    if family not in FAMILIES:
        raise TomlensError(f"no free-text family {family!r}", f"use one of {', '.join(FAMILIES)}")
    return free_text_items(family)


def select_items(family: str, items: Sequence[str] = ()) -> list[FreeTextItem]:
    """`family`'s items, or those `items` names: item ids ("shs-03", "sts-02-just") or 1-based
    positions in the family's list ("1", "2"), in the family's order; empty: all of them."""
    pool = family_items(family)
    if not items:
        return pool
    by_id = {it.id: i for i, it in enumerate(pool)}
    keep: set[int] = set()
    for raw in items:
        name = str(raw).strip()
        if name in by_id:
            keep.add(by_id[name])
        elif name.isdigit() and 1 <= int(name) <= len(pool):
            keep.add(int(name) - 1)
        else:
            raise TomlensError(f"{name!r} is not an item of {family!r}",
                               f"use positions 1..{len(pool)} or ids such as {pool[0].id!r} "
                               f"(`tomlens freetext items --family {family}` lists them)")
    return [pool[i] for i in sorted(keep)]


@dataclass(frozen=True)
class FreeTextConfig:
    """Which model answers which free-text items, with greedy decoding of at most `max_new_tokens`
    tokens. `seed` seeds torch before decoding (greedy uses no randomness; recorded for provenance)."""

    model: ModelSpec = ModelSpec()
    family: str = SHORT_STORY_FAMILY
    items: tuple[str, ...] = ()  # ids or 1-based positions; empty: all of the family's items
    max_new_tokens: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        one_of("free-text family", self.family, FAMILIES)
        if self.max_new_tokens < 1:
            raise TomlensError(f"max_new_tokens = {self.max_new_tokens} must be at least 1", "use e.g. 48")
        object.__setattr__(self, "items", tuple(str(x) for x in self.items))
        select_items(self.family, self.items)  # a bad item name fails before the model loads


@dataclass(frozen=True, kw_only=True)
class FreeTextSummary:
    """What an answering run says about itself (result.json): how many items were answered, how many
    answers the token limit cut off, why decoding stopped (reason -> answers), the seconds it took
    (None: not timed) and the files it wrote."""

    n_items: int
    n_cut_off: int
    stop_reasons: dict[str, int]
    seconds: float | None
    files: tuple[str, ...]


def summarise_answers(answers: pd.DataFrame) -> FreeTextSummary:
    """The summary of a table of answers (`generate_answers`' columns and its `seconds` attribute)."""
    return FreeTextSummary(n_items=len(answers), n_cut_off=int(answers["cut_off"].sum()),
                           stop_reasons={str(k): int(v) for k, v in answers["stop_reason"].value_counts().items()},
                           seconds=answers.attrs.get("seconds"), files=(ANSWERS, CODING, CONFIG, MANIFEST))


@dataclass(frozen=True)
class FreeTextResult:
    answers: pd.DataFrame  # one row per item: answer, stop_reason, cut_off, rubric, ...
    config: FreeTextConfig | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    summary: FreeTextSummary | None = None  # None: summarised from `answers` when saved

    def save(self, out: str | Path) -> Path:
        """answers.csv, coding.csv (for the coder), config.json, manifest.json and, last, result.json."""
        summary = self.summary if self.summary is not None else summarise_answers(self.answers)
        out = begin_save(out)
        write_table(self.answers, out / ANSWERS)
        export_for_coding(self.answers, out / CODING)
        return finish_save(out, self.config, self.manifest, summary_to_dict(summary))

    @classmethod
    def load(cls, out: str | Path) -> FreeTextResult:
        if not (Path(out) / RESULT).is_file():
            raise TomlensError(f"{out} holds no finished free-text run (no {RESULT})",
                               f"run `tomlens freetext answer --family FAMILY --out {out}` first")
        out, config, manifest, data = read_finished(out, FreeTextConfig)
        summary = summary_from_dict(FreeTextSummary, data, folder=out, stage="free-text")
        return cls(read_table(out / ANSWERS), config, manifest, summary)

    def describe(self, out: str | Path | None = None) -> str:
        """What was answered and the next step; `out` is the run folder (the sheet's folder)."""
        n, cut = len(self.answers), int(self.answers["cut_off"].sum()) if "cut_off" in self.answers else 0
        sheet = Path(out) / CODING if out is not None else Path(CODING)
        return (f"{n} answers ({cut} cut off at the token limit); "
                f"code `{sheet}` (fill `code` with an allowed value on every row), then "
                f"`tomlens freetext score {sheet} --out DIR`")


def run(config: FreeTextConfig, *, model: Model | None = None, progress: bool = True) -> FreeTextResult:
    """Greedy answers of `config.model` (or the loaded `model`) to the selected items."""
    items = select_items(config.family, config.items)
    if model is None:
        model = config.model.load()
    answers = generate_answers(model, items, max_new_tokens=config.max_new_tokens, seed=config.seed,
                               progress=progress)
    manifest = run_manifest(model, config, stimuli_hash=items_hash(items),
                            extra={"items": [it.id for it in items], "decoding": "greedy"})
    return FreeTextResult(answers, config=config, manifest=manifest, summary=summarise_answers(answers))


def sheet_items(path: str | Path) -> list[FreeTextItem] | None:
    """The items a coding sheet was exported for, from the `config.json` beside it (None without one:
    `import_codes` then expects every item of the sheet's families)."""
    cfg = Path(path).parent / CONFIG
    if not cfg.is_file():
        return None
    config = config_from_dict(FreeTextConfig, read_json(cfg))
    return select_items(config.family, config.items)


def score_sheet(path: str | Path, *, n_boot: int = 1000, seed: int = 0,
                items: Sequence[FreeTextItem] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the coded rows, `free_text_summary` of them) from a filled coding sheet; the sheet must hold
    each exported item exactly once with a valid code (`import_codes`)."""
    coded = import_codes(path, items if items is not None else sheet_items(path))
    return coded, free_text_summary(coded, n_boot=n_boot, seed=seed)


def save_scores(summary: pd.DataFrame, sheet: str | Path, out: str | Path, *, n_boot: int, seed: int) -> Path:
    """summary.csv and score.json in `out`: which sheet (by sha256), the items' hash, the answering
    model and answer run's config (from the manifest beside the sheet; None when the sheet sits
    elsewhere) and the bootstrap settings."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_table(summary, out / SUMMARY)
    items = sheet_items(sheet)
    folder = Path(sheet).parent
    manifest = read_json(folder / MANIFEST) if (folder / MANIFEST).is_file() else {}
    write_json({"sheet": str(Path(sheet).resolve()), "sheet_sha256": file_sha256(sheet),
                "stimuli_hash": items_hash(items) if items is not None else manifest.get("stimuli_hash"),
                "model": manifest.get("model"), "answers_config": manifest.get("config"),
                "answers_manifest": str((folder / MANIFEST).resolve()) if manifest else None,
                "n_boot": n_boot, "seed": seed, "versions": versions()}, out / SCORE)
    return out / SUMMARY


__all__ = ["ANSWERS", "CODING", "FAMILIES", "FreeTextConfig", "FreeTextResult", "FreeTextSummary", "SCORE", "SUMMARY",
           "family_items", "items_hash", "run", "save_scores", "score_sheet", "select_items", "sheet_items",
           "summarise_answers"]
