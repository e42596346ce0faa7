"""Steering on tiny-llama (order-only, 8 tasks): alpha 0 is behaviour's answer, the fast path equals a
plain hooked forward, a planted answer direction flips answers while random ones mostly do not,
and the stage saves, loads and runs from the CLI."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from tomlens.behaviour import score
from tomlens.cli import main
from tomlens.models.tokens import encode, option_first_tokens
from tomlens.runs.base import ModelSpec, StimuliSpec
from tomlens.runs.steering import SteeringConfig, SteeringResult, run
from tomlens.steering import Direction, dose_response, random_directions, steering
from tomlens.steering.dose import option_roles
from tomlens.stimuli import generate


@pytest.fixture
def llama(load_tiny):
    return load_tiny("tiny-llama")


@pytest.fixture(scope="module")
def stimuli():
    return generate("order-only", n=8, seed=0)


def test_alpha_zero_reproduces_behaviours_first_token_choices(llama, stimuli) -> None:
    d = Direction("belief", "mean_difference", 1, torch.randn(64))
    pp = dose_response(llama, stimuli, [d], [0.0, 2.0], progress=False, per_prompt=True)
    zero = pp[pp["alpha"] == 0.0].sort_values("prompt")
    beh = score(llama, stimuli, progress=False)
    assert zero["choice"].tolist() == (beh["p_a_first"] < 0.5).astype(int).tolist()
    start, now = option_roles(stimuli)
    lp = beh[["logp_a_first", "logp_b_first"]].to_numpy()
    want = [lp[i, start[i]] - lp[i, now[i]] for i in range(len(stimuli))]
    assert zero["logit_diff"].tolist() == pytest.approx(want, abs=1e-4)


def test_the_prefix_reusing_dose_equals_a_plain_steered_forward(llama, stimuli) -> None:
    rows = stimuli[:6]
    d = Direction("x", "random", 0, torch.randn(64, generator=torch.Generator().manual_seed(3)) * 0.05)
    pp = dose_response(llama, rows, [d], [3.0], progress=False, per_prompt=True, batch_size=4).sort_values("prompt")
    toks = option_first_tokens(llama, rows, [s.options for s in rows])
    start, now = option_roles(rows)
    batch = encode(llama, [s.text for s in rows])
    with torch.inference_mode(), steering(llama, [d], 3.0):
        logits = llama(batch.input_ids, **batch.forward_kwargs())[:, -1]
    want = [float(logits[i, toks[i, start[i]]] - logits[i, toks[i, now[i]]]) for i in range(len(rows))]
    assert pp["logit_diff"].tolist() == pytest.approx(want, abs=1e-4)


def test_a_planted_answer_direction_flips_answers_and_random_directions_mostly_do_not(llama, stimuli) -> None:
    W = llama.unembed.original_component.weight.detach()
    g = llama.ln_final.original_component.weight.detach()
    first = option_first_tokens(llama, stimuli, [s.options for s in stimuli])
    start, now = option_roles(stimuli)
    last = llama.cfg.n_layers - 1
    tables = []
    for task in sorted({s.task_id for s in stimuli}):  # options differ per task: one planted vector each
        idx = [i for i, s in enumerate(stimuli) if s.task_id == task]
        k = idx[0]
        v = g * (W[first[k, start[k]]] - W[first[k, now[k]]])  # raises logit(start) - logit(now) after ln_final
        planted = Direction("planted", "file", last, v / v.norm() * 0.1)
        t = dose_response(llama, [stimuli[i] for i in idx], [planted, *random_directions(planted, 20)],
                          [-1.0, 1.0], progress=False, per_prompt=True)
        t["start"] = [start[idx[p]] for p in t["prompt"]]
        tables.append(t)
    df = pd.concat(tables)
    p = df[df["direction"] == "planted"]
    assert (p[p["alpha"] == 1.0]["choice"] == p[p["alpha"] == 1.0]["start"]).all()  # every answer: start
    assert (p[p["alpha"] == -1.0]["choice"] != p[p["alpha"] == -1.0]["start"]).all()  # every answer: now
    fb = p[(p["condition"] == "false_belief") & (p["alpha"] == -1.0)]
    assert fb["flipped"].mean() >= 0.5  # false-belief answers at "start" are all flipped to "now"
    rand = df[df["source"] == "random"]
    assert rand["flipped"].mean() < 0.25
    assert rand.groupby("direction")["flipped"].mean().max() < p["flipped"].mean()


def test_run_saves_and_loads_and_judges_each_layer(llama, tmp_path) -> None:
    cfg = SteeringConfig(model=ModelSpec(name="tiny-llama", dtype="float32"),
                         stimuli=StimuliSpec(family="order-only", n=8), layers=(0, 1), alphas=(-2.0, 0.0, 2.0),
                         n_random=4, store=str(tmp_path / "store"))
    result = run(cfg, model=llama, progress=False)
    layers = result.summary.layers
    assert [d.layer for d in layers] == [0, 1] and all(d.verdict in ("found", "withheld") for d in layers)
    assert set(result.dose["condition"]) == {"false_belief", "true_belief", "reality"}
    assert set(result.dose["direction"]) == {"belief", "shuffled", "random:0", "random:1", "random:2", "random:3"}
    # the selection half runs the belief direction beside random directions of its own draw
    assert set(result.selection["direction"]) == {"belief", "random:0", "random:1", "random:2", "random:3"}
    assert all(isinstance(d.selection_margin, float) and d.selection_random_max is not None for d in layers)
    # margins and verdicts over the random directions' 95th percentile and mean, never their maximum
    assert result.summary.random_quantile == 0.95
    for d in layers:
        assert d.selection_margin == pytest.approx(d.selection_flip - d.selection_random_p95)
        assert 0.0 <= d.random_mean <= d.random_max and d.random_p95 <= d.random_max
        assert d.n_random == 4 and 1 / 5 <= d.p_random <= 1.0
    # ... and not the evaluation half's: a dose chosen where those happen to be weak would flatter their null
    from tomlens.runs.steering import SELECTION_SEED
    from tomlens.steering import random_directions

    for layer in (0, 1):
        belief = result.directions[layer][0]
        evaluation = [d for d in result.directions[layer] if d.source == "random"]
        drawn = random_directions(belief, 4, seed=cfg.seed + SELECTION_SEED)
        assert len(evaluation) == 4 and not any(torch.allclose(a.vector, b.vector) for a in drawn for b in evaluation)
    assert result.best().layer in (0, 1)
    out = result.save(tmp_path / "run")
    back = SteeringResult.load(out)
    assert back.summary == result.summary and back.config == cfg
    pd.testing.assert_frame_equal(back.dose, result.dose)
    assert torch.equal(back.directions[1][0].vector, result.directions[1][0].vector)
    assert "verdict" in back.describe() or "withheld" in back.describe()


def test_cli_exit_codes(tmp_path, capsys) -> None:
    args = ["steer", "--model", "tiny-llama", "--n", "4", "--layers", "1", "--alphas=-2,0,2", "--n-random", "3",
            "--store", str(tmp_path / "store"), "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "ok")]) == 0
    assert (tmp_path / "ok" / "steering_dose.html").is_file() and (tmp_path / "ok" / "result.json").is_file()
    assert "alpha chosen on the selection half" in capsys.readouterr().out
    bad_layer = [a if a != "1" else "9" for a in args]  # tiny-llama has layers 0 and 1
    assert main([*bad_layer, "--out", str(tmp_path / "bad")]) == 2
    bad_alpha = [a if a != "--alphas=-2,0,2" else "--alphas=2,x" for a in args]
    assert main([*bad_alpha, "--out", str(tmp_path / "bad")]) == 2
    assert "fix:" in capsys.readouterr().err


def test_cli_reads_negative_doses_in_both_documented_forms() -> None:
    """argparse's own rules, no private hook: a list after "=", or one dose per word."""
    from tomlens.cli import build_parser

    parser = build_parser()
    for form in (["--alphas=-4,-2,0,2,4"], ["--alphas", "-4", "-2", "0", "2", "4"]):
        args = parser.parse_args(["steer", "--out", "o", *form])
        assert [float(x) for a in args.alphas for x in a.split(",")] == [-4.0, -2.0, 0.0, 2.0, 4.0], form
