"""Caching benchmark: tomlens `cache_activations` against the two limits named in the design.

Task: `resid_post` at every layer, at two positions (final token, protagonist mention), for 256
generated unexpected-transfer belief prompts on the embedded SmolLM2-135M.

  time   : tomlens (tokenize, forward with hooks, write shards) vs a plain transformers forward
           over the same length-sorted batches (same dtype and batch size, tokenization included,
           logits computed, under inference_mode). Target ratio <= 1.0.
  memory : activation memory (peak minus what was resident after loading the model) of tomlens vs
           TransformerLens `run_with_cache` with every hook over the same batches. Target <= 0.1.

Every variant runs in its own fresh subprocess, so peaks and allocator state never leak between
them. On CPU the peak is the process's peak RSS (VmHWM, reset after loading); on CUDA it is
`torch.cuda.max_memory_allocated`. Each child also reports the bytes of what it keeps.

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

VARIANTS = ("hf_default", "hf_eager", "tomlens", "tl_run_with_cache")


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


class PeakMemory:
    """Peak memory of a region: CUDA allocator stats on GPU, peak RSS (VmHWM) on CPU."""

    def __init__(self, device: str):
        self.device = device

    def start(self) -> None:
        import gc

        import torch

        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
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


def run_child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    stimuli = belief_prompts(args.prompts)
    positions = ["final", "protagonist"]
    result: dict[str, Any] = {"variant": variant, "device": device, "dtype": str(dtype),
                              "threads": torch.get_num_threads()}

    if variant.startswith("hf_"):
        from types import SimpleNamespace

        from transformers import AutoModelForCausalLM

        from tomlens.models import encode
        from tomlens.models.embedded import embedded_dir, load_tokenizer

        folder = embedded_dir()
        impl = "eager" if variant == "hf_eager" else None  # None: transformers' default (sdpa)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=impl).to(device).eval()
        tok = load_tokenizer(folder)
        tok.add_bos_token, tok.padding_side = True, "left"
        shim = SimpleNamespace(tokenizer=tok, parameters=hf.parameters, cfg=SimpleNamespace(n_ctx=None))
        result["attn_implementation"] = hf.config._attn_implementation
        batches, n_tokens = sorted_batches(shim, stimuli, args.batch_size)

        def one_pass(rows_list: list[list[int]]) -> int:
            kept = 0
            with torch.inference_mode():
                for rows in rows_list:
                    b = encode(shim, [stimuli[r].text for r in rows])
                    logits = hf(input_ids=b.input_ids, attention_mask=b.attention_mask,
                                position_ids=b.position_ids).logits
                    kept = max(kept, logits.nbytes)
                    del logits
            return kept

        one_pass(batches[:1])  # warm-up
        runs = []
        for _ in range(args.repeats):
            mem = PeakMemory(device)
            mem.start()
            t0 = time.perf_counter()
            kept = one_pass(batches)
            if device == "cuda":
                torch.cuda.synchronize()
            runs.append((time.perf_counter() - t0, mem.stop(), kept))
    else:
        from tomlens.activations import cache_activations
        from tomlens.models import encode, load_model
        from tomlens.hooks import resolve_positions

        model = load_model("smollm2-135m", device=device, dtype=dtype)
        batches, n_tokens = sorted_batches(model, stimuli, args.batch_size)
        n_layers = model.cfg.n_layers

        if variant == "tomlens":
            def one_pass(rows_list: list[list[int]]) -> int:
                rows = sorted(r for b in rows_list for r in b)
                with tempfile.TemporaryDirectory() as store:
                    acts = cache_activations(model, [stimuli[r] for r in rows], "resid_post", positions,
                                             store=store, batch_size=args.batch_size, progress=False)
                    assert not acts.reused and acts.get("resid_post", "final").shape[1] == n_layers
                    return sum(acts.get("resid_post", p).nbytes for p in positions)
        else:
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
                        kept = max(kept, sum(v.nbytes for v in cache.values()) + logits.nbytes)
                        del logits, cache
                return kept

        one_pass(batches[:1])  # warm-up (also builds the tokenizer fingerprint once)
        runs = []
        for _ in range(args.repeats):
            mem = PeakMemory(device)
            mem.start()
            t0 = time.perf_counter()
            kept = one_pass(batches)
            if device == "cuda":
                torch.cuda.synchronize()
            runs.append((time.perf_counter() - t0, mem.stop(), kept))

    best = min(runs, key=lambda r: r[0])
    result.update({
        "prompts": len(stimuli), "batch_size": args.batch_size, "batches": len(batches),
        "seconds": best[0], "seconds_all": [r[0] for r in runs],
        "peak_activation_bytes": max(r[1] for r in runs), "kept_bytes": best[2],
        "tokens": n_tokens, "tokens_per_s": n_tokens / best[0],
    })
    return result


# ---------------------------------------------------------------------------------------------
# driver


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1, help="timed passes per variant (the fastest counts)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--out", default="bench-out/cache.json")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        print("RESULT " + json.dumps(run_child(args.child, args)), flush=True)
        return 0

    # the embedded model is converted once before any timing
    from tomlens.models.embedded import embedded_dir

    embedded_dir()
    results: dict[str, Any] = {}
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--child", variant, "--prompts", str(args.prompts),
               "--batch-size", str(args.batch_size), "--repeats", str(args.repeats),
               "--threads", str(args.threads)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise SystemExit(f"variant {variant} failed (exit {proc.returncode})")
        results[variant] = json.loads(line[-1][len("RESULT "):])
        r = results[variant]
        print(f"{variant:<18} {r['seconds']:7.2f} s   peak activations {r['peak_activation_bytes'] / 2**20:9.1f} MiB"
              f"   kept {r['kept_bytes'] / 2**20:9.2f} MiB   (child wall {time.perf_counter() - t0:.0f} s)",
              flush=True)

    summary: dict[str, Any] = {"results": results}
    if "tomlens" in results:
        tl = results["tomlens"]
        hf = [results[v] for v in ("hf_default", "hf_eager") if v in results]
        if hf:
            summary["time_ratio_vs_hf_default"] = (tl["seconds"] / results["hf_default"]["seconds"]
                                                   if "hf_default" in results else None)
            summary["time_ratio_vs_hf_eager"] = (tl["seconds"] / results["hf_eager"]["seconds"]
                                                 if "hf_eager" in results else None)
            fastest = min(hf, key=lambda r: r["seconds"])
            summary["time_ratio"] = tl["seconds"] / fastest["seconds"]
            summary["time_baseline"] = fastest["variant"]
        if "tl_run_with_cache" in results:
            base = results["tl_run_with_cache"]
            summary["memory_ratio"] = tl["peak_activation_bytes"] / max(1, base["peak_activation_bytes"])
            summary["kept_ratio"] = tl["kept_bytes"] / max(1, base["kept_bytes"])
    summary["targets"] = {"time_ratio": 1.0, "memory_ratio": 0.1}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    if "time_ratio" in summary:
        print(f"time   tomlens / fastest plain transformers forward ({summary['time_baseline']}): "
              f"{summary['time_ratio']:.2f}  (target <= 1.0)")
    if "memory_ratio" in summary:
        print(f"memory tomlens / run_with_cache(all hooks), peak activations: {summary['memory_ratio']:.3f}"
              f"  (target <= 0.1); kept bytes ratio {summary['kept_ratio']:.5f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
