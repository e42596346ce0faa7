"""gpu tier, tiny models: each hot path run on CUDA gives the CPU's fp32 numbers. In fp32 the results
must match to fp32 rounding. In bf16 they must match to bf16's tolerances: the model's weights and
activations are rounded to bf16 (8 significant bits), so the check there is that a bf16 run on the GPU does
what the CPU run does, to within that precision. Position, padding or row mix-ups would show up in
the fp32 checks.

The paths: behaviour scoring, activation caching, probe fitting, exact and attribution patching,
and steering. They are called through their public APIs, as the CPU tests call them. The reference
is `load_tiny` (fp32 on the CPU, the same seeded weights). Where CUDA is absent, the whole tier
skips in one line (tests/conftest.py).

The bf16 tolerances are at least 4x the errors measured for bf16 against fp32 on the CPU for
these models and inputs (log-probs of about -11: 3e-3 at most; activations: 0.6% relative; raw
patched logit differences: 1.3% relative, 2.3e-3 at most).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import clean_model as _clean
from helpers import short_pairs

from tomlens.activations import cache_activations
from tomlens.behaviour import score, score_options
from tomlens.models import encode, load_model, load_tokenizer, tiny
from tomlens.models.tokens import option_first_tokens
from tomlens.patching import attribution_patching, exact_patching
from tomlens.probes import LogisticProbe, group_codes, make_target
from tomlens.steering import Direction, dose_response, steering
from tomlens.stimuli import generate

pytestmark = pytest.mark.gpu

NAMES: tuple[str, ...] = ("tiny-gpt2", "tiny-llama", "tiny-neox")
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
FP32_ATOL = 1e-4  # as the CPU tests compare a padded batch with one prompt: fp32 rounding, other reduction order


def assert_near(got: torch.Tensor, want: torch.Tensor, dtype: str, *, rel16: float, what: str,
                atol32: float = FP32_ATOL) -> None:
    """fp32: elementwise within `atol32` (+ the same relative slack). bf16: ||got - want|| / ||want||
    <= `rel16`. NaN must sit in the same places in both (cells a pair has no token for)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, what
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{what}: NaN in other places"
    finite = ~torch.isnan(want)
    got, want = got[finite], want[finite]
    if dtype == "float32":
        torch.testing.assert_close(got, want, atol=atol32, rtol=atol32, msg=lambda m: f"{what}: {m}")
        return
    err = float((got - want).norm() / want.norm().clamp_min(1e-30))
    assert err <= rel16, f"{what}: bf16 on CUDA is {err:.3g} off the CPU's fp32 (relative), allowed {rel16}"


@pytest.fixture(scope="module")
def on_gpu(cuda: torch.device) -> Callable[[str, str], Any]:
    """`on_gpu(name, dtype)`: the tiny model with `load_tiny`'s weights (seed 0) on CUDA, once per module."""
    loaded: dict[tuple[str, str], Any] = {}

    def load(name: str, dtype: str) -> Any:
        if (name, dtype) not in loaded:
            loaded[(name, dtype)] = load_model(name, device=cuda, dtype=dtype, seed=0)
        model = _clean(loaded[(name, dtype)])
        param = next(model.parameters())
        assert param.device.type == "cuda" and str(param.dtype) == f"torch.{dtype}"
        return model

    return load


@pytest.fixture(scope="module")
def order_only() -> list[Any]:
    return generate("order-only", n=2, seed=0)  # 8 prompts of different lengths, both conditions


@pytest.fixture(scope="module")
def transfer() -> list[Any]:
    return generate("unexpected-transfer", n=1, seed=0)  # 16 prompts with every span


# ---------------------------------------------------------------------------------------------- behaviour
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_behaviour_scores_on_cuda_equal_the_cpus(load_tiny, on_gpu, order_only, name, dtype):
    cpu, gpu = load_tiny(name), on_gpu(name, dtype)
    want = score_options(cpu, order_only, batch_size=3, progress=False)
    got = score_options(gpu, order_only, batch_size=3, progress=False)
    assert [[o.n_tokens for o in pair] for pair in got] == [[o.n_tokens for o in pair] for pair in want]
    for field in ("logp_sum", "logp_first"):
        g = torch.tensor([[getattr(o, field) for o in pair] for pair in got])
        w = torch.tensor([[getattr(o, field) for o in pair] for pair in want])
        assert_near(g, w, dtype, rel16=1e-3, what=field)  # log-probs near -11: bf16 is 1e-4 off
        assert_near(g[:, 0] - g[:, 1], w[:, 0] - w[:, 1], dtype, rel16=3e-2, what=f"{field}, a minus b")
    table_cpu, table_gpu = score(cpu, order_only, progress=False), score(gpu, order_only, progress=False)
    assert table_gpu["id"].tolist() == table_cpu["id"].tolist()
    assert_near(torch.tensor(table_gpu["p_answer"].to_numpy()), torch.tensor(table_cpu["p_answer"].to_numpy()),
                dtype, rel16=1e-2, what="p_answer")


# ---------------------------------------------------------------------------------------------- caching
SITES = ["resid_post", "z:1", "head_out:0", "attn_out:1", "resid_pre:0"]
POSITIONS = ["final", "protagonist", "object:first", "contrast_end"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_cached_activations_on_cuda_equal_the_cpus(load_tiny, on_gpu, transfer, tmp_path, name, dtype):
    # two stores: an fp32 GPU request has the CPU request's key (the device is not part of it)
    want = cache_activations(load_tiny(name), transfer, SITES, POSITIONS, store=tmp_path / "cpu",
                             batch_size=5, progress=False)
    got = cache_activations(on_gpu(name, dtype), transfer, SITES, POSITIONS, store=tmp_path / "gpu",
                            batch_size=5, progress=False)
    assert not got.reused and got.ids == want.ids == [s.id for s in transfer]
    assert got.dtype == getattr(torch, dtype)
    for kind in want.kinds:
        assert got.layers(kind) == want.layers(kind)
        for position in POSITIONS:
            assert_near(got.get(kind, position), want.get(kind, position), dtype, rel16=3e-2,
                        what=f"{kind} at {position}")


def test_a_cache_written_in_many_shards_on_cuda_equals_the_cpus(load_tiny, on_gpu, transfer, tmp_path):
    """Several shards: each waits for its batches' non-blocking copies into pinned memory before it
    is written, while later batches run (one shard alone would not show a copy read too early)."""
    kw = dict(batch_size=2, shard_rows=3, flush_seconds=1e9, progress=False)
    want = cache_activations(load_tiny("tiny-llama"), transfer, SITES, POSITIONS, store=tmp_path / "cpu", **kw)
    got = cache_activations(on_gpu("tiny-llama", "float32"), transfer, SITES, POSITIONS, store=tmp_path / "gpu", **kw)
    assert not got.reused
    for kind in want.kinds:
        for position in POSITIONS:
            assert_near(got.get(kind, position), want.get(kind, position), "float32", rel16=3e-2,
                        what=f"{kind} at {position}")


# ---------------------------------------------------------------------------------------------- probes
@pytest.mark.parametrize("dtype", DTYPES)
def test_probe_fits_on_cuda_equal_the_cpus(load_tiny, transfer, tmp_path, cuda, dtype):
    """The same activations (cached on the CPU, stored in `dtype`) fitted on CUDA and on the CPU.
    The CPU solves in float64 and CUDA in float32 (tomlens.probes.logistic._solve_dtype), so the
    two fits agree to the solver's tolerance, not to the last bit. One C, so no tie in the
    cross-validation can pick another C on the two devices."""
    acts = cache_activations(load_tiny("tiny-llama"), transfer, ["resid_post"], ["final", "protagonist"],
                             store=tmp_path, dtype=dtype, progress=False)
    y, keep = make_target(transfer, "protagonist_belief")
    X = torch.cat([acts.get("resid_post", p) for p in ("final", "protagonist")], dim=1)[keep].transpose(0, 1)
    groups = group_codes([s for s, k in zip(transfer, keep.tolist(), strict=True) if k])
    fits = {dev: LogisticProbe(C=1.0, device=dev).fit(X, y[keep], groups) for dev in ("cpu", cuda)}
    cpu, gpu = fits["cpu"], fits[cuda]
    assert torch.equal(gpu.classes_.cpu(), cpu.classes_.cpu())
    assert torch.equal(gpu.fit_status_.cpu(), cpu.fit_status_.cpu())
    X64 = X.double()
    # decision values of about 1-5: a float32 solve (refined by Newton) was 1e-10 off a float64 one
    assert_near(gpu.decision_function(X64), cpu.decision_function(X64), "bfloat16", rel16=1e-4, what="decision values")
    assert_near(gpu.direction, cpu.direction, "bfloat16", rel16=1e-4, what="probe directions")
    assert torch.equal(gpu.predict(X64), cpu.predict(X64))


# ---------------------------------------------------------------------------------------------- patching
PATCH_SITES = {"heads": ["all", "each"], "resid": ["each"], "mlp": ["each"]}


def _compare_patching(got: Any, want: Any, dtype: str) -> None:
    assert got.cells == want.cells
    assert got.pair_ids == want.pair_ids and got.token_labels == want.token_labels
    for field in ("values", "clean", "corrupted"):
        assert_near(getattr(got, field), getattr(want, field), dtype, rel16=5e-2, what=field)
    if dtype == "float32":  # the effects themselves (patched minus corrupted), not only raw logit differences
        assert_near(got.values - got.corrupted, want.values - want.corrupted, dtype, rel16=0.0, what="effects")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_exact_patching_on_cuda_equals_the_cpus(load_tiny, on_gpu, name, dtype):
    cpu, gpu = load_tiny(name), on_gpu(name, dtype)
    pairs = short_pairs(cpu.tokenizer, 3)  # names of different lengths: two left-padded groups
    want = exact_patching(cpu, pairs, sites=PATCH_SITES, batch_pairs=2, progress=False)
    got = exact_patching(gpu, pairs, sites=PATCH_SITES, batch_pairs=2, progress=False)
    _compare_patching(got, want, dtype)


def test_checkpointed_exact_patching_on_cuda_equals_the_cpus_and_resumes(load_tiny, on_gpu, tmp_path):
    """Small chunks written to checkpoints while the next chunk runs (each landing waited for by its
    CUDA event); a second run from the checkpoints gives the same values."""
    from tomlens.patching.checkpoints import Checkpoints

    cpu, gpu = load_tiny("tiny-llama"), on_gpu("tiny-llama", "float32")
    pairs = short_pairs(cpu.tokenizer, 3)
    want = exact_patching(cpu, pairs, sites=PATCH_SITES, batch_pairs=2, progress=False)
    store = Checkpoints(tmp_path, {"pairs": "gpu", "positions": ["final"]})
    got = exact_patching(gpu, pairs, sites=PATCH_SITES, batch_pairs=2, checkpoints=store, chunk_runs=2,
                         progress=False)
    _compare_patching(got, want, "float32")
    saved = store.saved
    again = exact_patching(gpu, pairs, sites=PATCH_SITES, batch_pairs=2, checkpoints=store, chunk_runs=2,
                           progress=False)
    assert store.saved == saved and store.loaded >= saved  # nothing ran again
    torch.testing.assert_close(again.values, got.values, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_attribution_patching_on_cuda_equals_the_cpus(load_tiny, on_gpu, name, dtype):
    cpu, gpu = load_tiny(name), on_gpu(name, dtype)
    pairs = short_pairs(cpu.tokenizer, 3)
    want = attribution_patching(cpu, pairs, sites=PATCH_SITES, batch_pairs=2, progress=False)
    got = attribution_patching(gpu, pairs, sites=PATCH_SITES, batch_pairs=2, progress=False)
    _compare_patching(got, want, dtype)


def test_integrated_gradients_on_cuda_equal_the_cpus(load_tiny, on_gpu):
    cpu, gpu = load_tiny("tiny-llama"), on_gpu("tiny-llama", "float32")
    pairs = short_pairs(cpu.tokenizer, 2)
    kw = dict(sites={"heads": ["each"]}, batch_pairs=2, steps=3, path="sites", progress=False)
    _compare_patching(attribution_patching(gpu, pairs, **kw), attribution_patching(cpu, pairs, **kw), "float32")


# ---------------------------------------------------------------------------------------------- steering
def _direction(layer: int, scale: float, seed: int) -> Direction:
    # on the CPU, as a user's saved direction would be: steering moves it to the model's device
    vector = torch.randn(64, generator=torch.Generator().manual_seed(seed)) * scale
    return Direction(f"random:{seed}", "random", layer, vector)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["add", "project_out"])
def test_steering_on_cuda_equals_the_cpus(load_tiny, on_gpu, order_only, dtype, mode):
    cpu, gpu = load_tiny("tiny-llama"), on_gpu("tiny-llama", dtype)
    directions = [_direction(1, 0.5, 3), _direction(0, 0.5, 4)]
    kw = dict(mode=mode, progress=False, per_prompt=True, batch_size=3)
    want = dose_response(cpu, order_only, directions, [-2.0, 0.0, 3.0], **kw)
    got = dose_response(gpu, order_only, directions, [-2.0, 0.0, 3.0], **kw)
    keys = ["direction", "alpha", "prompt", "id", "condition"]
    assert got[keys].equals(want[keys])
    w, g = torch.tensor(want["logit_diff"].to_numpy()), torch.tensor(got["logit_diff"].to_numpy())
    assert_near(g, w, dtype, rel16=5e-2, what="steered logit differences")
    if dtype == "float32":  # choices agree wherever the two options are not within rounding of a tie
        clear = (w.abs() > 10 * FP32_ATOL).numpy()
        assert (got["choice"].to_numpy()[clear] == want["choice"].to_numpy()[clear]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_steered_forward_on_cuda_equals_the_cpus(load_tiny, on_gpu, order_only, dtype):
    cpu, gpu = load_tiny("tiny-llama"), on_gpu("tiny-llama", dtype)
    directions = [_direction(1, 0.5, 5)]
    texts = [s.text for s in order_only]
    out = {}
    for key, model in (("cpu", cpu), ("gpu", gpu)):
        batch = encode(model, texts)
        toks = option_first_tokens(model, order_only, [s.options for s in order_only])
        with torch.inference_mode(), steering(model, directions, 2.0):
            last = model(batch.input_ids, **batch.forward_kwargs())[:, -1].float()
        out[key] = last.gather(1, toks.to(last.device))
    assert_near(out["gpu"], out["cpu"], dtype, rel16=3e-2, what="steered option logits")


# ---------------------------------------------------------------------------------------------- syncs
SYNC_WARNING = "called a synchronizing CUDA operation"


def _syncs(run: Callable[[], Any]) -> int:
    """Host syncs CUDA reports while `run()` runs (torch.cuda.set_sync_debug_mode "warn": one
    warning per synchronizing call), leaving out the ones raised inside transformers.

    transformers' eager attention mask (`masking_utils.eager_mask`) builds `torch.tensor(0.0,
    device=...)` on every forward, a blocking copy of one scalar: one sync per forward that tomlens
    does not make (seen on an H200 with transformers 5.17) and that costs little, the host being
    ahead of the GPU when it happens."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(SYNC_WARNING in str(w.message) and f"{os.sep}transformers{os.sep}" not in w.filename for w in seen)


def _tiny_llama_with_layers(n_layers: int, folder: Any, device: torch.device) -> Any:
    config = tiny.TINY["tiny-llama"].build_config()
    config.num_hidden_layers = n_layers
    config.save_pretrained(folder)
    load_tokenizer("tiny-llama").save_pretrained(folder)
    return load_model(f"random:{folder}", device=device, dtype="float32")


def test_caching_on_cuda_syncs_a_fixed_number_of_times_whatever_the_batches_and_depth(on_gpu, tmp_path, cuda):
    """Counted by CUDA itself: the caching loop syncs a fixed number of times per call (waiting
    for the kept activations before the shard is written, reading back its few host facts), never
    per batch, per row or per layer."""
    assert _syncs(lambda: torch.ones(1, device=cuda).item()) == 1  # the counter sees a sync

    stories = generate("unexpected-transfer", n=2, seed=0)  # 32 prompts
    kw = dict(progress=False, shard_rows=10_000, flush_seconds=1e9)  # one shard, no time-based flush

    def count(model: Any, rows: int, batch: int, store: str) -> int:
        cache_activations(model, stories[:rows], ["resid_post"], ["final", "protagonist"],
                          store=tmp_path / f"warm-{store}", batch_size=batch, **kw)  # lazy CUDA set-up
        return _syncs(lambda: cache_activations(model, stories[:rows], ["resid_post"], ["final", "protagonist"],
                                                store=tmp_path / store, batch_size=batch, **kw))

    two = on_gpu("tiny-llama", "float32")
    six = _tiny_llama_with_layers(6, tmp_path / "six", cuda)
    at_8, at_16 = count(two, 16, 8, "b8"), count(two, 32, 16, "b16")  # two batches each
    four = count(two, 32, 8, "four")  # four batches of 8
    deep = count(six, 16, 8, "deep")
    assert at_8 == at_16 == four == deep, \
        f"syncs per call: 2 batches of 8 {at_8}, of 16 {at_16}, 4 batches {four}, 6 layers {deep}"
    # per call: the weights' fingerprint read back (one), the wait before the one shard is written
    # (one); the rest of the bound is slack for a one-off read, never one per batch
    assert at_8 <= 4, f"{at_8} syncs for one call (one shard)"


# ---------------------------------------------------------------------------------------------- plain forward
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_the_plain_forward_on_cuda_computes_the_bridges_numbers(on_gpu, transfer, name, dtype):
    """Caching the residual stream and scoring run the Hugging Face model without the bridge's
    wrappers: the same operations in the same order, so the same numbers on the GPU too, to rounding."""
    from tomlens.hooks import capture
    from tomlens.hooks.capture import _capture_bridge
    from tomlens.hooks.sites import Site
    from tomlens.models.plain import plain_forward
    from tomlens.models.positions import resolve_positions

    model = on_gpu(name, dtype)
    assert plain_forward(model) is not None
    batch = encode(model, [s.text for s in transfer])
    pos = resolve_positions(transfer, batch, POSITIONS)
    sites = [Site(k, layer) for layer in range(model.cfg.n_layers) for k in ("resid_pre", "resid_post")]
    with torch.inference_mode():
        got, want = capture(model, batch, sites, pos), _capture_bridge(model, batch, sites, pos, None)
    for site in sites:
        torch.testing.assert_close(got[site], want[site], msg=lambda m, s=site: f"{s}: {m}")
    plain = score_options(model, transfer, batch_size=4, progress=False)
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda t, hook: t)]):
        bridge = score_options(model, transfer, batch_size=4, progress=False)
    for got_pair, want_pair in zip(plain, bridge, strict=True):
        for a, b in zip(got_pair, want_pair, strict=True):
            assert a.n_tokens == b.n_tokens and a.first_token == b.first_token
            tol = 1e-3 if dtype == "float32" else 5e-2  # bf16 log-probs near -11: one ulp is 0.06
            assert a.logp_sum == pytest.approx(b.logp_sum, abs=tol) and a.logp_first == pytest.approx(b.logp_first, abs=tol)
