"""BigToM (Gandhi et al., 2023) forward-belief prompts, read from the user's copy of `bigtom.csv`.

The data set is external: the loader takes its path and never copies it. Each story gives one
prompt per condition, all with the same two options, so true- vs false-belief prompts of one story
form a minimal pair that differs only in the percept sentence (the `contrast` span).

Options are the parts of the two belief answers that differ: "Noor believes the milk pitcher
contains oat milk." / "... almond milk." become the prompt ending "Answer: Noor believes the milk
pitcher contains" and the options ("almond milk", "oat milk"). With whole sentences as options both
would start with the same token and a first-token score could not tell them apart;
`answer_format="sentence"` keeps the whole sentences (without the final period) instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from tomlens.errors import TomlensError
from tomlens.stimuli.records import Span, Stimulus

# Field numbers (1-based, as in the data set's README).
F_STORY, F_AWARE, F_UNAWARE = 1, 2, 3
F_BELIEF_Q = 6
F_BELIEF_AWARE, F_BELIEF_UNAWARE = 9, 12
F_RANDOM, F_RANDOM_AWARE, F_RANDOM_UNAWARE = 15, 16, 17
MIN_FIELDS, MAX_FIELDS = 17, 19

# condition -> (event is the causal one?, protagonist perceives the event?)
CONDITIONS: dict[str, tuple[bool, bool]] = {
    "true_belief": (True, True),
    "false_belief": (True, False),
    "true_control": (False, True),  # random event, perceived: nothing relevant changes
    "false_control": (False, False),  # random event, not perceived
}

_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_QUESTION_NAME = re.compile(
    r"^\s*(?:Does|Did|Do|Is|Was|Will|Would)\s+(.+?)\s+(?:believe|think|know|expect|assume)\b"
)


def load_bigtom(
    path: str | Path,
    conditions: Sequence[str] = ("true_belief", "false_belief"),
    include_initial_belief: bool = False,
    *,
    answer_format: Literal["tail", "sentence"] = "tail",
    limit: int | None = None,
    percept: Literal["original", "aligned"] = "original",
) -> list[Stimulus]:
    """Forward-belief prompts from BigToM's `bigtom.csv` (';'-separated, no header).

    Per story and condition: sentences 1-3 of the story (and sentence 4, the initial belief, with
    `include_initial_belief`), the event (the causal event, or the random event in the
    `*_control` conditions), the percept sentence (aware or not aware), then
    "Question: <belief question>\\nAnswer: <shared start of the two answers>".

    Labels: `world_state` is the new state after a causal event and the old one after a random
    event; `protagonist_belief` is the new state only when the protagonist perceived the causal
    event; `reference_state` is always the old state (what was true before the event), so
    `belief_is_reference` separates false belief from true belief. `answer` is the belief.
    Options are in the same order for every condition of a story and alternate between stories.
    `percept="aligned"` writes the aware sentence as the unaware one with "not" turned into
    "indeed" ("Noor does indeed see ..." beside "Noor does not see ..."), so the two conditions
    differ in one word of equal token count (for activation patching; `meta["percept"]` says
    which form a prompt has); rows whose unaware sentence has no "not" keep BigToM's wording.
    A malformed row raises `TomlensError` naming the file and line.
    """
    path = Path(path)
    if isinstance(conditions, str):
        conditions = (conditions,)
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown or not conditions:
        raise TomlensError(
            f"unknown BigToM condition(s) {unknown!r}" if unknown else "no BigToM condition given",
            f"choose from {list(CONDITIONS)}",
        )
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise TomlensError(f"limit={limit!r} must be a positive number of stories",
                           "ask for at least one story (CLI: --n 1 or more; leave --n out for all stories)")
    if answer_format not in ("tail", "sentence"):
        raise TomlensError(f"unknown answer_format {answer_format!r}", "use 'tail' or 'sentence'")
    if percept not in ("original", "aligned"):
        raise TomlensError(f"unknown percept form {percept!r}", "use 'original' or 'aligned'")
    if not path.is_file():
        raise TomlensError(
            f"BigToM file {str(path)!r} does not exist",
            "pass the path of bigtom.csv from the BigToM repository "
            "(cicl-stanford/procedural-evals-tom, data/bigtom/bigtom.csv)",
        )

    out: list[Stimulus] = []
    n_stories = 0
    with path.open(encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if limit is not None and n_stories >= limit:
                break
            story = _parse_row(path, line_no, line.rstrip("\r\n"), answer_format)
            story["rewritten"] = set()
            if percept == "aligned":
                for aware, unaware in (("aware", "unaware"), ("random_aware", "random_unaware")):
                    rewritten = _NOT.sub(r"\1indeed\2", story[unaware], count=1)
                    if rewritten != story[unaware]:
                        story[aware] = rewritten
                        story["rewritten"].add(aware)
            options = story["options"] if n_stories % 2 == 0 else story["options"][::-1]
            for condition in conditions:
                out.append(_stimulus(story, condition, options, include_initial_belief))
            n_stories += 1
    if n_stories == 0:
        raise TomlensError(f"BigToM file {str(path)!r} holds no stories", "check the file")
    return out


def _fail(path: Path, line_no: int, problem: str) -> TomlensError:
    return TomlensError(
        f"{path}, line {line_no}: {problem}",
        f"each line needs {MIN_FIELDS} to {MAX_FIELDS} ';'-separated fields as described in "
        "BigToM's README (story; aware; not aware; ...; belief answers in fields 9 and 12; "
        "random event in fields 15-17)",
    )


def _parse_row(path: Path, line_no: int, line: str, answer_format: str) -> dict:
    fields = [x.strip() for x in line.split(";")]
    if not MIN_FIELDS <= len(fields) <= MAX_FIELDS:
        raise _fail(path, line_no, f"{len(fields)} fields, expected {MIN_FIELDS} to {MAX_FIELDS}")

    def field(k: int) -> str:
        value = fields[k - 1]
        if not value:
            raise _fail(path, line_no, f"field {k} is empty")
        return value

    sentences = _SENTENCE.split(field(F_STORY))
    if len(sentences) != 5:
        raise _fail(
            path, line_no,
            f"field {F_STORY} (story) has {len(sentences)} sentences, expected 5 (setting, desire, "
            "action, initial belief, causal event)",
        )
    new, old = field(F_BELIEF_AWARE).rstrip("."), field(F_BELIEF_UNAWARE).rstrip(".")
    if answer_format == "tail":
        prefix, new_opt, old_opt = _split_common_prefix(new, old)
    else:
        prefix, new_opt, old_opt = "", new, old
    if not new_opt or not old_opt or new_opt == old_opt:
        raise _fail(
            path, line_no,
            f"the belief answers (fields {F_BELIEF_AWARE} and {F_BELIEF_UNAWARE}) do not differ "
            f"in a way that gives two options: {new!r} / {old!r}",
        )
    setup = " ".join(sentences[:3])
    m = _QUESTION_NAME.match(field(F_BELIEF_Q))
    candidates = [m.group(1)] if m else []
    candidates.append(re.sub(r"\W+$", "", sentences[0].split()[0]))
    name = next((c for c in candidates if c and _word(c).search(setup)), None)
    if name is None:
        raise _fail(
            path, line_no,
            "cannot find the protagonist's name (from the belief question, field "
            f"{F_BELIEF_Q}, or the story's first word) in the first three story sentences",
        )
    return {
        "line": line_no,
        "sentences": sentences,
        "aware": field(F_AWARE), "unaware": field(F_UNAWARE),
        "question": field(F_BELIEF_Q),
        "random": field(F_RANDOM),
        "random_aware": field(F_RANDOM_AWARE), "random_unaware": field(F_RANDOM_UNAWARE),
        "new": new_opt, "old": old_opt, "prefix": prefix,
        "answer_new": field(F_BELIEF_AWARE), "answer_old": field(F_BELIEF_UNAWARE),
        "options": (new_opt, old_opt),
        "name": name,
        "tag": fields[17] if len(fields) > 17 else "",
    }


def _word(word: str) -> re.Pattern[str]:
    return re.compile(rf"(?<!\w){re.escape(word)}(?!\w)")


_NOT = re.compile(r"(\b(?:does|do|did) )not( )")  # "does not see" -> "does indeed see"


def _split_common_prefix(a: str, b: str) -> tuple[str, str, str]:
    """Split two sentences into their shared leading words and the two differing tails."""
    wa, wb = a.split(), b.split()
    k = 0
    while k < min(len(wa), len(wb)) and wa[k] == wb[k]:
        k += 1
    return " ".join(wa[:k]), " ".join(wa[k:]), " ".join(wb[k:])


def _stimulus(story: dict, condition: str, options: tuple[str, str], initial: bool) -> Stimulus:
    causal, perceives = CONDITIONS[condition]
    setup = story["sentences"][:4] if initial else story["sentences"][:3]
    event = story["sentences"][4] if causal else story["random"]
    key = ("aware" if perceives else "unaware") if causal else ("random_aware" if perceives else "random_unaware")
    percept = story[key]

    text = " ".join(setup) + " "
    event_span = Span(len(text), len(text) + len(event))
    text += event + " "
    contrast = Span(len(text), len(text) + len(percept))
    text += percept + "\n"
    query_start = len(text)
    text += f"Question: {story['question']}\nAnswer:"
    if story["prefix"]:
        text += " " + story["prefix"]
    name_at = _word(story["name"]).search(text)
    if name_at is None:  # _parse_row found it in the first three sentences, which come first
        raise RuntimeError(f"protagonist {story['name']!r} vanished from the prompt text")
    world = story["new"] if causal else story["old"]
    belief = story["new"] if (causal and perceives) else story["old"]
    line = story["line"]
    return Stimulus(
        id=f"bigtom-{line:03d}-{condition}",
        text=text,
        options=options,
        answer=belief,
        family="bigtom",
        task_id=f"bigtom-{line:03d}",
        template_id="forward_belief_initial" if initial else "forward_belief",
        condition=condition,
        reversed=options[0] == story["old"],
        prompt_type="belief",
        world_state=world,
        protagonist_belief=belief,
        reference_state=story["old"],
        spans={
            "protagonist": Span(name_at.start(), name_at.end()),
            "event": event_span,
            "contrast": contrast,
            "query": Span(query_start, len(text)),
        },
        meta={
            "line": line,
            "event": "causal" if causal else "random",
            "perceives_event": perceives,
            "include_initial_belief": initial,
            "answer_prefix": story["prefix"],
            "belief_answer_aware": story["answer_new"],
            "belief_answer_unaware": story["answer_old"],
            "generation_tag": story["tag"],
            "percept": "aligned" if key in story.get("rewritten", ()) else "original",
        },
    )
