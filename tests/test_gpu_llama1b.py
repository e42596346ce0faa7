"""gpu tier, `random-llama-1b` (the Llama-3.2-1B shape, random weights): bf16 on CUDA gives the CPU's
fp32 numbers to within bf16's tolerances. The paths checked are behaviour scoring, caching, probe
fitting, exact and attribution patching, and steering.

The tolerances are about 3-5x the errors of bf16 against fp32 measured on the CPU for this model
and these prompts. Log-probs: 0.18% relative. Cached activations: 2.1%. Patched logit differences:
3.6%. Steered ones: 3.3%.

Both models hold the same weights. The CUDA model is built in bf16, and its weights are copied into
the CPU model as fp32, so the comparison measures bf16 arithmetic on the GPU and nothing else.
A 1B model in fp32 on the CPU takes about 5 GB and is slow. The CPU side is therefore kept small:
four short prompts, two pairs, two layers' sites. The tiny-model module
(tests/test_gpu_tiny.py) holds the paths to fp32 rounding. This one checks that the real shape
(GQA 32/8 heads, a 128k vocabulary, sdpa attention, 16 layers) runs on the GPU and agrees.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import short_pairs

from tomlens.activations import cache_activations
from tomlens.behaviour import score_options
from tomlens.models import load_model
from tomlens.patching import attribution_patching, exact_patching
from tomlens.probes import LogisticProbe, group_codes, make_target
from tomlens.steering import Direction, dose_response
from tomlens.stimuli import generate

pytestmark = pytest.mark.gpu

NAME = "random-llama-1b"
LAYERS = [1, 14]  # an early and a late block: errors grow with depth


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over the entries that are not NaN in `want` (NaN must match)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape and torch.equal(torch.isnan(got), torch.isnan(want))
    keep = ~torch.isnan(want)
    return float((got[keep] - want[keep]).norm() / want[keep].norm().clamp_min(1e-30))


def _copy_weights(src: Any, dst: Any) -> None:
    """`dst`'s Hugging Face weights set to `src`'s, in `dst`'s dtype and device (in place: the
    bridge wraps the same modules)."""
    want = src.original_model.state_dict()
    with torch.no_grad():
        for name, tensor in dst.original_model.state_dict().items():
            tensor.copy_(want[name].to(device=tensor.device, dtype=tensor.dtype))


@pytest.fixture(scope="module")
def llama(cuda: torch.device) -> tuple[Any, Any]:
    """(fp32 on the CPU, bf16 on CUDA), same weights."""
    gpu = load_model(NAME, device=cuda, dtype="bfloat16", seed=0)
    cpu = load_model(NAME, device="cpu", dtype="float32", seed=0)
    _copy_weights(gpu, cpu)
    return cpu, gpu


@pytest.fixture(scope="module")
def prompts() -> list[Any]:
    stimuli = generate("order-only", n=1, seed=0)  # both conditions of one task
    return stimuli[:4]


def test_behaviour_scores(llama, prompts):
    cpu, gpu = llama
    want = score_options(cpu, prompts, batch_size=2, progress=False)
    got = score_options(gpu, prompts, batch_size=2, progress=False)
    assert [[o.n_tokens for o in p] for p in got] == [[o.n_tokens for o in p] for p in want]
    for field in ("logp_sum", "logp_first"):
        g = torch.tensor([[getattr(o, field) for o in p] for p in got])
        w = torch.tensor([[getattr(o, field) for o in p] for p in want])
        assert relative_error(g, w) <= 1e-2, field  # log-probs near -log(128256) = -11.8


def test_cached_activations(llama, prompts, tmp_path):
    cpu, gpu = llama
    sites = [f"resid_post:{LAYERS[0]},{LAYERS[1]}", f"z:{LAYERS[1]}", f"head_out:{LAYERS[0]}"]
    positions = ["final", "protagonist"]
    want = cache_activations(cpu, prompts, sites, positions, store=tmp_path / "cpu", batch_size=3, progress=False)
    got = cache_activations(gpu, prompts, sites, positions, store=tmp_path / "gpu", batch_size=3, progress=False)
    assert got.ids == want.ids and got.dtype == torch.bfloat16
    for kind in want.kinds:
        for position in positions:
            err = relative_error(got.get(kind, position), want.get(kind, position))
            assert err <= 8e-2, f"{kind} at {position}: {err:.3g}"


def test_probe_fit(llama, tmp_path, cuda):
    """Probes on the 1B's fp32 activations (d = 2048 > n: the reduced solver), fitted on CUDA and
    on the CPU."""
    cpu, _ = llama
    stimuli = generate("order-only", n=2, seed=0)
    acts = cache_activations(cpu, stimuli, [f"resid_post:{LAYERS[1]}"], ["final"], store=tmp_path, progress=False)
    y, keep = make_target(stimuli, "protagonist_belief")
    X = acts.get("resid_post", "final")[keep].transpose(0, 1)
    groups = group_codes([s for s, k in zip(stimuli, keep.tolist(), strict=True) if k])
    on_cpu = LogisticProbe(C=1.0, device="cpu").fit(X, y[keep], groups)
    on_gpu = LogisticProbe(C=1.0, device=cuda).fit(X, y[keep], groups)
    assert torch.equal(on_gpu.fit_status_.cpu(), on_cpu.fit_status_.cpu())
    X64 = X.double()
    assert relative_error(on_gpu.decision_function(X64), on_cpu.decision_function(X64)) <= 1e-4
    assert torch.equal(on_gpu.predict(X64).cpu(), on_cpu.predict(X64).cpu())


@pytest.mark.parametrize("method", ["exact", "attribution"])
def test_patching(llama, method):
    cpu, gpu = llama
    pairs = short_pairs(cpu.tokenizer, 2)
    run = exact_patching if method == "exact" else attribution_patching
    kw = dict(sites={"heads": ["all"], "resid": ["final"]}, layers=LAYERS, batch_pairs=2, progress=False)
    want, got = run(cpu, pairs, **kw), run(gpu, pairs, **kw)
    assert got.cells == want.cells and got.pair_ids == want.pair_ids
    # one scale for all three: the clean and corrupted logit differences of a random model are
    # near 0.1, where bf16's rounding (about 0.02) is a large share of each
    fields = ("values", "clean", "corrupted")
    err = relative_error(torch.cat([getattr(got, f).reshape(-1) for f in fields]),
                         torch.cat([getattr(want, f).reshape(-1) for f in fields]))
    assert err <= 1e-1, f"{method}: {err:.3g}"


def test_steering(llama, prompts):
    cpu, gpu = llama
    vector = torch.randn(cpu.cfg.d_model, generator=torch.Generator().manual_seed(0))
    direction = Direction("random:0", "random", LAYERS[0], vector)
    kw = dict(progress=False, per_prompt=True, batch_size=2)
    want = dose_response(cpu, prompts, [direction], [0.0, 4.0], **kw)
    got = dose_response(gpu, prompts, [direction], [0.0, 4.0], **kw)
    assert got[["alpha", "prompt", "id"]].equals(want[["alpha", "prompt", "id"]])
    err = relative_error(torch.tensor(got["logit_diff"].to_numpy()), torch.tensor(want["logit_diff"].to_numpy()))
    assert err <= 1e-1, f"steered logit differences: {err:.3g}"
