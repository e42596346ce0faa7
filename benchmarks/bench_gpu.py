"""`make bench-gpu`: tomlens on a CUDA GPU against its baselines, on Llama-3 shapes in bf16.

For each of `random-llama-1b` and `random-llama-8b` (random weights, real shapes; they load with no
model package installed), each measured side by side with its baseline in this one process:

  cache      : `cache_activations` (resid_post at every layer, final + protagonist) against a plain
               transformers forward over the same length-sorted batches, eager and sdpa attention
               (bench_cache.run_timing: variants alternate batch by batch). Target <= 1.0 against
               the faster of the two.
  sdpa       : why transformers' sdpa can lose to eager on left-padded batches: one padded batch
               timed with eager, with sdpa (with its padding mask and without any mask), and under
               each SDPA backend; the GPU kernels that take the time under sdpa (torch.profiler).
  behaviour  : `score_options` on every option of the prompts against a plain forward over the
               same texts and batches (eager and sdpa). Target <= 1.0 against the faster.
  probes     : `fit_logistic` on the cached resid_post of every layer, on the GPU against on the CPU
               (same data, same C grid and folds); the largest difference in held-out accuracy.
  syncs      : host syncs per cached batch on the real GPU (torch.cuda.set_sync_debug_mode "warn"
               counts every synchronising CUDA call): should be 0 per batch, a few per call.
Then `bench_patching.py` on random-llama-1b in bf16 (its own process): exact patching against
TransformerLens's looped patching (target >= 20x) and attribution against exact (target >= 20x).

Without CUDA it says so in one line and exits 0, having run nothing.

    python benchmarks/bench_gpu.py [--models random-llama-1b random-llama-8b] [--prompts 256]

Writes bench-out/gpu.json.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = ROOT / "bench-out"
sys.path[:0] = [str(HERE), str(ROOT)]


DEVICE = "cuda"  # `--cpu-check` runs every section on the CPU with tiny models, to check the script


def clock() -> float:
    """`time.perf_counter()` once every queued kernel has run."""
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def best_of(fn: Any, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn` (after one untimed warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def free() -> None:
    import torch

    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# the models: one bridge (tomlens) and plain transformers models of the same weights


def hf_model(name: str, impl: str) -> Any:
    """The transformers model behind `load_model(name, seed=0)` with attention `impl`, bf16 on CUDA."""
    from tomlens.models.tiny import build_tiny

    return build_tiny(name, 0, device=DEVICE, dtype=dtype(), attn_implementation=impl).eval().to(DEVICE, dtype())


def dtype() -> Any:
    import torch

    return torch.bfloat16 if DEVICE == "cuda" else torch.float32


def tokenizer_shim(tokenizer: Any, model: Any) -> Any:
    """What `tomlens.models.encode` needs of a model, for a plain transformers one."""
    return SimpleNamespace(tokenizer=tokenizer, parameters=model.parameters, cfg=SimpleNamespace(n_ctx=None))


def plain_forward(model: Any, shim: Any, texts: list[list[str]]) -> None:
    """A plain transformers forward (logits, no KV cache) over each batch of texts, tokenised as
    tomlens does (left padding, attention mask, positions from each row's first token)."""
    import torch

    from tomlens.models import encode

    with torch.inference_mode():
        for batch_texts in texts:
            b = encode(shim, batch_texts)
            model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                  use_cache=False)


# ---------------------------------------------------------------------------------------------
# sections


def cache_section(name: str, prompts: int, batch_size: int, repeats: int) -> dict[str, Any]:
    import bench_cache

    args = SimpleNamespace(model=name, prompts=prompts, batch_size=batch_size, repeats=repeats, threads=0)
    timing = bench_cache.run_timing(args, ["hf_default", "hf_eager", "tomlens"])
    fastest = min(timing["hf_default"]["seconds"], timing["hf_eager"]["seconds"])
    return {"timing": timing, "ratio_vs_fastest": timing["tomlens"]["seconds"] / fastest,
            "ratio_vs_eager": timing["tomlens"]["seconds"] / timing["hf_eager"]["seconds"],
            "ratio_vs_sdpa": timing["tomlens"]["seconds"] / timing["hf_default"]["seconds"]}


def sdpa_section(name: str, stimuli: list[Any], batch_size: int) -> dict[str, Any]:
    """One left-padded batch (the longest prompts, so the most padding is the longest rows') under
    each attention path, and the kernels sdpa spends its time in."""
    from tomlens.models import encode, load_tokenizer

    tok = load_tokenizer(name)
    out: dict[str, Any] = {}
    texts = [s.text for s in stimuli[-batch_size:]]
    for impl in ("eager", "sdpa"):
        model = hf_model(name, impl)
        b = encode(tokenizer_shim(tok, model), texts)
        out["padding_tokens"] = int(sum(b.pad))
        out["tokens"] = int(b.input_ids.numel())
        out.update(_sdpa_timings(model, b, impl))
        del model  # the timings' closures are gone with their frame, so this frees the model
        free()
    return out


def _sdpa_timings(model: Any, b: Any, impl: str) -> dict[str, Any]:
    """`sdpa_section`'s timings of one attention path on the encoded batch `b`."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(mask: bool = True) -> None:
        with torch.inference_mode():
            model(input_ids=b.input_ids, attention_mask=b.attention_mask if mask else None,
                  position_ids=b.position_ids, use_cache=False)

    out: dict[str, Any] = {f"{impl}_padded_s": best_of(run, 3)}
    if impl == "sdpa":
        out["sdpa_no_mask_s"] = best_of(lambda: run(False), 3)
        for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION):
            try:
                with sdpa_kernel([backend]):
                    out[f"sdpa_padded_{backend.name.lower()}_s"] = best_of(run, 3)
            except RuntimeError as e:
                out[f"sdpa_padded_{backend.name.lower()}_s"] = f"unavailable: {str(e).splitlines()[0][:120]}"
        out["sdpa_padded_top_kernels"] = top_kernels(run)
    return out


def top_kernels(fn: Any, k: int = 6) -> list[str]:
    """The `k` CUDA kernels with the most GPU time in one call of `fn`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU]) as prof:
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    field = "device_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, field, 0.0), reverse=True)
    return [f"{e.key[:90]}: {getattr(e, field, 0.0) / 1e3:.2f} ms x{e.count}" for e in rows[:k]]


def behaviour_section(name: str, model: Any, stimuli: list[Any], batch_size: int, repeats: int) -> dict[str, Any]:
    """`score_options` against plain forwards over the same texts in the same batches."""
    from tomlens.behaviour.scoring import _plan, score_options
    from tomlens.models import load_tokenizer

    jobs = sorted(_plan(model.tokenizer, stimuli), key=lambda j: len(j.text))
    texts = [[j.text for j in jobs[i : i + batch_size]] for i in range(0, len(jobs), batch_size)]
    t_tomlens = best_of(lambda: score_options(model, stimuli, batch_size=batch_size, progress=False), repeats)
    tok = load_tokenizer(name)
    plain = {}
    for impl in ("eager", "sdpa"):
        hf = hf_model(name, impl)
        shim = tokenizer_shim(tok, hf)
        plain[impl] = best_of(functools.partial(plain_forward, hf, shim, texts), repeats)
        del hf
        free()
    return {"rows": len(jobs), "stimuli": len(stimuli), "tomlens_s": t_tomlens, "plain_s": plain,
            "ratio_vs_fastest": t_tomlens / min(plain.values())}


def probe_section(stimuli: list[Any], resid: Any) -> dict[str, Any]:
    """One probe per layer on resid_post at the final token: GPU against CPU, the same problem."""
    import torch

    from tomlens.probes.logistic import C_GRID, fit_logistic
    from tomlens.probes.splits import group_codes, group_kfold
    from tomlens.probes.targets import make_target

    y, _ = make_target(stimuli, "protagonist_belief")
    groups = group_codes(stimuli, "task")
    split = group_kfold(groups, 5, seed=0)[0]
    X = resid.float().transpose(0, 1).contiguous()  # [layer, n, d]
    out: dict[str, Any] = {"units": int(X.shape[0]), "train": int(split.train.numel()), "d": int(X.shape[2])}
    acc = {}
    for device in (DEVICE, "cpu"):
        Xd, tr, te = X.to(device), split.train, split.test

        def fit() -> Any:
            return fit_logistic(Xd[:, tr.to(device)], y[tr].unsqueeze(0), groups=groups[tr], c_grid=C_GRID, cv=4,
                                seed=0, device=device)

        out[f"{device}_s"] = best_of(fit, 1)
        res = fit()
        coef, icpt = res.coef[0].to("cpu").double(), res.intercept[0].to("cpu").double()
        scores = torch.bmm(X[:, te].double(), coef.transpose(1, 2)) + icpt.unsqueeze(1)
        pred = res.classes.to("cpu")[(scores[..., 0] > 0).long()]
        acc[device] = (pred == y[te]).double().mean(1)
    out["speedup_gpu_vs_cpu"] = out["cpu_s"] / out[f"{DEVICE}_s"]
    out["max_heldout_accuracy_diff"] = float((acc[DEVICE] - acc["cpu"]).abs().max())
    return out


def sync_section(model: Any, stimuli: list[Any], batch_size: int) -> dict[str, Any]:
    """Synchronising CUDA calls of one caching call at two batch counts (torch's sync debug mode
    warns once per such call): the difference is what one more batch costs. Those raised inside
    transformers are counted apart."""
    import tempfile

    import torch

    from tomlens.activations import cache_activations

    counts = {}
    for n_batches in (2, 4):
        rows = stimuli[: n_batches * batch_size]
        with tempfile.TemporaryDirectory() as store, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                cache_activations(model, rows, "resid_post", ["final", "protagonist"], store=store,
                                  batch_size=batch_size, progress=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        inside = sum(f"{os.sep}transformers{os.sep}" in w.filename for w in syncs)
        counts[n_batches] = (len(syncs) - inside, inside)
    # transformers' eager mask makes one per forward itself (`torch.tensor(0.0, device=...)`)
    return {"syncs_per_call_2_batches": counts[2][0], "syncs_per_call_4_batches": counts[4][0],
            "syncs_per_extra_batch": (counts[4][0] - counts[2][0]) / 2,
            "transformers_syncs_per_extra_batch": (counts[4][1] - counts[2][1]) / 2}


def model_sections(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import bench_cache

    from tomlens.activations import cache_activations
    from tomlens.models import load_model

    print(f"\n=== {name} (bf16) ===", flush=True)
    stimuli = bench_cache.belief_prompts(args.prompts)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    out["cache"] = cache_section(name, args.prompts, args.batch_size, args.repeats)
    free()
    print(f"  cache: tomlens / fastest plain forward {out['cache']['ratio_vs_fastest']:.2f} "
          f"(eager {out['cache']['ratio_vs_eager']:.2f}, sdpa {out['cache']['ratio_vs_sdpa']:.2f}) "
          f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    lengths = sorted(stimuli, key=lambda s: len(s.text))
    if name in args.sdpa_models:
        out["sdpa"] = sdpa_section(name, lengths, args.batch_size)
        print(f"  sdpa: {json.dumps({k: v for k, v in out['sdpa'].items() if k != 'sdpa_padded_top_kernels'})}",
              flush=True)
    model = load_model(name, device=DEVICE, dtype=dtype())
    out["syncs"] = sync_section(model, stimuli, args.batch_size) if DEVICE == "cuda" else {
        "syncs_per_extra_batch": "not measured off CUDA"}
    print(f"  syncs: {out['syncs']}", flush=True)
    behave = stimuli[: args.behaviour_prompts]
    out["behaviour"] = behaviour_section(name, model, behave, args.batch_size, args.repeats)
    print(f"  behaviour: tomlens / fastest plain forward {out['behaviour']['ratio_vs_fastest']:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as store:
        acts = cache_activations(model, stimuli, "resid_post", ["final"], store=store,
                                 batch_size=args.batch_size, progress=False)
        resid = acts.get("resid_post", "final")
    del model
    free()
    out["probes"] = probe_section(stimuli, resid)
    print(f"  probes: GPU {out['probes'][f'{DEVICE}_s']:.2f} s vs CPU {out['probes']['cpu_s']:.2f} s "
          f"({out['probes']['speedup_gpu_vs_cpu']:.1f}x); max accuracy diff "
          f"{out['probes']['max_heldout_accuracy_diff']:.3f}", flush=True)
    return out


def patching_section(args: argparse.Namespace) -> dict[str, Any]:
    path = OUT / "gpu-patching.json"
    cmd = [sys.executable, str(HERE / "bench_patching.py"), "--model", args.patching_model, "--pairs",
           str(args.pairs), "--tl-pairs", "2", "--budget-s", str(args.patching_budget_s), "--tl-budget-s",
           str(args.patching_budget_s), "--memory-mb", str(args.memory_mb), "--out", str(path)]
    print(f"\n=== patching ({args.patching_model}, bf16): {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc or not path.exists():
        return {"failed": f"bench_patching.py exit {rc}"}
    return json.loads(path.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["random-llama-1b", "random-llama-8b"])
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--behaviour-prompts", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sdpa-models", nargs="*", default=["random-llama-1b"], help="models to run the sdpa diagnosis on")
    p.add_argument("--patching-model", default="random-llama-1b")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--patching-budget-s", type=float, default=60.0)
    p.add_argument("--memory-mb", type=float, default=16384)
    p.add_argument("--skip-patching", action="store_true")
    p.add_argument("--out", default=str(OUT / "gpu.json"))
    p.add_argument("--cpu-check", action="store_true", help=argparse.SUPPRESS)  # the script's own test
    args = p.parse_args()

    import torch

    if args.cpu_check:
        global DEVICE
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("bench-gpu: CUDA is not available on this machine; nothing was run (run it on a machine "
              "with an NVIDIA GPU and a CUDA build of torch)")
        return 0
    OUT.mkdir(exist_ok=True)
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (script check)"
    result: dict[str, Any] = {"device": device_name, "torch": torch.__version__,
                              "args": vars(args), "models": {}}
    import transformers

    result["transformers"] = transformers.__version__
    for name in args.models:  # each result is written as soon as it is in: a killed run keeps what finished
        result["models"][name] = model_sections(name, args)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
        if name == args.patching_model and not args.skip_patching:
            result["patching"] = patching_section(args)
            Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    result["ratios"] = ratios(result)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"\n=== summary on {result['device']} (ratios measured side by side in this run) ===")
    for key, value in result["ratios"].items():
        print(f"{key:<78} {value}")
    print(f"wrote {args.out}")
    return 0


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, r in result["models"].items():
        out[f"{name} cache: time vs fastest transformers forward (target <= 1.0)"] = round(r["cache"]["ratio_vs_fastest"], 2)
        out[f"{name} behaviour: time vs fastest transformers forward"] = round(r["behaviour"]["ratio_vs_fastest"], 2)
        out[f"{name} probes: GPU speed-up over CPU (x)"] = round(r["probes"]["speedup_gpu_vs_cpu"], 1)
        out[f"{name} syncs per extra cached batch (target 0)"] = r["syncs"]["syncs_per_extra_batch"]
        if "sdpa" in r:
            sd = r["sdpa"]
            out[f"{name} sdpa / eager on one padded batch"] = round(sd["sdpa_padded_s"] / sd["eager_padded_s"], 2)
    patching = result.get("patching", {})
    out.update({f"patching {k}": v for k, v in patching.get("ratios", {}).items()})
    return out


if __name__ == "__main__":
    sys.exit(main())
