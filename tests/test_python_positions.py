"""One vocabulary for positions (issue 29 parts 2 and 3): the Python patching API reads `sites` and
`positions` as `tomlens patch` does, so `exact_patching(model, pairs, sites=["heads", "resid"])`
plans the cells the command plans by default (the role positions), `positions=("all",)` asks for
the every-position sweep the API used to run by default, and a misspelt position is refused with
the command's own "did you mean"."""

from __future__ import annotations

import pytest
from helpers import short_pairs

from tomlens.errors import TomlensError
from tomlens.patching import attribution_patching, exact_patching, prepare_pairs
from tomlens.patching.cells import plan_cells
from tomlens.patching.exact import ExactSweep
from tomlens.runs.patching import PatchingConfig
from tomlens.runs.patching import run as run_patching

pytestmark = pytest.mark.integration  # tiny models



@pytest.fixture
def planned_cells(monkeypatch):
    """The cells of every exact sweep laid out (by the Python API or by a patching run), in order;
    `planned_cells.pairs` the pairs each was laid out on."""

    class Seen(list):
        pairs: list[list] = []

    seen = Seen()
    seen.pairs = []
    real = ExactSweep.__init__

    def recording(self, model, prepared, cells, *args, **kwargs):
        seen.append(list(cells))
        seen.pairs.append(list(prepared.pairs))
        real(self, model, prepared, cells, *args, **kwargs)

    monkeypatch.setattr(ExactSweep, "__init__", recording)
    return seen


def command_cells(model, pairs, planned_cells, **settings) -> tuple[list, list]:
    """The cells `tomlens patch --dry-run` plans for these pairs (exact patching, denoising only),
    and the pairs it patches (its selection half)."""
    config = PatchingConfig(method="exact", direction="denoise", top_k=0, ablation="none", force=True,
                            dry_run=True, **settings)
    before = len(planned_cells)
    result = run_patching(config, model=model, pairs=pairs, progress=False)
    assert result.dry_run and len(planned_cells) == before + 1
    return planned_cells.pop(), planned_cells.pairs.pop()


@pytest.mark.parametrize("positions", [None, ("all",), ("mentions",), ("roles", "heads=contrast"),
                                       ("resid=each", "heads=final")])
def test_the_python_api_plans_the_cells_the_command_plans(gpt2_pairs, planned_cells, positions):
    model, pairs = gpt2_pairs
    kw = {} if positions is None else {"positions": positions}
    cli, selection = command_cells(model, pairs, planned_cells, sites=("heads", "resid"), **kw)
    # the command patches its selection half (`each`, and `all` for the residual stream: one cell
    # per token of the selection's longest pair) at the mentions every pair it was given shares
    given = pairs if positions == ("mentions",) else selection
    plan = exact_patching(model, given, sites=["heads", "resid"], dry_run=True, progress=False, **kw)
    python = planned_cells.pop()
    assert python == cli and plan.stages[0].units == len(cli)
    if positions is None:  # the default: heads at 3 role positions, the residual stream at 4
        assert {c.position for c in python if c.kind == "head"} == {"final", "query_protagonist", "query_object"}
        assert {c.position for c in python if c.kind == "resid_pre"} == {"final", "contrast", "query_protagonist",
                                                                       "query_object"}


def test_positions_all_restores_the_old_default_sweep(gpt2_pairs, planned_cells):
    model, pairs = gpt2_pairs
    roles = exact_patching(model, pairs, sites=["heads", "resid"], dry_run=True, progress=False)
    every = exact_patching(model, pairs, sites=["heads", "resid"], positions=("all",), dry_run=True, progress=False)
    _, every_cells = planned_cells
    old = plan_cells(model, ["heads", "resid"], n_aligned=prepare_pairs(model, pairs).n_aligned)  # DEFAULT_POSITIONS
    assert every_cells == old
    assert {c.position for c in every_cells} == {"all", "each"}
    assert roles.total_runs < every.total_runs


def test_sites_as_a_mapping_keep_their_own_positions(gpt2_pairs, planned_cells):
    model, pairs = gpt2_pairs
    sites = {"heads": ["all"], "resid": ["all", "final"]}  # the whole residual stream at once, as before
    exact_patching(model, pairs, sites=sites, dry_run=True, progress=False)
    want = plan_cells(model, sites, n_aligned=prepare_pairs(model, pairs).n_aligned)
    assert planned_cells.pop() == want
    exact_patching(model, pairs, sites=sites, positions=("query_object",), dry_run=True, progress=False)
    assert planned_cells.pop() == plan_cells(model, sites, ["query_object"], n_aligned=prepare_pairs(model, pairs).n_aligned)


@pytest.mark.parametrize("patch", [exact_patching, attribution_patching])
def test_a_misspelt_position_or_site_gets_the_command_s_suggestion(gpt2_pairs, patch):
    model, pairs = gpt2_pairs
    for sites, positions, near in ((["heads"], ("fnal",), "final"), (["heads", "resid"], ("heads=query_protagnist",),
                                                                    "query_protagonist"),
                                   (["haeds"], ("roles",), "heads")):
        with pytest.raises(TomlensError) as command:
            PatchingConfig(sites=tuple(sites), positions=positions)
        with pytest.raises(TomlensError) as python:
            patch(model, pairs, sites=sites, positions=positions, progress=False)
        assert f"did you mean {near!r}?" in python.value.problem
        assert (python.value.problem, python.value.fix) == (command.value.problem, command.value.fix)


def test_role_positions_the_stories_lack_are_left_out_with_the_command_s_note(load_tiny, planned_cells, capsys):
    model = load_tiny("tiny-llama")
    pairs = short_pairs(model.tokenizer, 2)  # no question spans: query_protagonist and query_object left out
    cli, selection = command_cells(model, pairs, planned_cells, sites=("heads", "resid"))
    capsys.readouterr()
    exact_patching(model, selection, sites=["heads", "resid"], dry_run=True, progress=False)
    python = planned_cells.pop()
    said = capsys.readouterr().out
    assert python == cli
    assert {c.position for c in python} == {"final", "contrast"}
    n = 2 * len(selection)
    assert f"note: position 'query_object' left out: {n} of {n} stories have no 'query_object' span" in said
    attribution_patching(model, pairs, sites=["heads"], progress=True)
    assert "note: position 'query_protagonist' left out" in capsys.readouterr().out
    attribution_patching(model, pairs, sites=["heads"], progress=False)
    assert "note:" not in capsys.readouterr().out  # quiet without progress


def test_pairs_prepared_without_the_role_positions_are_prepared_with_them(load_tiny):
    model = load_tiny("tiny-llama")
    pairs = short_pairs(model.tokenizer, 3)
    prepared = prepare_pairs(model, pairs, batch_pairs=2)  # no selectors, two groups
    from_prepared = exact_patching(model, prepared, sites=["heads"], progress=False)
    from_pairs = exact_patching(model, pairs, sites=["heads"], batch_pairs=2, progress=False)
    assert from_prepared.cells == from_pairs.cells and {c.position for c in from_pairs.cells} == {"final"}
    assert from_prepared.pair_ids == from_pairs.pair_ids
    assert from_prepared.values.equal(from_pairs.values)  # the same groups, the same forwards


def test_the_readers_of_a_head_ranking_default_to_where_a_role_sweep_put_the_heads(gpt2_pairs):
    """The README's Python flow on default (role) sweeps: rank_heads, compare and head_table read the
    heads at "final" (a role sweep has no "all"), and at "all" where the sweep patched them there."""
    from tomlens.patching import compare, head_table, rank_heads

    model, pairs = gpt2_pairs
    exact = exact_patching(model, pairs, sites=["heads"], progress=False)
    attr = attribution_patching(model, pairs, sites=["heads"], progress=False)
    assert exact.head_position() == "final" and "all" not in {c.position for c in exact.cells}
    assert len(rank_heads(exact)) == model.cfg.n_layers * model.cfg.n_heads
    stats = compare(exact, attr, kind="head")
    assert stats["position"] == "final" and stats["n_cells"] == model.cfg.n_layers * model.cfg.n_heads
    table = head_table(exact, attr)
    assert {"patch_effect", "attribution_effect"} <= set(table.columns) and len(table) == len(rank_heads(exact))
    every = exact_patching(model, pairs, sites=["heads"], positions=["all", "final"], progress=False)
    assert every.head_position() == "all"
