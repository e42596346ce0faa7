"""The shortcut audit: can a reader who tracks nobody's mind tell a set's contrasts apart?

`audit_stimuli(stimuli)` runs the generic battery (`heuristics`) and each family's registered rules
(`tomlens.stimuli.shortcuts`, `contrasts.register_rule`) on every contrast, with task-held-out folds,
and returns an `AuditReport` whose shortcut rows later stages name beside their findings.
"""

from tomlens.audit.contrasts import register_contrast, register_rule
from tomlens.audit.result import AuditReport, AuditRow
from tomlens.audit.run import audit_stimuli, sample_per_task
from tomlens.stimuli.shortcuts import Contrast, Rule

__all__ = ["AuditReport", "AuditRow", "Contrast", "Rule", "audit_stimuli", "register_contrast",
           "register_rule", "sample_per_task"]
