"""load_model: names, tiny models, offline behaviour, errors, provenance, the embedded model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from tomlens.cli import main as cli_main
from tomlens.devices import DTYPES, dtype_name, parse_dtype, resolve_dtype
from tomlens.errors import TomlensError
from tomlens.models import embedded, encode, list_models, load_model, provenance
from tomlens.models.paths import atomic_dir

SHAPES = {  # n_layers, n_heads, n_key_value_heads, d_model, d_head
    "tiny-gpt2": (2, 4, 4, 64, 16),
    "tiny-llama": (2, 4, 2, 64, 16),
    "tiny-neox": (2, 4, 4, 64, 16),
}


def test_tiny_models_have_the_promised_shape(tiny_model):
    n_layers, n_heads, n_kv, d_model, d_head = SHAPES[provenance(tiny_model)["model"]]
    cfg = tiny_model.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head) == (n_layers, n_heads, d_model, d_head)
    assert cfg.d_vocab == 49152
    assert not tiny_model.training
    assert tiny_model.tokenizer.padding_side == "left"
    assert tiny_model.tokenizer.pad_token_id is not None
    prov = provenance(tiny_model)
    assert prov["n_key_value_heads"] == n_kv
    assert prov["source"] == "tiny" and prov["seed"] == 0 and prov["dtype"] == "float32"


def test_gqa_model_reports_its_kv_heads(load_tiny):
    model = load_tiny("tiny-llama")
    assert model.cfg.n_key_value_heads == 2
    batch = encode(model, ["Anne moved the ball."])
    shapes: dict[str, tuple[int, ...]] = {}

    def recorder(kind):
        def record(x, hook):
            shapes[kind] = tuple(x.shape)

        return record

    hooks = [(f"blocks.0.attn.hook_{n}", recorder(n)) for n in ("k", "z")]
    with torch.inference_mode():
        model.run_with_hooks(batch.input_ids, fwd_hooks=hooks, **batch.forward_kwargs())
    assert shapes["k"][2] == 2 and shapes["z"][2] == 4  # [batch, pos, heads, d_head]


def test_tiny_models_are_deterministic_by_seed(load_tiny):
    batch_text = ["The box is empty."]
    a = load_tiny("tiny-llama", seed=0)
    b = load_model("tiny-llama", dtype="float32", seed=0)
    c = load_tiny("tiny-llama", seed=1)
    assert a is not b
    # the seed fixes every weight bit for bit (the same random draws, no arithmetic)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.inference_mode():
        la = a(encode(a, batch_text).input_ids)
        lb = b(encode(b, batch_text).input_ids)
        lc = c(encode(c, batch_text).input_ids)
    # equal weights in other buffers: MKL may round by memory alignment, so fp32 tolerance (logits ~1)
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(la, lc, atol=1e-3, rtol=1e-3)
    assert provenance(c)["revision"] == "random-init:seed=1"


def test_each_load_is_a_fresh_bridge_without_hooks(load_tiny):
    first = load_model("tiny-gpt2")
    first.add_hook("blocks.0.hook_resid_post", lambda x, hook: x * 0, is_permanent=True)
    second = load_model("tiny-gpt2")
    assert second is not first
    batch = encode(second, ["Hello there"])
    with torch.inference_mode():
        clean = second(batch.input_ids, **batch.forward_kwargs())
        zeroed = first(batch.input_ids, **batch.forward_kwargs())
    assert not torch.allclose(clean, zeroed, atol=1e-3, rtol=1e-3)
    # another bridge with the same weights: fp32 tolerance (logits ~1), as above
    torch.testing.assert_close(clean, load_tiny("tiny-gpt2")(batch.input_ids, **batch.forward_kwargs()),
                               atol=1e-5, rtol=1e-5)


def test_tiny_load_touches_no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    model = load_model("tiny-neox")
    assert model.cfg.n_layers == 2


def test_dtype_choice(load_tiny):
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    with pytest.raises(TomlensError, match="unknown dtype"):
        resolve_dtype("float13", torch.device("cpu"))
    # one table for models and the activation store: every name reads back from `dtype_name`
    for name, dtype in DTYPES.items():
        assert parse_dtype(name) == parse_dtype(dtype_name(dtype)) == parse_dtype(f"torch.{dtype_name(dtype)}") == dtype
    with pytest.raises(TomlensError, match="not a floating-point"):
        parse_dtype(torch.int64)
    model = load_model("tiny-llama", dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert provenance(model)["dtype"] == "bfloat16"


def test_unknown_names_say_what_to_do():
    with pytest.raises(TomlensError, match="did you mean 'tiny-gpt2'"):
        load_model("tiny-gtp2")
    with pytest.raises(TomlensError, match="not in the local Hugging Face cache") as err:
        load_model("tomlens-test/no-such-model-anywhere")
    assert "local model directory" in (err.value.fix or "")
    with pytest.raises(TomlensError, match="does not exist"):
        load_model("./no/such/folder")
    with pytest.raises(TomlensError, match="unknown device"):
        load_model("tiny-gpt2", device="toaster")
    with pytest.raises(TomlensError, match="no revisions"):
        load_model("tiny-gpt2", revision="main")


def test_folder_without_config_is_rejected(tmp_path):
    (tmp_path / "weights.txt").write_text("not a model")
    with pytest.raises(TomlensError, match="no config.json"):
        load_model(str(tmp_path))


def test_local_directory_round_trip(tmp_path, load_tiny):
    """A folder written by save_pretrained loads by path and computes the same logits."""
    from tomlens.models.tiny import build_tiny

    build_tiny("tiny-llama", seed=0).save_pretrained(tmp_path)
    source = load_tiny("tiny-llama")
    source.tokenizer.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype="float32")
    prov = provenance(model)
    assert prov["source"] == "local" and str(tmp_path.resolve()) in prov["revision"]
    assert model.tokenizer.padding_side == "left"
    texts = ["Sally looks in the basket.", "Hi"]
    with torch.inference_mode():
        a = source(encode(source, texts).input_ids, **encode(source, texts).forward_kwargs())
        b = model(encode(model, texts).input_ids, **encode(model, texts).forward_kwargs())
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # another copy of the weights: fp32 rounding


def test_provenance_carries_versions_and_shape(load_tiny):
    prov = provenance(load_tiny("tiny-gpt2"))
    assert prov["model"] == "tiny-gpt2" and prov["architecture"] == "GPT2LMHeadModel"
    assert set(prov["versions"]) == {"tomlens", "torch", "transformer_lens", "transformers", "numpy", "sklearn", "python"}
    assert prov["versions"]["transformer_lens"].startswith("4.3")
    assert prov["n_layers"] == 2 and prov["d_vocab"] == 49152
    json.dumps(prov)  # provenance goes into JSON manifests


def test_run_manifest_names_model_config_seed_and_versions(load_tiny, monkeypatch):
    from dataclasses import dataclass, field

    from tomlens.provenance import run_manifest, versions
    from tomlens.runs.base import ModelSpec

    @dataclass(frozen=True)
    class Study:
        model: ModelSpec = field(default_factory=lambda: ModelSpec(name="tiny-gpt2", seed=3))
        layers: tuple[int, ...] = (0, 1)

    monkeypatch.setattr("sys.argv", ["tomlens", "run", "study.toml"])
    man = run_manifest(load_tiny("tiny-gpt2"), Study(), stimuli_hash="abc", extra={"stage": "probes"})
    assert man["model"]["model"] == "tiny-gpt2" and man["model"]["bos"]["source"] == "tokenizer"
    assert man["config"] == {"model": {"name": "tiny-gpt2", "revision": None, "dtype": None, "device": None,
                                       "prepend_bos": None, "seed": 3, "device_map": None}, "layers": [0, 1]}
    assert man["seed"] == 3 and man["stimuli_hash"] == "abc" and man["stage"] == "probes"
    assert man["argv"] == ["tomlens", "run", "study.toml"] and man["time"].endswith("+00:00")
    assert man["versions"] == versions() == man["model"]["versions"]
    assert run_manifest(None, {"seed": 7})["seed"] == 7
    with pytest.raises(ValueError, match="seed"):
        run_manifest(None, {}, extra={"seed": 1})
    json.dumps(man)


def test_atomic_dir_leaves_nothing_when_killed(tmp_path):
    final = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "half.safetensors").write_text("partial")
            raise RuntimeError("killed")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(final) as tmp:
        (tmp / "a").write_text("1")
    with atomic_dir(final) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in final.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_converted_folder_counts_only_with_its_marker(tmp_path):
    source = embedded.gguf_path()
    assert source.name == embedded.GGUF_NAME and source.stat().st_size > 50_000_000
    (tmp_path / "config.json").write_text("{}")
    assert not embedded._is_current(tmp_path, source)  # a half folder (no marker) is never used
    (tmp_path / embedded.MARKER).write_text(json.dumps({"gguf_file": source.name, "gguf_size": 1}))
    assert not embedded._is_current(tmp_path, source)  # another GGUF version: convert again
    (tmp_path / embedded.MARKER).write_text(
        json.dumps({"gguf_file": source.name, "gguf_size": source.stat().st_size})
    )
    assert embedded._is_current(tmp_path, source)


def test_cli_lists_the_names(capsys):
    assert cli_main(["models"]) == 0
    out = capsys.readouterr().out
    for m in list_models():
        assert m.name in out
    assert "[default]" in out and "smollm2-135m" in out


def test_builtin_models_never_reach_the_network_even_without_the_offline_switches():
    """conftest sets HF_HUB_OFFLINE for the tests; a user's shell may not. In a fresh process without
    the switches, with every socket refused and recorded, the built-in names still load and run."""
    script = textwrap.dedent("""
        import json, socket
        tried = []
        def refuse(*args, **kwargs):
            tried.append(repr(args[:2]))
            raise OSError("network disabled by the test")
        socket.socket.connect = socket.socket.connect_ex = refuse
        socket.create_connection = socket.getaddrinfo = refuse
        import torch
        from tomlens.models import encode, load_model, load_tokenizer
        for name in ("tiny-llama", "tiny-gpt2"):
            model = load_model(name, dtype="float32")
            assert load_tokenizer(name)("a b")["input_ids"] == model.tokenizer("a b")["input_ids"]
            with torch.inference_mode():
                logits = model(encode(model, ["Anna put the ball in the"]).input_ids)
            assert torch.isfinite(logits).all()
        print(json.dumps(tried))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], "built-in models tried the network"


@pytest.mark.slow
def test_embedded_model_predicts_paris(smollm2):
    prov = provenance(smollm2)
    assert (prov["n_layers"], prov["n_heads"], prov["n_key_value_heads"], prov["d_model"]) == (30, 9, 3, 576)
    assert prov["source"] == "embedded" and "sha256:" in prov["revision"]
    tok = smollm2.tokenizer
    texts = ["The capital of France is", "Paris is the capital of"]
    batch = encode(smollm2, texts)
    with torch.inference_mode():
        logits = smollm2(batch.input_ids, **batch.forward_kwargs())
        single = smollm2(encode(smollm2, texts[:1]).input_ids)
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    banana = tok.encode(" banana", add_special_tokens=False)[0]
    assert logits[0, -1, paris] > logits[0, -1, banana] + 5
    assert logits[0, -1].argmax().item() == paris
    france = tok.encode(" France", add_special_tokens=False)[0]
    assert logits[1, -1, france] > logits[1, -1, banana] + 5
    # padded batch vs one prompt through 30 layers, logits up to ~30: fp32 rounding (4e-5 seen)
    torch.testing.assert_close(logits[0, batch.pad[0]:], single[0], atol=1e-3, rtol=1e-5)


def test_hub_id_loads_offline_from_the_local_cache(tmp_path, monkeypatch, load_tiny):
    """A hub id already in the HF cache loads with no network; its commit is the revision."""
    from huggingface_hub import constants

    from tomlens.models.tiny import build_tiny

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--tomlens-test--tiny-llama"
    snapshot = repo / "snapshots" / commit
    build_tiny("tiny-llama", seed=0).save_pretrained(snapshot)
    load_tiny("tiny-llama").tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    model = load_model("tomlens-test/tiny-llama", dtype="float32")
    prov = provenance(model)
    assert prov["source"] == "hub" and prov["revision"] == commit and prov["n_key_value_heads"] == 2
    assert model.tokenizer.padding_side == "left"
    with pytest.raises(TomlensError, match="not in the local Hugging Face cache"):
        load_model("tomlens-test/tiny-llama", revision="v2")


@pytest.mark.slow
def test_cli_convert_leaves_a_complete_folder(capsys):
    assert cli_main(["models", "--convert"]) == 0
    folder = embedded.embedded_dir()
    assert f"converted: {folder}" in capsys.readouterr().out
    assert embedded._is_current(folder, embedded.gguf_path())
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["num_key_value_heads"] == 3
    assert "add_bos_token" not in json.loads((folder / "tokenizer_config.json").read_text())  # the GGUF's rule
    assert list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin"))


def test_load_tokenizer_matches_the_model_without_loading_weights(tmp_path, monkeypatch):
    from tomlens.models import load_model, load_tokenizer
    from tomlens.models.tiny import build_tiny

    text = ["Anna puts the ball in the basket.", "Where will Anna look for the ball?"]
    model = load_model("tiny-llama")
    tok = load_tokenizer("tiny-llama")
    assert tok(text)["input_ids"] == model.tokenizer(text)["input_ids"] and tok.padding_side == "left"
    folder = tmp_path / "m"
    build_tiny("tiny-gpt2", 0).save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    import transformers

    def no_weights(*a, **k):
        raise AssertionError("load_tokenizer must not load weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    assert load_tokenizer(str(folder))(text)["input_ids"] == tok(text)["input_ids"]


@pytest.mark.parametrize("name,params,layers,heads,kv", [
    ("random-llama-1b", 1.236e9, 16, 32, 8),
    ("random-llama-8b", 8.03e9, 32, 32, 8),
])
def test_full_size_random_shapes_match_the_real_models(name, params, layers, heads, kv):
    """Built on the meta device: the shapes and parameter count of the real Llama 3 models."""
    from tomlens.models.tiny import build_tiny

    model = build_tiny(name, 0, device="meta", dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - params) / params < 0.01
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (layers, heads, kv)
    assert next(model.parameters()).dtype == torch.bfloat16


def test_random_init_keeps_the_architecture_and_tokenizer_with_fresh_seeded_weights(tmp_path, load_tiny):
    """random:NAME reads NAME's config only: weights differ from NAME's, repeat for a seed, and
    the tokenizer is NAME's."""
    from tomlens.models import load_tokenizer
    from tomlens.models.tiny import build_tiny

    folder = tmp_path / "trained"
    build_tiny("tiny-llama", seed=5).save_pretrained(folder)  # stands in for trained weights
    load_tiny("tiny-llama").tokenizer.save_pretrained(folder)
    base = load_model(str(folder), dtype="float32")
    r0 = load_model(f"random:{folder}", dtype="float32", seed=0)
    again = load_model(f"random:{folder}", dtype="float32", seed=0)
    r1 = load_model(f"random:{folder}", dtype="float32", seed=1)
    weights = lambda m: [p.detach() for p in m.parameters() if p.ndim == 2]  # noqa: E731
    assert len(weights(r0)) == len(weights(base)) > 0
    assert all(not torch.equal(a, b) for a, b in zip(weights(r0), weights(base), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights(r0), weights(again), strict=True))
    assert not torch.equal(weights(r0)[0], weights(r1)[0])
    text = ["Anna puts the ball in the basket."]
    assert r0.tokenizer(text)["input_ids"] == base.tokenizer(text)["input_ids"]
    assert load_tokenizer(f"random:{folder}")(text)["input_ids"] == base.tokenizer(text)["input_ids"]
    prov = provenance(r0)
    assert prov["source"] == "random-init" and prov["base"] == str(folder) and prov["seed"] == 0
    assert prov["revision"].startswith(f"random-init:seed=0 of {folder}@local:")
    assert (prov["n_layers"], prov["d_model"]) == (provenance(base)["n_layers"], provenance(base)["d_model"])
    tiny = load_model("random:tiny-llama", dtype="float32", seed=2)
    assert provenance(tiny)["revision"] == "random-init:seed=2 of tiny-llama@config"
    assert all(torch.equal(a, b) for a, b in zip(weights(tiny), weights(load_tiny("tiny-llama", seed=2)), strict=True))
    with pytest.raises(TomlensError, match="names no base model"):
        load_model("random:")
    with pytest.raises(TomlensError, match="has no revisions"):
        load_model("random:tiny-gpt2", revision="main")


def test_a_model_is_remembered_as_a_model_and_anything_else_is_asked_each_time():
    """`isinstance(x, Model)` keeps a yes per object (the suite's type checker asks it on every call,
    and on Python 3.11 asking reads every member), forgets the object with it, says no to what lacks
    a member, and remembers nothing for what it cannot hash, nor for protocols derived from Model."""
    import dataclasses
    import gc
    import weakref
    from typing import Protocol, runtime_checkable

    from tomlens.models.protocol import _ACCEPTED_MODELS, Model

    reads = [0]

    class Partial:  # every member but `named_parameters`; `hook_dict` counts its reads
        cfg = tokenizer = blocks = None

        @property
        def hook_dict(self):
            reads[0] += 1
            return {}

        def __call__(self, *args): ...
        def hooks(self, *args): ...
        def parameters(self, *args): ...

    class Stand(Partial):
        def named_parameters(self, *args): ...

    before = len(_ACCEPTED_MODELS)
    partial = Partial()
    assert not isinstance(partial, Model) and partial not in _ACCEPTED_MODELS
    stand = Stand()
    assert isinstance(stand, Model) and stand in _ACCEPTED_MODELS and len(_ACCEPTED_MODELS) == before + 1
    seen = reads[0]
    assert isinstance(stand, Model) and reads[0] == seen  # from memory: no member read again
    gone = weakref.ref(stand)
    del stand
    gc.collect()
    assert gone() is None and len(_ACCEPTED_MODELS) == before

    @dataclasses.dataclass  # eq without hash: unhashable
    class Unhashable(Stand):
        x: int = 0

    seen = reads[0]
    unhashable = Unhashable()
    assert isinstance(unhashable, Model) and isinstance(unhashable, Model)
    assert reads[0] == seen + 2 and len(_ACCEPTED_MODELS) == before  # asked each time, never kept

    @runtime_checkable
    class Bigger(Model, Protocol):  # a member more: not answered from Model's memory
        def extra(self) -> None: ...

    stand = Stand()
    assert isinstance(stand, Model) and not isinstance(stand, Bigger)
