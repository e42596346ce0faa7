"""The patch stage's resume key reads what the BOS rule does to the tokens, not the setting: a
`bos.source` that changes nothing (the tokenizer already follows the rule asked for) reuses the
finished chunks under `.partial/`; a rule that changes the tokens starts new ones."""

from __future__ import annotations

import pytest

from tomlens.models import load_model, provenance
from tomlens.runs.base import ModelSpec
from tomlens.runs.pairs import PairsConfig
from tomlens.runs.pairs import run as run_pairs
from tomlens.runs.patching import PatchingConfig, run

pytestmark = pytest.mark.integration  # tiny models


def _keys(out) -> set[str]:
    return {p.name for p in (out / ".partial").iterdir()}


def test_a_no_op_bos_source_reuses_the_chunks_and_a_real_change_does_not(tmp_path, capsys):
    own = load_model("tiny-llama", device="cpu", dtype="float32")  # the tokenizer's own rule: no BOS
    same = load_model("tiny-llama", device="cpu", dtype="float32", prepend_bos=False)  # asked for, already so
    other = load_model("tiny-llama", device="cpu", dtype="float32", prepend_bos=True)
    assert provenance(own)["bos"]["source"] != provenance(same)["bos"]["source"]  # the setting differs
    assert not provenance(same)["bos"]["prepend"] and provenance(other)["bos"]["prepend"]
    spec = ModelSpec("tiny-llama")
    pairs = run_pairs(PairsConfig(model=spec, n=1, contrasts=("present",)), model=own).pairs
    config = PatchingConfig(model=spec, method="exact", sites=("heads",), positions=("final",), top_k=0,
                            force=True, chunk_runs=2)
    out = tmp_path / "patch"
    first = run(config, model=own, pairs=pairs, out=out, progress=False)
    [key] = _keys(out)
    assert first.checkpoints.count() > 0
    capsys.readouterr()
    run(config, model=same, pairs=pairs, out=out, progress=False)
    assert _keys(out) == {key} and "16 patched runs (--max-runs 100,000), 16 already run" in capsys.readouterr().out
    run(config, model=other, pairs=pairs, out=out, progress=False)
    assert len(_keys(out)) == 2  # BOS prepended: other tokens, other chunks
