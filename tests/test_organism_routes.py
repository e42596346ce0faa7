"""The organism's attention routes: the key each belief question must look at, read from the
stories' role spans, and the losses that supervise the look-ups."""

from __future__ import annotations

import math

import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.organism.routes import ROUTES, NO_TARGET, mover_loss, names_of, route_loss, route_targets
from tomlens.organism.train import OrganismConfig
from tomlens.organism.vocab import build_tokenizer, words
from tomlens.stimuli import generate

pytestmark = pytest.mark.unit


def _stories():
    stimuli = [*generate("false-belief-factorial", n=2, seed=0), *generate("unexpected-contents", n=2, seed=0, decoys=True),
               *generate("order-only", n=1, seed=0)]
    tok = build_tokenizer(sorted({w for s in stimuli for w in words(s.text + " " + " ".join(s.options))}))
    return stimuli, tok, route_targets(tok, stimuli, names_of(stimuli))


def _tokens(tok, s):
    return tok.convert_ids_to_tokens(tok(s.text)["input_ids"])


def test_each_route_points_at_the_token_that_decides_the_belief() -> None:
    stimuli, tok, targets = _stories()
    cue, told, seen = (ROUTES.index(r) for r in ("cue", "told", "seen"))
    for i, s in enumerate(stimuli):
        pos = targets.positions[i].tolist()
        tokens = _tokens(tok, s)
        if s.prompt_type != "belief" or s.family == "order-only":
            assert pos == [-1, -1, -1]
        tokens_on = [tokens[j] for j in targets.mover[i].nonzero().flatten().tolist()]
        if s.family == "order-only":
            assert not tokens_on
            continue
        # the mover looks at every mention of the answer's word
        assert set(tokens_on) == {s.answer.lower()} and len(tokens_on) == tokens.count(s.answer.lower())
        if s.prompt_type != "belief":
            continue
        if s.family == "false-belief-factorial":
            # the word after the protagonist's name in their cue sentence: absence in a false belief,
            # presence in a true one
            assert tokens[pos[cue] - 1] == s.meta["protagonist"].lower() and pos[told] == pos[seen] == -1
            assert s.spans["cue"].of(s.text).lower().split()[:2] == tokens[pos[cue] - 1:pos[cue] + 1]
        else:
            assert pos[cue] == -1 and tokens[pos[told]] == s.meta["protagonist"].lower()
            assert tokens[pos[seen]] == s.meta["container"].lower()
            # told: the protagonist named after "but not" exactly when not told
            assert (tokens[pos[told] - 1] == "not") == (s.condition != "informed")
            # looked in: the container named after "not the" exactly when the protagonist looked elsewhere
            assert (tokens[pos[seen] - 2] == "not") == (s.condition != "open_container")


def test_the_echo_names_the_first_person_of_each_sentence() -> None:
    stimuli, tok, targets = _stories()
    only = next(i for i, x in enumerate(stimuli) if x.family == "order-only")
    assert (targets.echo[only] == NO_TARGET).all()  # not on order-only stories (the interchange's)
    for kind, want in (("belief", "protagonist"), ("reality", None)):  # "The OBJ is now in the" names no one
        s = next(x for x in stimuli if x.family == "false-belief-factorial" and x.prompt_type == kind)
        i = stimuli.index(s)
        tokens = _tokens(tok, s)
        echo = [tok.convert_ids_to_tokens(t) if t != NO_TARGET else None for t in targets.echo[i, : len(tokens)].tolist()]
        assert echo[0] is None and s.meta["protagonist"].lower() in echo  # BOS: no sentence has named anyone yet
        question = len(tokens) - 1 - tokens[::-1].index(".")  # the last full stop: the question follows
        assert set(echo[question + 1:]) == {s.meta[want].lower() if want else None}
        assert (targets.echo[i, len(tokens):] == NO_TARGET).all()


def test_the_route_loss_is_small_on_the_target_and_large_elsewhere() -> None:
    n, heads, width = 3, 4, 6
    positions = torch.tensor([[2, -1], [4, 1], [-1, -1]])
    lengths = torch.tensor([6, 5, 6])
    on = torch.full((n, heads, width, width), 1e-9)
    for i, (a, b) in enumerate(positions.tolist()):
        if a >= 0:
            on[i, 1, lengths[i] - 1, a] = 1.0
        if b >= 0:
            on[i, 3, lengths[i] - 1, b] = 1.0
    assert float(route_loss(on, (1, 3), positions, lengths)) < 1e-4
    uniform = torch.full((n, heads, width, width), 1 / width)
    assert float(route_loss(uniform, (1, 3), positions, lengths)) == pytest.approx(2 * math.log(6), abs=1e-3)
    on = torch.tensor([[1, 0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    # the mover: the attention on all its targets counts (2 and 3 of 6 under uniform); a row without one is left out
    want = -(math.log(2 / 6) + math.log(3 / 6)) / 2
    assert float(mover_loss(uniform, 2, on, lengths)) == pytest.approx(want, abs=1e-4)
    assert float(mover_loss(uniform[2:], 2, on[2:], lengths[2:])) == 0.0


def test_route_heads_the_model_lacks_or_that_collide_are_refused() -> None:
    on = {"routes": 1.0, "echo": 1.0}
    with pytest.raises(TomlensError, match="one integer head per route"):
        OrganismConfig(route_heads=(1, 2), **on)
    with pytest.raises(TomlensError, match="cue route head L7H1 is not in a model"):
        OrganismConfig(route_layer=7, **on)
    with pytest.raises(TomlensError, match="mover_head"):
        OrganismConfig(mover_head=(3,), **on)
    with pytest.raises(TomlensError, match="route_heads"):
        OrganismConfig(route_heads=1, **on)
    with pytest.raises(TomlensError, match="at least 2"):
        OrganismConfig(later_interchange_batch=1)  # the knockout's mean over one source is that source
    with pytest.raises(TomlensError, match="curriculum_until_swap"):
        OrganismConfig(curriculum_until_swap=True, interchange=0.0)
    with pytest.raises(TomlensError, match="not all different"):
        OrganismConfig(route_heads=(0, 2, 3), **on)  # (2, 0) is the interchange head
    with pytest.raises(TomlensError, match="not all different"):
        OrganismConfig(mover_head=(2, 1), **on)
    for layer in (0, 5):  # 5: the state after the final norm, not a layer's input
        with pytest.raises(TomlensError, match="echo_layer"):
            OrganismConfig(echo_layer=layer, **on)
    for mix in ({"bigtom": 1.0}, {"order-only": float("inf")}, {"order-only": 0.0}):
        with pytest.raises(TomlensError, match="family_mix"):
            OrganismConfig(family_mix=mix)
    OrganismConfig(routes=0.0, route_heads=(1,))  # routes off: their heads are not checked
