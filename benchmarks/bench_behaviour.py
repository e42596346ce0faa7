"""Behaviour-scoring benchmark: `score_options` against the plain forward it replaced.

Task: both options of every prompt of the demo's behaviour stage (`tomlens/runs/demo.toml`, every
`[[behaviour.stimuli]]` set as the demo builds it) scored by log-probability on the embedded
SmolLM2-135M, fp32, batch size 8.

  tomlens  : `tomlens.behaviour.scoring.score_options`: rows sorted by tokens, a batch's shared
      prefix (the same story under several questions and both options) run once and the rest of
      each row against its keys and values, and only the read positions unembedded.
  baseline : the same rows (`_plan`) sorted by length, one left-padded forward per batch that
      unembeds every position (the scorer before issue 29).
  Same answer: the largest absolute difference of any option's summed and first-token log-prob.

The two alternate (baseline, tomlens, baseline, tomlens, ...) so that drift in the machine's load
falls on both; the ratio is of their summed times.

    .venv/bin/python benchmarks/bench_behaviour.py [--fraction 1.0] [--repeats 1] [--threads 2]

`--fraction f` keeps the first `f` of every stimulus set (whole stories stay together).
Writes bench-out/behaviour.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import tomllib
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "bench-out"
DEMO = HERE.parent / "tomlens" / "runs" / "demo.toml"


def demo_stimuli(fraction: float) -> list:
    """The demo's behaviour prompts, the first `fraction` of every set."""
    from tomlens.runs.base import StimuliSpec

    spec = tomllib.loads(DEMO.read_text())
    stimuli = []
    for entry in spec["behaviour"]["stimuli"]:
        got = StimuliSpec(**entry).load()
        stimuli += got[: max(1, math.ceil(len(got) * fraction))]
    return stimuli


def score_plain(model, stimuli, batch_size: int = 8) -> list:
    """The scorer before issue 29: rows sorted by length, one whole forward per batch (every
    position unembedded), the log-probs gathered on the device and moved to the host once."""
    import torch

    from tomlens.behaviour.scoring import _continuation_logprobs, _option_scores, _plan
    from tomlens.devices import to_device
    from tomlens.models.tokens import encode

    jobs = sorted(_plan(model.tokenizer, stimuli), key=lambda j: len(j.text))
    logps, spans = [], []
    with torch.inference_mode():
        for at in range(0, len(jobs), batch_size):
            chunk = jobs[at : at + batch_size]
            batch = encode(model, [j.text for j in chunk])
            rows, positions, tokens = [], [], []
            for row, job in enumerate(chunk):
                end = batch.pad[row] + batch.lengths[row]
                for i, j, toks in job.wants:
                    start = end - len(toks) if job.joint else end
                    rows += [row] * len(toks)
                    positions += range(start - 1, start - 1 + len(toks))
                    tokens += toks
                    spans.append((i, j, len(toks), toks[0]))
            logits = model(batch.input_ids, **batch.forward_kwargs())
            logps.append(_continuation_logprobs(logits, to_device([rows, positions, tokens], logits.device)))
    scores = _option_scores(torch.cat(logps).tolist(), spans)
    return [(scores[(i, 0)], scores[(i, 1)]) for i in range(len(stimuli))]


def max_abs_difference(a: list, b: list) -> float:
    return max(max(abs(x.logp_sum - y.logp_sum), abs(x.logp_first - y.logp_first))
               for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--fraction", type=float, default=1.0, help="first fraction of every stimulus set")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="(baseline, tomlens) pairs, alternated")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=str(OUT / "behaviour.json"))
    args = ap.parse_args()

    import torch

    from tomlens.behaviour.scoring import _plan, _rows, score_options
    from tomlens.io import write_atomic
    from tomlens.models import load_model, provenance

    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    model = load_model(args.model, dtype="float32")
    stimuli = demo_stimuli(args.fraction)
    rows = _rows(model, _plan(model.tokenizer, stimuli))
    n_tokens = sum(len(r.ids) for r in rows)
    print(f"{args.model}: {len(stimuli)} prompts, {len(rows)} rows, {n_tokens} tokens; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    score_options(model, stimuli[:8], batch_size=args.batch_size, progress=False)  # warm-up, not timed
    score_plain(model, stimuli[:8], batch_size=args.batch_size)

    times: dict[str, list[float]] = {"baseline": [], "tomlens": []}
    got: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, fn in (("baseline", score_plain),
                         ("tomlens", lambda m, s, batch_size: score_options(m, s, batch_size=batch_size, progress=False))):
            t0 = time.perf_counter()
            got[name] = fn(model, stimuli, batch_size=args.batch_size)
            times[name].append(time.perf_counter() - t0)
            print(f"{name}: {times[name][-1]:.1f} s", flush=True)
    ratio = sum(times["baseline"]) / sum(times["tomlens"])
    diff = max_abs_difference(got["baseline"], got["tomlens"])
    result = {
        "task": "both options of every demo behaviour prompt scored by log-probability, batch size "
                f"{args.batch_size}, fp32",
        "model": provenance(model),
        "threads": torch.get_num_threads(),
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "prompts": len(stimuli), "rows": len(rows), "tokens": n_tokens,
        "seconds": {k: [round(x, 2) for x in v] for k, v in times.items()},
        "max_abs_logp_difference": diff,
        "ratios": {
            "score_options speed-up over the plain forward (demo prompts)": round(ratio, 2),
            "score_options max |log-prob difference| from the plain forward": f"{diff:.2e}",
        },
    }
    write_atomic(json.dumps(result, indent=2) + "\n", args.out)
    print(f"score_options {ratio:.2f}x faster than the plain forward; max |log-prob difference| {diff:.2e}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
