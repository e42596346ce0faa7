"""Batched caching of chosen sites at chosen token positions into the content-addressed store.

The fast path is the performance rules of the design: prompts sorted by token length (little
padding), `torch.inference_mode()`, the forward stopped right after the last site needed (no final
norm, no unembedding, no KV cache), only the requested positions kept (gathered inside the hook),
results kept on the model's device until a shard is written. A second identical request loads the
shards and never runs the model; an interrupted one resumes from its finished shards. Out of GPU
memory, the batch halves and the run goes on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tomlens.activations import store as st
from tomlens.activations.activation_set import ActivationSet, row_labels
from tomlens.errors import TomlensError
from tomlens.hooks import capture, check_selectors, check_sites, parse_selectors, parse_sites, resolve_positions
from tomlens.hooks.sites import Site
from tomlens.models import encode, provenance
from tomlens.stimuli.records import Stimulus, stimuli_hash

SHARD_BYTES = 256 * 2**20  # target shard size; bounds the work an interruption loses
_OOM_ERRORS: tuple[type[BaseException], ...] = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError}
)
_FINGERPRINTS: dict[int, tuple[Any, dict[str, Any]]] = {}


def cache_activations(
    model: Any,
    stimuli: Sequence[Stimulus],
    sites: str | Site | Sequence[str | Site],
    positions: str | Sequence[str],
    *,
    store: str | os.PathLike[str] | None = None,
    batch_size: int | None = None,
    dtype: torch.dtype | str | None = None,
    progress: bool = True,
    shard_rows: int | None = None,
) -> ActivationSet:
    """Cache `sites` (e.g. `"resid_post"`, `"head_out:10-14"`) at `positions` (e.g. `["final",
    "protagonist"]`) for every stimulus, or load them if this exact request was cached before.

    `store`: root folder (default `$TOMLENS_HOME/activations` or the user cache dir); the request
    lives in a sub-folder named by its hash. `dtype`: storage dtype (default: the model's).
    `batch_size`: prompts per forward (default 64 on CUDA, 16 on CPU; halves on out-of-memory).
    `shard_rows`: rows per shard (default: about 256 MiB per shard); fixed by the first run.
    Per-head kinds are cached for every head; pick heads from the loaded tensor.
    """
    stimuli = list(stimuli)
    layers, selectors = _validate(model, stimuli, sites, positions)
    model_dtype, device = _model_dtype_device(model)
    store_dtype = st.dtype_from_name(dtype) if isinstance(dtype, str) else (dtype or model_dtype)
    prov, tokenizer = provenance(model), _tokenizer_fingerprint(model)
    request = {
        "format": st.FORMAT,
        "model": {k: v for k, v in prov.items() if k != "device"},
        "tokenizer": tokenizer["hash"],
        "weights": weights_fingerprint(model),
        "dtype": st.dtype_to_name(store_dtype),
        "stimuli_hash": stimuli_hash(stimuli),
        "n": len(stimuli),
        "sites": [Site(k, layer).label() for k, ls in layers.items() for layer in ls],
        "positions": selectors,
    }
    key = st.request_key(request)
    folder = (st.default_store() if store is None else Path(store)) / key
    if st.is_complete(folder):
        return ActivationSet.load(folder, stimuli, reused=True)
    folder.mkdir(parents=True, exist_ok=True)
    st.remove_stale_temps(folder)

    tail = {kind: _per_site_shape(model, kind) for kind in layers}
    row_bytes = sum(len(selectors) * len(ls) * math.prod(tail[k]) * store_dtype.itemsize for k, ls in layers.items())
    plan = _plan(folder, key, request, len(stimuli), shard_rows or max(64, min(16384, SHARD_BYTES // row_bytes)))

    def shapes_for(n_rows: int) -> dict[str, tuple[int, ...]]:
        return {st.tensor_name(k, p): (n_rows, len(ls), *tail[k]) for k, ls in layers.items() for p in selectors}

    def meta_for(i: int, a: int, b: int) -> dict[str, str]:
        return {"key": key, "shard": str(i), "start": str(a), "stop": str(b), "format": str(st.FORMAT)}

    todo = [(i, a, b) for i, (a, b) in enumerate(plan["shards"])
            if not st.shard_is_valid(folder / st.shard_file(i), meta_for(i, a, b), shapes_for(b - a))]
    runner = _Runner(model, stimuli, layers, selectors, store_dtype, batch_size or _default_batch_size(device),
                     progress, total=sum(b - a for _, a, b in todo))
    try:
        runner.measure([(a, b) for _, a, b in todo])  # fails on a bad span before any forward
        for i, a, b in todo:
            st.write_shard(folder / st.shard_file(i), runner.run_rows(a, b), meta_for(i, a, b))
    finally:
        runner.close()

    st.write_text(folder / st.STIMULI, "".join(json.dumps(s.to_dict(), ensure_ascii=False) + "\n" for s in stimuli))
    st.write_json(folder / st.MANIFEST, {  # written last: its presence marks the store complete
        "format": st.FORMAT,
        "complete": True,
        "key": key,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": prov,
        "tokenizer": tokenizer,
        "dtype": request["dtype"],
        "stimuli_hash": request["stimuli_hash"],
        "n": len(stimuli),
        "sites": request["sites"],
        "layers": layers,
        "positions": selectors,
        "shapes": {k: list(v) for k, v in shapes_for(len(stimuli)).items()},
        "shards": [{"file": st.shard_file(i), "start": a, "stop": b} for i, (a, b) in enumerate(plan["shards"])],
        "batch_size": runner.batch_size,
        "rows": [row_labels(s) for s in stimuli],
    })
    st.remove_stale_temps(folder)
    return ActivationSet.load(folder, stimuli, reused=False)


def _validate(
    model: Any, stimuli: list[Stimulus], sites: Any, positions: Any
) -> tuple[dict[str, list[int]], list[str]]:
    """Check the request before anything runs; return {kind: sorted layers} and the selectors."""
    if not stimuli:
        raise TomlensError("no stimuli to cache", "pass at least one stimulus")
    ids = [s.id for s in stimuli]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise TomlensError(f"stimulus id {dup!r} appears more than once",
                           "give every stimulus a unique id: rows are traced back by id")
    site_list = parse_sites(sites, int(model.cfg.n_layers))
    for site in site_list:
        if site.head is not None:
            raise TomlensError(f"site {site} names one head; the cache stores every head of {site.kind}",
                               f"ask for {site.kind}:{site.layer} and index the head axis after loading")
    check_sites(model, site_list)
    selectors = parse_selectors(positions)
    check_selectors(stimuli, selectors)
    layers: dict[str, list[int]] = defaultdict(list)
    for site in site_list:
        layers[site.kind].append(site.layer)
    return {k: sorted(v) for k, v in layers.items()}, selectors


def _plan(folder: Path, key: str, request: dict[str, Any], n: int, rows_per: int) -> dict[str, Any]:
    """Rows per shard, fixed by the first run of a request so that a resume cuts the same shards."""
    plan = st.read_json(folder / st.PLAN)
    if not plan or plan.get("key") != key:
        bounds = [[a, min(a + rows_per, n)] for a in range(0, n, rows_per)]
        plan = {"key": key, "request": request, "shard_rows": rows_per, "shards": bounds}
        st.write_json(folder / st.PLAN, plan)
    return plan


def _model_dtype_device(model: Any) -> tuple[torch.dtype, torch.device]:
    p = next(model.parameters())
    return p.dtype, p.device


def _default_batch_size(device: torch.device) -> int:
    return 64 if device.type == "cuda" else 16


def _per_site_shape(model: Any, kind: str) -> tuple[int, ...]:
    cfg = model.cfg
    if kind == "z":
        return (int(cfg.n_heads), int(cfg.d_head))
    if kind == "head_out":
        return (int(cfg.n_heads), int(cfg.d_model))
    return (int(cfg.d_model),)


def weights_fingerprint(model: Any, per_tensor: int = 256) -> str:
    """Hash of `per_tensor` evenly spaced values of every parameter (one transfer from the device).

    The provenance names the weights only as well as the loader knew them (a model built by hand
    has revision "unknown"); this keeps two different sets of weights from sharing a cache key."""
    names, samples = [], []
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            k = min(per_tensor, flat.numel())
            idx = torch.arange(k, device=flat.device) * (flat.numel() - 1) // max(k - 1, 1)
            samples.append(flat[idx].float())
            names.append(f"{name}:{tuple(p.shape)}")
    values = torch.cat(samples).cpu().numpy().tobytes() if samples else b""
    return hashlib.sha256("|".join(names).encode() + values).hexdigest()[:24]


def _tokenizer_fingerprint(model: Any) -> dict[str, Any]:
    """Name, class, size and a hash of the vocabulary (computed once per tokenizer object)."""
    tok = model.tokenizer
    hit = _FINGERPRINTS.get(id(tok))
    if hit is not None and hit[0] is tok:
        return {**hit[1], "padding_side": tok.padding_side}
    vocab = sorted(tok.get_vocab().items())
    backend = getattr(tok, "backend_tokenizer", None)
    pipeline = backend.to_str() if backend is not None else None  # merges, normaliser, pre-tokeniser
    digest = st.request_key({"vocab": vocab, "bos": tok.bos_token, "pad": tok.pad_token,
                             "add_bos": getattr(tok, "add_bos_token", None), "pipeline": pipeline})
    info = {"name": getattr(tok, "name_or_path", None), "class": type(tok).__name__,
            "vocab_size": len(vocab), "hash": digest}
    _FINGERPRINTS[id(tok)] = (tok, info)
    return {**info, "padding_side": tok.padding_side}


class _Runner:
    """Runs rows in length-sorted batches, halving the batch on out-of-memory, with a progress bar."""

    def __init__(self, model: Any, stimuli: list[Stimulus], layers: dict[str, list[int]], selectors: list[str],
                 dtype: torch.dtype, batch_size: int, progress: bool, total: int):
        self.model, self.stimuli, self.layers, self.selectors, self.dtype = model, stimuli, layers, selectors, dtype
        self.sites = [Site(k, layer) for k, ls in layers.items() for layer in ls]
        self.batch_size = max(1, int(batch_size))
        self.bar = tqdm(total=total, desc="caching", unit="prompt", disable=not progress or total == 0)
        self.tokens = 0
        self.start = time.perf_counter()
        self.lengths: dict[int, int] = {}

    def close(self) -> None:
        self.bar.close()

    def measure(self, ranges: list[tuple[int, int]], chunk: int = 2048) -> None:
        """Token count of every row to run, before any forward: also fails early on a span no token covers."""
        for a, b in ranges:
            for c in range(a, b, chunk):
                rows = self.stimuli[c : min(b, c + chunk)]
                batch = encode(self.model, [s.text for s in rows])
                resolve_positions(rows, batch, self.selectors)
                self.lengths.update(zip(range(c, c + len(rows)), batch.lengths))

    def run_rows(self, a: int, b: int) -> dict[str, torch.Tensor]:
        """Activations of rows a..b in the caller's order: {"kind@position": [rows, layer, ...]} on the CPU."""
        order = sorted(range(a, b), key=lambda r: (self.lengths[r], r))
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        done: list[int] = []
        while len(done) < len(order):
            rows = order[len(done) : len(done) + self.batch_size]
            try:
                out = self._run_batch(rows)
            except _OOM_ERRORS:
                if self.batch_size == 1:
                    raise TomlensError("out of GPU memory with a batch of one prompt",
                                       "use a smaller model, a shorter prompt, or a GPU with more memory") from None
                self.batch_size = max(1, self.batch_size // 2)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.bar.write(f"out of memory: batch size now {self.batch_size}")
                continue
            for kind, ls in self.layers.items():
                stacked = torch.stack([out[Site(kind, layer)] for layer in ls], dim=2)  # [b, sel, layer, ...]
                for j, sel in enumerate(self.selectors):
                    parts[st.tensor_name(kind, sel)].append(stacked[:, j])
            del out
            done.extend(rows)
            self.tokens += sum(self.lengths[r] for r in rows)
            self.bar.update(len(rows))
            self.bar.set_postfix(tok_s=f"{self.tokens / max(1e-9, time.perf_counter() - self.start):.0f}",
                                 batch=self.batch_size, refresh=False)
        # Put rows back in the caller's order, then move to the CPU once per shard.
        back = torch.argsort(torch.tensor(done, dtype=torch.long) - a)
        tensors = {}
        for name in list(parts):
            full = torch.cat(parts.pop(name))
            tensors[name] = full[back.to(full.device)].to("cpu")
        return tensors

    def _run_batch(self, rows: list[int]) -> dict[Site, torch.Tensor]:
        chunk = [self.stimuli[r] for r in rows]
        batch = encode(self.model, [s.text for s in chunk])
        pos = resolve_positions(chunk, batch, self.selectors)
        with torch.inference_mode():
            return capture(self.model, batch, self.sites, pos, dtype=self.dtype)
