"""Dose-response: what steering along each direction with each dose does to the answers.

For every prompt the measure is the first-token logit difference between the option where the
object started (`reference_state`) and the option where it is now (`world_state`), which equals
the log-probability difference of those tokens (the normaliser cancels): positive means the model
answers "start", the false-belief answer. The chosen option is the one whose first token scores
higher, as behaviour's first-token choice (`tomlens.behaviour.score`'s `p_a_first`).

Speed: with positions = "final" only the last column changes, and in a causal model nothing before
it does, so every steered run reuses the unsteered run's keys and values and computes one token
(`tomlens.hooks.patch.forward_last`, exact); many (direction, alpha) pairs share one forward, each
row with its own vector and dose; only the logits of the options' first tokens are computed.
alpha = 0 is the unhooked run itself (every mode is the identity there), so it costs no pass.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.errors import TomlensError
from tomlens.hooks.patch import forward_last
from tomlens.models.tokens import encode, option_first_tokens
from tomlens.steering.directions import Direction
from tomlens.steering.interventions import check_directions, check_mode, row_hooks

CONDITIONS: tuple[str, ...] = ("false_belief", "true_belief", "reality")
COLUMNS: tuple[str, ...] = ("direction", "source", "layer", "alpha", "condition", "n", "logit_diff",
                            "logit_diff_se", "accuracy", "flip_rate")


def condition_of(s: Any) -> str:
    """"reality" for reality prompts (both conditions), else false_belief / true_belief by whether
    the protagonist's belief differs from the world."""
    if s.prompt_type == "reality":
        return "reality"
    return "false_belief" if s.belief_differs else "true_belief"


def option_roles(stimuli: Sequence[Any]) -> tuple[list[int], list[int]]:
    """Per stimulus, the index of the option where the object started and of where it is now."""
    start, now = [], []
    for s in stimuli:
        if s.reference_state not in s.options or s.world_state not in s.options or s.reference_state == s.world_state:
            raise TomlensError(
                f"stimulus {s.id!r}: its options {list(s.options)} must be the start location "
                f"(reference_state {s.reference_state!r}) and the current one (world_state {s.world_state!r})",
                "steer on false-belief families whose options are the two locations (e.g. order-only)")
        start.append(s.options.index(s.reference_state))
        now.append(s.options.index(s.world_state))
    return start, now


def count_passes(n_prompts: int, n_directions: int, alphas: Sequence[float]) -> int:
    """Forward passes (one prompt, one direction, one alpha each) a dose-response runs: the
    unsteered run once per prompt, then every direction at every non-zero alpha."""
    return n_prompts * (1 + n_directions * sum(1 for a in alphas if float(a) != 0.0))


def _logits(model: Any, batch: Any, vocab: Tensor, *, hooks: Sequence[Any] = (), rows: Tensor | None = None,
            prefix: Any = None, keep_cache: bool = False) -> tuple[Tensor, Any]:
    start = batch.input_ids.shape[1] - 1 if prefix is not None else 0
    logits, cache = forward_last(model, batch.input_ids, batch.forward_kwargs(), list(hooks), rows=rows,
                                 prefix=prefix, start=start, keep_cache=keep_cache, vocab=vocab)
    return logits.float(), cache


def dose_response(model: Any, stimuli: Sequence[Any], directions: Sequence[Direction], alphas: Sequence[float], *,
                  mode: str = "add", positions: str = "final", batch_size: int = 16, progress: bool = True,
                  sources: Mapping[int, Float[Tensor, "n d"]] | None = None,
                  rows_per_forward: int | None = None, per_prompt: bool = False) -> pd.DataFrame:
    """One row per direction x alpha x condition (false_belief, true_belief, reality): n, mean
    logit difference (start minus now) with its standard error, accuracy and flip rate (share of
    prompts whose chosen option differs from the unhooked run's).

    `sources` (mode "patch"): per layer, the source run's final-token activations, `[n, d]` in
    stimulus order (e.g. `paired_sources`). `per_prompt=True` returns the per-prompt table instead
    (direction, layer, alpha, prompt index, id, condition, logit_diff, choice, correct, flipped)."""
    check_mode(mode, positions)
    stimuli = list(stimuli)
    if not stimuli:
        raise TomlensError("no prompts to steer", "pass at least one stimulus")
    directions = list(directions)
    check_directions(model, directions)
    alphas = [float(a) for a in alphas]
    if not alphas:
        raise TomlensError("no alphas", "give at least one dose, e.g. -4,-2,0,2,4")
    if mode == "patch":
        if positions != "final":
            raise TomlensError("mode 'patch' is run at the final position here",
                               "use positions = 'final', or the `steering` context manager with [n, pos, d] sources")
        missing = sorted({d.layer for d in directions} - set(sources or {}))
        if missing:
            raise TomlensError(f"mode 'patch' needs source activations for layers {missing}",
                               "pass sources = paired_sources(model, stimuli, layers)")
        for layer, t in (sources or {}).items():
            if t.shape[0] != len(stimuli):
                raise TomlensError(f"sources for layer {layer} have {t.shape[0]} rows for {len(stimuli)} prompts",
                                   "pass one source row per prompt, in stimulus order")
    start_opt, now_opt = option_roles(stimuli)
    first = option_first_tokens(model, stimuli, [tuple(s.options) for s in stimuli])  # [n, 2]
    n = len(stimuli)
    steered = [(i, a) for i, _ in enumerate(directions) for a in alphas if a != 0.0]
    by_layer: dict[int, list[tuple[int, float]]] = {}
    for i, a in steered:
        by_layer.setdefault(int(directions[i].layer), []).append((i, a))
    total = count_passes(n, len(directions), alphas)
    if progress:
        tqdm.write(f"steering: {len(directions)} directions x {sum(a != 0 for a in alphas)} non-zero alphas x "
                   f"{n} prompts + {n} unsteered = {total} forward passes ({mode}, {positions} position)",
                   file=sys.stderr)
    bar = tqdm(total=total, desc="steering", unit="pass", disable=not progress)
    batch_size = max(1, int(batch_size))
    per_fwd = max(batch_size, int(rows_per_forward or 4 * batch_size))
    diff = torch.full((len(directions) + 1, len(alphas), n), float("nan"))  # last "direction": unhooked
    choice = torch.full((len(directions) + 1, len(alphas), n), -1, dtype=torch.long)
    order = sorted(range(n), key=lambda i: (len(stimuli[i].text), i))
    a_index = {a: j for j, a in enumerate(alphas)}
    with torch.inference_mode():
        for b0 in range(0, n, batch_size):
            idx = order[b0 : b0 + batch_size]
            b = len(idx)
            batch = encode(model, [stimuli[i].text for i in idx])
            toks = first[idx]  # [b, 2]
            vocab, inv = torch.unique(toks.flatten(), return_inverse=True)
            inv = inv.view(b, 2)
            s_idx = torch.tensor([start_opt[i] for i in idx])
            n_idx = torch.tensor([now_opt[i] for i in idx])
            keep = positions == "final"
            base, cache = _logits(model, batch, vocab, keep_cache=keep)
            bar.update(b)

            def record(logits: Tensor, rows_dir: list[int], rows_alpha: list[float]) -> None:
                logits = logits.cpu()
                k = len(rows_dir) // b
                cols = inv.repeat(k, 1) if logits.shape[-1] == vocab.numel() else toks.repeat(k, 1)
                two = logits.gather(1, cols)  # [r, 2]: first-token logits of option a and b
                rr = torch.arange(two.shape[0])
                d = two[rr, s_idx.repeat(k)] - two[rr, n_idx.repeat(k)]
                c = (two[:, 1] > two[:, 0]).long()
                prompts = torch.tensor(idx).repeat(k)
                for r in range(two.shape[0]):
                    di, aj = rows_dir[r], a_index[rows_alpha[r]]
                    diff[di, aj, prompts[r]] = d[r]
                    choice[di, aj, prompts[r]] = c[r]

            record(base, [len(directions)] * b, [alphas[0]] * b)
            for layer, combos in sorted(by_layer.items()):
                per = max(1, per_fwd // b)
                for c0 in range(0, len(combos), per):
                    chunk = combos[c0 : c0 + per]
                    k = len(chunk)
                    vec = torch.stack([directions[i].vector for i, _ in chunk]).repeat_interleave(b, 0)
                    dose = torch.tensor([a for _, a in chunk], dtype=torch.float32).repeat_interleave(b)
                    src = None if mode != "patch" else sources[layer][idx].repeat(k, 1)
                    hooks = row_hooks(layer, vec, dose, mode=mode, positions=positions, source=src)
                    rows = torch.arange(b).repeat(k)
                    logits, _ = _logits(model, batch, vocab, hooks=hooks, rows=rows, prefix=cache)
                    record(logits, [i for i, _ in chunk for _ in range(b)], [a for _, a in chunk for _ in range(b)])
                    bar.update(b * k)
    bar.close()
    base_d, base_c = diff[-1, 0], choice[-1, 0]
    for i, _ in enumerate(directions):
        for j, a in enumerate(alphas):
            if a == 0.0:
                diff[i, j], choice[i, j] = base_d, base_c
    answer = torch.tensor([s.answer_index for s in stimuli])
    conds = [condition_of(s) for s in stimuli]
    if per_prompt:
        rows_out = []
        for i, d in enumerate(directions):
            for j, a in enumerate(alphas):
                for p in range(n):
                    rows_out.append({"direction": d.name, "source": d.source, "layer": d.layer, "alpha": a,
                                     "prompt": p, "id": stimuli[p].id, "condition": conds[p],
                                     "logit_diff": float(diff[i, j, p]), "choice": int(choice[i, j, p]),
                                     "correct": bool(choice[i, j, p] == answer[p]),
                                     "flipped": bool(choice[i, j, p] != base_c[p])})
        return pd.DataFrame(rows_out)
    masks = {c: torch.tensor([x == c for x in conds]) for c in CONDITIONS}
    out = []
    for i, d in enumerate(directions):
        for j, a in enumerate(alphas):
            for c in CONDITIONS:
                m = masks[c]
                k = int(m.sum())
                if k == 0:
                    continue
                dd = diff[i, j, m].double().numpy()
                out.append({"direction": d.name, "source": d.source, "layer": int(d.layer), "alpha": a,
                            "condition": c, "n": k, "logit_diff": float(dd.mean()),
                            "logit_diff_se": float(dd.std(ddof=1) / np.sqrt(k)) if k > 1 else float("nan"),
                            "accuracy": float((choice[i, j, m] == answer[m]).double().mean()),
                            "flip_rate": float((choice[i, j, m] != base_c[m]).double().mean())})
    return pd.DataFrame(out, columns=list(COLUMNS))


def paired_sources(model: Any, stimuli: Sequence[Any], layers: Sequence[int], *, store: Any = None,
                   batch_size: int | None = None, progress: bool = True) -> dict[int, Tensor]:
    """For mode "patch": per layer, the final-token resid_post of each prompt's partner (same task,
    same question, the other condition), `[n, d]` in stimulus order."""
    from tomlens.activations import cache_activations

    stimuli = list(stimuli)
    key: dict[tuple[str, str, bool], list[int]] = {}
    for i, s in enumerate(stimuli):
        key.setdefault((s.task_id, s.prompt_type, s.reversed), []).append(i)
    partner = []
    for i, s in enumerate(stimuli):
        others = [j for j in key[(s.task_id, s.prompt_type, s.reversed)] if stimuli[j].condition != s.condition]
        if len(others) != 1:
            raise TomlensError(f"stimulus {s.id!r} has {len(others)} prompts of another condition in its task",
                               "patch on families with one false- and one true-belief version of each question "
                               "(e.g. order-only)")
        partner.append(others[0])
    layers = sorted({int(x) for x in layers})
    acts = cache_activations(model, stimuli, " ".join(f"resid_post:{x}" for x in layers), ["final"], store=store,
                             batch_size=batch_size, progress=progress)
    x = acts.get("resid_post", "final")
    stored = acts.layers("resid_post")
    return {layer: x[partner, stored.index(layer)].to(torch.float32) for layer in layers}
