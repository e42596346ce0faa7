"""The shipped model organism: it loads offline by name, its model card's accuracies hold on fresh
held-out stories, and the methods find on it what its random twin does not have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tomlens.behaviour import score
from tomlens.models import load_model, provenance
from tomlens.models.organism import ORGANISM_NAME, organism_dir
from tomlens.organism.card import RECORD, meets_target
from tomlens.organism.data import held_out_stories
from tomlens.organism.train import ACCURACY_TARGET
from tomlens.runs.validate import CHECKS, ValidationResult, fast_config


def test_the_organism_loads_offline_and_its_twin_has_its_shape_but_not_its_weights() -> None:
    model = load_model(ORGANISM_NAME)
    prov = provenance(model)
    assert prov["source"] == "organism" and prov["revision"].startswith("sha256:")
    twin = load_model(f"random:{ORGANISM_NAME}")
    tprov = provenance(twin)
    assert tprov["base"] == ORGANISM_NAME and tprov["n_layers"] == prov["n_layers"]
    assert tprov["n_heads"] == prov["n_heads"] and tprov["d_vocab"] == prov["d_vocab"]
    w, tw = (next(m.parameters()) for m in (model, twin))
    assert w.shape == tw.shape and not torch.equal(w, tw)


def test_fresh_held_out_stories_confirm_the_model_card() -> None:
    """Held-out tasks drawn anew (other generator seeds than the card's test split, the same held-out
    keys, every word in the vocabulary): the cells the card says reach the target reach it here too,
    and those it says do not, do not. Four generator seeds, pooled: errors cluster in a few held-out
    template combinations, so one seed's 4 to 160 prompts of a cell swing by several points (0.91 to
    1.00 over ten seeds; pooled, the lowest cell, factorial true belief, 0.983 of 1320)."""
    import pandas as pd

    record = json.loads((organism_dir() / RECORD).read_text())
    cfg = record["config"]
    model = load_model(ORGANISM_NAME)
    vocab = set(model.tokenizer.get_vocab())
    options = {"unexpected-contents": {"decoys": cfg["contents_decoys"]}}
    frames = []
    for generator_seed in (9000, 9100, 9200, 9300):
        stories, _ = held_out_stories({"order-only": 150, "false-belief-factorial": 200, "unexpected-contents": 150},
                                      vocab, share=cfg["held_out_share"], seed=cfg["seed"], options=options,
                                      generator_seed=generator_seed)
        scored = score(model, stories, batch_size=64, progress=False)
        scored["cell"] = [f"{s.family}/{s.condition}/{s.prompt_type}" for s in stories]
        scored["story"] = [s.text for s in stories]
        frames.append(scored)
    scored = pd.concat(frames).drop_duplicates("story")  # a story two seeds both drew counts once
    accuracy = scored.groupby("cell")["correct"].mean()
    card = record["test_accuracy"]
    assert set(accuracy.index) == set(card)
    for cell, value in accuracy.items():  # the card's verdict per cell holds on fresh stories
        if card[cell] >= ACCURACY_TARGET:
            assert value >= ACCURACY_TARGET - 0.03, (cell, value)  # a smaller sample than the card's
        elif card[cell] <= ACCURACY_TARGET - 0.1:  # clearly under: stays under
            assert value < ACCURACY_TARGET, (cell, value)
        else:  # just under the target on the card's sample: the same within sampling error
            assert abs(value - card[cell]) <= 0.1, (cell, value, card[cell])
    # The card's own split: the positive control's family answers every held-out question and every cell
    # meets the target, so the card says so and train-organism exits 0 on the default recipe. (Seed 0 of the
    # same recipe left contents false belief one prompt under it, 122 of 126; the default seed is 1.)
    assert all(v == 1.0 for k, v in card.items() if k.startswith("order-only/")), card
    assert min(card.values()) >= ACCURACY_TARGET and meets_target(record), card


def _validate(name: str, tmp_path: Path) -> ValidationResult:
    from tomlens.runs.validate import run

    # 48 tasks: a probe needs rows; steering at the middle depths only (layers 1 to 3: every layer
    # triples the steering passes; the full run's steering picks layer 2) and 20 random head sets
    # keep it fast
    result = run(fast_config(name, n_tasks=48, store=str(tmp_path / "store"), steering_depths=(0.25, 0.5, 0.75),
                             n_random_heads=20), progress=False)
    result.save(tmp_path / name.replace(":", "_"))
    return result


def test_the_checks_find_belief_where_training_put_it_on_the_organism_and_nothing_on_its_twin(tmp_path: Path) -> None:
    """The positive and the negative control (fast settings, 48 tasks): on the organism every check
    passes, and the ranking names first the head that interchange training put the belief variable
    in (its training record), so the methods find belief where it is known to be, not just
    somewhere. The twin passes none."""
    organism = _validate(ORGANISM_NAME, tmp_path).table.set_index("check")
    twin = _validate(f"random:{ORGANISM_NAME}", tmp_path).table.set_index("check")
    assert list(organism.index) == list(CHECKS) == list(twin.index)
    assert not twin["passed"].any()
    assert organism["passed"].all(), organism[["value", "null", "detail"]].to_dict(orient="index")
    layer, head = json.loads((organism_dir() / RECORD).read_text())["config"]["interchange_head"]
    assert f"L{layer}H{head};" in organism.loc["topk_recovery", "detail"]  # ranked first
    assert organism.loc["probe", "value"] > twin.loc["probe", "value"] + 0.3


# Seeds a new user might pick: the 4242, which failed steering under the old rule (its most-flipping random
# direction of 20 flipped 0.125 > 0.10), and the first small ones after 0 (the test above). On an earlier organism,
# with the command's defaults on 13 seeds (0-5, 7, 42, 123, 2024, 4242, 31337, 99991) the old rule failed steering on
# 4 (2, 123, 4242, 99991) and the new one on none; on this organism every check passes on all 13 (2026-11-28). Seed 5
# failed attribution (Spearman 0.786 < 0.8 over its 8 active heads)
# while integrated gradients moved every differing token for a head at the final token: layer-0 heads L0H3 and L0H5
# got 0.15 and 0.24 of the gap, exact patching 0.01 each. Moving the final token alone, as patching it does, it passes.
SEEDS = (1, 2, 3, 4, 5, 4242)


@pytest.mark.acceptance
@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_every_check_passes_on_the_organism_and_fails_on_its_twin_whatever_the_seed(seed: int, tmp_path: Path) -> None:
    """The positive control holds on any seed a user picks, and the negative one fails on it: the
    seed draws the stories, the selection and evaluation halves and every random control. Steering
    is judged on its random directions' mean and 95th percentile, which do not grow with how many are
    drawn (their maximum does, and failed --seed 4242 with the belief direction flipping every
    answer). The sizes are `tomlens validate`'s but for fewer permutations and random head sets
    (each check's null is a mean over them, or a max-statistic over units judged by its p-value) and
    steering at layers 1 and 2 (the answer takes the belief only from layer 2's planted head at the
    final token, so layers 0 and 1 flip nothing and the full run chooses layer 2; its other three
    layers would more than double the steering passes)."""
    from tomlens.runs.validate import run

    def validate(name: str) -> ValidationResult:
        return run(fast_config(name, n_tasks=48, seed=seed, store=str(tmp_path / "store"), steering_layers=(1, 2),
                               n_random_heads=20), progress=False)

    organism = validate(ORGANISM_NAME).table.set_index("check")
    assert list(organism.index) == list(CHECKS)
    failed = organism.loc[~organism["passed"], ["value", "null", "detail"]]
    assert organism["passed"].all(), failed.to_dict(orient="index")
    twin = validate(f"random:{ORGANISM_NAME}").table.set_index("check")
    assert not twin["passed"].any(), twin.loc[twin["passed"], ["value", "null", "detail"]].to_dict(orient="index")


def test_integrated_gradients_at_the_final_token_share_out_what_its_layer_does_there() -> None:
    """Completeness, per layer: along the sites, a layer's heads at the final token move together
    at that token alone, so their estimates add up to patching all of them there (up to the 32-step
    sum's error), in padded groups of order-only pairs. The path used to move every differing token,
    and on an earlier organism layer 0's heads then added up to 0.38 of the gap against 0.06 patched together at the final
    token (seed 5; two of them 0.15 and 0.24, each 0.01 patched alone), which failed validation. With
    8 steps the saturated planted head overshoots: layer 2 sums to 1.10 against 0.996 here."""
    from tomlens.patching.attribution import attribution_patching
    from tomlens.patching.heads import HeadSetSweep
    from tomlens.patching.metric import summarise
    from tomlens.patching.pairs import prepare_pairs
    from tomlens.stimuli.pairs import make_pairs

    model = load_model(ORGANISM_NAME)
    pairs, _ = make_pairs("order-only", n=24, seed=5, tokenizer=model.tokenizer)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    layers = HeadSetSweep(model, prepare_pairs(model, pairs, selectors=("final",)),
                          [[(layer, h) for h in range(n_heads)] for layer in range(n_layers)], position="final")
    layers.run(progress=False)
    joint = summarise(*layers.values()).mean
    got = attribution_patching(model, pairs, sites="heads", positions=("final",), steps=32, progress=False)
    heads = got.select("head", "final").groupby("layer")["effect"].sum()
    for layer in range(n_layers):
        assert abs(heads[layer] - float(joint[layer])) < 0.1, (layer, heads.to_dict(), joint.tolist())


def test_the_belief_reaches_the_answer_through_the_planted_head_and_no_earlier_one_at_the_final_token() -> None:
    """The planted head is where the belief enters the answer, not a relay: patched from the false-belief
    story at the final token it restores the gap alone, and every head of the layers before it,
    patched there together, restores next to nothing (a retrain without the upstream-invariance
    loss formed the belief in L1H6, which restored 0.97 alone, and L2H0 only passed it on)."""
    from tomlens.patching.heads import HeadSetSweep
    from tomlens.patching.metric import summarise
    from tomlens.patching.pairs import prepare_pairs
    from tomlens.stimuli.pairs import make_pairs

    model = load_model(ORGANISM_NAME)
    layer, head = json.loads((organism_dir() / RECORD).read_text())["config"]["interchange_head"]
    pairs, _ = make_pairs("order-only", n=24, seed=11, tokenizer=model.tokenizer)
    upstream = [(lay, h) for lay in range(layer) for h in range(model.cfg.n_heads)]
    sweep = HeadSetSweep(model, prepare_pairs(model, pairs, selectors=("final",)), [[(layer, head)], upstream],
                         position="final")
    sweep.run(progress=False)
    planted, before = (float(v) for v in summarise(*sweep.values()).mean)
    assert planted > 0.9 and abs(before) < 0.1, (planted, before)


def test_attribution_along_each_head_finds_the_planted_head_where_plain_attribution_misses_it() -> None:
    """Plain attribution misses the head the belief is planted in, which exact patching ranks first:
    it reads a saturated slope at the base run, so its estimate for the head is near zero (or of the
    wrong sign) where patching the head restores the whole gap. Integrating along each layer's head
    outputs in turn (the blocks after them recomputed, as patching a head does) ranks it first, within
    0.1 of exact patching once the sum has converged, and agrees with exact patching on the top 2. The
    planted head saturates the answer, so the 8-step sum overshoots it (1.34 here, 1.08 at 16 steps,
    0.98 at 32 and 64, exact 0.99); it still ranks it first. (Integrating along the token embeddings
    shares a chain's effect out between its heads: on an earlier organism, whose planted head fed two
    strong readers, it put the planted head third; on this one it ranks it first on validate's pairs,
    0.43 against its reader L3H5's 0.34.)"""
    from tomlens.patching import exact_patching
    from tomlens.patching.attribution import attribution_patching
    from tomlens.runs import pairs
    from tomlens.runs.base import ModelSpec

    model = load_model(ORGANISM_NAME)
    built = pairs.run(pairs.PairsConfig(model=ModelSpec(ORGANISM_NAME), family="order-only", n=24, seed=0),
                      model=model, progress=False).pairs
    planted = tuple(json.loads((organism_dir() / RECORD).read_text())["config"]["interchange_head"])

    def heads(result):
        t = result.select("head", "final").sort_values("effect", key=abs, ascending=False, kind="stable")
        return {(int(r.layer), int(r.head)): float(r.effect) for r in t.itertuples()}

    def attribution(**kw):
        return heads(attribution_patching(model, built, sites=("heads",), positions=("final",), progress=False, **kw))

    exact = heads(exact_patching(model, built, sites=("heads",), positions=("final",), progress=False))
    assert next(iter(exact)) == planted and exact[planted] > 0.9
    plain = attribution()
    assert abs(plain[planted] - exact[planted]) > 0.5, plain[planted]  # the slope at the base run
    assert next(iter(attribution(steps=8, path="sites"))) == planted
    sites = attribution(steps=32, path="sites")
    assert next(iter(sites)) == planted and abs(sites[planted] - exact[planted]) < 0.1, sites[planted]
    assert set(list(sites)[:2]) == set(list(exact)[:2])


def test_the_training_defaults_are_the_shipped_organism_s_settings() -> None:
    """`tomlens train-organism` with no settings reproduces the shipped weights: its training.json
    records every setting there is, each with its default value."""
    from dataclasses import asdict

    from tomlens.organism.train import OrganismConfig

    record = json.loads((organism_dir() / RECORD).read_text())
    defaults = json.loads(json.dumps(asdict(OrganismConfig())))  # tuples as lists, as in the record
    assert set(defaults) == set(record["config"])
    for key, value in record["config"].items():
        assert json.dumps(defaults[key]) == json.dumps(value), key  # 1 == 1.0 == True would pass ==
