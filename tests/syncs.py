"""Count, on a CPU, the operations that would make a CUDA run wait for the GPU (host syncs).

On a GPU every `.item()`, `int(t)`, `bool(t)`, `nonzero`, boolean-mask index or device-to-host copy
drains the queue: the host stops until all queued kernels have run, so a hot loop with one per row
runs as many short bursts with the GPU idle between them. On a CPU they cost nothing and so are
invisible in timings, but they still go through PyTorch's dispatcher, where a `TorchDispatchMode`
sees them. `SyncCounter` counts them per op, so a test can hold a hot loop to a count that does
not grow with the batch size, the layers, the heads, the positions or the pairs.

What it sees:
  - `_local_scalar_dense`: `.item()`, `int(t)`, `float(t)`, `bool(t)` (a Python `if t:` too);
  - `nonzero` (also what boolean-mask indexing and `torch.where(cond)` run), `masked_select`,
    `equal`, `unique` and its variants, `is_nonzero`;
  - a copy from a non-CPU device to the CPU (`_to_copy` / `copy_`), where the run is on a device;
  - with `methods=True` (the default), every call of `Tensor.tolist`, `Tensor.numpy` and
    `Tensor.cpu` on any tensor: on a CPU these are not dispatched (the data is already on the
    host), but in a hot loop over device tensors each would be a sync on CUDA;
  - `Tensor.item`, `int(t)`, `float(t)`, `bool(t)` and `t.__index__()` as Python calls too: under
    `torch.inference_mode()` a CPU tensor's scalar read skips the dispatcher (the mode never sees
    it), so these are counted where they are called, once, as `_local_scalar_dense` / `is_nonzero`.
What it cannot see: `.to("cpu")` / `.to(device)` (on a CPU run every device is the host, so a move
to the model's device and a move to the host look alike; the gpu tier's count, made by CUDA itself
with `torch.cuda.set_sync_debug_mode`, sees them), syncs inside a kernel on a real GPU, and host reads of tensors
that are legitimately on the host (a plan built from tokenizer output) are no syncs at all, so a
loop is free to use Python lists and numpy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
SYNC_OPS: frozenset[Any] = frozenset({
    _aten._local_scalar_dense, _aten.nonzero, _aten.nonzero_static, _aten.masked_select, _aten.equal,
    _aten.is_nonzero, _aten._unique, _aten._unique2, _aten.unique_dim, _aten.unique_consecutive,
    _aten.unique_dim_consecutive,
})
_COPIES: frozenset[Any] = frozenset({_aten._to_copy, _aten.copy_})
_METHODS: tuple[str, ...] = ("tolist", "numpy", "cpu")
# Python-level scalar reads, counted under the op name the dispatcher would show for them.
_SCALAR_READS: dict[str, str] = {"item": "_local_scalar_dense", "__int__": "_local_scalar_dense",
                                 "__float__": "_local_scalar_dense", "__index__": "_local_scalar_dense",
                                 "__bool__": "is_nonzero"}
_SCALAR_OPS: frozenset[Any] = frozenset({_aten._local_scalar_dense, _aten.is_nonzero})


def _to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A copy whose source is on a device and whose destination is the CPU."""
    if func.overloadpacket is _aten._to_copy:
        src, dst = args[0], kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst is not None \
            and torch.device(dst).type == "cpu"
    dst, src = args[0], args[1]
    return src.device.type != "cpu" and dst.device.type == "cpu"


class SyncCounter(TorchDispatchMode):
    """`with SyncCounter() as c: ...` then `c.total` and `c.counts` (op name -> calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.in_scalar_read = 0  # inside a counted Python scalar read: its dispatched op is not counted again

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in SYNC_OPS:
            if not (self.in_scalar_read and packet in _SCALAR_OPS):
                self.counts[packet.__name__] += 1
        elif packet in _COPIES and _to_host(func, args, kwargs):
            self.counts["device_to_host_copy"] += 1
        return func(*args, **kwargs)

    def summary(self) -> str:
        return ", ".join(f"{k} x{v}" for k, v in self.counts.most_common()) or "none"


@contextmanager
def count_syncs(methods: bool = True) -> Iterator[SyncCounter]:
    """A `SyncCounter` over the block, also counting `Tensor.tolist/.numpy/.cpu` calls when `methods`."""
    counter = SyncCounter()
    saved = {name: getattr(torch.Tensor, name) for name in (*(_METHODS if methods else ()), *_SCALAR_READS)}

    def counting(name: str, original: Any) -> Any:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter.counts[f"Tensor.{name}"] += 1
            return original(self, *args, **kwargs)
        return method

    def scalar_read(name: str, original: Any) -> Any:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter.in_scalar_read:  # a read inside a read (e.g. __index__ calling item)
                return original(self, *args, **kwargs)
            counter.counts[_SCALAR_READS[name]] += 1
            counter.in_scalar_read += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counter.in_scalar_read -= 1
        return method

    try:
        for name, original in saved.items():
            wrap = scalar_read if name in _SCALAR_READS else counting
            setattr(torch.Tensor, name, wrap(name, original))
        with counter:
            yield counter
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


def tiny_with_layers(name: str, n_layers: int, folder: Any) -> Any:
    """`name` (a tiny model) with `n_layers` blocks, random weights, fp32 on the CPU: the same
    widths, heads and tokenizer, so a test can check that a count does not grow with depth."""
    from pathlib import Path

    from tomlens.models import embedded, load_model, tiny

    folder = Path(folder)
    config = tiny.TINY[name].build_config()
    for key in ("num_hidden_layers", "n_layer"):
        if hasattr(config, key):
            setattr(config, key, n_layers)
    config.save_pretrained(folder)
    embedded.load_tokenizer(tiny.tokenizer_dir()).save_pretrained(folder)
    return load_model(f"random:{folder}", dtype="float32", device="cpu")


def count_of(fn: Any) -> tuple[int, str]:
    """(total, summary) of the syncs one call of `fn()` makes."""
    with count_syncs() as c:
        fn()
    return c.total, c.summary()


def assert_same_and_small(counts: dict[Any, tuple[int, str]], bound: int) -> None:
    """Every size gave the same count (it grows with nothing), and that count is at most `bound`."""
    totals = {k: v[0] for k, v in counts.items()}
    assert len(set(totals.values())) == 1, counts
    assert next(iter(totals.values())) <= bound, counts


class OpCounter(TorchDispatchMode):
    """Every op a block dispatches (`with OpCounter() as c: ...`, then `c.total`). On a GPU each is
    at most one kernel launch, and a small model's forward on a fast GPU is bound by its launches
    (the Llama-3.2-1B shape: about 940 per batch through the bridge), so this count is what a CPU
    test can hold the GPU's per-forward overhead to. Views count too: a conservative count."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
