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
Nothing in the loop waits for the GPU: the vectors, sources and answer columns are put on the
device before it (built on the host), every run's result stays there, and the whole table comes to
the host in one copy at the end of the call, where the summary is computed in numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.hooks.patch import forward_last
from tomlens.messages import warn
from tomlens.models.protocol import Model
from tomlens.models.tokens import encode, option_first_tokens
from tomlens.steering.directions import Direction
from tomlens.steering.interventions import check_directions, check_mode, model_device, row_hooks

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


def _logits(model: Model, batch: Any, vocab: Tensor, *, hooks: Sequence[Any] = (), rows: Tensor | None = None,
            prefix: Any = None, keep_cache: bool = False) -> tuple[Tensor, Any]:
    start = batch.input_ids.shape[1] - 1 if prefix is not None else 0
    logits, cache = forward_last(model, batch.input_ids, batch.forward_kwargs(), list(hooks), rows=rows,
                                 prefix=prefix, start=start, keep_cache=keep_cache, vocab=vocab)
    return logits.float(), cache


def dose_response(model: Model, stimuli: Sequence[Any], directions: Sequence[Direction], alphas: Sequence[float], *,
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
        _check_patch_sources(positions, directions, sources, len(stimuli))
    steer = _Steer.of(model, directions, alphas, mode, positions, sources, batch_size, rows_per_forward)
    runs = steer.run(stimuli, progress)
    diff, choice = runs.to_host(len(stimuli), len(alphas))
    base_d, base_c = diff[-1, 0], choice[-1, 0]
    zero = [j for j, a in enumerate(alphas) if a == 0.0]  # alpha 0 is the unhooked run
    diff[:-1, zero], choice[:-1, zero] = base_d, base_c
    answer = np.array([s.answer_index for s in stimuli])
    conds = [condition_of(s) for s in stimuli]
    if per_prompt:
        return _per_prompt_table(directions, alphas, stimuli, conds, diff[:-1], choice[:-1], answer, base_c)
    return _summary_table(directions, alphas, conds, diff[:-1], choice[:-1], answer, base_c)


def _check_patch_sources(positions: str, directions: Sequence[Direction],
                         sources: Mapping[int, Tensor] | None, n: int) -> None:
    """Mode "patch" here: the final position, and one source row per prompt for every layer steered."""
    if positions != "final":
        raise TomlensError("mode 'patch' is run at the final position here",
                           "use positions = 'final', or the `steering` context manager with [n, pos, d] sources")
    missing = sorted({d.layer for d in directions} - set(sources or {}))
    if missing:
        raise TomlensError(f"mode 'patch' needs source activations for layers {missing}",
                           "pass sources = paired_sources(model, stimuli, layers)")
    for layer, t in (sources or {}).items():
        if t.shape[0] != n:
            raise TomlensError(f"sources for layer {layer} have {t.shape[0]} rows for {n} prompts",
                               "pass one source row per prompt, in stimulus order")


@dataclass(frozen=True)
class _Steer:
    """One dose-response call's settings, with every direction's vector and every patch source
    on the model's device once (a chunk's rows index them there). `by_layer`: the steered
    (direction, alpha) pairs of each layer (alpha 0 is the unhooked run, not steered);
    `per_fwd`: the rows one steered forward may hold."""

    model: Any
    directions: list[Direction]
    alphas: list[float]
    mode: str
    positions: str
    batch_size: int
    per_fwd: int
    by_layer: dict[int, list[tuple[int, float]]]
    vectors: Tensor
    on_device: dict[int, Tensor]
    device: torch.device

    @classmethod
    def of(cls, model: Model, directions: list[Direction], alphas: list[float], mode: str, positions: str,
           sources: Mapping[int, Tensor] | None, batch_size: int, rows_per_forward: int | None) -> _Steer:
        by_layer: dict[int, list[tuple[int, float]]] = {}
        for i, direction in enumerate(directions):
            for a in alphas:
                if a != 0.0:
                    by_layer.setdefault(int(direction.layer), []).append((i, a))
        batch_size = max(1, int(batch_size))
        device = model_device(model)
        vectors = to_device(torch.stack([d.vector.to(torch.float32) for d in directions]), device)
        on_device = {layer: to_device(t, device) for layer, t in (sources or {}).items() if layer in by_layer}
        return cls(model, directions, alphas, mode, positions, batch_size,
                   max(batch_size, int(rows_per_forward or 4 * batch_size)), by_layer, vectors, on_device, device)

    def run(self, stimuli: list[Any], progress: bool) -> _Runs:
        """Every prompt unhooked, then at every steered (direction, alpha), batch by batch in
        length order; each batch's prompt is run once and reused by its steered passes."""
        start_opt, now_opt = option_roles(stimuli)
        first = option_first_tokens(self.model, stimuli, [tuple(s.options) for s in stimuli]).tolist()  # [n, 2], host
        n = len(stimuli)
        total = count_passes(n, len(self.directions), self.alphas)
        if progress:
            warn(f"steering: {len(self.directions)} directions x {sum(a != 0 for a in self.alphas)} non-zero "
                       f"alphas x {n} prompts + {n} unsteered = {total} forward passes ({self.mode}, "
                       f"{self.positions} position)")
        bar = tqdm(total=total, desc="steering", unit="pass", disable=not progress)
        order = sorted(range(n), key=lambda i: (len(stimuli[i].text), i))
        runs = _Runs(len(self.directions), {a: j for j, a in enumerate(self.alphas)})
        with torch.inference_mode():
            for b0 in range(0, n, self.batch_size):
                idx = order[b0 : b0 + self.batch_size]
                batch = encode(self.model, [stimuli[i].text for i in idx])
                answers = _AnswerColumns.of([first[i] for i in idx], [start_opt[i] for i in idx],
                                            [now_opt[i] for i in idx], self.device)
                base, cache = _logits(self.model, batch, answers.vocab, keep_cache=self.positions == "final")
                runs.add(answers.read(base, 1), [len(self.directions)] * len(idx), [self.alphas[0]] * len(idx), idx)
                bar.update(len(idx))
                self._steer_batch(batch, answers, cache, idx, runs, bar)
        bar.close()
        return runs

    def _steer_batch(self, batch: Any, answers: _AnswerColumns, cache: Any, idx: list[int], runs: _Runs,
                     bar: Any) -> None:
        """The batch's prompts at every steered (direction, alpha), as many combinations a forward
        as `per_fwd` rows allow, from the cached unhooked prefix."""
        b, device = len(idx), self.device
        rows_of = to_device(torch.tensor(idx, dtype=torch.long), device) if self.on_device else None
        for layer, combos in sorted(self.by_layer.items()):
            per = max(1, self.per_fwd // b)
            for c0 in range(0, len(combos), per):
                chunk = combos[c0 : c0 + per]
                k = len(chunk)
                which = to_device(torch.tensor([i for i, _ in chunk], dtype=torch.long), device)
                vec = self.vectors.index_select(0, which).repeat_interleave(b, 0)
                dose = to_device(torch.tensor([a for _, a in chunk], dtype=torch.float32), device)
                dose = dose.repeat_interleave(b)
                src = (None if self.mode != "patch" or rows_of is None
                       else self.on_device[layer].index_select(0, rows_of).repeat(k, 1))
                hooks = row_hooks(layer, vec, dose, mode=self.mode, positions=self.positions, source=src)
                rows = torch.arange(b, device=device).repeat(k)
                logits, _ = _logits(self.model, batch, answers.vocab, hooks=hooks, rows=rows, prefix=cache)
                runs.add(answers.read(logits, k), [i for i, _ in chunk for _ in range(b)],
                         [a for _, a in chunk for _ in range(b)], idx * k)
                bar.update(b * k)

@dataclass(frozen=True)
class _AnswerColumns:
    """A batch's answer tokens, laid out on the host and moved once: `vocab` (the option tokens,
    once each, sorted: the only logits a forward computes), and per prompt the columns of its two
    options in `vocab` (`inv`), in the full vocabulary (`toks`, for a model whose unembedding cannot be
    narrowed), and which of the two is the start (`start`) and the current location (`now`)."""

    vocab: Int[Tensor, " v"]
    inv: Int[Tensor, "b 2"]
    toks: Int[Tensor, "b 2"]
    start: Int[Tensor, " b"]
    now: Int[Tensor, " b"]

    @classmethod
    def of(cls, toks: list[list[int]], start: list[int], now: list[int], device: torch.device) -> _AnswerColumns:
        vocab = sorted({t for pair in toks for t in pair})
        where = {t: j for j, t in enumerate(vocab)}
        inv = [[where[a], where[b]] for a, b in toks]
        return cls(*(to_device(torch.tensor(x, dtype=torch.long), device) for x in (vocab, inv, toks, start, now)))

    def read(self, logits: Float[Tensor, "r v"], k: int) -> Float[Tensor, "2 r"]:
        """[start-minus-now logit difference, chosen option (0 or 1)] of every row of `k` stacked
        copies of the batch, on the device."""
        cols = (self.inv if logits.shape[-1] == self.vocab.numel() else self.toks).repeat(k, 1)
        two = logits.gather(1, cols)  # [r, 2]: first-token logits of option a and b
        rr = torch.arange(two.shape[0], device=two.device)
        d = two[rr, self.start.repeat(k)] - two[rr, self.now.repeat(k)]
        c = (two[:, 1] > two[:, 0]).to(d.dtype)
        return torch.stack([d, c])


class _Runs:
    """Every run's (logit difference, choice) kept on the device with where it goes (direction,
    alpha, prompt: host lists), moved to the host once at the end of the call."""

    def __init__(self, n_directions: int, a_index: Mapping[float, int]):
        self.n_directions = n_directions
        self.a_index = a_index
        self.values: list[Tensor] = []
        self.at: tuple[list[int], list[int], list[int]] = ([], [], [])

    def add(self, values: Float[Tensor, "2 r"], directions: list[int], alphas: list[float], prompts: list[int]) -> None:
        self.values.append(values)
        self.at[0].extend(directions)
        self.at[1].extend(self.a_index[a] for a in alphas)
        self.at[2].extend(prompts)

    def to_host(self, n: int, n_alphas: int) -> tuple[np.ndarray, np.ndarray]:
        """`diff` (float32) and `choice` (int64, -1 where not run) as `[direction + 1, alpha, prompt]`
        arrays, the last "direction" the unhooked run."""
        host = torch.cat(self.values, 1).cpu().numpy()
        diff = np.full((self.n_directions + 1, n_alphas, n), np.nan, dtype=np.float32)
        choice = np.full((self.n_directions + 1, n_alphas, n), -1, dtype=np.int64)
        diff[self.at], choice[self.at] = host[0], host[1].astype(np.int64)
        return diff, choice


def _per_prompt_table(directions: Sequence[Direction], alphas: Sequence[float], stimuli: Sequence[Any],
                      conds: list[str], diff: np.ndarray, choice: np.ndarray, answer: np.ndarray,
                      base_c: np.ndarray) -> pd.DataFrame:
    """One row per direction x alpha x prompt (in that order), from host arrays."""
    n_dir, n_alpha, n = diff.shape
    each = n_alpha * n
    return pd.DataFrame({
        "direction": np.repeat([d.name for d in directions], each).tolist(),
        "source": np.repeat([d.source for d in directions], each).tolist(),
        "layer": np.repeat(np.array([d.layer for d in directions], dtype=np.int64), each),
        "alpha": np.tile(np.repeat(np.array(alphas, dtype=np.float64), n), n_dir),
        "prompt": np.tile(np.arange(n, dtype=np.int64), n_dir * n_alpha),
        "id": [stimuli[p].id for p in range(n)] * (n_dir * n_alpha),
        "condition": conds * (n_dir * n_alpha),
        "logit_diff": diff.reshape(-1).astype(np.float64),
        "choice": choice.reshape(-1),
        "correct": (choice == answer[None, None, :]).reshape(-1),
        "flipped": (choice != base_c[None, None, :]).reshape(-1),
    })


def _summary_table(directions: Sequence[Direction], alphas: Sequence[float], conds: list[str], diff: np.ndarray,
                   choice: np.ndarray, answer: np.ndarray, base_c: np.ndarray) -> pd.DataFrame:
    """One row per direction x alpha x condition (conditions with prompts only), from host arrays:
    no tensor is read here. Rates are computed for every (direction, alpha) at once; the mean and
    standard error one row at a time, as numpy sums a 1-d array (pairwise), so they stay bit for bit
    what they were."""
    out = []
    masks = {c: np.array([x == c for x in conds], dtype=bool) for c in CONDITIONS}
    acc = {c: (choice[:, :, m] == answer[m]).mean(-1) for c, m in masks.items() if m.any()}
    flip = {c: (choice[:, :, m] != base_c[m]).mean(-1) for c, m in masks.items() if m.any()}
    for i, d in enumerate(directions):
        for j, a in enumerate(alphas):
            for c, m in masks.items():
                k = int(m.sum())
                if k == 0:
                    continue
                dd = diff[i, j, m].astype(np.float64)
                out.append({"direction": d.name, "source": d.source, "layer": int(d.layer), "alpha": a,
                            "condition": c, "n": k, "logit_diff": float(dd.mean()),
                            "logit_diff_se": float(dd.std(ddof=1) / np.sqrt(k)) if k > 1 else float("nan"),
                            "accuracy": float(acc[c][i, j]), "flip_rate": float(flip[c][i, j])})
    return pd.DataFrame(out, columns=list(COLUMNS))


def paired_sources(model: Model, stimuli: Sequence[Any], layers: Sequence[int], *, store: Any = None,
                   batch_size: int | None = None, progress: bool = True) -> dict[int, Tensor]:
    """For mode "patch": per layer, the final-token resid_post of each prompt's partner (same task,
    same question, the other condition), `[n, d]` in stimulus order."""
    from tomlens.activations import cache_activations

    stimuli = list(stimuli)
    key: dict[tuple[str, str, bool], list[int]] = {}
    for i, s in enumerate(stimuli):
        key.setdefault((s.task_id, s.prompt_type, s.reversed), []).append(i)
    partner = []
    for s in stimuli:
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
