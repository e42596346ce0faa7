"""Gemma 3 270M offline (the `tomlens[gemma]` extra), per-head features with one KV head on the
tiny random Gemma 3, and `device_map` loading: errors, the tiny integration, the real model."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import short_pairs, tl_metric

from tomlens.errors import TomlensError
from tomlens.hooks import Site, attn_out_bias, capture, parse_sites, w_o
from tomlens.models import embedded, encode, gemma, load_model, load_tokenizer, provenance
from tomlens.models.registry import check_device_map
from tomlens.models.tiny import build_tiny
from tomlens.runs.base import ModelSpec, config_from_dict

GEMMA_INSTALLED = importlib.util.find_spec(gemma.PACKAGE) is not None
TEXT = "Anne put the apple in the basket. While Anne was away, Bob moved the apple to the box. Anne will look in the"


# --- the package and the conversion folder (no model booted) -------------------------------------


@pytest.mark.unit
def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, gemma.PACKAGE, None)  # `import` of it now raises ImportError
    with pytest.raises(TomlensError, match=r"pip install 'tomlens\[gemma\]'") as e:
        gemma.package()
    assert gemma.DISTRIBUTION in e.value.problem
    with pytest.raises(TomlensError, match=r"tomlens\[gemma\]"):
        load_model(gemma.GEMMA_NAME)  # before any conversion or download is attempted


@pytest.mark.unit
def test_a_missing_chunk_says_to_reinstall(monkeypatch):
    def missing() -> None:
        raise FileNotFoundError("Missing chunk files: part02")

    monkeypatch.setitem(sys.modules, gemma.PACKAGE, SimpleNamespace(verify_chunks=missing))
    with pytest.raises(TomlensError, match="chunk of the GGUF is missing") as e:
        gemma.package()
    assert "--force-reinstall" in e.value.fix


@pytest.mark.unit
def test_only_a_folder_whose_marker_names_the_packaged_gguf_is_used(tmp_path):
    module = SimpleNamespace(MODEL_NAME="gemma-3-270m-q4_k_m.gguf", EXPECTED_SHA256="ab" * 32)
    (tmp_path / "config.json").write_text("{}")
    assert not gemma._is_current(tmp_path, module)  # interrupted: no marker yet, convert again
    (tmp_path / gemma.MARKER).write_text(json.dumps({"gguf_file": module.MODEL_NAME, "gguf_sha256": "cd" * 32}))
    assert not gemma._is_current(tmp_path, module)  # another GGUF version
    (tmp_path / gemma.MARKER).write_text(json.dumps({"gguf_file": module.MODEL_NAME, "gguf_sha256": "ab" * 32}))
    assert gemma._is_current(tmp_path, module)
    assert gemma.gemma_revision(tmp_path) == f"{module.MODEL_NAME}@sha256:{'ab' * 32}"


@pytest.mark.unit
def test_the_saved_tokenizer_config_says_it_adds_bos(tmp_path):
    """Gemma's tokenizer adds <bos>; the saved config must say so, or TransformerLens re-loads it.
    A folder converted before this rule gets it on its next use, other settings untouched."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>"}))
    gemma.mark_bos(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"bos_token": "<bos>",
                                                                             "add_bos_token": True}
    gemma.mark_bos(tmp_path)  # idempotent
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["add_bos_token"] is True
    assert [f.name for f in tmp_path.iterdir()] == ["tokenizer_config.json"]  # no temp file left


@pytest.mark.unit
def test_a_hand_written_folder_loads_back_with_tied_embeddings(tmp_path):
    """The conversion's writer (safetensors + plain config) on a tiny Gemma 3: same logits after
    `from_pretrained`, the output embedding tied again rather than stored twice."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = build_tiny("tiny-gemma3", seed=0)
    model.config.quantization_config = {"quant_method": "gguf"}  # what a GGUF load leaves behind
    model.config.architectures = None
    left_out = gemma.write_state_dict(model, tmp_path)
    config = gemma.plain_config(model.config)
    assert "quantization_config" not in config and config["architectures"] == [gemma.ARCHITECTURE]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert left_out == ["lm_head.weight"]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    saved, built = back.state_dict(), model.state_dict()
    assert saved.keys() == built.keys() and all(torch.equal(saved[k], built[k]) for k in built)
    back.config._attn_implementation = "eager"  # as the tiny model was built: the same kernels
    ids = torch.tensor([[1, 500, 600, 700, 800, 900, 1000, 1100]])
    with torch.inference_mode():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=0, rtol=0)


# --- device_map: refused where it cannot work, before anything loads ---------------------------


@pytest.mark.unit
@pytest.mark.parametrize("name", ["tiny-llama", "smollm2-135m", "tom-organism", "gemma3-270m", "random:org/model"])
def test_device_map_is_refused_for_built_in_and_random_models(name):
    with pytest.raises(TomlensError, match="device_map is not supported") as e:
        load_model(name, device_map="auto")
    assert "Hugging Face id or a local model folder" in e.value.fix


@pytest.mark.unit
def test_device_and_device_map_cannot_be_used_together(tmp_path):
    with pytest.raises(TomlensError, match="cannot be used together"):
        load_model(str(tmp_path), device="cpu", device_map="cpu")
    with pytest.raises(TomlensError, match="cannot be used together"):
        ModelSpec(name="org/model", device="cuda", device_map="auto").load()
    with pytest.raises(TomlensError, match="not a device map"):
        check_device_map("org/model", None, "")


@pytest.mark.unit
def test_device_map_without_accelerate_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "accelerate" else real(n, *a))
    with pytest.raises(TomlensError, match="accelerate") as e:
        check_device_map("org/model", None, "auto")
    assert e.value.fix == "pip install accelerate"


@pytest.mark.unit
def test_model_spec_reads_device_map_from_a_config():
    spec = config_from_dict(ModelSpec, {"name": "org/model", "device_map": "auto"})
    assert spec.device_map == "auto" and spec.device is None
    with pytest.raises(TomlensError, match="device_map"):
        config_from_dict(ModelSpec, {"name": "org/model", "device_map": 3})


@pytest.mark.integration
def test_device_map_cpu_loads_a_local_folder(tmp_path, load_tiny, monkeypatch):
    """accelerate's placement of a saved tiny Llama: the map reaches `from_pretrained`, the bridge
    runs, and gives what `device` gives."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed: device_map cannot be checked here")
    from transformers import AutoModelForCausalLM

    build_tiny("tiny-llama", seed=0).save_pretrained(tmp_path)
    embedded.load_tokenizer(embedded.tokenizer_dir()).save_pretrained(tmp_path)
    seen = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("device_map"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    mapped = load_model(str(tmp_path), dtype="float32", device_map="cpu")
    plain = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert seen == ["cpu", None]  # passed through once, and only when asked for
    assert provenance(mapped)["device"] == "cpu" and str(mapped.cfg.device) == "cpu"
    batch = encode(mapped, [TEXT, "Bob moved the apple."])
    with torch.inference_mode():
        got = mapped(batch.input_ids, **batch.forward_kwargs())
        want = plain(batch.input_ids, **batch.forward_kwargs())
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # same weights, same device, same kernels


def _tiny_llama_folder(folder):
    build_tiny("tiny-llama", seed=0).save_pretrained(folder)
    embedded.load_tokenizer(embedded.tokenizer_dir()).save_pretrained(folder)
    return str(folder)


@pytest.mark.integration
def test_a_one_device_map_boots_where_the_weights_are_in_their_dtype(tmp_path, monkeypatch):
    """device_map="cpu" on a GPU machine: transformers leaves no hf_device_map, so the bridge must
    be told the parameters' device (TransformerLens would default to CUDA) and the dtype must be
    the CPU's fp32, not the GPU default bf16. The GPU is faked: TL's get_device and tomlens's
    default device say CUDA; nothing may move the model."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed: device_map cannot be checked here")
    from transformer_lens.model_bridge.sources.transformers import source

    import tomlens.devices

    folder = _tiny_llama_folder(tmp_path)
    monkeypatch.setattr(source, "get_device", lambda: torch.device("cuda"))
    monkeypatch.setattr(tomlens.devices, "default_device", lambda: torch.device("cuda"))
    moves = []
    real_to = torch.nn.Module.to

    def spy(self, *args, **kwargs):
        moves.append((type(self).__name__, args, kwargs))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy)
    model = load_model(folder, device_map="cpu")
    assert moves == []  # accelerate placed it; neither tomlens nor the bridge moves it
    param = next(model.parameters())
    assert str(model.cfg.device) == str(param.device) == "cpu"
    assert param.dtype == torch.float32 and provenance(model)["dtype"] == "float32"
    batch = encode(model, [TEXT])
    with torch.inference_mode():
        assert torch.isfinite(model(batch.input_ids, **batch.forward_kwargs())).all()


@pytest.mark.unit
def test_map_device_follows_the_maps_targets():
    from tomlens.models.registry import map_device

    assert map_device("cpu") == torch.device("cpu")
    assert map_device({"model": "cpu", "lm_head": "disk"}) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(TomlensError, match="CUDA is not available"):
            map_device({"model.layers.0": 0, "lm_head": "cpu"})
        assert map_device("auto") == torch.device("cpu")  # no GPU: accelerate keeps it on the CPU


@pytest.mark.unit
def test_device_map_stays_out_of_the_hash_until_it_is_set():
    """Runs hashed before device_map existed are still reused: an unset map does not enter the hash."""
    from dataclasses import replace

    from tomlens.runs.base import StimuliSpec, config_hash, config_to_dict
    from tomlens.runs.probes import ProbesConfig

    config = ProbesConfig(model=ModelSpec(name="tiny-llama"), stimuli=StimuliSpec(family="order-only", n=4))
    plain = config_to_dict(config)
    assert plain["model"].pop("device_map") is None
    assert config_hash(config) == config_hash(plain)
    mapped = replace(config, model=replace(config.model, name="org/model", device_map="auto"))
    assert config_hash(mapped) != config_hash(replace(config, model=replace(config.model, name="org/model")))


@pytest.mark.unit
def test_the_random_twin_of_a_mapped_model_loads_on_one_device():
    from tomlens.runs.base import StimuliSpec
    from tomlens.runs.probes import ProbesConfig, twin_spec

    stimuli = StimuliSpec(family="order-only", n=4)
    cpu = twin_spec(ProbesConfig(model=ModelSpec(name="org/model", device_map="cpu"), stimuli=stimuli))
    assert (cpu.name, cpu.device_map, cpu.device) == ("random:org/model", None, "cpu")
    auto = twin_spec(ProbesConfig(model=ModelSpec(name="org/model", device_map="auto", seed=3), stimuli=stimuli))
    assert (auto.name, auto.device_map, auto.device, auto.seed) == ("random:org/model", None, None, 3)


@pytest.mark.integration
def test_a_probes_stage_with_a_device_map_runs_its_random_twin(tmp_path):
    """The twin is random:<folder> on one device; with the map copied into it, load_model refused
    it after the real model's activations were cached."""
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed: device_map cannot be checked here")
    from tomlens.runs import probes
    from tomlens.runs.base import StimuliSpec

    folder = _tiny_llama_folder(tmp_path / "model")
    config = probes.ProbesConfig(
        model=ModelSpec(name=folder, dtype="float32", device_map="cpu"),
        stimuli=StimuliSpec(family="order-only", n=4, seed=1), targets=("protagonist_belief",),
        sites=("resid_post",), store=str(tmp_path / "store"), format="csv", random_twin=True,
        folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=20, n_permutations=9, selection=False)
    result = probes.run(config, progress=False)
    assert result.sweep.metadata["random_twin"]["model"] == f"random:{folder}"
    acts = result.table[result.table["features"] == "activations"]
    assert len(acts) > 0 and acts["baseline_random_init"].notna().all()  # the twin's scores merged in


# --- tiny-gemma3: one KV head, sliding-window layers --------------------------------------------


@pytest.fixture
def tg(load_tiny):
    return load_tiny("tiny-gemma3")


@pytest.mark.integration
def test_tiny_gemma3_has_one_kv_head_and_a_binding_sliding_window(tg):
    cfg = tg.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_model) == (3, 4, 1, 16, 64)
    assert provenance(tg)["n_key_value_heads"] == 1
    hf = build_tiny("tiny-gemma3", seed=0)
    assert hf.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert hf.config.query_pre_attn_scalar != hf.config.head_dim  # the bridge must scale by the former
    ids = encode(tg, [TEXT]).input_ids
    assert ids.shape[1] > 4 * hf.config.sliding_window  # the window binds
    with torch.inference_mode():
        want = hf(ids).logits
        torch.testing.assert_close(tg(ids), want, atol=1e-5, rtol=1e-5)  # the bridge keeps the window
        wide = build_tiny("tiny-gemma3", seed=0)
        wide.config.sliding_window = 4096
        assert (wide(ids).logits - want).abs().max() > 1e-2  # the window changes the numbers


@pytest.mark.integration
def test_tiny_gemma3_per_head_capture_shapes_and_sums(tg):
    """z per query head (4, though one KV head serves them), head_out per head; the heads add up to
    the projection output, and Gemma's post-attention norm of that sum is `attn_out`."""
    n, h, d = tg.cfg.n_layers, tg.cfg.n_heads, tg.cfg.d_model
    batch = encode(tg, [TEXT, "Bob moved the apple to the box."])  # left padded
    b, p = batch.input_ids.shape
    positions = torch.arange(p).expand(b, p)
    sites = parse_sites(["z", "head_out", "attn_out"], n) + [Site("z", 2, head=3)]
    with torch.inference_mode():
        out = capture(tg, batch, sites, positions)
        _, cache = tg.run_with_cache(batch.input_ids, **batch.forward_kwargs())
    assert out[Site("z", 2, head=3)].shape == (b, p, tg.cfg.d_head)
    for layer in range(n):
        z, heads = out[Site("z", layer)], out[Site("head_out", layer)]
        assert z.shape == (b, p, h, tg.cfg.d_head) and heads.shape == (b, p, h, d)
        assert w_o(tg, layer).shape == (h, tg.cfg.d_head, d)
        total = heads.sum(-2) + attn_out_bias(tg, layer)
        torch.testing.assert_close(total, cache[f"blocks.{layer}.attn.hook_out"], atol=1e-5, rtol=1e-4)
        normed = tg.blocks[layer].ln1_post(cache[f"blocks.{layer}.attn.hook_out"])
        torch.testing.assert_close(out[Site("attn_out", layer)], normed, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(total, out[Site("attn_out", layer)], atol=1e-2)  # the norm is not a no-op
        torch.testing.assert_close(heads[..., 3, :], z[..., 3, :] @ w_o(tg, layer)[3], atol=1e-6, rtol=1e-5)


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore::tomlens.patching.metric.UnstableGapWarning")  # random weights: no gap
def test_tiny_gemma3_per_head_patching_matches_a_direct_hook(tg):
    from tomlens.patching.cells import hook_for
    from tomlens.patching.exact import exact_patching
    from tomlens.patching.pairs import prepare_pairs

    pairs = short_pairs(tg.tokenizer, 2)
    result = exact_patching(tg, prepare_pairs(tg, pairs), sites=["heads"], positions=("all",), progress=False)
    heads = result.select("head", "all")
    assert len(heads) == tg.cfg.n_layers * tg.cfg.n_heads
    assert sorted(zip(heads.layer, heads["head"], strict=True)) == [(l, h) for l in range(3) for h in range(4)]
    assert torch.isfinite(result.values).all()
    for layer, head in ((0, 0), (2, 3)):
        cell = next(i for i, c in enumerate(result.cells)
                    if c.kind == "head" and c.position == "all" and (c.layer, c.head) == (layer, head))
        for j, pair in enumerate(pairs):
            b = encode(tg, [pair.clean.text, pair.corrupted.text])
            name = hook_for("head", layer)
            with torch.inference_mode():
                _, clean = tg.run_with_cache(b.input_ids[:1])

                def put(act, hook=None):
                    act = act.clone()
                    act[:, :, head] = clean[name][:, :, head]
                    return act

                direct = float(tl_metric(tg, pair)(tg.run_with_hooks(b.input_ids[1:], fwd_hooks=[(name, put)])))
            assert float(result.values[cell, j]) == pytest.approx(direct, abs=1e-5)


@pytest.mark.integration
def test_tiny_gemma3_probe_sweep_over_heads(tmp_path, tg):
    from tomlens.runs import probes
    from tomlens.runs.base import StimuliSpec

    config = probes.ProbesConfig(
        model=ModelSpec(name="tiny-gemma3", dtype="float32"),
        stimuli=StimuliSpec(family="order-only", n=4, seed=1), targets=("protagonist_belief",),
        sites=("resid_post", "head_out"), store=str(tmp_path / "store"), format="csv", random_twin=False,
        folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=20, n_permutations=9)
    result = probes.run(config, model=tg, progress=False)
    acts = result.table[result.table["features"] == "activations"]
    per_head = acts[acts.kind == "head_out"]
    assert sorted(set(zip(per_head.layer, per_head["head"], strict=True))) == [(l, h) for l in range(3) for h in range(4)]
    assert sorted(set(acts[acts.kind == "resid_post"].layer)) == [0, 1, 2]
    assert acts.score.between(0, 1).all()


# --- the real model ------------------------------------------------------------------------------


def _gemma_or_skip():
    if not GEMMA_INSTALLED:
        pytest.skip(f"{gemma.DISTRIBUTION} is not installed (pip install 'tomlens[gemma]'): "
                    "Gemma 3 270M cannot be checked here")


# What makes the model what it is; transformers reads each from the GGUF's metadata.
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "query_pre_attn_scalar",
                 "sliding_window", "layer_types", "rms_norm_eps", "rope_theta", "rope_local_base_freq",
                 "rope_parameters", "rope_scaling", "max_position_embeddings", "hidden_activation",
                 "final_logit_softcapping", "attn_logit_softcapping", "tie_word_embeddings",
                 "bos_token_id", "eos_token_id", "pad_token_id")


def _same_config_as_the_gguf(folder, scratch) -> None:
    """The folder's config.json against transformers' reading of the GGUF's metadata (no weights)."""
    from transformers import AutoConfig

    module = gemma.package()
    source = gemma._assemble(module, scratch)
    want = AutoConfig.from_pretrained(source.parent, gguf_file=source.name).to_dict()
    got = AutoConfig.from_pretrained(folder).to_dict()
    compared = [k for k in CONFIG_FIELDS if k in want or k in got]
    assert {"num_hidden_layers", "head_dim", "query_pre_attn_scalar", "sliding_window", "layer_types"} <= set(compared)
    assert {k: got.get(k) for k in compared} == {k: want.get(k) for k in compared}
    assert got["architectures"] == [gemma.ARCHITECTURE]
    source.unlink()


@pytest.mark.acceptance
def test_random_gemma_reads_the_gguf_metadata_without_dequantising(tmp_path, monkeypatch):
    """random:gemma3-270m needs only the shape and the tokenizer: read from the GGUF in seconds in
    a fresh cache (no converted folder), never the ~100 s conversion."""
    _gemma_or_skip()
    from transformers import AutoConfig

    converted = gemma.models_dir() / gemma.GEMMA_NAME  # the real cache's, checked against the GGUF elsewhere
    monkeypatch.setenv("TOMLENS_HOME", str(tmp_path / "home"))

    def refuse(**kwargs):
        raise AssertionError("random:gemma3-270m de-quantised the GGUF")

    monkeypatch.setattr(gemma, "gemma_dir", refuse)
    start = time.perf_counter()
    folder = gemma.tokenizer_dir()
    seconds = time.perf_counter() - start
    assert folder.is_relative_to(tmp_path) and seconds < gemma.CONVERSION_SECONDS / 2, seconds
    marker = json.loads((folder / gemma.MARKER).read_text())
    assert marker["contents"] == "tokenizer+config" and marker["transformers"]
    assert json.loads((folder / "tokenizer_config.json").read_text())["add_bos_token"] is True
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == [gemma.ARCHITECTURE]
    if (converted / "config.json").is_file():  # the same reading as the conversion's, field for field
        want = AutoConfig.from_pretrained(converted).to_dict()
        assert {k: config.to_dict().get(k) for k in CONFIG_FIELDS} == {k: want.get(k) for k in CONFIG_FIELDS}
    else:
        print("gemma3-270m is not converted here: its config.json was not compared with the GGUF-only one")
    assert gemma.gemma_revision(folder).startswith("gemma-3-270m-q4_k_m.gguf@sha256:")
    model = load_model(f"random:{gemma.GEMMA_NAME}", device="cpu", dtype="float32")
    info = provenance(model)
    assert (info["n_layers"], info["n_heads"], info["n_key_value_heads"], info["d_model"]) == (18, 4, 1, 640)
    assert info["revision"].startswith("random-init:seed=0 of gemma3-270m@gemma-3-270m-q4_k_m.gguf@sha256:")
    assert info["bos"]["prepend"] and tuple(load_tokenizer(gemma.GEMMA_NAME)(TEXT).input_ids)[0] == 2


@pytest.mark.acceptance
def test_gemma3_270m_loads_offline_and_runs_the_demo_sized_pipeline(tmp_path, capsys):
    """The bridge's logits equal transformers' on the converted folder; z is 4 heads of 256; then
    behaviour and probes (resid_post and head_out) on order-only stories through an experiment."""
    _gemma_or_skip()
    from transformers import AutoModelForCausalLM

    from tomlens.runs.experiment import ExperimentConfig, run_experiment

    start = time.perf_counter()
    model = load_model(gemma.GEMMA_NAME, device="cpu", dtype="float32")
    info = provenance(model)
    assert (info["n_layers"], info["n_heads"], info["n_key_value_heads"], info["d_model"]) == (18, 4, 1, 640)
    assert info["source"] == "extra" and info["revision"].startswith("gemma-3-270m-q4_k_m.gguf@sha256:")
    assert info["bos"]["prepend"]  # Gemma's tokenizer adds <bos>, and the bridge follows it
    folder = gemma.gemma_dir()
    _same_config_as_the_gguf(folder, tmp_path)
    marker = json.loads((folder / gemma.MARKER).read_text())
    assert marker["contents"] == "model+tokenizer" and "package" in marker
    assert json.loads((folder / "tokenizer_config.json").read_text())["add_bos_token"] is True
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    batch = encode(model, [TEXT])
    with torch.inference_mode():
        want = hf(batch.input_ids).logits
        _, cache = model.run_with_cache(batch.input_ids)
        got = model(batch.input_ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # eager vs sdpa attention kernels
    assert cache["blocks.0.attn.hook_z"].shape == (1, batch.input_ids.shape[1], 4, 256)
    assert tuple(load_tokenizer(gemma.GEMMA_NAME)(TEXT).input_ids) == tuple(batch.input_ids[0].tolist())
    del hf, cache

    config = ExperimentConfig.from_dict({
        "name": "gemma-check", "model": {"name": gemma.GEMMA_NAME, "dtype": "float32", "device": "cpu"},
        "behaviour": {"stimuli": [{"family": "order-only", "n": 2, "seed": 0}]},
        "probes": {"stimuli": {"family": "order-only", "n": 6, "seed": 1}, "targets": ["protagonist_belief"],
                   "sites": ["resid_post", "head_out"], "positions": ["final"], "folds": 3,
                   "inner_folds": 2, "c_grid": [0.1, 1.0], "n_boot": 50, "n_permutations": 19,
                   "random_twin": False, "format": "csv"},
    })
    result = run_experiment(config, tmp_path / "run", progress=False)
    behaviour, probes = result.result("behaviour"), result.result("probes")
    assert result.manifest["models"][0]["model"]["model"] == gemma.GEMMA_NAME
    assert len(behaviour.table) > 0
    acts = probes.table[probes.table["features"] == "activations"]
    assert sorted(set(acts[acts.kind == "resid_post"].layer)) == list(range(18))
    heads = acts[acts.kind == "head_out"]
    assert sorted(set(zip(heads.layer, heads["head"], strict=True))) == [(l, h) for l in range(18) for h in range(4)]
    assert acts.score.between(0, 1).all()
    print(f"gemma3-270m: load + check + pipeline in {time.perf_counter() - start:.0f} s")


@pytest.mark.unit
def test_models_convert_takes_gemma_and_reports_a_missing_extra(monkeypatch, capsys):
    """`tomlens models --convert gemma3-270m` converts through gemma_dir (stubbed here: the real
    conversion is the acceptance tests'); without the package it is one error naming the extra."""
    from tomlens.cli import main

    monkeypatch.setattr(gemma, "gemma_dir", lambda **_: "/cache/gemma-folder")
    assert main(["models", "--convert", "gemma3-270m"]) == 0
    assert "converted: /cache/gemma-folder" in capsys.readouterr().out
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, gemma.PACKAGE, None)
    assert main(["models", "--convert", "gemma3-270m"]) == 2
    assert "tomlens[gemma]" in capsys.readouterr().err
    assert main(["models", "--convert", "gpt-5"]) == 2  # names the choices
    assert "use one of smollm2-135m, gemma3-270m, all" in capsys.readouterr().err
