"""Batched caching of chosen sites at chosen token positions into the content-addressed store.

The fast path is the performance rules of the design: prompts sorted by token length (little
padding), `torch.inference_mode()`, the forward stopped right after the last site needed (no final
norm, no unembedding, no KV cache), only the requested positions kept (gathered inside the hook),
results kept on the model's device until a shard is written. A second identical request loads the
shards and never runs the model; an interrupted one resumes from its finished shards. A shard is
written when about `SHARD_BYTES` or `FLUSH_SECONDS` of work are pending, whichever comes first, so a
killed run loses minutes, not hours; the first shards come sooner (`FIRST_FLUSH_SECONDS`, then twice
the wait each time up to the flush interval), so a Ctrl-C in the first minute keeps most of what ran.
A resumed run says how many prompts its finished shards hold, and an interrupted one says how many it
kept and how many it lost. Out of GPU memory, the batch halves and the run goes on.

Shards are cut only between batches, and batches are consecutive slices of one length-sorted order
from the start (or from where a resumed run picks up), so where a shard ends never changes which
prompts share a forward: the numbers do not depend on the flush points.
"""

from __future__ import annotations

import math
import os
import sys
import time
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.activations import store as st
from tomlens.activations.activation_set import ActivationSet, row_labels
from tomlens.devices import dtype_name, parse_dtype, to_device
from tomlens.errors import TomlensError
from tomlens.hooks import check_sites, parse_sites
from tomlens.hooks.capture import capture_via, twin_for
from tomlens.hooks.sites import Site
from tomlens.io import sha256_hex, write_json, write_jsonl
from tomlens.messages import say, warn
from tomlens.models import provenance
from tomlens.models.positions import check_selectors, parse_selectors, token_positions
from tomlens.models.protocol import Model
from tomlens.models.tokens import padded, tokenize
from tomlens.oom import OOM_ERRORS, release_memory
from tomlens.stimuli.records import Stimulus, stimuli_hash

SHARD_BYTES = 256 * 2**20  # a shard is written once this much is pending (bounds memory held)
FLUSH_SECONDS = 120.0  # ... or once this much work is pending (bounds the work a kill loses)
FIRST_FLUSH_SECONDS = 15.0  # the first shard of a run is written this soon (then 30, 60, ... up to the above)
_FINGERPRINTS: dict[int, tuple[Any, dict[str, Any]]] = {}


def work_clock() -> float:
    """What the flush points are timed by (a test may stand in a clock of its own)."""
    return time.perf_counter()


def cache_activations(
    model: Model,
    stimuli: Sequence[Stimulus],
    sites: str | Site | Sequence[str | Site],
    positions: str | Sequence[str],
    *,
    store: str | os.PathLike[str] | None = None,
    batch_size: int | None = None,
    dtype: torch.dtype | str | None = None,
    progress: bool = True,
    shard_rows: int | None = None,
    flush_seconds: float | None = None,
) -> ActivationSet:
    """Cache `sites` (e.g. `"resid_post"`, `"head_out:10-14"`) at `positions` (e.g. `["final",
    "protagonist"]`) for every stimulus, or load them if this exact request was cached before.

    `store`: root folder (default `$TOMLENS_HOME/activations` or the user cache dir); the request
    lives in a sub-folder named by its hash. `dtype`: storage dtype (default: the model's).
    `batch_size`: prompts per forward (default 64 on CUDA, 16 on CPU; halves on out-of-memory).
    `shard_rows` / `flush_seconds`: a shard is written once this many rows (default: about 256 MiB)
    or this many seconds of work (default `FLUSH_SECONDS`, 2 minutes; the first shard sooner, after
    `FIRST_FLUSH_SECONDS`) are pending; neither changes the numbers, and a resumed run may use other values.
    Per-head kinds are cached for every head; pick heads from the loaded tensor.
    """
    root = st.default_store() if store is None else Path(store)
    st.check_writable(root)  # before the model does any work: a read-only store is one clear error
    stimuli = list(stimuli)
    layers, selectors = _validate(model, stimuli, sites, positions)
    flush_seconds = FLUSH_SECONDS if flush_seconds is None else float(flush_seconds)
    if not flush_seconds >= 0 or (shard_rows is not None and shard_rows < 1):
        raise TomlensError(f"shard_rows={shard_rows}, flush_seconds={flush_seconds}: a shard needs at least one row "
                           "and the flush interval cannot be negative",
                           "pass shard_rows >= 1 and flush_seconds >= 0 (0 writes a shard after every batch)")
    model_dtype, device = _model_dtype_device(model)
    store_dtype = parse_dtype(dtype) if isinstance(dtype, str) else (dtype or model_dtype)
    req = _Request.of(model, stimuli, layers, selectors, store_dtype)
    folder = root / req.key
    with st.writer_lock(folder):
        if st.is_complete(folder):
            try:
                return ActivationSet.load(folder, stimuli, reused=True)
            except st.DamagedStore as damaged:  # recompute from the first damaged shard on
                warn(f"{damaged.problem}: recomputing it")
                (folder / st.MANIFEST).unlink()
        st.remove_stale_temps(folder)
        runner = _Runner(model, stimuli, layers, selectors, store_dtype, batch_size or _default_batch_size(device),
                         progress)
        try:
            shards = _run_into_shards(runner, req, folder, shard_rows, flush_seconds)
        finally:
            runner.close()
        write_jsonl((s.to_dict() for s in stimuli), folder / st.STIMULI)
        write_json(req.manifest(stimuli, shards, runner.batch_size), folder / st.MANIFEST, indent=1)  # last: complete
        st.remove_stale_temps(folder)
        return ActivationSet.load(folder, stimuli, reused=False)


@dataclass(frozen=True)
class _Request:
    """What determines the cached numbers (`request`: its hash names the store folder) and what the
    manifest records beside it: the provenance, the tokenizer's fingerprint, the layers per site
    kind, the position selectors, and each kind's per-row shape."""

    request: dict[str, Any]
    key: str
    prov: dict[str, Any]
    tokenizer: dict[str, Any]
    layers: dict[str, list[int]]
    selectors: list[str]
    tail: dict[str, tuple[int, ...]]  # kind -> per-row shape of one layer at one position
    dtype: torch.dtype

    @classmethod
    def of(cls, model: Model, stimuli: list[Stimulus], layers: dict[str, list[int]], selectors: list[str],
           store_dtype: torch.dtype) -> _Request:
        prov, tokenizer = provenance(model), _tokenizer_fingerprint(model)
        request = {
            "format": st.FORMAT,
            "model": {k: v for k, v in prov.items() if k not in ("device", "bos")},
            "prepend_bos": prov["bos"]["prepend"],  # what the model saw; not who chose it
            "tokenizer": tokenizer["hash"],
            "weights": weights_fingerprint(model),
            "dtype": dtype_name(store_dtype),
            "stimuli_hash": stimuli_hash(stimuli),
            "n": len(stimuli),
            "sites": [Site(k, layer).label() for k, ls in layers.items() for layer in ls],
            "positions": selectors,
        }
        tail = {kind: _per_site_shape(model, kind) for kind in layers}
        return cls(request, st.request_key(request), prov, tokenizer, layers, selectors, tail, store_dtype)

    def shapes_for(self, n_rows: int) -> dict[str, tuple[int, ...]]:
        return {st.tensor_name(k, p): (n_rows, len(ls), *self.tail[k]) for k, ls in self.layers.items()
                for p in self.selectors}

    def rows_per_shard(self, shard_rows: int | None) -> int:
        """`shard_rows`, else the rows that make about `SHARD_BYTES` (64 to 16384)."""
        row_bytes = sum(len(self.selectors) * len(ls) * math.prod(self.tail[k]) * self.dtype.itemsize
                        for k, ls in self.layers.items())
        return shard_rows or max(64, min(16384, SHARD_BYTES // row_bytes))

    def manifest(self, stimuli: list[Stimulus], shards: list[dict[str, Any]], batch_size: int) -> dict[str, Any]:
        """`manifest.json`: written last, its presence marks the store complete."""
        return {
            "format": st.FORMAT,
            "complete": True,
            "key": self.key,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model": self.prov,
            "tokenizer": self.tokenizer,
            "dtype": self.request["dtype"],
            "stimuli_hash": self.request["stimuli_hash"],
            "n": len(stimuli),
            "sites": self.request["sites"],
            "layers": self.layers,
            "positions": self.selectors,
            "shapes": {k: list(v) for k, v in self.shapes_for(len(stimuli)).items()},
            "shards": shards,  # stretches [start, stop) of the length-sorted run order
            "batch_size": batch_size,
            "rows": [row_labels(s) for s in stimuli],
        }


def _run_into_shards(runner: _Runner, req: _Request, folder: Path, shard_rows: int | None,
                     flush_seconds: float) -> list[dict[str, Any]]:
    """Keep the shards an interrupted run finished, run the rest and write each new shard as it
    fills; the shard list, in run order."""
    order = runner.measure()  # fails on a bad span before any forward
    shards = _finished_shards(folder, req.key, order, req.shapes_for)
    st.remove_shards_from(folder, len(shards))
    start = shards[-1]["stop"] if shards else 0
    if 0 < start < len(order):
        say(f"resuming: {start} of {len(order)} prompts done (in {len(shards)} finished shards under {folder})")
    try:
        for a, b, rows, tensors in runner.shards(order, start, req.rows_per_shard(shard_rows), flush_seconds):
            name = st.shard_file(len(shards))
            st.write_shard(folder / name, {**tensors, st.ROWS: rows}, st.shard_meta(req.key, len(shards), a, b))
            shards.append({"file": name, "start": a, "stop": b})
    except KeyboardInterrupt:
        warn(interrupted_message(shards[-1]["stop"] if shards else 0, runner.done, len(order), folder))
        raise
    return shards


def interrupted_message(kept: int, ran: int, total: int, folder: Path) -> str:
    """What an interrupted cache says, truthfully: how many prompts its finished shards keep and how
    many that ran since the last shard are lost (`ran`: prompts whose forward finished)."""
    lost = max(0, ran - kept)
    if kept == 0:
        return (f"stopped: nothing kept ({lost} of {total} prompts had run, none in a finished shard yet); "
                "the same command starts again from the beginning")
    text = f"stopped: {kept} of {total} prompts kept in finished shards under {folder}"
    if lost:
        text += f"; the {lost} run since the last shard are lost"
    return text + "; run the same command again to resume"

def _validate(
    model: Model, stimuli: list[Stimulus], sites: Any, positions: Any
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


def _finished_shards(
    folder: Path, key: str, order: list[int], shapes_for: Callable[[int], dict[str, tuple[int, ...]]]
) -> list[dict[str, Any]]:
    """The shards an interrupted run finished, in order, while each continues the one before and
    holds exactly the rows the run order puts there; work resumes where the last one stops."""
    shards: list[dict[str, Any]] = []
    start = 0
    while start < len(order):
        name = st.shard_file(len(shards))
        got = st.read_finished_shard(folder / name, st.shard_meta(key, len(shards), start), shapes_for)
        if got is None or got[1] > len(order) or got[2].tolist() != sorted(order[start : got[1]]):
            break
        shards.append({"file": name, "start": start, "stop": got[1]})
        start = got[1]
    return shards


def _model_dtype_device(model: Model) -> tuple[torch.dtype, torch.device]:
    p = next(model.parameters())
    return p.dtype, p.device


def _default_batch_size(device: torch.device) -> int:
    return 64 if device.type == "cuda" else 16


def _per_site_shape(model: Model, kind: str) -> tuple[int, ...]:
    cfg = model.cfg
    if kind == "z":
        return (int(cfg.n_heads), int(cfg.d_head))
    if kind == "head_out":
        return (int(cfg.n_heads), int(cfg.d_model))
    return (int(cfg.d_model),)


def weights_fingerprint(model: Model, per_tensor: int = 256) -> str:
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
    return sha256_hex("|".join(names).encode() + values, 24)


def _tokenizer_fingerprint(model: Model) -> dict[str, Any]:
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

    def __init__(self, model: Model, stimuli: list[Stimulus], layers: dict[str, list[int]], selectors: list[str],
                 dtype: torch.dtype, batch_size: int, progress: bool):
        self.model, self.stimuli, self.layers, self.selectors, self.dtype = model, stimuli, layers, selectors, dtype
        self.device = _model_dtype_device(model)[1]
        self.sites = [Site(k, layer) for k, ls in layers.items() for layer in ls]
        self.plain = twin_for(model, self.sites)  # asked once: nothing changes the model between batches
        self.batch_size = max(1, int(batch_size))
        self.progress = progress
        self.bar: tqdm | None = None  # made once the rows left to run are known
        self.tokens = 0
        self.start = time.perf_counter()
        self.ids: dict[int, array[int]] = {}  # row -> its token ids, kept from `measure` (4 bytes a token)
        self.at: dict[int, list[int]] = {}  # row -> unpadded token index of each selector
        self.done = 0  # prompts of the run order whose forward finished (resumed ones included)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def measure(self, chunk: int = 2048) -> list[int]:
        """The run order, rows sorted by token count (ties by row), before any forward: every row is
        tokenized here, once, and its positions resolved on the host (so a span no token covers
        fails before any forward); the batches reuse both."""
        for c in range(0, len(self.stimuli), chunk):
            rows = self.stimuli[c : c + chunk]
            ids, offsets = tokenize(self.model, [s.text for s in rows])
            for r, row_ids, at in zip(range(c, c + len(rows)), ids, token_positions(rows, offsets, self.selectors),
                                      strict=True):
                self.ids[r], self.at[r] = array("i", row_ids), at
        return sorted(range(len(self.stimuli)), key=lambda r: (len(self.ids[r]), r))

    def shards(
        self, order: list[int], start: int, rows_per: int, flush_seconds: float
    ) -> Iterator[tuple[int, int, Tensor, dict[str, Tensor]]]:
        """Run `order[start:]` batch by batch; yield `(a, b, rows, tensors)` for the stretch
        `order[a:b]` each time `rows_per` rows or `flush_seconds` of work are pending (the first
        after `FIRST_FLUSH_SECONDS`, each wait then doubling up to `flush_seconds`), and at the end.
        `rows` are the caller's row indices, ascending, and `tensors` hold them in that order."""
        bar = self.bar = tqdm(total=len(order), initial=start, desc="caching", unit="prompt",
                              disable=not self.progress or start == len(order))
        parts: dict[str, list[Tensor]] = defaultdict(list)
        a = pos = self.done = start
        since = work_clock()
        wait = min(flush_seconds, FIRST_FLUSH_SECONDS)  # early shards first: an early Ctrl-C keeps them
        while pos < len(order):
            rows = order[pos : pos + self.batch_size]
            try:
                out = self._run_batch(rows)
            except OOM_ERRORS:
                if self.batch_size == 1:
                    raise TomlensError("out of GPU memory with a batch of one prompt",
                                       "use a smaller model, a shorter prompt, or a GPU with more memory") from None
                self.batch_size = max(1, self.batch_size // 2)
                release_memory()
                bar.write(f"out of memory: batch size now {self.batch_size}", file=sys.stderr)
                continue
            for kind, ls in self.layers.items():
                stacked = torch.stack([out[Site(kind, layer)] for layer in ls], dim=2)  # [b, sel, layer, ...]
                parts[kind].append(to_host_async(stacked))
            del out
            pos += len(rows)
            self.done = pos
            self.tokens += sum(len(self.ids[r]) for r in rows)
            bar.update(len(rows))
            bar.set_postfix(tok_s=f"{self.tokens / max(1e-9, time.perf_counter() - self.start):.0f}",
                            batch=self.batch_size, refresh=False)
            if pos == len(order) or pos - a >= rows_per or work_clock() - since >= wait:
                wait_for_host_copies(self.device)  # the one sync of a shard: its copies have landed
                yield a, pos, *self._in_row_order(order[a:pos], parts)
                parts, a, since = defaultdict(list), pos, work_clock()
                wait = min(flush_seconds, 2 * wait)

    def _run_batch(self, rows: list[int]) -> dict[Site, torch.Tensor]:
        batch = padded(self.model, [self.ids[r] for r in rows])
        at = [[pad + i for i in self.at[r]] for pad, r in zip(batch.pad, rows, strict=True)]
        pos = to_device(torch.tensor(at, dtype=torch.long), batch.input_ids.device)
        with torch.inference_mode():
            return capture_via(self.plain, self.model, batch, self.sites, pos, dtype=self.dtype)


    def _in_row_order(self, ran: list[int], parts: dict[str, list[Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:
        """Rows `ran` (run order) sorted back into the caller's order, one tensor per (kind, selector);
        all on the host already (`to_host_async`)."""
        back = torch.tensor(sorted(range(len(ran)), key=ran.__getitem__), dtype=torch.long)
        tensors = {}
        for kind in list(parts):
            full = torch.cat(parts.pop(kind))[back]  # [rows, sel, layer, ...]
            for j, sel in enumerate(self.selectors):
                tensors[st.tensor_name(kind, sel)] = full[:, j].contiguous()
        return torch.tensor(sorted(ran), dtype=torch.long), tensors


def to_host_async(tensor: Tensor) -> Tensor:
    """`tensor` copied to the host without waiting: on CUDA into pinned memory, non-blocking, so the
    next batch's kernels queue behind the copy; `wait_for_host_copies` before reading it."""
    if tensor.device.type != "cuda":
        return tensor.to("cpu")
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


def wait_for_host_copies(device: torch.device) -> None:
    """Wait once for every copy `to_host_async` queued on `device` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
