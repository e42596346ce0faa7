"""Caching benchmark: tomlens `cache_activations` against the two limits named in the design.

Task: `resid_post` at every layer, at two positions (final token, protagonist mention), for 256
generated unexpected-transfer belief prompts on the embedded SmolLM2-135M (`--model` picks another:
e.g. `random-llama-1b` / `random-llama-8b`, random weights in Llama 3 shapes, on a GPU).

  time   : tomlens (tokenize, forward with hooks, write a shard) vs a plain transformers forward
           over the same length-sorted batches (same dtype and batch size, tokenization included,
           logits computed, no KV cache, under inference_mode), with transformers' default
           attention (sdpa) and with eager attention. Target ratio <= 1.0 against the faster.
  memory : activation memory (peak minus what was resident after loading the model and a warm-up)
           of one tomlens run over all prompts vs TransformerLens `run_with_cache` with every hook
           over the same batches. Target <= 0.1.

Timing alternates the variants batch by batch (the order rotating), so a busy machine slows them
alike; tomlens is timed as one `cache_activations` call per batch (each with its own fresh store,
so every call also writes a shard and a manifest: a conservative count). The memory runs each
get a fresh process; on CPU the peak is the process's peak RSS (VmHWM, reset after the warm-up,
glibc told to return every large block on free), on CUDA `torch.cuda.max_memory_allocated`.
The tomlens memory run is also the time of one whole-pipeline call over all prompts.

    .venv/bin/python benchmarks/bench_cache.py [--prompts 256] [--batch-size 16] [--repeats 1]

Writes bench-out/cache.json and prints both ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------
# memory measurement


def _proc_status(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    """Hand memory freed by earlier work (the warm-up) back to the OS, so it cannot hide a peak."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of a region: CUDA allocator stats on GPU, peak RSS (VmHWM) on CPU."""

    def __init__(self, device: str):
        self.device = device

    def start(self) -> None:
        import gc

        import torch

        gc.collect()
        _malloc_trim()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.method = "torch.cuda.max_memory_allocated"
            self.base = torch.cuda.memory_allocated()
            return
        try:  # "5" resets the peak RSS counter (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
            self.method = "VmHWM (reset after loading)"
        except OSError:
            self.method = "VmHWM since start (could not reset)"
        self.base = _proc_status("VmRSS") or 0

    def stop(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated() - self.base)
        return int((_proc_status("VmHWM") or 0) - self.base)


# ---------------------------------------------------------------------------------------------
# one variant, in a child process


def belief_prompts(n: int) -> list[Any]:
    from tomlens.stimuli import generate

    k = max(1, n // 8)
    while True:
        stimuli = [s for s in generate("unexpected-transfer", n=k, seed=0) if s.prompt_type == "belief"]
        if len(stimuli) >= n:
            return stimuli[:n]
        k *= 2


def sorted_batches(encode_model: Any, stimuli: list[Any], batch_size: int) -> tuple[list[list[int]], int]:
    """The batches tomlens makes: rows sorted by (token length, index), then cut in order; and the token count."""
    from tomlens.models import encode

    lengths = encode(encode_model, [s.text for s in stimuli]).lengths
    order = sorted(range(len(stimuli)), key=lambda r: (lengths[r], r))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)], sum(lengths)


class Setup:
    """The prompts, the length-sorted batches and the callables that run one pass of each variant."""

    def __init__(self, args: argparse.Namespace, variants: list[str]):
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        self.model_name = args.model
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.stimuli = belief_prompts(args.prompts)
        self.positions = ["final", "protagonist"]
        self.batch_size = args.batch_size
        self.passes = {v: getattr(self, "_" + v)() for v in variants}

    def _hf(self, impl: str | None):
        from types import SimpleNamespace

        import torch
        from transformers import AutoModelForCausalLM

        from tomlens.models import encode, load_tokenizer
        from tomlens.models.embedded import EMBEDDED_NAME, embedded_dir
        from tomlens.models.tiny import TINY, build_tiny

        name = self.model_name
        if name in TINY:  # the same weights tomlens gets from load_model(name, seed=0)
            hf = build_tiny(name, 0, device=self.device, dtype=self.dtype, attn_implementation=impl or "sdpa")
        else:
            folder = embedded_dir() if name == EMBEDDED_NAME else name
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype, attn_implementation=impl)
        hf = hf.to(self.device, self.dtype).eval()
        tok = load_tokenizer(name)
        shim = SimpleNamespace(tokenizer=tok, parameters=hf.parameters, cfg=SimpleNamespace(n_ctx=None))
        self.batches, self.tokens = sorted_batches(shim, self.stimuli, self.batch_size)
        stimuli = self.stimuli

        def one_pass(rows_list: list[list[int]]) -> int:
            kept = 0
            with torch.inference_mode():
                for rows in rows_list:
                    b = encode(shim, [stimuli[r].text for r in rows])
                    logits = hf(input_ids=b.input_ids, attention_mask=b.attention_mask,
                                position_ids=b.position_ids, use_cache=False).logits
                    kept = max(kept, logits.nbytes)
                    del logits
            return kept

        one_pass.info = {"attn_implementation": hf.config._attn_implementation}
        return one_pass

    def _hf_default(self):
        return self._hf(None)  # transformers' default attention (sdpa)

    def _hf_eager(self):
        return self._hf("eager")

    def _bridge(self):
        if not hasattr(self, "model"):
            from tomlens.models import load_model

            self.model = load_model(self.model_name, device=self.device, dtype=self.dtype)
            self.batches, self.tokens = sorted_batches(self.model, self.stimuli, self.batch_size)
        return self.model

    def _tomlens(self):
        from tomlens.activations import cache_activations

        model, stimuli, positions = self._bridge(), self.stimuli, self.positions

        def one_pass(rows_list: list[list[int]]) -> int:
            rows = sorted(r for b in rows_list for r in b)
            with tempfile.TemporaryDirectory() as store:
                acts = cache_activations(model, [stimuli[r] for r in rows], "resid_post", positions,
                                         store=store, batch_size=self.batch_size, progress=False)
                assert not acts.reused and acts.get("resid_post", "final").shape[1] == model.cfg.n_layers
                return sum(acts.get("resid_post", p).nbytes for p in positions)

        one_pass.info = {"sites": "resid_post (all layers)", "positions": positions}
        return one_pass

    def _tl_run_with_cache(self):
        import torch

        from tomlens.models import encode
        from tomlens.models.positions import resolve_positions

        model, stimuli, positions = self._bridge(), self.stimuli, self.positions
        n_layers = model.cfg.n_layers

        def one_pass(rows_list: list[list[int]]) -> int:
            kept = 0
            with torch.inference_mode():
                for rows in rows_list:
                    chunk = [stimuli[r] for r in rows]
                    b = encode(model, [s.text for s in chunk])
                    logits, cache = model.run_with_cache(b.input_ids, **b.forward_kwargs())
                    pos = resolve_positions(chunk, b, positions)
                    idx = torch.arange(len(rows))[:, None]
                    _ = [cache[f"blocks.{L}.hook_resid_post"][idx, pos].clone() for L in range(n_layers)]
                    storages = {v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                                for v in cache.values()}
                    kept = max(kept, sum(storages.values()) + logits.nbytes)
                    del logits, cache
            return kept

        one_pass.info = {"hooks": "every hook (names_filter=None)"}
        return one_pass


def timed(setup: Setup, variant: str, batches: list[list[int]], measure_memory: bool) -> dict[str, Any]:
    import torch

    mem = PeakMemory(setup.device)
    if measure_memory:
        mem.start()
    t0 = time.perf_counter()
    kept = setup.passes[variant](batches)
    if setup.device == "cuda":
        torch.cuda.synchronize()
    out = {"seconds": time.perf_counter() - t0, "kept_bytes": kept}
    if measure_memory:
        out["peak_activation_bytes"] = mem.stop()
        out["memory_method"] = mem.method
    return out


def run_timing(args: argparse.Namespace, variants: list[str]) -> dict[str, Any]:
    """All timed variants in one process, alternating batch by batch (order rotating); with
    repeats, each batch's fastest time counts."""
    setup = Setup(args, variants)
    for v in variants:
        setup.passes[v](setup.batches[:1])  # warm-up
    best: dict[str, list[float]] = {v: [float("inf")] * len(setup.batches) for v in variants}
    for r in range(args.repeats):
        for i, rows in enumerate(setup.batches):
            k = (i + r) % len(variants)
            for v in variants[k:] + variants[:k]:
                best[v][i] = min(best[v][i], timed(setup, v, [rows], measure_memory=False)["seconds"])
    return {v: {"seconds": sum(best[v]), "tokens": setup.tokens, "tokens_per_s": setup.tokens / sum(best[v]),
                **setup.passes[v].info, "device": setup.device, "dtype": str(setup.dtype),
                "prompts": len(setup.stimuli), "batches": len(setup.batches), "batch_size": setup.batch_size}
            for v in variants}


def run_memory(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    """One variant alone in a fresh process, one pass over every batch: peak activation memory,
    what it keeps, and (for tomlens) the time of one whole-pipeline call."""
    setup = Setup(args, [variant])
    setup.passes[variant](setup.batches[:1])  # warm-up
    return timed(setup, variant, setup.batches, measure_memory=True)


def _child(args: argparse.Namespace, role: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", role, "--model", args.model, "--prompts", str(args.prompts),
           "--batch-size", str(args.batch_size), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    t0 = time.perf_counter()
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if role != "timing":
        # A fixed mmap threshold makes glibc give every large block back on free, so peak RSS
        # follows live tensors instead of memory the allocator kept from earlier batches.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"benchmark child {role} failed (exit {proc.returncode})")
    print(f"  [{role}: {time.perf_counter() - t0:.0f} s]", flush=True)
    return json.loads(line[-1][len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model name (see `tomlens models`)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1,
                   help="timed rounds over the batches (each batch's fastest time counts)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="bench-out/cache.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        if args.child == "timing":
            result = run_timing(args, ["hf_default", "hf_eager", "tomlens"])
        else:
            result = run_memory(args, args.child)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    from tomlens.models.embedded import EMBEDDED_NAME, embedded_dir

    if args.model == EMBEDDED_NAME:
        embedded_dir()  # convert the embedded model once, before anything is timed
    print(f"caching resid_post x every layer at final + protagonist, {args.prompts} belief prompts, "
          f"batch {args.batch_size}", flush=True)
    timing = _child(args, "timing")
    memory = {v: _child(args, v) for v in ("tomlens", "tl_run_with_cache")}

    tl, fastest_hf = timing["tomlens"], min((timing["hf_default"], timing["hf_eager"]), key=lambda r: r["seconds"])
    summary: dict[str, Any] = {
        "task": {"model": args.model, "sites": "resid_post, every layer", "positions": ["final", "protagonist"],
                 "prompts": args.prompts, "batch_size": args.batch_size, "device": tl["device"], "dtype": tl["dtype"]},
        "timing": timing,
        "memory": memory,
        "time_ratio": tl["seconds"] / fastest_hf["seconds"],
        "time_ratio_vs_hf_default": tl["seconds"] / timing["hf_default"]["seconds"],
        "time_ratio_vs_hf_eager": tl["seconds"] / timing["hf_eager"]["seconds"],
        "memory_ratio": memory["tomlens"]["peak_activation_bytes"]
        / max(1, memory["tl_run_with_cache"]["peak_activation_bytes"]),
        "kept_bytes_ratio": memory["tomlens"]["kept_bytes"] / max(1, memory["tl_run_with_cache"]["kept_bytes"]),
        "targets": {"time_ratio": 1.0, "memory_ratio": 0.1},
    }
    summary["ratios"] = {
        "cache: time vs fastest transformers forward (target <= 1.0)": round(summary["time_ratio"], 2),
        "cache: peak activation memory vs run_with_cache (target <= 0.1)": round(summary["memory_ratio"], 3),
        "cache: kept bytes vs run_with_cache": round(summary["kept_bytes_ratio"], 5),
    }
    for v, r in timing.items():
        print(f"  time   {v:<18} {r['seconds']:7.2f} s  ({r['tokens_per_s']:.0f} tok/s)")
    for v, r in memory.items():
        print(f"  memory {v:<18} peak activations {r['peak_activation_bytes'] / 2**20:8.1f} MiB, "
              f"kept {r['kept_bytes'] / 2**20:8.2f} MiB  (one pass {r['seconds']:.1f} s)")
    print(f"time ratio   tomlens / fastest plain transformers forward: {summary['time_ratio']:.2f} (target <= 1.0; "
          f"vs sdpa {summary['time_ratio_vs_hf_default']:.2f}, vs eager {summary['time_ratio_vs_hf_eager']:.2f})")
    print(f"memory ratio tomlens / run_with_cache(every hook), peak activations: {summary['memory_ratio']:.3f} "
          f"(target <= 0.1); kept bytes {summary['kept_bytes_ratio']:.5f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
