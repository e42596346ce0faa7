"""Minimal pairs for activation patching: a false-belief prompt and its matched true-belief prompt.

`clean` is the false-belief story (or the animate agent, or the protagonist who does not perceive
the event), `corrupted` the matched control, both ending in the SAME belief prompt with the same
`options`; `clean.answer` is the belief-consistent answer and the other option the
world-consistent one (metric: logit(clean.answer) - logit(other), first token each, last position).

Patching compares the two runs position by position, so a pair is only usable when, for the
model's tokenizer, both texts have the same number of tokens and every token that differs lies
inside the `contrast` span (the sentence that carries what the protagonist witnessed or was told).
`align_pairs` keeps exactly those pairs and reports every other one with its reason; misaligned
pairs are never returned. Without a tokenizer `make_pairs` checks the same thing at the level of
characters (the texts are identical outside the contrast spans), which every tokenizer needs but
not every tokenizer finds sufficient.

Families: "unexpected-transfer" (false belief vs present / informed protagonist; with decoys the
present control swaps the absence and presence cues between the decoy and the move, and the
informed control swaps who is told and who is not, so the contrast spans those words only),
"unexpected-contents" (vs open container / informed), "order-only" (false vs true belief: the same
sentences, the protagonist leaving before or after the move; the contrast covers both sentences,
and the token counts match whenever both orders tokenise to the same count), "goal-encoding"
(animate vs accidental agent, from `tomlens.stimuli.goal_encoding`), "bigtom" (no percept vs
percept, from the user's BigToM file), "kosoy" (Sally-Anne vs its twin with the same two sentences
swapped, so the owner witnesses the move, like order-only pairs; Smarties vs the newcomer having
looked inside; `tomlens.stimuli.kosoy.minimal_pairs`),
"indirect-request" (unaware vs aware speaker with an equal-length explicit cue, "knows nothing
about" vs "knows all about"; `tomlens.stimuli.epitome.ir_minimal_pairs`).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tomlens.errors import TomlensError
from tomlens.stimuli.records import Span, Stimulus

PAIR_FAMILIES: tuple[str, ...] = ("unexpected-transfer", "unexpected-contents", "order-only",
                                  "goal-encoding", "bigtom", "motomqa", "kosoy", "indirect-request", "user")
USER = "user"  # a user's own stories (`tomlens.stimuli.user_pairs`): contrasts are the file's conditions
# family -> contrast name -> the span role the pair's `contrast` is narrowed to (None: keep).
CONTRASTS: dict[str, dict[str, str | None]] = {
    "unexpected-transfer": {"present": "contrast_seen", "informed": "contrast_told",
                            "no_transfer": None},
    "unexpected-contents": {"open_container": "contrast_seen", "informed": "contrast_told",
                            "correct_label": "contrast_label"},
    "order-only": {"true_belief": None},
    "goal-encoding": {"control": None, "inanimate": None},
    "bigtom": {"true_belief": None},
    "motomqa": {"one_believer": None},  # true vs false ToM statement, one embedded believer swapped
    "kosoy": {"witnessed": None, "looked": None},  # Sally-Anne / Smarties vs the witnessed twin
    "indirect-request": {"aware": None},  # unaware vs aware speaker, equal-length explicit cue
    USER: {"true_belief": None},  # the default; a user's file may name any condition
}
# How a pair's two texts must correspond (MinimalPair.alignment).
ALIGNMENTS: tuple[str, ...] = ("tokens", "roles")
# What "differs only in what the protagonist witnessed or was told" means per family.
DEFAULT_CONTRASTS: dict[str, tuple[str, ...]] = {
    "unexpected-transfer": ("present", "informed"),
    "unexpected-contents": ("open_container", "informed"),
    "order-only": ("true_belief",),
    "goal-encoding": ("control",),
    "bigtom": ("true_belief",),
    "motomqa": ("one_believer",),
    "kosoy": ("witnessed", "looked"),
    "indirect-request": ("aware",),
    USER: ("true_belief",),
}


@dataclass(frozen=True)
class MinimalPair:
    """A clean (false-belief) and a corrupted (matched control) prompt; see the module doc."""

    id: str
    clean: Stimulus
    corrupted: Stimulus
    family: str
    contrast: str  # the control condition the clean prompt is paired with
    # "tokens": the two texts must tokenise to the same length and differ only inside the contrast span
    # (every generated family); "roles": they may differ in length and wording (a user's own false- and
    # true-belief versions), and are patched at role positions resolved in each story (ALIGNMENTS)
    alignment: str = "tokens"

    def __post_init__(self) -> None:
        if self.alignment not in ALIGNMENTS:
            raise TomlensError(f"pair {self.id!r}: alignment {self.alignment!r} is not one of {list(ALIGNMENTS)}",
                               "use 'tokens' (token-identical outside the contrast) or 'roles' (any wording)")

    @property
    def other_answer(self) -> str:
        """The option that is not `clean.answer` (the world-consistent one)."""
        a, b = self.clean.options
        return b if self.clean.answer == a else a

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "family": self.family, "contrast": self.contrast,
               "clean": self.clean.to_dict(), "corrupted": self.corrupted.to_dict()}
        if self.alignment != "tokens":  # files of token-aligned pairs keep their shape
            out["alignment"] = self.alignment
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MinimalPair:
        return cls(id=d["id"], clean=Stimulus.from_dict(d["clean"]),
                   corrupted=Stimulus.from_dict(d["corrupted"]), family=d["family"],
                   contrast=d["contrast"], alignment=d.get("alignment", "tokens"))


@dataclass
class PairReport:
    """How many candidate pairs there were, how many are usable, and why the others are not.

    `dropped_pairs` holds (pair id, reason) for every pair left out; a reason starts with a short
    category ("token_count", "outside_contrast", ...) followed by ": " and the details.
    """

    family: str
    total: int = 0
    aligned: int = 0
    dropped_pairs: list[tuple[str, str]] = field(default_factory=list)
    checked_with: str = "characters"  # "characters", or the tokenizer's name

    @property
    def dropped(self) -> int:
        return len(self.dropped_pairs)

    @property
    def counts(self) -> dict[str, int]:
        return {"total": self.total, "aligned": self.aligned, "dropped": self.dropped}

    @property
    def aligned_fraction(self) -> float:
        return self.aligned / self.total if self.total else 0.0

    def reason_counts(self) -> Counter:
        return Counter(reason.split(":", 1)[0] for _, reason in self.dropped_pairs)

    def summary(self, examples: int = 3) -> str:
        lines = [
            f"{self.family}: {self.aligned} of {self.total} pairs {'usable' if self.family == USER else 'aligned'} "
            f"({100 * self.aligned_fraction:.1f}%, checked with {self.checked_with}); "
            f"{self.dropped} dropped"
        ]
        shown: Counter = Counter()
        for category, count in self.reason_counts().most_common():
            lines.append(f"  {count} x {category}")
            for pid, reason in self.dropped_pairs:
                if reason.startswith(category + ":") and shown[category] < examples:
                    shown[category] += 1
                    lines.append(f"      e.g. {pid}: {reason.split(':', 1)[1].strip()}")
        return "\n".join(lines)

    def merge(self, token_report: PairReport) -> None:
        """Fold in `align_pairs`' report on the pairs this (character-level) report kept."""
        self.dropped_pairs.extend(token_report.dropped_pairs)
        self.aligned = token_report.aligned
        self.checked_with = token_report.checked_with

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, **self.counts, "checked_with": self.checked_with,
                "dropped_pairs": [list(x) for x in self.dropped_pairs]}


# ---------------------------------------------------------------------------------------------
# Building candidate pairs
# ---------------------------------------------------------------------------------------------


def make_pairs(
    family: str,
    n: int | None = None,
    seed: int = 0,
    tokenizer: Any = None,
    path: str | Path | None = None,
    *,
    contrasts: Sequence[str] | None = None,
    **options: Any,
) -> tuple[list[MinimalPair], PairReport]:
    """Clean/corrupted pairs of a family, checked; returns (usable pairs, report).

    `n` tasks (transfer, contents; None: 20), items (goal encoding) or the first `n` stories or tasks
    (bigtom, user; None = all); `path` is the BigToM csv; `contrasts` picks the controls to pair with (default:
    what the protagonist witnessed or was told, see DEFAULT_CONTRASTS); other `options` go to the
    family's generator (goal encoding defaults to k = 6 habituations and `manner_scope="test"`,
    so the animate and accidental prompts differ only in the test reach). With a `tokenizer`
    (a Hugging Face tokenizer with offsets) pairs are aligned token by token; without one only
    the character-level check runs.
    """
    if family not in PAIR_FAMILIES:
        raise TomlensError(f"no minimal pairs for family {family!r}",
                           f"use one of {list(PAIR_FAMILIES)}")
    if contrasts is None:
        contrasts = DEFAULT_CONTRASTS[family]
    if isinstance(contrasts, str):
        contrasts = (contrasts,)
    if family == USER:  # the file's own conditions, checked against the file
        return check_pairs(_user_pairs(path, n, contrasts, options), tokenizer, family=family)
    bad = [c for c in contrasts if c not in CONTRASTS[family]]
    if bad or not contrasts:
        raise TomlensError(f"contrasts={list(contrasts)!r} is not a non-empty subset of "
                           f"{family}'s contrasts", f"choose from {list(CONTRASTS[family])}")
    if family in ("unexpected-transfer", "unexpected-contents"):
        candidates = _false_belief_pairs(family, n, seed, contrasts, options)
    elif family == "order-only":
        candidates = _order_pairs(n, seed, options)
    elif family == "goal-encoding":
        candidates = _goal_pairs(n, seed, contrasts, options)
    elif family == "motomqa":
        from tomlens.stimuli.motomqa import minimal_pairs

        candidates = minimal_pairs(20 if n is None else n, seed, **options)
    elif family == "kosoy":
        from tomlens.stimuli.kosoy import minimal_pairs as kosoy_pairs

        candidates = kosoy_pairs(24 if n is None else n, seed, contrasts=contrasts, **options)
    elif family == "indirect-request":
        from tomlens.stimuli.epitome import ir_minimal_pairs

        candidates = ir_minimal_pairs(24 if n is None else n, seed, **options)
    else:
        candidates = _bigtom_pairs(path, n, options)
    return check_pairs(candidates, tokenizer, family=family)


def _user_pairs(path: str | Path | None, n: int | None, contrasts: Sequence[str],
                options: dict[str, Any]) -> list[MinimalPair]:
    from tomlens.stimuli.user_pairs import user_pairs

    if path is None:
        raise TomlensError("pairs of your own stories need your stimulus file",
                           "pass path=... (CLI: tomlens pairs user --path my.jsonl); docs/stimulus-format.md")
    if options:
        raise TomlensError(f"unknown option(s) {sorted(options)} for user pairs",
                           "pass only family, n, path, tokenizer and contrasts")
    return user_pairs(path, contrasts=contrasts, n=n)


def _narrow(s: Stimulus, role: str | None) -> Stimulus:
    """The record with `contrast` narrowed to the one sentence this pair swaps."""
    if role is None:
        return s
    return s.with_(spans={**s.spans, "contrast": s.spans[role]})


def _false_belief_pairs(family: str, n: int | None, seed: int, contrasts: Sequence[str],
                        options: dict[str, Any]) -> list[MinimalPair]:
    from tomlens.stimuli import false_belief

    decoys = options.pop("decoys", True)
    if options:
        raise TomlensError(f"unknown option(s) {sorted(options)} for {family} pairs",
                           "pass only family, n, seed, tokenizer, contrasts and decoys")
    if n is None:
        n = 20
    pairs: list[MinimalPair] = []
    for task in false_belief.make_tasks(family, n, seed, decoys):
        for rev in (False, True):
            fb = false_belief.build_story(task, "false_belief", rev)
            clean_full = false_belief.story_stimulus(fb, "belief")
            for contrast in contrasts:
                role = CONTRASTS[family][contrast]
                control = false_belief.build_story(task, contrast, rev)
                corrupted = false_belief.story_stimulus(control, "belief")
                pairs.append(MinimalPair(
                    id=f"{task.task_id}{'-rev' if rev else ''}-{contrast}",
                    clean=_narrow(clean_full, role), corrupted=_narrow(corrupted, role),
                    family=family, contrast=contrast,
                ))
    return pairs


def _order_pairs(n: int | None, seed: int, options: dict[str, Any]) -> list[MinimalPair]:
    """Order-only false- vs true-belief belief prompts: the same sentences in another order."""
    from tomlens.stimuli import order_only

    if options:
        raise TomlensError(f"unknown option(s) {sorted(options)} for order-only pairs",
                           "pass only family, n, seed, tokenizer and contrasts")
    pairs: list[MinimalPair] = []
    for task in order_only.make_order_tasks(20 if n is None else n, seed):
        clean = order_only.order_stimulus(task, "false_belief", "belief")
        corrupted = order_only.order_stimulus(task, "true_belief", "belief")
        pairs.append(MinimalPair(id=f"{task.task_id}-true_belief", clean=clean, corrupted=corrupted,
                                 family=order_only.FAMILY, contrast="true_belief"))
    return pairs


def _goal_pairs(n: int | None, seed: int, contrasts: Sequence[str],
                options: dict[str, Any]) -> list[MinimalPair]:
    from tomlens.stimuli.goal_encoding import goal_encoding

    opts = {"ks": (6,), "manner_scope": "test", "wording": "matched", **options}
    if "test_cases" in opts:
        raise TomlensError("goal-encoding pairs choose their own test cases",
                           "pick the control with contrasts=('control',) or ('inanimate',)")
    stimuli = goal_encoding(n=20 if n is None else n, seed=seed,
                            test_cases=("animate", *contrasts), **opts)
    cells: dict[tuple, dict[str, Stimulus]] = defaultdict(dict)
    for s in stimuli:
        key = (s.task_id, s.meta["k"], s.template_id)
        cells[key][s.meta["test_case"]] = s
    pairs = []
    for (task_id, k, template), by_case in cells.items():
        for contrast in contrasts:
            pairs.append(MinimalPair(
                id=f"{task_id}-{contrast}-k{k}-{template}", clean=by_case["animate"],
                corrupted=by_case[contrast], family="goal-encoding", contrast=contrast,
            ))
    return pairs


def _bigtom_pairs(path: str | Path | None, n: int | None,
                  options: dict[str, Any]) -> list[MinimalPair]:
    from tomlens.stimuli.bigtom import load_bigtom

    if path is None:
        raise TomlensError("BigToM pairs need the BigToM file",
                           "pass path=... (CLI: --path bigtom.csv) from the BigToM repository")
    if "conditions" in options:
        raise TomlensError("BigToM pairs choose their own conditions",
                           "drop the conditions option")
    options = {"percept": "aligned", **options}  # one word apart, so that tokens align
    stimuli = load_bigtom(path, conditions=("false_belief", "true_belief"), limit=n, **options)
    by_task: dict[str, dict[str, Stimulus]] = defaultdict(dict)
    for s in stimuli:
        by_task[s.task_id][s.condition] = _with_query_protagonist(s)
    return [
        MinimalPair(id=f"{task_id}-true_belief", clean=c["false_belief"],
                    corrupted=c["true_belief"], family="bigtom", contrast="true_belief")
        for task_id, c in by_task.items()
    ]


def _with_query_protagonist(s: Stimulus) -> Stimulus:
    """The record with a `query_protagonist` span: the protagonist's last mention inside the
    query (BigToM's "Answer: Noor believes ..."), where a patching sweep looks by default."""
    if "protagonist" not in s.spans or "query" not in s.spans:
        return s
    q = s.spans["query"]
    name = re.escape(s.span_text("protagonist"))
    found = list(re.finditer(rf"(?<!\w){name}(?!\w)", s.text[q.start : q.end]))
    if not found:
        return s
    m = found[-1]
    return s.with_(spans={**s.spans, "query_protagonist": Span(q.start + m.start(), q.start + m.end())})


# ---------------------------------------------------------------------------------------------
# Checking: characters first (any tokenizer), then tokens (the model's tokenizer)
# ---------------------------------------------------------------------------------------------


def _preview(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _overlaps(a: Span, b: Span) -> bool:
    return a.start < b.end and b.start < a.end


def structural_problem(pair: MinimalPair) -> str | None:
    """Why a pair cannot be a minimal pair whatever the tokenizer (None when it can)."""
    c, k = pair.clean, pair.corrupted
    if c.options != k.options:
        return f"options: clean {list(c.options)} vs corrupted {list(k.options)}"
    if c.answer not in c.options:
        return f"options: clean answer {c.answer!r} is not an option"
    if pair.alignment == "roles":
        return _role_pair_problem(c, k)
    for s, name in ((c, "clean"), (k, "corrupted")):
        for role in ("contrast", "query"):
            if role not in s.spans:
                return f"missing_span: the {name} prompt {s.id!r} has no {role!r} span"
    cs, ks = c.spans["contrast"], k.spans["contrast"]
    # Where the contrast lies inside the prompt itself (goal encoding: the test reach), the
    # prompts differ by design; the check below still holds everything else fixed.
    overlap = _overlaps(c.spans["query"], cs) or _overlaps(k.spans["query"], ks)
    if not overlap and c.span_text("query") != k.span_text("query"):
        return (f"query: the prompts differ ({_preview(c.span_text('query'))} vs "
                f"{_preview(k.span_text('query'))})")
    if c.text[: cs.start] != k.text[: ks.start] or c.text[cs.end:] != k.text[ks.end:]:
        before = c.text[: cs.start] != k.text[: ks.start]
        a, b = (c.text[: cs.start], k.text[: ks.start]) if before else (c.text[cs.end:],
                                                                        k.text[ks.end:])
        i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        return (f"outside_contrast: the texts differ {'before' if before else 'after'} the "
                f"contrast span ({_preview(a[i:i + 30])} vs {_preview(b[i:i + 30])})")
    if c.text == k.text:
        return "identical: the clean and corrupted texts are the same"
    return None


def _role_pair_problem(c: Stimulus, k: Stimulus) -> str | None:
    """Why a role-aligned pair (texts free to differ in length and wording) cannot be patched: its
    question must be the same words in both stories, since the metric reads the final token and a
    question asked differently is not the same measurement. A story without a `query` span is read
    by `tomlens.stimuli.user_pairs.query_span` (its final sentence, from the question on)."""
    from tomlens.stimuli.user_pairs import query_span

    if c.text == k.text:
        return "identical: the clean and corrupted texts are the same"
    asked = []
    for s in (c, k):
        span = s.spans.get("query") or query_span(s.text)
        asked.append(span.of(s.text) if span is not None else "")
    if asked[0] != asked[1]:
        return (f"query: the two stories ask different questions ({_preview(asked[0])} vs "
                f"{_preview(asked[1])}); ask the same question in both versions")
    return None


def check_pairs(pairs: Iterable[MinimalPair], tokenizer: Any = None,
                family: str | None = None) -> tuple[list[MinimalPair], PairReport]:
    """The character-level check for every pair, then `align_pairs` when a tokenizer is given."""
    pairs = list(pairs)
    family = family or (pairs[0].family if pairs else "")
    report = PairReport(family=family, total=len(pairs))
    kept = []
    seen: set[str] = set()
    for p in pairs:
        if p.id in seen:
            raise TomlensError(f"duplicate minimal-pair id {p.id!r}", "give every pair its own id")
        seen.add(p.id)
        problem = structural_problem(p)
        if problem:
            report.dropped_pairs.append((p.id, problem))
        else:
            kept.append(p)
    if tokenizer is None:
        report.aligned = len(kept)
        return kept, report
    aligned, token_report = align_pairs(kept, tokenizer)
    report.merge(token_report)
    return aligned, report


def _encode(tokenizer: Any, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    try:
        enc = tokenizer(texts, return_offsets_mapping=True)
    except NotImplementedError as e:  # slow (Python) tokenizers have no offsets
        raise TomlensError(
            f"tokenizer {type(tokenizer).__name__} gives no character offsets",
            "use a fast (Rust) Hugging Face tokenizer, e.g. AutoTokenizer.from_pretrained(..., "
            "use_fast=True)",
        ) from e
    return [(list(ids), [tuple(o) for o in offs])
            for ids, offs in zip(enc["input_ids"], enc["offset_mapping"], strict=True)]


def _inside(text: str, offset: tuple[int, int], span: Span) -> bool:
    """Whether a token's characters, ignoring surrounding whitespace, lie inside `span`."""
    start, end = offset
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return span.start <= start and end <= span.end


def tokenizer_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def align_pairs(pairs: Sequence[MinimalPair],
                tokenizer: Any) -> tuple[list[MinimalPair], PairReport]:
    """Keep pairs whose two texts have equal token counts and differ only inside the contrast span
    (role-aligned pairs, `alignment="roles"`, need only options whose first tokens differ).

    Tokenizes with the tokenizer's default special tokens (as the model sees the text). Returns
    (aligned pairs, report); every other pair is in the report with its reason.
    """
    pairs = list(pairs)
    family = pairs[0].family if pairs else ""
    report = PairReport(family=family, total=len(pairs), checked_with=tokenizer_name(tokenizer))
    if not pairs:
        return [], report
    texts = [t for p in pairs for t in (p.clean.text, p.corrupted.text)]
    encoded = _encode(tokenizer, texts)
    with_options = _encode(tokenizer, [f"{p.clean.text} {o}" for p in pairs for o in p.clean.options[:2]])
    aligned = []
    for j, p in enumerate(pairs):
        tokens = None if p.alignment == "roles" else _token_problem(p, encoded[2 * j], encoded[2 * j + 1], tokenizer)
        reason = tokens or _option_clash(p, with_options[2 * j : 2 * j + 2], tokenizer)
        if reason:
            report.dropped_pairs.append((p.id, reason))
        else:
            aligned.append(p)
    report.aligned = len(aligned)
    return aligned, report


def _token_problem(pair: MinimalPair, clean: tuple[list[int], list[tuple[int, int]]],
                   corrupted: tuple[list[int], list[tuple[int, int]]], tokenizer: Any) -> str | None:
    (ids_c, off_c), (ids_k, off_k) = clean, corrupted
    cs, ks = pair.clean.spans["contrast"], pair.corrupted.spans["contrast"]
    if len(ids_c) != len(ids_k):
        return (f"token_count: clean has {len(ids_c)} tokens, corrupted {len(ids_k)} "
                f"(contrast {_preview(cs.of(pair.clean.text))} vs "
                f"{_preview(ks.of(pair.corrupted.text))})")
    diff = [i for i, (a, b) in enumerate(zip(ids_c, ids_k, strict=True)) if a != b]
    if not diff:
        return "identical: both texts give the same tokens"
    for i in diff:
        if not (_inside(pair.clean.text, off_c[i], cs)
                and _inside(pair.corrupted.text, off_k[i], ks)):
            pieces = tokenizer.convert_ids_to_tokens([ids_c[i], ids_k[i]])
            return (f"outside_contrast: token {i} differs outside the contrast span "
                    f"({pieces[0]!r} vs {pieces[1]!r})")
    return None


def _option_clash(pair: MinimalPair, encoded: list[tuple[list[int], list[tuple[int, int]]]],
                  tokenizer: Any) -> str | None:
    """The logit difference compares the first token of each option: equal first tokens (e.g.
    " 5 AM" and " 3 AM" split as " " + digit) leave nothing to compare."""
    end = len(pair.clean.text)
    firsts = []
    for ids, offs in encoded:
        t = next((t for t, (cs, ce) in enumerate(offs) if cs >= end or ce > end), None)
        if t is None:
            return "options: an option could not be located in the tokens"
        firsts.append(ids[t])
    if firsts[0] == firsts[1]:
        piece = tokenizer.convert_ids_to_tokens([firsts[0]])[0]
        return (f"options_share_first_token: {pair.clean.options[0]!r} and {pair.clean.options[1]!r} "
                f"both start with {piece!r}")
    return None


def diff_positions(pair: MinimalPair, tokenizer: Any) -> list[int]:
    """Token indices (unpadded, with default special tokens) where an aligned pair differs."""
    (ids_c, _), (ids_k, _) = _encode(tokenizer, [pair.clean.text, pair.corrupted.text])
    if len(ids_c) != len(ids_k):
        raise TomlensError(f"pair {pair.id!r} is not token-aligned for this tokenizer",
                           "run align_pairs first and use only the pairs it keeps")
    return [i for i, (a, b) in enumerate(zip(ids_c, ids_k, strict=True)) if a != b]


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def write_pairs(pairs: Iterable[MinimalPair], path: str | Path) -> Path:
    """Write pairs as JSON lines, atomically (temporary name, then rename)."""
    from tomlens.io import write_jsonl

    return write_jsonl((p.to_dict() for p in pairs), path)


def read_pairs(path: str | Path) -> list[MinimalPair]:
    """Read pairs written by `write_pairs`; a malformed line raises TomlensError naming it."""
    path = Path(path)
    if not path.is_file():
        raise TomlensError(f"pairs file {str(path)!r} does not exist",
                           "write one with `tomlens pairs FAMILY --out FILE`")
    pairs = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                pairs.append(MinimalPair.from_dict(json.loads(line)))
            except TomlensError as e:
                raise TomlensError(f"{path}, line {line_no}: {e.problem}", e.fix) from e
            except (ValueError, KeyError, TypeError) as e:
                raise TomlensError(
                    f"{path}, line {line_no}: not a minimal pair ({type(e).__name__}: {e})",
                    "each line must be an object with id, family, contrast, clean, corrupted "
                    "as written by write_pairs",
                ) from e
    return pairs


__all__ = [
    "ALIGNMENTS", "CONTRASTS", "DEFAULT_CONTRASTS", "MinimalPair", "PAIR_FAMILIES", "PairReport", "align_pairs",
    "check_pairs", "diff_positions", "make_pairs", "read_pairs", "structural_problem",
    "USER", "write_pairs",
]
