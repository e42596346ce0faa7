"""Host syncs of attribution patching, the AtP* search and steering, counted on the CPU
(tests/syncs.py): none per pair, group, layer, hook, head, cell, GradDrop block, direction, alpha,
prompt or batch. On a GPU each one drains the queue.

Before this change (these modules as at main 51b5ae2), the cases below made: attribution 10 at 2
layers and 22 at 6 (one `.cpu()` per hook, the metrics per group, a scalar read per group), 28 and 64
with the three pairs in three groups, the same along either integrated-gradient path; AtP* 30 / 178
(88 / 532 in three groups: a copy per hook and GradDrop block, a score check per layer); the search
37 / 149 (93 / 429); dose-response 392 at 2 layers and 1172 at 6 (a read per direction, alpha and
condition, a copy per forward), up to 1260 in batches of 3; fitting directions 58 / 64 / 158 / 176 (a
read per direction built); the whole stage 738 / 752 / 2182 / 2216 (2 and 6 layers, 8 and 16 tasks).
A steered forward counted none then either, but each of its hooks copied its vectors and doses from
the host, a blocking copy per forward on a GPU (`test_steering_hooks_put_...` fails there).

What is left per call is a fixed handful, itemised at each bound; most of it reads host tensors
(answer tokens, labels, split indices), which a CUDA run does not wait on."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import short_pairs
from syncs import assert_same_and_small, count_of, tiny_with_layers
from torch.utils._python_dispatch import TorchDispatchMode

from tomlens.errors import TomlensError
from tomlens.hooks.attention import score_error
from tomlens.models.tokens import encode
from tomlens.patching.attribution import attribution_patching
from tomlens.patching.exact import exact_patching
from tomlens.patching.search import _raise_on_bad_scores, atp_star, search
from tomlens.runs.base import StimuliSpec
from tomlens.runs.steering import SteeringConfig, run
from tomlens.steering import (
    Direction,
    dose_response,
    fit_directions,
    paired_sources,
    random_directions,
    steering,
    steering_hooks,
)
from tomlens.stimuli import generate

pytestmark = pytest.mark.integration

# attribution_patching (plain, and integrated gradients along the sites or the embeddings): the one
# copy of the cell table (cells x pairs, with the base and source metrics) to the host (1), and
# prepare_pairs reading the answer tokens, a host tensor, into Python once (1).
ATTRIBUTION_BOUND = 2
# atp_star: prepare_pairs' read (1), the one copy of every group's estimate table (1), the query/key
# fix's score checks read from that host table as Python floats (1).
ATP_STAR_BOUND = 3
# search (GradDrop on, one round: the budget holds the top k of each kind only): atp_star's 3, the
# estimates and the GradDrop estimates normalised, as numpy (2), and per verification call (the rule's
# cells, then the false-negative samples) one copy of every group's patched metrics (1) and their
# normalised effects as numpy (1): 3 + 2 + 2 * 2.
SEARCH_BOUND = 9
# steering: one finiteness check of every direction when the hooks are made (1); nothing per forward.
STEERED_FORWARD_BOUND = 1
# dose_response: the options' first tokens read once (1), the directions' finiteness check (1), and
# every run's logit difference and choice moved to the host once (`.cpu()` and `.numpy()`, 2).
DOSE_BOUND = 4
# fit_directions: make_target's "any row labelled" (1), its keep mask and labels as Python (2), the
# balanced shuffle's labels in and out (2), every layer's direction length and shuffled-labels check
# in one read (1), the finiteness check of every direction (1); the activation cache's own: the shard
# written (2), the store's and the set's checks (4).
FIT_BOUND = 13
# the steering stage: the task groups and split (4, host), fitting (13), the belief norms in one
# read (1), two dose-responses (selection and evaluation, 4 each).
STAGE_BOUND = 26


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """tiny-llama at 2 and 6 layers, warmed up: exact patching checks its shared-prefix shortcuts
    once per model (one scalar read, never again), which a count per call must not see; after it,
    integrated gradients along the sites take their shortcut too."""
    out = {}
    for n_layers in (2, 6):
        model = tiny_with_layers("tiny-llama", n_layers, tmp_path_factory.mktemp(f"llama{n_layers}"))
        exact_patching(model, short_pairs(model.tokenizer, 1), positions=("all",), layers=[n_layers - 1], progress=False)
        out[n_layers] = model
    return out


# (pairs, pairs per group): one pair, three in one group, three in groups of one
PAIRINGS = ((1, 8), (3, 8), (3, 1))
ATTRIBUTION = {
    "plain": {},
    "integrated gradients along the sites": {"steps": 3, "path": "sites"},
    "integrated gradients along the embeddings": {"steps": 3, "path": "embeddings"},
}


@pytest.mark.parametrize("method", list(ATTRIBUTION))
def test_attribution_makes_the_same_few_syncs_whatever_the_pairs_and_depth(models: dict[int, Any],
                                                                           method: str) -> None:
    counts = {}
    for n_layers, model in models.items():
        for n, per_group in PAIRINGS:
            pairs = short_pairs(model.tokenizer, n)
            counts[(n_layers, n, per_group)] = count_of(lambda: attribution_patching(
                model, pairs, sites={"heads": ("all", "final"), "resid": ("each",), "mlp": ("all",)},
                batch_pairs=per_group, progress=False, **ATTRIBUTION[method]))
    assert_same_and_small(counts, ATTRIBUTION_BOUND)


def test_atp_star_estimates_make_the_same_few_syncs_whatever_the_pairs_and_depth(models: dict[int, Any]) -> None:
    counts = {}
    for n_layers, model in models.items():
        for n, per_group in PAIRINGS:
            pairs = short_pairs(model.tokenizer, n)
            counts[(n_layers, n, per_group)] = count_of(lambda: atp_star(
                model, pairs, sites=("heads", "q", "k", "resid"), graddrop=True, batch_pairs=per_group,
                progress=False))
    assert_same_and_small(counts, ATP_STAR_BOUND)


def test_search_makes_the_same_few_syncs_whatever_the_pairs_and_depth(models: dict[int, Any]) -> None:
    """Each verification round is an exact patching pass of its own, so rounds are held to one (a
    budget of the top k per kind and position) for counts that compare."""
    counts = {}
    for n_layers, model in models.items():
        for n, per_group in PAIRINGS:
            pairs = short_pairs(model.tokenizer, n)

            def go() -> None:
                res = search(model, pairs, sites=("heads", "q", "k"), k=2, budget=6, fn_samples=2, graddrop=True,
                             batch_pairs=per_group, progress=False)
                assert res.settings["rounds"] == 1 and res.verified_as.count("sample") == 6

            counts[(n_layers, n, per_group)] = count_of(go)
    assert_same_and_small(counts, SEARCH_BOUND)


def test_the_search_still_refuses_scores_it_cannot_rebuild() -> None:
    """The query/key fix's check is read with the estimates, after every layer ran: the same
    refusal, naming the first layer whose scores are off."""
    scores = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    scores[..., 0, 1:] = torch.finfo(torch.float32).min  # masked entries: never compared
    good = float(score_error(scores.clone(), scores))
    bad = float(score_error(scores + 1e-2, scores))
    assert good == 0.0 and bad > 1
    _raise_on_bad_scores({0: [good, good], 3: [good]})
    with pytest.raises(TomlensError, match="layer 2"):
        _raise_on_bad_scores({0: [good], 2: [good, bad], 5: [bad]})
    with pytest.raises(TomlensError, match="layer 1"):
        _raise_on_bad_scores({1: [float("nan")]})


# ---- steering ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stimuli() -> list[Any]:
    return generate("order-only", n=8, seed=0)


def _directions(model: Any) -> list[Direction]:
    """A direction at every layer, and three random ones of its norm beside it."""
    out = []
    for layer in range(model.cfg.n_layers):
        vec = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(layer))
        belief = Direction("belief", "mean_difference", layer, vec)
        out += [belief, *random_directions(belief, 3)]
    return out


STEERINGS = {
    "add at the final token": {"mode": "add"},
    "project out everywhere": {"mode": "project_out", "positions": "all"},
    "patch the component": {"mode": "patch"},
}


@pytest.mark.parametrize("how", list(STEERINGS))
def test_a_steered_forward_makes_no_sync_whatever_the_batch_and_depth(models: dict[int, Any], stimuli: list[Any],
                                                                     how: str) -> None:
    counts = {}
    for n_layers, model in models.items():
        dirs = _directions(model)
        for n in (8, 16):
            batch = encode(model, [s.text for s in stimuli[:n]])
            kw = dict(STEERINGS[how])
            if kw["mode"] == "patch":
                kw["source"] = {layer: torch.randn(n, model.cfg.d_model) for layer in range(n_layers)}

            def go() -> None:
                with torch.inference_mode(), steering(model, dirs, 2.0, **kw):
                    model(batch.input_ids, **batch.forward_kwargs())

            counts[(n_layers, n)] = count_of(go)
    assert_same_and_small(counts, STEERED_FORWARD_BOUND)


class _CrossDeviceCopies(TorchDispatchMode):
    """Counts copies between devices (on a GPU, a host tensor copied in a hook blocks every forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten._to_copy:
            dst = kwargs.get("device")
            self.n += dst is not None and torch.device(dst) != args[0].device
        elif func.overloadpacket is torch.ops.aten.copy_:
            self.n += args[0].device != args[1].device
        return func(*args, **kwargs)


@pytest.mark.parametrize("mode", ["add", "patch"])
def test_steering_hooks_put_vectors_doses_and_sources_on_the_device_once(mode: str) -> None:
    """Hooks made for a device copy nothing onto it when they run ("meta" stands in for a GPU)."""
    d = 16
    dirs = [Direction("belief", "mean_difference", 1, torch.randn(d)), Direction("x", "random", 1, torch.randn(d))]
    source = torch.randn(3, d) if mode == "patch" else None
    (_, fn), = steering_hooks(dirs, 2.0, n_rows=3, mode=mode, source=source, device="meta")
    act = torch.empty(3, 5, d, device="meta")
    with _CrossDeviceCopies() as copies:
        out = fn(act)
    assert out.device.type == "meta" and out.shape == act.shape
    assert copies.n == 0


@pytest.mark.parametrize("mode", ["add", "patch"])
def test_dose_response_makes_the_same_few_syncs_whatever_the_batch_and_depth(models: dict[int, Any],
                                                                            stimuli: list[Any], mode: str) -> None:
    counts = {}
    for n_layers, model in models.items():
        dirs = _directions(model)
        for n in (8, 16):
            rows = stimuli[:n]
            sources = paired_sources(model, rows, list(range(n_layers)), progress=False) if mode == "patch" else None
            counts[(n_layers, n)] = count_of(lambda: dose_response(
                model, rows, dirs, [-2.0, 0.0, 1.0, 2.0], mode=mode, batch_size=n, progress=False, sources=sources))
            # several batches a call: nothing per batch either
            counts[(n_layers, n, "batches of 3")] = count_of(lambda: dose_response(
                model, rows, dirs, [-2.0, 0.0, 1.0, 2.0], mode=mode, batch_size=3, progress=False, sources=sources))
    assert_same_and_small(counts, DOSE_BOUND)


def test_fitting_directions_makes_the_same_few_syncs_whatever_the_stories_and_depth(models: dict[int, Any],
                                                                                   stimuli: list[Any]) -> None:
    counts = {}
    for n_layers, model in models.items():
        for n in (8, 16):
            counts[(n_layers, n)] = count_of(lambda: fit_directions(
                model, stimuli[:n], layers=list(range(n_layers)), n_random=3 + n // 8, progress=False))
    assert_same_and_small(counts, FIT_BOUND)


def test_the_steering_stage_makes_the_same_few_syncs_whatever_the_tasks_and_depth(models: dict[int, Any]) -> None:
    counts = {}
    for n_layers, model in models.items():
        for n in (8, 16):
            config = SteeringConfig(stimuli=StimuliSpec(family="order-only", n=n), n_random=3, alphas=(-2.0, 0.0, 2.0))
            counts[(n_layers, n)] = count_of(lambda: run(config, model=model, progress=False))
    assert_same_and_small(counts, STAGE_BOUND)


def test_a_direction_with_nan_entries_is_refused_where_it_is_used(models: dict[int, Any], stimuli: list[Any]) -> None:
    """Finiteness is checked for all directions at once where they are used (or fitted), not one
    vector at a time as each is built: the same refusal, naming the first bad one."""
    model = models[2]
    bad = Direction("odd", "random", 1, torch.full((model.cfg.d_model,), float("nan")))  # builds
    dirs = [*_directions(model), bad]
    with pytest.raises(TomlensError, match="'odd' \\(layer 1\\) has NaN"):
        dose_response(model, stimuli[:4], dirs, [1.0], progress=False)
    with pytest.raises(TomlensError, match="'odd' \\(layer 1\\) has NaN"):
        with steering(model, dirs, 1.0):
            pass
