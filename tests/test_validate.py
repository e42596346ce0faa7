"""`tomlens validate` end to end on tiny-llama (random weights: every check must fail, which is itself
the negative control) and its exit codes. `validate_fast` is the one call the organism's test makes:
    assert validate_fast("tom-organism", tmp_path)[0] == 0
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tomlens.cli import main
from tomlens.runs.validate import CHECKS, ValidationResult, fast_config


def validate_fast(model: str, tmp_path: Path, **overrides: Any) -> tuple[int, ValidationResult]:
    """`tomlens validate` with the fast settings (`fast_config`, changed by `overrides`): the exit
    code and the result read back from the folder it wrote."""
    cfg = fast_config(model, **overrides)
    out = tmp_path / "validate"
    argv = ["validate", "--model", model, "--n-tasks", str(cfg.n_tasks), "--n-permutations", str(cfg.n_permutations),
            "--n-random-heads", str(cfg.n_random_heads), "--n-random-directions", str(cfg.n_random_directions),
            "--seed", str(cfg.seed), "--store", str(tmp_path / "store"), "--out", str(out), "--no-progress"]
    if cfg.k is not None:
        argv += ["--k", str(cfg.k)]
    if cfg.alphas is not None:
        argv += ["--alphas=" + ",".join(map(str, cfg.alphas))]  # "=": negative doses are not flags
    if cfg.steering_layers is not None:
        argv += ["--layers", ",".join(map(str, cfg.steering_layers))]
    code = main(argv)
    return code, ValidationResult.load(out)


def test_tiny_llama_fails_every_check_and_writes_the_table(tmp_path: Path, capsys) -> None:
    # 8 tasks keeps this near 15 s; the organism's test uses fast_config's 16
    code, result = validate_fast("tiny-llama", tmp_path, n_tasks=8, n_permutations=100, n_random_heads=20)
    printed = capsys.readouterr().out
    assert code == 1 and not result.passed
    assert list(result.table["check"]) == list(CHECKS) and not result.table["passed"].any()
    assert all(d for d in result.table["detail"]) and "0 of 5 checks pass: FAILED" in printed
    out = tmp_path / "validate"
    for f in ("checks.csv", "checks.json", "config.json", "manifest.json", "result.json",
              "probes/result.json", "patching/result.json", "steering/result.json"):
        assert (out / f).is_file(), f
    assert result.summary.k == 1 and result.summary.heads == 8  # 2 layers x 4 heads: 5% floors to 0 -> 1
    # the numbers are the stages' own
    rows = result.table.set_index("check")
    sel = json.loads((out / "probes" / "selection.json").read_text())["protagonist_belief"]
    assert rows.loc["probe", "value"] == sel["evaluation"]["score"]
    steer = json.loads((out / "steering" / "result.json").read_text())["layers"]
    chosen = max(steer, key=lambda d: (d["selection_margin"], -d["layer"]))  # picked on the selection half
    assert rows.loc["steering", "value"] == chosen["flip_false_belief"]
    patch = json.loads((out / "patching" / "result.json").read_text())
    if patch.get("withheld"):  # the gate may stop a random model: then the checks say so
        assert patch["withheld"].removeprefix("withheld: ") in rows.loc["topk_recovery", "detail"]
    else:
        assert rows.loc["topk_recovery", "value"] == patch["topk"][0]["top_effect"]
        assert math.isfinite(rows.loc["attribution", "value"])


def test_bad_input_exits_2(tmp_path: Path, capsys) -> None:
    # k beyond the model's heads is known only once the model is loaded
    assert main(["validate", "--model", "tiny-llama", "--k", "9", "--n-tasks", "4", "--store",
                 str(tmp_path / "store"), "--out", str(tmp_path / "v"), "--no-progress"]) == 2
    assert "more than the model's 8 heads" in capsys.readouterr().err
    assert main(["validate", "--model", "no-such-model", "--out", str(tmp_path / "v")]) == 2
    assert not (tmp_path / "v").exists()
    # the steering stage's settings are checked before the probes run: exit 2, not a failed check
    for bad, says in (("--alphas=0", "no non-zero dose"), ("--layers=9", "does not exist")):
        assert main(["validate", "--model", "tiny-llama", "--n-tasks", "8", bad, "--out", str(tmp_path / "v"),
                     "--no-progress"]) == 2
        err = capsys.readouterr()
        assert says in err.err and "stage 1 of 3" not in err.out
