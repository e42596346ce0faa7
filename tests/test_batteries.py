"""The behaviour stage computes each seed paper's battery summary (with the scoring the paper needs
beyond two options' log-probs), saves and reloads it, and the report shows it."""

from __future__ import annotations

import pandas as pd

from tomlens.behaviour.batteries import BATTERIES, ENRICHERS, battery_summaries, headline
from tomlens.runs.base import ModelSpec, StimuliSpec
from tomlens.runs.behaviour import BehaviourConfig, BehaviourResult, run


def test_every_battery_family_is_a_generator_with_a_summary():
    from tomlens.stimuli import FAMILIES

    assert {"kosoy", "motomqa", "recursive-mindreading", "indirect-request", "scalar-implicature",
            "false-belief-factorial"} <= set(BATTERIES)
    assert set(BATTERIES) <= set(FAMILIES)
    assert set(ENRICHERS) <= set(BATTERIES)
    assert battery_summaries(pd.DataFrame({"x": [1]})) == {}


def test_behaviour_stage_scores_saves_and_reports_the_batteries(tmp_path):
    from tomlens.report.experiment import _behaviour_sections

    stimuli = (StimuliSpec(family="scalar-implicature", n=1), StimuliSpec(family="kosoy", n=1),
               StimuliSpec(family="indirect-request", n=2),
               StimuliSpec(family="motomqa", n=1, options={"conditions": ["simplified/true-first", "simplified/false-first"]}))
    config = BehaviourConfig(model=ModelSpec(name="tiny-llama"), stimuli=stimuli, n_boot=50)
    result = run(config, progress=False)
    assert set(result.batteries) == {"scalar-implicature", "kosoy", "indirect-request", "motomqa"}
    mq = result.table[result.table["family"] == "motomqa"]
    assert mq["p_true_pooled"].between(0, 1).all()  # pooled over True/true/TRUE vs False/false/FALSE
    assert (result.batteries["motomqa"]["scoring"].astype(str).str.contains("pool")).all()
    assert all(len(df) for df in result.batteries.values())
    # scalar implicature needs the bets over "0".."3", which only the enricher computes
    si = result.table[result.table["family"] == "scalar-implicature"]
    assert si[["p_0", "p_1", "p_2", "p_3"]].notna().all().all()
    assert abs(si[["p_0", "p_1", "p_2", "p_3"]].sum(axis=1) - 1).max() < 1e-6
    result.save(tmp_path / "b")
    back = BehaviourResult.load(tmp_path / "b")
    assert set(back.batteries) == set(result.batteries)
    for family, df in result.batteries.items():
        assert list(back.batteries[family].columns) == list(df.columns) and len(back.batteries[family]) == len(df)
    assert family in back.describe()
    for family, df in result.batteries.items():  # the same headline after a reload (a blank string is empty)
        assert list(headline(back.batteries[family])[0].columns) == list(headline(df)[0].columns)
    sections = _behaviour_sections(back)
    battery = [s for s in sections if "batteries" in s.heading]
    assert battery and len(battery[0].collapsed) == len(result.batteries)  # one folded line each


def test_headline_keeps_the_papers_cells_and_flags_and_drops_prose():
    from tomlens.behaviour.batteries import HEADLINE_ROWS

    rows = [{"family": "x", "cell": f"level {i}", "value": 0.5, "paper": None, "flag": None, "note": "long"}
            for i in range(20)]
    rows[3]["paper"] = 0.7
    rows[7]["flag"] = "answers 'false' to 95% of statements"
    top, what = headline(pd.DataFrame(rows))
    assert list(top["cell"]) == ["level 3", "level 7"] and what == "the paper's headline cells"
    assert "note" not in top.columns and "family" not in top.columns and "flag" in top.columns
    kosoy_like = pd.DataFrame([{"level": "cell", "domain": "tom", "score": 0.1, "ci_low": None}] * 30
                              + [{"level": "domain", "domain": "tom", "score": 0.2, "ci_low": None}])
    top, _ = headline(kosoy_like.assign(task=""))  # blank strings are empty too (as after a CSV reload)
    assert list(top["level"]) == ["domain"] and "ci_low" not in top.columns and "task" not in top.columns
    plain = pd.DataFrame([{"cell": i, "value": 1.0, "paper": None, "flag": "odd" if i == 30 else ""}
                          for i in range(40)])
    top, what = headline(plain)
    assert what == "the first rows" and len(top) == HEADLINE_ROWS and 30 in set(top["cell"])  # flags kept
    assert headline(pd.DataFrame(columns=["cell", "value"]))[0].empty


def test_battery_summaries_get_the_runs_option_mass_threshold(monkeypatch):
    """A summary that takes `min_mass` gets the run's threshold, to flag its own cells with
    `aggregates.option_mass_columns`; one that does not is called as before."""
    from tomlens.behaviour import batteries
    from tomlens.behaviour.aggregates import option_mass_columns

    def summary(df: pd.DataFrame, *, n_boot: int = 1000, min_mass: float = 0.5) -> pd.DataFrame:
        return pd.DataFrame([{"cell": "all", **option_mass_columns(df, min_mass)}])

    monkeypatch.setitem(batteries.BATTERIES, "kosoy", summary)
    table = pd.DataFrame({"family": ["kosoy"] * 2, "option_mass_first": [0.3, 0.5], "option_mass": [0.2, 0.4]})
    assert bool(battery_summaries(table, min_mass=0.5)["kosoy"]["low_option_mass"].iloc[0])
    got = battery_summaries(table, min_mass=0.3)["kosoy"].iloc[0]
    assert not got.low_option_mass and got.mean_option_mass_first == 0.4
