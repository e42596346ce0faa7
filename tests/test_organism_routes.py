"""The organism's attention routes: the key each belief question must look at, read from the
stories' role spans, and the losses that supervise the look-ups."""

from __future__ import annotations

import math

import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.organism.routes import NO_TARGET, ROUTES, mover_loss, names_of, route_loss, route_targets
from tomlens.organism.train import OrganismConfig
from tomlens.organism.vocab import build_tokenizer, words
from tomlens.stimuli import generate
from tomlens.stimuli.false_belief import CONTENTS_TEMPLATES
from tomlens.stimuli.lexicon import CUE_POOLS

pytestmark = pytest.mark.unit


# The first words of the generator's telling and looking phrases, and of its templates' leaving shut
_TELLING = {words(p)[0] for p in CUE_POOLS["told"]}
_LOOKING = {words(p)[0] for p in CUE_POOLS["look"]}
_SHUTTING = {words(t["shut"])[0] for t in CONTENTS_TEMPLATES.values()} | {words(t["closed"])[1] for t in CONTENTS_TEMPLATES.values()}
assert not _TELLING & {"tells"} and not _LOOKING & _SHUTTING  # else the verb alone would not decide


def _stories():
    stimuli = [*generate("false-belief-factorial", n=2, seed=0), *generate("unexpected-contents", n=2, seed=0, decoys=True),
               *generate("order-only", n=1, seed=0)]
    tok = build_tokenizer(sorted({w for s in stimuli for w in words(s.text + " " + " ".join(s.options))}))
    return stimuli, tok, route_targets(tok, stimuli, names_of(stimuli))


def _positions(targets, i: int) -> list[int]:
    """Each route's single key token in prompt `i` (-1: none)."""
    out = []
    for on in targets.keys[i]:
        at = on.nonzero().flatten().tolist()
        assert len(at) <= 1
        out.append(at[0] if at else -1)
    return out


def _starts(tok, s) -> list[int]:
    return [a for a, _ in tok(s.text, return_offsets_mapping=True)["offset_mapping"]]


def _tokens(tok, s):
    return tok.convert_ids_to_tokens(tok(s.text)["input_ids"])


def test_each_route_points_at_the_token_that_decides_the_belief() -> None:
    stimuli, tok, targets = _stories()
    cue, told, seen, label, fill = (ROUTES.index(r) for r in ("cue", "told", "seen", "label", "fill"))
    for i, s in enumerate(stimuli):
        pos = _positions(targets, i)
        tokens = _tokens(tok, s)
        if s.family == "unexpected-contents":
            # both candidates at every question: the label's word in the label sentence, the contents where filled
            assert tokens[pos[label]] == s.meta["label"].lower() and tokens[pos[fill]] == s.meta["contents"].lower()
            starts = _starts(tok, s)  # each key lies in its sentence: the label sentence, the filling
            assert s.spans["contrast_label"].start <= starts[pos[label]] < s.spans["contrast_label"].end
            assert starts[pos[fill]] == s.spans["object"].start
            assert pos[label] < pos[told] if s.prompt_type == "belief" else pos[cue] == pos[told] == pos[seen] == -1
        elif s.prompt_type != "belief" or s.family == "order-only":
            assert pos == [-1] * len(ROUTES)
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
            assert tokens[pos[cue] - 1] == s.meta["protagonist"].lower() and pos[told:] == [-1] * (len(ROUTES) - told)
            assert s.spans["cue"].of(s.text).lower().split()[:2] == tokens[pos[cue] - 1:pos[cue] + 1]
        else:
            assert pos[cue] == -1
            # told: the verb of the frame about the protagonist ("As for Sam, Jane then <verb>"), a
            # telling exactly when informed, "tells ... nothing" otherwise
            assert tokens[pos[told] - 4:pos[told] - 2] == [s.meta["protagonist"].lower(), ","]
            assert (tokens[pos[told]] in _TELLING) == (s.condition == "informed")
            assert (tokens[pos[told]:pos[told] + 3] == ["tells", tokens[pos[told] + 1], "nothing"]) == (s.condition != "informed")
            # looked in: the verb of the frame about the labelled container, a looking exactly in the
            # open-container control, leaving it shut otherwise
            assert tokens[pos[seen] - 4:pos[seen] - 2] == [s.meta["container"].lower(), ","]
            assert (tokens[pos[seen]] in _LOOKING) == (s.condition == "open_container")
            assert (tokens[pos[seen]] in _SHUTTING) == (s.condition != "open_container")
            for route in (told, seen):  # both keys lie in the contrast the generator swaps
                span = s.spans["contrast_told" if route == told else "contrast_seen"]
                assert span.start <= _starts(tok, s)[pos[route]] < span.end


def test_without_decoys_the_routes_point_at_the_hearer_and_the_look_verb() -> None:
    stimuli = generate("unexpected-contents", n=2, seed=0, decoys=False)
    tok = build_tokenizer(sorted({w for s in stimuli for w in words(s.text + " " + " ".join(s.options))}))
    targets = route_targets(tok, stimuli, names_of(stimuli))
    told, seen = ROUTES.index("told"), ROUTES.index("seen")
    for i, s in enumerate(stimuli):
        pos, tokens = _positions(targets, i), _tokens(tok, s)
        if s.prompt_type != "belief":
            assert pos[told] == pos[seen] == -1
            continue
        # the hearer: the protagonist when informed, nobody otherwise
        assert tokens[pos[told]] == (s.meta["protagonist"].lower() if s.condition == "informed" else "nobody")
        # the verb after the protagonist's name in the look sentence: a looking only in the open-container control
        assert tokens[pos[seen] - 1] == s.meta["protagonist"].lower()
        assert (tokens[pos[seen]] in _LOOKING) == (s.condition == "open_container")


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


def test_with_echo_containers_a_look_frames_verb_names_its_container() -> None:
    """Both look frames of a decoy contents story name the same person, so the first-person echo
    gives their verbs the same answer; `echo_containers` names the frame's container instead (and
    nothing changes in the factorial's stories or where a person comes first)."""
    stimuli, tok, plain = _stories()
    targets = route_targets(tok, stimuli, names_of(stimuli), echo_containers=True)
    seen = ROUTES.index("seen")
    for i, s in enumerate(stimuli):
        if s.family != "unexpected-contents":
            assert torch.equal(targets.echo[i], plain.echo[i])
            continue
        if s.prompt_type != "belief":
            continue
        verb = _positions(targets, i)[seen]
        assert verb >= 0
        name = tok.convert_ids_to_tokens(int(targets.echo[i, verb]))
        assert name == s.meta["container"].lower() != tok.convert_ids_to_tokens(int(plain.echo[i, verb]))
        told = _positions(targets, i)[ROUTES.index("told")]
        assert targets.echo[i, told] == plain.echo[i, told]  # the telling frames' subject is a person


def test_the_route_loss_is_small_on_the_target_and_large_elsewhere() -> None:
    n, heads, width = 3, 4, 6
    positions = torch.tensor([[2, -1], [4, 1], [-1, -1]])
    keys = torch.zeros(n, 2, width, dtype=torch.bool)
    lengths = torch.tensor([6, 5, 6])
    on = torch.full((n, heads, width, width), 1e-9)
    for i, (a, b) in enumerate(positions.tolist()):
        if a >= 0:
            on[i, 1, lengths[i] - 1, a] = 1.0
            keys[i, 0, a] = True
        if b >= 0:
            on[i, 3, lengths[i] - 1, b] = 1.0
            keys[i, 1, b] = True
    assert float(route_loss(on, (1, 3), keys, lengths)) < 1e-4
    uniform = torch.full((n, heads, width, width), 1 / width)
    assert float(route_loss(uniform, (1, 3), keys, lengths)) == pytest.approx(2 * math.log(6), abs=1e-3)
    keys[0, 0, 3] = True  # two keys: their attention adds up (2 of 6 under uniform)
    want = -((math.log(2 / 6) + math.log(1 / 6)) / 2 + math.log(1 / 6))
    assert float(route_loss(uniform, (1, 3), keys, lengths)) == pytest.approx(want, abs=1e-3)
    on = torch.tensor([[1, 0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    # the mover: the attention on all its targets counts (2 and 3 of 6 under uniform); a row without one is left out
    want = -(math.log(2 / 6) + math.log(3 / 6)) / 2
    assert float(mover_loss(uniform, 2, on, lengths)) == pytest.approx(want, abs=1e-4)
    assert float(mover_loss(uniform[2:], 2, on[2:], lengths[2:])) == 0.0


def test_the_cue_route_reads_order_only_leaving_where_asked() -> None:
    stimuli, tok, default = _stories()
    both = route_targets(tok, stimuli, names_of(stimuli), cue_families=("order-only", "false-belief-factorial"))
    cue = ROUTES.index("cue")
    for i, s in enumerate(stimuli):
        if s.family != "order-only":
            assert torch.equal(both.keys[i], default.keys[i])
            continue
        assert not default.keys[i, cue].any()
        if s.prompt_type != "belief":
            assert not both.keys[i, cue].any()
            continue
        # the word after the protagonist's name in the sentence where they leave: read after the move or not
        tokens, at = _tokens(tok, s), _positions(both, i)[cue]
        assert tokens[at - 1] == s.meta["protagonist"].lower()
        assert " ".join(tokens[at - 1:at + 1]) == " ".join(s.spans["cue"].of(s.text).lower().split()[:2])


def test_the_mover_serves_only_its_families() -> None:
    stimuli, tok, both = _stories()
    factorial = route_targets(tok, stimuli, names_of(stimuli), mover_families=("false-belief-factorial",))
    for i, s in enumerate(stimuli):
        want = both.mover[i] if s.family == "false-belief-factorial" else torch.zeros_like(both.mover[i])
        assert torch.equal(factorial.mover[i], want)
    assert factorial.mover.any() and torch.equal(factorial.keys, both.keys)


def test_the_cue_sentence_option_keys_the_whole_cue_after_the_name() -> None:
    stimuli, tok, word = _stories()
    sentence = route_targets(tok, stimuli, names_of(stimuli), cue_sentence=True)
    cue = ROUTES.index("cue")
    for i, s in enumerate(stimuli):
        if s.family != "false-belief-factorial" or s.prompt_type != "belief":
            assert torch.equal(sentence.keys[i], word.keys[i])
            continue
        at = sentence.keys[i, cue].nonzero().flatten().tolist()
        tokens = _tokens(tok, s)
        assert at[0] == _positions(word, i)[cue] and at == list(range(at[0], at[-1] + 1))
        # every word of the cue sentence after the name (its full stop included)
        assert " ".join(tokens[at[0] - 1:at[-1] + 1]) == " ".join(words(s.spans["cue"].of(s.text)))


def test_route_heads_the_model_lacks_or_that_collide_are_refused() -> None:
    on = {"routes": 1.0, "echo": 1.0}
    with pytest.raises(TomlensError, match="one integer head per route"):
        OrganismConfig(route_heads=(1, 2, 3), **on)
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
        OrganismConfig(route_heads=(1, 0, 3, 4, 5), **on)  # (2, 0) is the interchange head
    OrganismConfig(route_heads=(0, 2, 3, 4, 5), **on)  # the cue head may be the interchange head
    with pytest.raises(TomlensError, match="not all different"):
        OrganismConfig(mover_head=(2, 1), **on)
    for layer in (0, 5):  # 5: the state after the final norm, not a layer's input
        with pytest.raises(TomlensError, match="echo_layer"):
            OrganismConfig(echo_layer=layer, **on)
    for mix in ({"bigtom": 1.0}, {"order-only": float("inf")}, {"order-only": 0.0}):
        with pytest.raises(TomlensError, match="family_mix"):
            OrganismConfig(family_mix=mix)
    for families in ((), ("order-only",)):
        with pytest.raises(TomlensError, match="mover_families"):
            OrganismConfig(mover_families=families, **on)
    with pytest.raises(TomlensError, match="cue_families"):
        OrganismConfig(cue_families=("unexpected-contents",), **on)
    for layer in (0, 5, 2.0):
        with pytest.raises(TomlensError, match="belief_layer"):
            OrganismConfig(belief_readout=1.0, belief_layer=layer)
    with pytest.raises(TomlensError, match="cue_sentence"):
        OrganismConfig(cue_sentence="False", **on)  # text from the command line is not a switch
    OrganismConfig(routes=0.0, route_heads=(1,))  # routes off: their heads are not checked

