"""The audit's typed result: one row per (family, contrast, heuristic), and the verdict they give.

`AuditReport.explaining(family, contrast)` is what later stages read: the shortcut rows that explain
a contrast, so a behaviour or probe finding on it can name the heuristic instead of claiming belief.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from tomlens.audit.evaluate import AT_CHANCE, OVER_CEILING, SHORTCUT, TOO_FEW


@dataclass(frozen=True)
class AuditRow:
    family: str
    contrast: str
    heuristic: str
    source: str  # "generic" or "family rule"
    accuracy: float
    ci_low: float
    ci_high: float
    chance: float
    n_rows: int
    n_tasks: int
    verdict: str
    null_mean: float = float("nan")  # the permutation null, run where the interval saw a shortcut
    null_sd: float = float("nan")

    def sentence(self) -> str:
        """One line a finding can carry: what explains which contrast, how well."""
        null = f", shuffled labels {self.null_mean:.2f} +- {self.null_sd:.2f}" if self.null_sd == self.null_sd else ""
        return (f"{self.heuristic} tells {self.contrast} apart at {self.accuracy:.2f} "
                f"[{self.ci_low:.2f}, {self.ci_high:.2f}] on held-out tasks (chance {self.chance:.2f}{null})")


def _row(d: dict[str, Any]) -> AuditRow:
    """A saved row (JSON writes NaN as null)."""
    floats = ("accuracy", "ci_low", "ci_high", "chance", "null_mean", "null_sd")
    fields: dict[str, Any] = {k: (float("nan") if v is None else float(v)) if k in floats else v for k, v in d.items()}
    return AuditRow(**fields)


@dataclass(frozen=True)
class AuditReport:
    """Every row, the contrasts or heuristics left out and why, and how it was made."""

    rows: tuple[AuditRow, ...]
    skipped: tuple[str, ...] = ()
    level: float = 0.95  # the per-row interval level (Bonferroni over `rows`)
    seed: int = 0
    stimuli_hash: str = ""
    families: tuple[str, ...] = field(default_factory=tuple)

    @property
    def shortcuts(self) -> tuple[AuditRow, ...]:
        return tuple(r for r in self.rows if r.verdict == SHORTCUT)

    @property
    def undecided(self) -> tuple[AuditRow, ...]:
        return tuple(r for r in self.rows if r.verdict == TOO_FEW)

    def explaining(self, family: str | None = None, contrast: str | None = None) -> tuple[AuditRow, ...]:
        """The shortcut rows of `family` (any if None) on `contrast` (any if None)."""
        return tuple(r for r in self.shortcuts if (family is None or r.family == family)
                     and (contrast is None or r.contrast == contrast))

    def verdict(self) -> str:
        """One sentence: no shortcut found, or how many and which, or why nothing could be judged."""
        if not self.rows:
            return "nothing audited: " + ("; ".join(self.skipped) or "no rows")
        if self.shortcuts:
            named = sorted({f"{r.family}: {r.contrast} <- {r.heuristic}" for r in self.shortcuts})
            return f"SHORTCUTS: {len(self.shortcuts)} of {len(self.rows)} rows explain a contrast ({'; '.join(named)})"
        if self.undecided and len(self.undecided) == len(self.rows):
            return f"undecided: every contrast has fewer held-out tasks than needed ({self.undecided[0].n_tasks})"
        tail = f"; {len(self.undecided)} rows undecided (too few tasks)" if self.undecided else ""
        over = [r for r in self.rows if r.verdict == OVER_CEILING]
        if over:
            tail += (f"; {len(over)} n-gram bags over 0.60 but not significant ("
                     + ", ".join(sorted({f'{r.family}: {r.contrast} <- {r.heuristic}' for r in over})) + ")")
        return f"no shortcut found: {len(self.rows)} rows, none above chance at the {self.level:.4f} level{tail}"

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([asdict(r) for r in self.rows], columns=list(AuditRow.__dataclass_fields__))

    def table(self, *, only_flagged: bool = False) -> str:
        """The rows as a fixed-width table, shortcuts first within each contrast (`only_flagged`: the
        rows not at chance, and no list of what was skipped)."""
        rows = [r for r in self.rows if r.verdict != AT_CHANCE] if only_flagged else list(self.rows)
        if not rows:
            return self.verdict()
        lines = [f"{'family':<24} {'contrast':<34} {'heuristic':<34} {'acc':>5} {'interval':>13} {'chance':>6}  verdict"]
        for r in sorted(rows, key=lambda r: (r.family, r.contrast, r.verdict != SHORTCUT, r.heuristic)):
            lines.append(f"{r.family[:24]:<24} {r.contrast[:34]:<34} {r.heuristic[:34]:<34} {r.accuracy:>5.2f} "
                         f"[{r.ci_low:.2f}, {r.ci_high:.2f}] {r.chance:>6.2f}  {r.verdict}")
        skipped = () if only_flagged else self.skipped
        return "\n".join([*lines, *(f"skipped: {s}" for s in skipped), self.verdict()])

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows], "skipped": list(self.skipped), "level": self.level,
                "seed": self.seed, "stimuli_hash": self.stimuli_hash, "families": list(self.families),
                "verdict": self.verdict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AuditReport:
        return cls(tuple(_row(r) for r in d["rows"]), tuple(d.get("skipped", ())), float(d["level"]),
                   int(d.get("seed", 0)), str(d.get("stimuli_hash", "")), tuple(d.get("families", ())))

    def write(self, path: str | Path) -> Path:
        from tomlens.io import write_json

        return write_json(self.to_dict(), path)

    @classmethod
    def read(cls, path: str | Path) -> AuditReport:
        return cls.from_dict(json.loads(Path(path).read_text()))
