"""The activation cache: right numbers in the caller's row order, a store that is reused, resumed
after an interruption, never loads half-written files, and says what it holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import tomlens.activations.cache as cache_mod
import tomlens.activations.store as store_mod
from tomlens.activations import ActivationSet, cache_activations, load_activations
from tomlens.cli import main as cli_main
from tomlens.errors import TomlensError
from tomlens.hooks import Site, capture
from tomlens.models import encode
from tomlens.models.positions import resolve_positions
from tomlens.stimuli.records import Span, Stimulus, stimuli_hash, write_jsonl

NAMES = [("Anne", "ball", "basket", "box"), ("Xiaoling", "marble", "cupboard", "drawer"),
         ("Li", "key", "bag", "jar"), ("Bartholomew", "scarf", "wardrobe", "suitcase"),
         ("Mo", "pen", "cup", "tin"), ("Sam", "book", "shelf", "desk"), ("Ida", "coin", "purse", "pocket")]


def story(i: int, name: str, obj: str, loc1: str, loc2: str) -> Stimulus:
    prefix = "It was a quiet morning in the old house by the river. " * (i % 3)  # lengths differ
    text = (f"{prefix}{name} put the {obj} in the {loc1}. While {name} was away, Max moved the {obj} "
            f"to the {loc2}. {name} will look for the {obj} in the")

    def span(word: str, after: int = 0) -> Span:
        start = text.index(word, after)
        return Span(start, start + len(word))

    c0 = text.index("While")
    fb = i % 2 == 0
    return Stimulus(
        id=f"story-{i}", text=text, options=(loc1, loc2), answer=loc1 if fb else loc2, family="test",
        task_id=f"task-{i // 2}", condition="false_belief" if fb else "true_belief",
        world_state=loc2, protagonist_belief=loc1 if fb else loc2, reference_state=loc1,
        spans={"protagonist": span(name, len(prefix)), "object": span(obj, len(prefix)),
               "location_1": span(loc1, len(prefix)), "location_2": span(loc2, c0),
               "contrast": Span(c0, text.index(".", c0) + 1)},
    )


STORIES = [story(i, *n) for i, n in enumerate(NAMES)]
SITES = ["resid_post", "z:1", "head_out:0", "attn_out:1", "resid_pre:0"]
POSITIONS = ["final", "protagonist", "object:first", "contrast_end"]


class Forwards:
    """Counts prompts that reach the model (a hook on the first block's input)."""

    def __init__(self, model):
        self.model, self.rows = model, 0

    def __enter__(self):
        self._ctx = self.model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", self._count)])
        self._ctx.__enter__()
        return self

    def _count(self, tensor, hook):
        self.rows += tensor.shape[0]

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _single(model, s: Stimulus, sites: list[Site], positions: list[str]) -> dict[Site, torch.Tensor]:
    batch = encode(model, [s.text])
    with torch.inference_mode():
        return capture(model, batch, sites, resolve_positions([s], batch, positions))


def test_batched_cache_equals_one_prompt_at_a_time_in_caller_order(tiny_model, tmp_path):
    acts = cache_activations(tiny_model, STORIES, SITES, POSITIONS, store=tmp_path, batch_size=3, progress=False)
    assert acts.ids == [s.id for s in STORIES] and len(acts) == len(STORIES)
    n_heads, d_head, d = tiny_model.cfg.n_heads, tiny_model.cfg.d_head, tiny_model.cfg.d_model
    n_layers = tiny_model.cfg.n_layers
    assert acts.layers("resid_post") == list(range(n_layers)) and acts.layers("z") == [1]
    assert acts.get("resid_post", "final").shape == (7, n_layers, d)
    assert acts.get("z", "protagonist").shape == (7, 1, n_heads, d_head)
    assert acts.get("head_out", "final").shape == (7, 1, n_heads, d)
    assert acts.get("resid_pre", "contrast_end").shape == (7, 1, d)
    assert acts.get("attn_out", "final").dtype == torch.float32
    sites = [Site("resid_post", L) for L in range(n_layers)] + [Site("z", 1), Site("head_out", 0)]
    for row, s in enumerate(STORIES):
        one = _single(tiny_model, s, sites, POSITIONS)
        for j, pos in enumerate(POSITIONS):  # padded batch vs one prompt, values < 0.5: fp32 tolerance
            for L in range(n_layers):
                torch.testing.assert_close(acts.get("resid_post", pos)[row, L], one[Site("resid_post", L)][0, j],
                                           atol=1e-4, rtol=0)
            torch.testing.assert_close(acts.get("z", pos)[row, 0], one[Site("z", 1)][0, j], atol=1e-4, rtol=0)
            torch.testing.assert_close(acts.get("head_out", pos)[row, 0], one[Site("head_out", 0)][0, j],
                                       atol=1e-4, rtol=0)


def test_same_request_loads_without_running_the_model(load_tiny, tmp_path):
    model = load_tiny("tiny-llama")
    with Forwards(model) as first:
        a = cache_activations(model, STORIES, SITES, POSITIONS, store=tmp_path, progress=False)
    with Forwards(model) as second:
        b = cache_activations(model, STORIES, SITES, POSITIONS, store=tmp_path, progress=False)
    assert first.rows == len(STORIES) and second.rows == 0
    assert not a.reused and b.reused and a.path == b.path
    assert torch.equal(a.get("resid_post", "final"), b.get("resid_post", "final"))  # both read the same shards
    # a different request gets its own folder
    c = cache_activations(model, STORIES, SITES, ["final"], store=tmp_path, progress=False)
    assert c.path != a.path and not c.reused
    assert load_activations(a.path).ids == a.ids


def test_other_weights_under_the_same_name_get_their_own_store(tmp_path):
    """A model saved anew into the same folder, or built by hand, must not reuse another's store."""
    from tomlens.models import load_model
    from tomlens.models.tiny import build_tiny

    folder = tmp_path / "local-model"
    tokenizer = load_model("tiny-llama").tokenizer
    paths = []
    for seed in (0, 1):
        build_tiny("tiny-llama", seed).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        local = load_model(str(folder))
        got = cache_activations(local, STORIES, ["resid_post:1"], ["final"], store=tmp_path / "s", progress=False)
        assert not got.reused
        paths.append(got.path)
    assert paths[0] != paths[1]
    # and two bridges that carry no revision at all differ by their weights
    from tomlens.activations.cache import weights_fingerprint

    assert weights_fingerprint(load_model("tiny-llama", seed=0)) != weights_fingerprint(load_model("tiny-llama", seed=1))
    assert weights_fingerprint(load_model("tiny-llama", seed=0)) == weights_fingerprint(load_model("tiny-llama", seed=0))


def test_interrupted_run_resumes_from_finished_shards(load_tiny, tmp_path, monkeypatch):
    model = load_tiny("tiny-gpt2")
    reference = cache_activations(model, STORIES, SITES, POSITIONS, store=tmp_path / "ref", progress=False)

    real_write = store_mod.write_shard
    written = []

    def write_then_die(path, tensors, metadata):
        if written:
            raise KeyboardInterrupt("killed")
        real_write(path, tensors, metadata)
        written.append(path)

    monkeypatch.setattr(store_mod, "write_shard", write_then_die)
    with pytest.raises(KeyboardInterrupt):  # batches of 2, a shard once 3 rows are pending: [0, 4) [4, 7)
        cache_activations(model, STORIES, SITES, POSITIONS, store=tmp_path, batch_size=2, shard_rows=3,
                          progress=False)
    monkeypatch.setattr(store_mod, "write_shard", real_write)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "ref"]
    assert len(written) == 1 and not (folder / "manifest.json").exists()
    with pytest.raises(TomlensError, match="no finished activation cache"):
        load_activations(folder)

    with Forwards(model) as resumed:  # other shard sizes on resume: shards need not match in size
        acts = cache_activations(model, STORIES, SITES, POSITIONS, store=tmp_path, batch_size=2, shard_rows=1,
                                 progress=False)
    assert resumed.rows == len(STORIES) - 4  # the first shard (4 rows) was not recomputed
    assert acts.path == folder
    assert [(s["start"], s["stop"]) for s in acts.manifest["shards"]] == [(0, 4), (4, 6), (6, 7)]
    assert acts.ids == reference.ids
    for kind in ("resid_post", "z", "head_out"):
        for pos in POSITIONS:  # batches of 2 here, one batch of 7 there: padding differs, so fp tolerance
            torch.testing.assert_close(acts.get(kind, pos), reference.get(kind, pos), atol=1e-5, rtol=1e-5)


def test_where_shards_end_never_changes_the_numbers(load_tiny, tmp_path):
    """Shards are cut between batches of one length-sorted order, so any flush points give the
    same forwards: equal numbers (same computation; a tolerance only for BLAS run-to-run noise)."""
    model = load_tiny("tiny-llama")
    runs = {
        "one shard": cache_activations(model, STORIES, SITES, POSITIONS, store=tmp_path / "a", batch_size=2,
                                       progress=False),
        "every 3 rows": cache_activations(model, STORIES, SITES, POSITIONS, store=tmp_path / "b", batch_size=2,
                                          shard_rows=3, progress=False),
        "every batch": cache_activations(model, STORIES, SITES, POSITIONS, store=tmp_path / "c", batch_size=2,
                                         flush_seconds=0, progress=False),
    }
    assert [len(r.manifest["shards"]) for r in runs.values()] == [1, 2, 4]
    first = runs["one shard"]
    for acts in runs.values():
        assert acts.ids == [s.id for s in STORIES]
        for kind in ("resid_post", "z", "head_out", "attn_out", "resid_pre"):
            for pos in POSITIONS:
                torch.testing.assert_close(acts.get(kind, pos), first.get(kind, pos), atol=1e-6, rtol=1e-6)


def test_a_shard_is_written_every_two_minutes_of_work_by_default(load_tiny, tmp_path, monkeypatch):
    """Small rows would fill one shard for the whole run; the time bound cuts it every ~2 minutes,
    the first shards sooner (after 15 s, then 30 s, 60 s, ...) so an early Ctrl-C keeps them."""
    model = load_tiny("tiny-gpt2")
    clock = [0.0]
    real_capture = cache_mod.capture_via

    def fifty_seconds_a_batch(*args, **kwargs):
        clock[0] += 50.0
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(cache_mod, "capture_via", fifty_seconds_a_batch)
    monkeypatch.setattr(cache_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0], strftime=time.strftime))
    acts = cache_activations(model, STORIES, ["resid_post"], ["final"], store=tmp_path, batch_size=1, progress=False)
    assert cache_mod.FLUSH_SECONDS == 120
    assert cache_mod.FIRST_FLUSH_SECONDS == 15
    # 50 s >= 15 s, 50 s >= 30 s, 100 s >= 60 s, 150 s >= 120 s, then the rest
    assert [s["stop"] - s["start"] for s in acts.manifest["shards"]] == [1, 1, 2, 3]
    assert acts.ids == [s.id for s in STORIES]


def test_leftover_temporaries_and_damaged_shards_never_load(load_tiny, tmp_path):
    model = load_tiny("tiny-gpt2")
    acts = cache_activations(model, STORIES, ["resid_post"], ["final"], store=tmp_path, batch_size=2, shard_rows=4,
                             progress=False)
    folder, good = acts.path, acts.get("resid_post", "final").clone()
    assert len(acts.manifest["shards"]) == 2
    del acts
    # simulate a killed writer: manifest gone, shard 1 half-written under its temporary name,
    # and shard 0 overwritten by garbage under its final name
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    tmp = folder / f".shard-00001.safetensors.{int(dead.stdout)}.tmp"
    tmp.write_bytes((folder / "shard-00001.safetensors").read_bytes()[:100])
    (folder / "shard-00001.safetensors").unlink()
    (folder / "shard-00000.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    (folder / "manifest.json").unlink()
    with pytest.raises(TomlensError):
        ActivationSet.load(folder)
    with Forwards(model) as rerun:
        again = cache_activations(model, STORIES, ["resid_post"], ["final"], store=tmp_path, progress=False)
    assert rerun.rows == len(STORIES)  # both shards recomputed
    assert not tmp.exists()  # the dead writer's temporary is cleaned up
    torch.testing.assert_close(again.get("resid_post", "final"), good, atol=1e-5, rtol=1e-5)


def test_manifest_says_what_the_store_holds(load_tiny, tmp_path):
    model = load_tiny("tiny-llama")
    acts = cache_activations(model, STORIES, SITES, POSITIONS, store=tmp_path, progress=False)
    m = json.loads((acts.path / "manifest.json").read_text())
    assert m["complete"] is True and m["key"] == acts.path.name
    assert m["model"]["model"] == "tiny-llama" and m["model"]["revision"] == "random-init:seed=0"
    assert m["model"]["versions"]["transformer_lens"].startswith("4.3")
    assert m["dtype"] == "float32" and m["tokenizer"]["vocab_size"] > 1000 and m["tokenizer"]["hash"]
    assert m["stimuli_hash"] == stimuli_hash(STORIES)
    assert m["positions"] == POSITIONS
    assert m["layers"] == {"resid_post": [0, 1], "z": [1], "head_out": [0], "attn_out": [1], "resid_pre": [0]}
    assert "z:1" in m["sites"] and "resid_post:0" in m["sites"]
    assert [r["id"] for r in m["rows"]] == [s.id for s in STORIES]
    assert m["rows"][1]["condition"] == "true_belief" and m["rows"][0]["belief_differs"] is True
    assert m["shapes"]["z@final"] == [7, 1, 4, model.cfg.d_head]
    labels = acts.labels()
    assert list(labels["id"]) == acts.ids and labels["belief_is_reference"].tolist()[:2] == [True, False]
    assert [s.id for s in load_activations(acts.path).stimuli] == acts.ids  # records come back from disk
    assert "resid_post" in acts.describe() and str(acts.path) in acts.describe()


def test_store_dtype_and_default_store(load_tiny, tmp_path, monkeypatch):
    model = load_tiny("tiny-gpt2")
    monkeypatch.setenv("TOMLENS_HOME", str(tmp_path))
    acts = cache_activations(model, STORIES[:2], ["resid_post:1"], ["final"], dtype="bfloat16", progress=False)
    assert acts.path.parent == tmp_path / "activations"
    assert acts.get("resid_post", "final").dtype == torch.bfloat16


def test_user_mistakes_are_named(load_tiny, tmp_path):
    model = load_tiny("tiny-gpt2")
    with pytest.raises(TomlensError, match="story-0.*'location_3'"):
        cache_activations(model, STORIES, ["resid_post"], ["location_3"], store=tmp_path, progress=False)
    with pytest.raises(TomlensError, match="more than once"):
        cache_activations(model, STORIES + STORIES[:1], ["resid_post"], ["final"], store=tmp_path)
    with pytest.raises(TomlensError, match="names one head"):
        cache_activations(model, STORIES, [Site("z", 0, head=1)], ["final"], store=tmp_path)
    acts = cache_activations(model, STORIES, ["resid_post:0"], ["final"], store=tmp_path, progress=False)
    with pytest.raises(TomlensError, match="mlp_out"):
        acts.get("mlp_out", "final")
    with pytest.raises(TomlensError, match="object"):
        acts.get("resid_post", "object")


def test_cli_caches_then_reuses(tmp_path, capsys):
    stimuli = write_jsonl(STORIES[:3], tmp_path / "stories.jsonl")
    args = ["cache", "--model", "tiny-gpt2", "--stimuli", str(stimuli), "--sites", "resid_post", "head_out:1",
            "--positions", "final", "protagonist", "--store", str(tmp_path / "store"), "--no-progress"]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "store") in out and "head_out" in out and "3 rows" in out and "reused" not in out
    assert cli_main(args) == 0
    assert "reused, model not run" in capsys.readouterr().out
    bad = [a if a != "resid_post" else "resid_pst" for a in args]
    assert cli_main(bad) == 2
    assert "unknown site kind 'resid_pst'" in capsys.readouterr().err
    assert os.path.isdir(tmp_path / "store")


@pytest.mark.slow
def test_real_model_caches_generated_stories_at_their_spans(smollm2, tmp_path):
    from tomlens.stimuli import generate

    stimuli = [s for s in generate("unexpected-transfer", n=1, seed=0) if s.prompt_type == "belief"][:4]
    positions = ["final", "protagonist", "location_1", "contrast_end"]
    acts = cache_activations(smollm2, stimuli, "resid_post:0,29 head_out:20", positions, store=tmp_path,
                             batch_size=4, progress=False)
    assert acts.get("resid_post", "final").shape == (4, 2, 576)
    assert acts.get("head_out", "protagonist").shape == (4, 1, 9, 576)  # 9 query heads over 3 kv heads
    batch = encode(smollm2, [s.text for s in stimuli])
    pos = resolve_positions(stimuli, batch, ["protagonist:first", "protagonist", "location_1", "contrast_end"])
    for row, s in enumerate(stimuli):
        ids = batch.input_ids[row]
        name = smollm2.tokenizer.decode(ids[int(pos[row, 0]) : int(pos[row, 1]) + 1].tolist()).strip()
        words = [smollm2.tokenizer.decode([int(ids[p])]).strip() for p in pos[row, 2:]]
        assert [name, *words] == [s.span_text("protagonist"), s.span_text("location_1"), "."]
    one = _single(smollm2, stimuli[2], [Site("resid_post", 29), Site("head_out", 20)], positions)
    torch.testing.assert_close(acts.get("resid_post", "protagonist")[2, 1], one[Site("resid_post", 29)][0, 1],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(acts.get("head_out", "final")[2, 0], one[Site("head_out", 20)][0, 0],
                               atol=1e-4, rtol=1e-4)


def test_a_shard_that_does_not_match_its_manifest_is_refused_then_recomputed(load_tiny, tmp_path):
    model = load_tiny("tiny-gpt2")
    a = cache_activations(model, STORIES, ["resid_post"], ["final"], store=tmp_path, batch_size=2, shard_rows=4,
                          progress=False)
    good = a.get("resid_post", "final").clone()
    b = cache_activations(model, STORIES[:4], ["resid_post"], ["final"], store=tmp_path, progress=False)
    (a.path / "shard-00000.safetensors").write_bytes((b.path / "shard-00000.safetensors").read_bytes())
    with pytest.raises(TomlensError, match="does not hold the rows its manifest lists"):
        load_activations(a.path)
    with Forwards(model) as rerun:  # the same request recomputes the damaged shard and what follows it
        again = cache_activations(model, STORIES, ["resid_post"], ["final"], store=tmp_path, batch_size=2,
                                  progress=False)
    assert rerun.rows == len(STORIES) and not again.reused
    torch.testing.assert_close(again.get("resid_post", "final"), good, atol=1e-6, rtol=1e-6)


def test_bad_shard_settings_are_named(load_tiny, tmp_path):
    with pytest.raises(TomlensError, match="flush interval"):
        cache_activations(load_tiny("tiny-gpt2"), STORIES, ["resid_post"], ["final"], store=tmp_path,
                          flush_seconds=-1, progress=False)
