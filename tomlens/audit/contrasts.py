"""Which contrasts a set is audited on, and which family rules join the generic battery.

Every set gets the contrasts any labelled set has: the keyed option's position (chance 0.5 by
design: a set whose answer is mostly the first option is biased whatever the model does) and, where
the rows carry world-state and belief labels, false vs true belief. A built-in family adds what its
generator module declares (`CONTRASTS` / `RULES`, or `CONTRASTS_BY_FAMILY` / `RULES_BY_FAMILY` where
one module holds several families); a user adds more with `register_contrast` / `register_rule`.
A user file whose rows name a built-in family gets that family's contrasts and rules, each applied
to the rows it can read.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Any, TypeVar

from tomlens.stimuli import FAMILIES
from tomlens.stimuli.records import Stimulus
from tomlens.stimuli.shortcuts import Contrast, Rule

Named = TypeVar("Named", Contrast, Rule)
_EXTRA_CONTRASTS: dict[str, list[Contrast]] = {}
_EXTRA_RULES: dict[str, list[Rule]] = {}
MAX_CONDITIONS = 8  # more conditions than this make "condition" a catalogue, not a contrast


def _answer_position(s: Stimulus) -> int | None:
    """Belief (and goal) prompts only: a reality prompt's answer is the world by design, so pooling
    it would make "the last-mentioned place" look like a shortcut of every transfer story."""
    return None if s.prompt_type == "reality" else s.answer_index


def _belief_label(s: Stimulus) -> str | None:
    if s.world_state is None or s.protagonist_belief is None:
        return None
    return "false belief" if s.belief_differs else "true belief"


def _condition(s: Stimulus) -> str | None:
    return s.condition or None


ANSWER_POSITION = Contrast("keyed option position", _answer_position,
                           "which of the two options is keyed on belief and goal prompts (an answer should not sit in one place)",
                           chance=0.5)
BELIEF = Contrast("false vs true belief", _belief_label,
                  "stories where the protagonist's belief differs from the world, against those where it agrees")
CONDITION = Contrast("condition", _condition, "the set's conditions, told apart")


def register_contrast(family: str, contrast: Contrast) -> None:
    """Audit `family`'s sets (built-in or a user's, by `Stimulus.family`) on one more contrast. One
    registered under a name already registered for `family` replaces it (a script or notebook cell
    run twice must not audit the contrast twice)."""
    _register(_EXTRA_CONTRASTS, family, contrast)


def register_rule(family: str, rule: Rule) -> None:
    """Try one more shortcut rule on `family`'s sets; a rule of a name already registered for
    `family` replaces it, as `register_contrast` does."""
    _register(_EXTRA_RULES, family, rule)


def _register(registry: dict[str, list[Named]], family: str, item: Named) -> None:
    kept: list[Named] = [x for x in registry.get(family, []) if x.name != item.name]
    registry[family] = kept + [item]


def _module(family: str) -> ModuleType | None:
    if family in FAMILIES:
        return importlib.import_module(FAMILIES[family][0])
    if family == "bigtom":
        return importlib.import_module("tomlens.stimuli.bigtom")
    return None


def _declared(family: str, single: str, by_family: str, empty: Any = ()) -> Any:
    """What `family`'s generator module declares under `by_family[family]`, else under `single`."""
    module = _module(family)
    if module is None:
        return empty
    per_family = getattr(module, by_family, None)
    return per_family.get(family, empty) if per_family is not None else getattr(module, single, empty)


def family_contrasts(family: str) -> list[Contrast]:
    """What `family` declares and what was registered for it, in that order; a registered contrast
    of a declared one's name takes its place."""
    return _declared_then_registered(_declared(family, "CONTRASTS", "CONTRASTS_BY_FAMILY"),
                                     _EXTRA_CONTRASTS.get(family, []))


def family_rules(family: str) -> list[Rule]:
    """What `family` declares and what was registered for it; a registered rule of a declared
    rule's name takes its place (one row per name: the audit keys its features by name)."""
    return _declared_then_registered(_declared(family, "RULES", "RULES_BY_FAMILY"), _EXTRA_RULES.get(family, []))


def _declared_then_registered(declared: Sequence[Named], registered: list[Named]) -> list[Named]:
    names = {x.name for x in registered}
    return [x for x in declared if x.name not in names] + registered


def unaudited(family: str) -> dict[str, str]:
    """Contrast name -> why the family leaves it out (`UNAUDITED` / `UNAUDITED_BY_FAMILY` beside its
    generator): a scalar-implicature speaker states their access, so the words must give it away."""
    return dict(_declared(family, "UNAUDITED", "UNAUDITED_BY_FAMILY", {}))


def contrasts_for(family: str, stimuli: Sequence[Stimulus]) -> list[Contrast]:
    """The contrasts to audit one family's rows on: the generic two (unless the family's own takes
    one's name), the family's own, and, for a family that declares none, its conditions (when there
    are 2 to `MAX_CONDITIONS` of them)."""
    own = family_contrasts(family)
    out = _declared_then_registered((ANSWER_POSITION, BELIEF), own)
    if not own and 2 <= len({s.condition for s in stimuli}) <= MAX_CONDITIONS:
        out.append(CONDITION)
    left_out = unaudited(family)
    return [c for c in out if c.name not in left_out]
