"""What a cache call pays besides its forwards: on a GPU these were most of the gap between caching
and a plain forward (256 prompts: a record's `to_dict` took a millisecond and ran twice per prompt,
and every prompt was tokenized twice). Counted here, never timed."""

from __future__ import annotations

import json
from collections import OrderedDict, namedtuple
from dataclasses import asdict
from typing import Any

import pytest

from tomlens.activations.cache import cache_activations
from tomlens.stimuli import FAMILIES, Span, Stimulus, generate


def _asdict_form(s: Stimulus) -> dict[str, Any]:
    """The record as `dataclasses.asdict` wrote it before: the hashes of stored caches depend on it."""
    d = asdict(s)
    d["options"] = list(s.options)
    d["spans"] = {k: [v.start, v.end] for k, v in s.spans.items()}
    d["belief_differs"] = s.belief_differs
    d.pop("mentions")
    if s.mentions:
        d["mentions"] = {k: [[v.start, v.end] for v in ms] for k, ms in s.mentions.items()}
    return d


@pytest.mark.unit
def test_a_records_dict_is_the_one_asdict_made_for_every_family() -> None:
    for family in FAMILIES:
        for s in generate(family, n=2, seed=5):
            d, want = s.to_dict(), _asdict_form(s)
            assert json.dumps(d) == json.dumps(want), family  # same keys, same order, same values
            d["meta"]["changed"] = True
            assert "changed" not in s.meta  # a copy, as asdict's was


@pytest.mark.unit
def test_a_records_dict_copies_meta_all_the_way_down() -> None:
    base = generate("order-only", n=1, seed=0)[0]
    s = base.with_(meta={"nested": {"list": [1, {"x": (2, 3)}]}, "tuple": (4, [5]), "span": Span(1, 2)})
    d = s.to_dict()
    assert d == _asdict_form(s) and d["meta"]["span"] == {"start": 1, "end": 2}
    json.dumps(d)  # a dataclass in meta becomes a dict, as asdict made it: the record still hashes
    d["meta"]["nested"]["list"][1]["x"] = None
    d["meta"]["tuple"][1].append(6)
    assert s.meta == {"nested": {"list": [1, {"x": (2, 3)}]}, "tuple": (4, [5]), "span": Span(1, 2)}


@pytest.mark.unit
def test_a_records_dict_copies_other_containers_as_asdict_did() -> None:
    """A dict subclass or a namedtuple holding a dataclass: `asdict` rebuilt both and turned the
    dataclass into a dict; so must `to_dict`, or the record would not be JSON (its hash) at all."""
    Pair = namedtuple("Pair", "left right")
    s = generate("order-only", n=1, seed=0)[0].with_(
        meta={"ordered": OrderedDict(span=Span(1, 2)), "pair": Pair(Span(3, 4), [5])})
    d = s.to_dict()
    assert d == _asdict_form(s) and json.dumps(d) == json.dumps(_asdict_form(s))
    assert d["meta"]["ordered"]["span"] == {"start": 1, "end": 2} and d["meta"]["pair"].right == [5]


@pytest.mark.integration
def test_a_cache_call_tokenizes_every_prompt_once(load_tiny: Any, tmp_path: Any, monkeypatch: Any) -> None:
    model = load_tiny("tiny-llama")
    stimuli = generate("order-only", n=4, seed=3)
    batches: list[int] = []  # prompts per tokenizer call on a list (a one-string call probes the BOS rule)
    tokenizer_type = type(model.tokenizer)
    original = tokenizer_type.__call__

    def counting(self: Any, text: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(text, str):
            batches.append(len(text))
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_type, "__call__", counting)
    acts = cache_activations(model, stimuli, "resid_post", ["final", "protagonist"], store=tmp_path,
                             batch_size=4, progress=False)
    monkeypatch.undo()
    assert not acts.reused and acts.get("resid_post", "final").shape[0] == len(stimuli)
    assert batches == [len(stimuli)]  # once, all together, when the rows are sorted by length
