"""The BOS rule: by default every model tokenizes as its own tokenizer does, so behaviour scores
equal a plain transformers run; `prepend_bos` / `--prepend-bos` overrides it, and the choice is in
provenance and in the activation store's key."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tomlens.behaviour.scoring import score_options
from tomlens.errors import TomlensError
from tomlens.models import encode, load_model, load_tokenizer, provenance
from tomlens.models.tokens import prepends_bos, set_bos_rule
from tomlens.stimuli.records import Stimulus

TEXTS = [
    ("Anna puts the ring in the drawer and leaves. Ben moves it to the box. Anna will look for the ring in the",
     ("drawer", "jewelry box")),
    ("The cat jumps out of the", ("basket", "box")),
    ("Max keeps his chocolate in the blue cupboard, goes out to play, and while he is away his mother "
     "moves the chocolate into the green cupboard. When Max comes back hungry, he looks in the",
     ("blue cupboard", "green cupboard")),
    ("Tea is in the", ("tin", "kettle")),
    ("Sally has a basket. Anne has a box. Sally puts her marble in the basket and goes for a walk. "
     "Sally thinks the marble is in the", ("basket", "box")),
]
BOS_ID = 1  # <|im_start|> in the SmolLM2 tokenizer that the embedded and tiny models share


def _stimuli() -> list[Stimulus]:
    return [Stimulus(id=f"s{i}", text=t, options=o, answer=o[0]) for i, (t, o) in enumerate(TEXTS)]


@torch.inference_mode()
def _reference(hf_model: Any, tokenizer: Any, stimuli: list[Stimulus], bos: bool) -> list[list[tuple[float, int]]]:
    """(sum of option log-probs, token count) per option: plain transformers, one prompt at a time,
    `tokenizer(text)` with its own special tokens (`bos`: the BOS id put in front by hand)."""
    head = [tokenizer.bos_token_id] if bos else []
    out = []
    for s in stimuli:
        prompt = head + tokenizer(s.text)["input_ids"]
        row = []
        for opt in s.options:
            full = head + tokenizer(f"{s.text} {opt}")["input_ids"]
            assert full[: len(prompt)] == prompt  # the option's tokens are exactly the tail
            logits = hf_model(torch.tensor([full])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            cont = full[len(prompt):]
            row.append((sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(cont)), len(cont)))
        out.append(row)
    return out


def _assert_scores_equal(got: list, want: list[list[tuple[float, int]]], atol: float) -> None:
    # Two computation paths (TransformerLens's eager bridge, batched and left-padded, vs the plain
    # model one prompt at a time): equal up to float32 reduction order.
    for pair, ref in zip(got, want, strict=True):
        for score, (logp, n) in zip(pair, ref, strict=True):
            assert score.n_tokens == n
            assert score.logp_sum == pytest.approx(logp, abs=atol)


def _lengths_differ(model: Any, stimuli: list[Stimulus]) -> None:
    batch = encode(model, [s.text for s in stimuli])
    assert len(set(batch.lengths)) == len(stimuli)  # batches really are left-padded


# --- the embedded model against plain transformers ------------------------------------------------


@pytest.mark.slow
def test_embedded_scores_equal_plain_transformers_by_default(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tomlens.models.embedded import embedded_dir

    folder = embedded_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    stimuli = _stimuli()
    _lengths_differ(smollm2, stimuli)
    assert tokenizer(TEXTS[1][0])["input_ids"][0] != BOS_ID  # the tokenizer's own rule: no BOS
    assert encode(smollm2, [TEXTS[1][0]]).input_ids[0, 0].item() != BOS_ID
    assert provenance(smollm2)["bos"] == {"prepend": False, "source": "tokenizer", "token": "<|im_start|>"}

    got = score_options(smollm2, stimuli, batch_size=3, progress=False)
    _assert_scores_equal(got, _reference(hf_model, tokenizer, stimuli, bos=False), atol=1e-4)

    with_bos = load_model("smollm2-135m", device="cpu", dtype="float32", prepend_bos=True)
    assert provenance(with_bos)["bos"] == {"prepend": True, "source": "user", "token": "<|im_start|>"}
    batch = encode(with_bos, [TEXTS[1][0]])
    assert batch.input_ids[0, 0].item() == BOS_ID and batch.offsets[0][0] == (0, 0)
    got_bos = score_options(with_bos, stimuli, batch_size=3, progress=False)
    want_bos = _reference(hf_model, tokenizer, stimuli, bos=True)
    _assert_scores_equal(got_bos, want_bos, atol=1e-4)
    # The extra <|im_start|> changes the numbers (which is why it is not the default).
    assert max(abs(a.logp_sum - b.logp_sum) for p, q in zip(got, got_bos, strict=True) for a, b in zip(p, q, strict=True)) > 1e-2


def test_a_folder_converted_with_forced_bos_is_repaired(tmp_path):
    """Earlier versions wrote `add_bos_token: true` into the converted folder; it is taken out."""
    from tomlens.models.embedded import _drop_forced_bos

    load_tokenizer("tiny-llama").save_pretrained(tmp_path)
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "add_bos_token": True}))
    _drop_forced_bos(tmp_path)
    assert json.loads(path.read_text()) == config
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


# --- tiny models: the same rule, fast ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-neox"])
@pytest.mark.parametrize("prepend_bos", [None, True])
def test_tiny_scores_equal_plain_transformers(name, prepend_bos):
    from tomlens.models.embedded import load_tokenizer as embedded_tokenizer
    from tomlens.models.tiny import build_tiny, tokenizer_dir

    model = load_model(name, device="cpu", dtype="float32", prepend_bos=prepend_bos)
    stimuli = _stimuli()
    _lengths_differ(model, stimuli)
    got = score_options(model, stimuli, batch_size=2, progress=False)
    want = _reference(build_tiny(name, seed=0), embedded_tokenizer(tokenizer_dir()), stimuli, bos=bool(prepend_bos))
    _assert_scores_equal(got, want, atol=1e-4)


STORY = ("Anna and her brother Tom are in the kitchen. Anna puts the ring in the drawer and goes out to "
         "the garden to water the flowers. While she is out, Tom moves the ring from the drawer to the box. ")
QUESTIONS = ("Anna will look for the ring in the", "The ring is now in the", "Where was the ring at first? In the")
OPTIONS = (("drawer", "box"), ("drawer", "jewelry box"), ("kitchen drawer", "garden shed by the gate"))


def _shared_story_stimuli() -> list[Stimulus]:
    """One long story under several questions, with one- and multi-token options (rows scored from
    the prompt's last position and rows scored as prompt + option), and one unrelated short prompt."""
    stimuli = [Stimulus(id=f"q{i}", text=STORY + q, options=o, answer=o[i % 2])
               for i, (q, o) in enumerate((q, o) for q in QUESTIONS for o in OPTIONS)]
    return stimuli + _stimuli()[1:2]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-neox"])
@pytest.mark.parametrize("prepend_bos", [None, True])
def test_shared_prefix_scores_equal_plain_transformers(name, prepend_bos, monkeypatch):
    """Rows of one story run their common prefix once and the rest against its keys and values:
    the log-probs are a plain model's, one prompt at a time, with and without BOS."""
    from tomlens.behaviour import scoring
    from tomlens.models.embedded import load_tokenizer as embedded_tokenizer
    from tomlens.models.tiny import build_tiny, tokenizer_dir

    model = load_model(name, device="cpu", dtype="float32", prepend_bos=prepend_bos)
    stimuli = _shared_story_stimuli()
    prefixes: list[int] = []
    shared = scoring._forward_shared
    monkeypatch.setattr(scoring, "_forward_shared",
                        lambda m, plain, chunk, prefix, *a: prefixes.append(prefix) or shared(m, plain, chunk, prefix, *a))
    got = score_options(model, stimuli, batch_size=4, progress=False)
    assert prefixes and min(prefixes) >= len(model.tokenizer(STORY)["input_ids"]) - 2  # the story runs once
    want = _reference(build_tiny(name, seed=0), embedded_tokenizer(tokenizer_dir()), stimuli, bos=bool(prepend_bos))
    _assert_scores_equal(got, want, atol=1e-4)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-neox"])
def test_tiny_models_follow_their_tokenizer(name, load_tiny):
    model = load_tiny(name)
    text = "Where will Sally look for her marble?"
    own = load_tokenizer(name)(text)["input_ids"]
    assert own[0] != BOS_ID
    assert encode(model, [text]).input_ids[0].tolist() == own
    assert model.to_tokens(text)[0].tolist() == own  # string input to the bridge agrees too
    assert not model.cfg.tokenizer_prepends_bos and not model.cfg.default_prepend_bos
    assert "add_bos_token" not in model.tokenizer.init_kwargs  # the boot-time mark is removed
    assert provenance(model)["bos"] == {"prepend": False, "source": "tokenizer", "token": "<|im_start|>"}

    forced = load_model(name, prepend_bos=True)
    assert encode(forced, [text]).input_ids[0].tolist() == [BOS_ID] + own
    assert forced.to_tokens(text)[0].tolist() == [BOS_ID] + own
    assert forced.cfg.tokenizer_prepends_bos and forced.cfg.default_prepend_bos
    assert load_tokenizer(name, prepend_bos=True)(text)["input_ids"] == [BOS_ID] + own
    assert provenance(forced)["bos"]["prepend"] is True and provenance(forced)["bos"]["source"] == "user"


def test_a_folder_whose_tokenizer_adds_bos_keeps_it_unless_told(tmp_path, load_tiny):
    """Own rule BOS (tokenizer.json's post-processor adds it): kept by default, dropped on request."""
    from tomlens.models.tiny import build_tiny

    folder = tmp_path / "bos-llama"
    build_tiny("tiny-llama", seed=0).save_pretrained(folder)
    tok = load_tokenizer("tiny-llama", prepend_bos=True)
    tok.save_pretrained(folder)
    text = "Anne moves the marble."
    plain = load_tokenizer("tiny-llama")(text)["input_ids"]

    model = load_model(str(folder))
    assert encode(model, [text]).input_ids[0].tolist() == [BOS_ID] + plain
    assert provenance(model)["bos"] == {"prepend": True, "source": "tokenizer", "token": "<|im_start|>"}
    without = load_model(str(folder), prepend_bos=False)
    assert encode(without, [text]).input_ids[0].tolist() == plain
    assert not without.cfg.tokenizer_prepends_bos
    assert load_tokenizer(str(folder), prepend_bos=False)(text)["input_ids"] == plain


def test_prepend_bos_without_a_bos_token_is_one_clear_error():
    tok = load_tokenizer("tiny-gpt2")
    tok.bos_token = None
    assert not prepends_bos(tok)
    assert set_bos_rule(tok, False)["prepend"] is False  # nothing to drop: fine
    with pytest.raises(TomlensError, match="no BOS token") as e:
        set_bos_rule(tok, True)
    assert "--prepend-bos" in e.value.fix


# --- the store key ----------------------------------------------------------------------------------


def test_store_key_changes_with_the_effective_bos_rule(tmp_path):
    from tomlens.activations import cache_activations
    from tomlens.stimuli import generate

    stimuli = generate("unexpected-transfer", n=1, seed=0)[:4]

    def cached(prepend_bos):
        model = load_model("tiny-gpt2", device="cpu", dtype="float32", prepend_bos=prepend_bos)
        return cache_activations(model, stimuli, "resid_post", "final", store=tmp_path, progress=False)

    default, with_bos = cached(None), cached(True)
    assert default.path != with_bos.path and not with_bos.reused
    assert json.loads((with_bos.path / "manifest.json").read_text())["model"]["bos"]["prepend"] is True
    assert not torch.allclose(default.get("resid_post", "final"), with_bos.get("resid_post", "final"))
    same = cached(False)  # the user asked for what the tokenizer does anyway: same activations, same store
    assert same.path == default.path and same.reused


# --- the command line -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["behave", "cache", "probe", "pairs", "patch"])
def test_every_model_command_takes_the_flag(command):
    from tomlens.cli import build_parser

    required = {"behave": ["--stimuli", "s", "--out", "o"], "cache": ["--stimuli", "s"],
                "probe": ["--stimuli", "s", "--out", "o"], "pairs": ["unexpected-transfer", "--out", "o"],
                "patch": ["--pairs", "p", "--out", "o"]}[command]
    parser = build_parser()
    assert parser.parse_args([command, *required]).prepend_bos is None
    assert parser.parse_args([command, *required, "--prepend-bos"]).prepend_bos is True
    assert parser.parse_args([command, *required, "--no-prepend-bos"]).prepend_bos is False


def test_cli_flag_reaches_the_model(tmp_path, capsys):
    from tomlens.cli import main
    from tomlens.stimuli import generate, write_jsonl

    stimuli = tmp_path / "s.jsonl"
    write_jsonl(generate("unexpected-transfer", n=1, seed=0)[:4], stimuli)
    base = ["--model", "tiny-gpt2", "--stimuli", str(stimuli)]
    assert main(["behave", *base, "--out", str(tmp_path / "b"), "--prepend-bos"]) == 0
    bos = json.loads((tmp_path / "b" / "summary.json").read_text())["provenance"]["bos"]
    assert bos == {"prepend": True, "source": "user", "token": "<|im_start|>"}
    assert main(["behave", *base, "--out", str(tmp_path / "n"), "--no-prepend-bos"]) == 0
    assert json.loads((tmp_path / "n" / "summary.json").read_text())["provenance"]["bos"]["prepend"] is False

    store = tmp_path / "store"
    assert main(["cache", *base, "--store", str(store), "--no-progress", "--prepend-bos"]) == 0
    (manifest,) = store.glob("*/manifest.json")
    assert json.loads(manifest.read_text())["model"]["bos"]["prepend"] is True

    pairs = tmp_path / "pairs.jsonl"
    assert main(["pairs", "unexpected-transfer", "--model", "tiny-gpt2", "--n", "1", "--out", str(pairs),
                 "--prepend-bos"]) == 0
    report = json.loads(pairs.with_name("pairs.report.json").read_text())
    assert report["bos"]["prepend"] is True and report["bos"]["source"] == "user"
    capsys.readouterr()


@pytest.mark.parametrize("argv", [["patch", "--pairs", "{pairs}", "--out", "{out}"],
                                  ["probe", "--stimuli", "{stimuli}", "--out", "{out}"]])
def test_patch_and_probe_pass_the_flag_to_load_model(argv, tmp_path, monkeypatch):
    """The flag reaches `load_model` (stopped there: these commands' own runs are tested elsewhere)."""
    import tomlens.models
    from tomlens.cli import main
    from tomlens.stimuli import generate, write_jsonl
    from tomlens.stimuli.pairs import make_pairs, write_pairs

    stimuli = generate("unexpected-transfer", n=1, seed=0)[:4]
    write_jsonl(stimuli, tmp_path / "s.jsonl")
    pairs, _ = make_pairs("unexpected-transfer", 1, 0, tokenizer=None)
    write_pairs(pairs, tmp_path / "p.jsonl")
    seen: list[Any] = []

    def fake_load_model(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("prepend_bos"))
        raise TomlensError("stopped after load_model", "")

    monkeypatch.setattr(tomlens.models, "load_model", fake_load_model)
    argv = [a.format(pairs=tmp_path / "p.jsonl", stimuli=tmp_path / "s.jsonl", out=tmp_path / "o") for a in argv]
    for flag, want in (([], None), (["--prepend-bos"], True), (["--no-prepend-bos"], False)):
        assert main([*argv, "--model", "tiny-gpt2", *flag]) == 2
        assert seen[-1] is want


def test_demo_passes_the_flag_to_load_model(tmp_path, monkeypatch):
    """The flag reaches `load_model` (stopped there). The demo's first stage, the shortcut audit,
    loads no model and takes a minute, so it is left out of the demo's experiment here."""
    import dataclasses

    import tomlens.models
    from tomlens.cli import demo

    seen: list[Any] = []

    def fake_load_model(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("prepend_bos"))
        raise TomlensError("stopped after load_model", "")

    def without_audit(args: Any, config: Any = demo.demo_config) -> Any:
        full = config(args)
        assert "audit" in full.stages
        return dataclasses.replace(full, stages={k: v for k, v in full.stages.items() if k != "audit"})

    monkeypatch.setattr(tomlens.models, "load_model", fake_load_model)
    monkeypatch.setattr(demo, "demo_config", without_audit)
    assert demo.main(["--out", str(tmp_path), "--no-prepend-bos"]) == 2
    assert demo.main(["--out", str(tmp_path), "--prepend-bos"]) == 2
    assert seen == [False, True]
