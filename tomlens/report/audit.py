"""The shortcut audit in a report: its section, and the findings it withholds.

A behaviour or probe number on a family whose contrasts a text heuristic tells apart could come from
that heuristic. Such a finding is withheld, with the heuristic named and its held-out accuracy, and
stays visible as withheld (never dropped), so a reader sees what was claimed and why it is not
claimed now. A behaviour finding is matched to a family by the family's name in its sentence (each
names the stories it is about); a probe finding by the families of the probe stage's set.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tomlens.report.findings import Finding
from tomlens.report.html import Section

AUDITED_STAGES = frozenset({"behaviour", "probes"})


def _names_family(finding: Finding, family: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(family)}(?![\w-])", finding.claim + " " + finding.test,
                     re.IGNORECASE) is not None


def withhold_explained(findings: Sequence[Finding], report: Any, families: Sequence[str] | None = None
                       ) -> list[Finding]:
    """`findings` with each found behaviour or probe claim on a family that a shortcut explains
    turned into a withheld one, naming the strongest shortcut and how many more there are.
    `families`: the families every finding is about (a probe run on one set, whose sentence names a
    file); None: each finding's own, read off its sentence."""
    out = []
    for f in findings:
        if f.stage not in AUDITED_STAGES:
            families_of: list[str] = []
        elif families is not None:
            families_of = list(families)
        else:
            families_of = [fam for fam in report.families if _names_family(f, fam)]
        rows = sorted((r for fam in families_of for r in report.explaining(fam)), key=lambda r: -r.accuracy)
        if f.status != "found" or not rows:
            out.append(f)
            continue
        more = f"; {len(rows) - 1} more shortcut rows in the audit" if len(rows) > 1 else ""
        out.append(replace(f, claim=f"whether {f.claim}", status="withheld",
                           test=f"the shortcut audit: {rows[0].sentence()}{more}, so this number could come from "
                                f"that cue rather than from tracking anyone's mind (was: {f.test})"))
    return out


def audit_sections(res: Any) -> list[Section]:
    """The verdict and the rows that are not at chance; every row is in the stage's audit.json."""
    report = res.report
    frame = report.frame()
    shown = frame[frame["verdict"] != "at chance"] if len(frame) else frame
    text = ("Each contrast of the sets this run's findings are made on (false vs true belief, the keyed "
            "option's position, each family's own contrasts) was tried against text heuristics that track "
            "nobody's mind: bags of n-grams, length, option order and mentions, the last presence or absence "
            "cue, and each family's registered rules, with whole tasks held out. Verdict: "
            f"{_short_verdict(report.verdict())}. Rows not at chance are in the table below (click to open); a "
            "finding on a family listed there is withheld.")
    n = len(shown)
    return [Section("Shortcut audit", text,
                    collapsed=[(f"the {n} row{'s' if n != 1 else ''} not at chance", [shown])] if n else [])]


def _short_verdict(verdict: str, limit: int = 240) -> str:
    """The verdict without its list of every shortcut where that list is long: the rows are in the
    table, and a paragraph naming dozens of them pushes the rest of the page down."""
    return verdict if len(verdict) <= limit else verdict.split(" (", 1)[0] + " (each named in the table)"
