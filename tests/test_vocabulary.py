"""One word per idea: the settings every stage shares have one name in every config and on every
command line, and an old name still reads for one release, saying the new one."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from tomlens.cli import build_parser
from tomlens.cli.options import CLOSED_SETS, check_choices
from tomlens.errors import TomlensError
from tomlens.hooks.sites import Site
from tomlens.runs.audit import AuditConfig
from tomlens.runs.base import ModelSpec, StimuliSpec, config_from_dict
from tomlens.runs.behaviour import BehaviourConfig
from tomlens.runs.cache import CacheConfig
from tomlens.runs.freetext import FreeTextConfig
from tomlens.runs.pairs import PairsConfig
from tomlens.runs.patching import PatchingConfig
from tomlens.runs.probes import ProbesConfig
from tomlens.runs.steering import SteeringConfig
from tomlens.runs.study import ExecutorOptions
from tomlens.runs.validate import ValidateConfig

pytestmark = pytest.mark.unit

SPLIT_CONFIGS = (ProbesConfig, SteeringConfig, PatchingConfig, ValidateConfig)  # each keeps selection apart
RETIRED_FLAGS = ("--selection-fraction",)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _visible_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}


def test_every_stage_with_a_selection_half_names_its_size_alike() -> None:
    for cls in SPLIT_CONFIGS:
        names = {f.name for f in dataclasses.fields(cls)}
        assert "select_fraction" in names and "selection_fraction" not in names, cls.__name__


def test_no_command_shows_a_retired_flag_and_each_split_command_takes_the_one_name() -> None:
    commands = _subparsers(build_parser())
    for name, parser in commands.items():
        assert not _visible_flags(parser) & set(RETIRED_FLAGS), name
    for name in ("probe", "patch", "steer", "validate"):
        assert "--select-fraction" in _visible_flags(commands[name]), name


def test_an_old_setting_name_reads_once_with_a_line_naming_the_new(capsys: pytest.CaptureFixture[str]) -> None:
    config = config_from_dict(ProbesConfig, {"stimuli": {"family": "order-only"}, "selection_fraction": 0.3})
    assert config.select_fraction == 0.3
    assert "'selection_fraction' is now 'select_fraction'" in capsys.readouterr().err
    with pytest.raises(TomlensError, match="both"):
        config_from_dict(ProbesConfig, {"stimuli": {"family": "order-only"},
                                        "selection_fraction": 0.3, "select_fraction": 0.4})


def test_an_old_flag_still_parses_and_says_the_new_one(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["probe", "--stimuli", "s.jsonl", "--out", "o", "--selection-fraction", "0.4"])
    assert args.select_fraction == 0.4
    assert "--select-fraction" in capsys.readouterr().err


# -- one name per idea: every flag sets the setting of its own name ------------------------------------
COMMAND_CONFIGS = {"audit": AuditConfig, "behave": BehaviourConfig, "cache": CacheConfig, "probe": ProbesConfig,
                   "pairs": PairsConfig, "patch": PatchingConfig, "steer": SteeringConfig, "validate": ValidateConfig}
RUN_ONLY = {"out", "no_progress", "help"}  # where a command writes and whether it draws progress bars
# A flag whose destination is not the name of the setting it fills, each for a reason.
OTHER_NAMES = {
    ("audit", "source"): "the stimuli (a family or a file), as `stimuli` in [audit]",
    ("audit", "fold_seed"): "the audit's folds (`seed` in [audit]); --seed seeds the generated stories",
    ("audit", "check"): "the exit status only",
    ("patch", "pairs"): "the pairs file (`pairs_path`); `pairs` in a file is the [pairs] table to build",
    ("steer", "directions"): "the probe directions file (`directions_path`)",
    ("validate", "layers"): "`steering_layers`: validate also patches, so its steering settings say so",
    ("validate", "depths"): "`steering_depths`, as `steering_layers`",
}


def _setting_names(cls: type) -> set[str]:
    """A config's settings and those of the settings tables it holds (model, stimuli, thresholds)."""
    hints = typing.get_type_hints(cls)
    names = set()
    for f in dataclasses.fields(cls):
        names.add(f.name)
        for inner in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(inner):
                names |= {g.name for g in dataclasses.fields(inner)}
    return names


def _all_visible(parser: argparse.ArgumentParser, name: str = "") -> list[tuple[str, argparse.Action]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                out += _all_visible(p, f"{name} {sub}".strip())
        elif action.help != argparse.SUPPRESS and action.dest != "help":
            out.append((name, action))
    return out


def test_every_flag_of_a_stage_command_fills_the_setting_of_its_own_name() -> None:
    commands = _subparsers(build_parser())
    for command, cls in COMMAND_CONFIGS.items():
        names = _setting_names(cls)
        for action in commands[command]._actions:
            dest = action.dest
            if dest in RUN_ONLY or (command, dest) in OTHER_NAMES or action.help == argparse.SUPPRESS:
                continue
            negated = dest.removeprefix("no_")
            assert dest in names or (dest != negated and negated in names), (command, action.option_strings, dest)


def test_no_idea_has_two_visible_spellings_across_commands() -> None:
    flags: dict[str, set[str]] = {}
    dests: dict[str, set[tuple[str, ...]]] = {}
    for _, action in _all_visible(build_parser()):
        for flag in action.option_strings:
            flags.setdefault(flag, set()).add(action.dest)
        if action.option_strings:
            dests.setdefault(action.dest, set()).add(tuple(action.option_strings))
    # `--set`: a generator's options (stimuli, audit, pairs) or the settings of a file (run, study, organism)
    assert {f: d for f, d in flags.items() if len(d) > 1} == {"--set": {"options", "overrides"}}
    assert {d: f for d, f in dests.items() if len(f) > 1} == {}
    for old in ("--permutations", "--selection-fraction", "--pairs"):  # steer's --target takes one target
        assert old not in flags or old == "--pairs" and flags[old] == {"pairs"}, old


@pytest.mark.parametrize("argv, dest, value, new", [
    (["probe", "--stimuli", "s", "--out", "o", "--permutations", "7"], "n_permutations", 7, "--n-permutations"),
    (["probe", "--stimuli", "s", "--out", "o", "--target", "world_state", "joint"], "targets",
     ["world_state", "joint"], "--targets"),
    (["validate", "--out", "o", "--permutations", "9"], "n_permutations", 9, "--n-permutations"),
    (["demo", "--pairs", "3"], "n_pairs", 3, "--n-pairs"),
])
def test_a_renamed_flag_still_parses_for_one_release(argv, dest, value, new, capsys) -> None:
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    old = next(a for a in argv if a.startswith("--") and a not in ("--stimuli", "--out"))
    assert f"{old} is now {new} (one name per idea)" in capsys.readouterr().err


def test_the_renamed_flags_reach_the_config(monkeypatch) -> None:
    from tomlens.cli import probe

    seen = []
    monkeypatch.setattr("tomlens.runs.probes.run", lambda config, **_: seen.append(config) or _stop())
    args = build_parser().parse_args(["probe", "--stimuli", "s.jsonl", "--out", "o", "--targets", "world_state",
                                      "--n-permutations", "5"])
    with pytest.raises(_Stop):
        probe.run(args)
    assert seen[0].targets == ("world_state",) and seen[0].n_permutations == 5


class _Stop(Exception):
    pass


def _stop() -> None:
    raise _Stop


# -- sites: one vocabulary on cache, probe and patch ---------------------------------------------------
def test_every_command_takes_the_site_kinds_and_the_shorthands_alike() -> None:
    stimuli = StimuliSpec(family="order-only", n=1)
    assert CacheConfig(stimuli=stimuli, sites=("heads", "resid_post:0", "attn:1")).sites == \
        ("head_out", "resid_post:0", "attn_out:1")
    assert ProbesConfig(stimuli=stimuli, sites=("resid_post", "heads")).sites == ("resid_post", "head_out")
    for sites in (("head_out", "resid_pre"), ("heads", "resid"), ("resid_post", "attn_out", "mlp_out", "z")):
        assert PatchingConfig(pairs_path="p.jsonl", sites=sites).sites == sites
    PatchingConfig(pairs_path="p.jsonl", sites=("head_out",), positions=("roles", "head_out=contrast"))


# -- did you mean: every closed set ---------------------------------------------------------------------
def _said(err: pytest.ExceptionInfo[TomlensError], suggestion: str) -> None:
    assert f"did you mean {suggestion!r}?" in err.value.problem


@pytest.mark.parametrize("build, suggestion", [
    (lambda: CacheConfig(stimuli=StimuliSpec(family="order-only"), sites=("resid_pst:0",)), "resid_post"),
    (lambda: CacheConfig(stimuli=StimuliSpec(family="order-only"), positions=("protagnist",)), "protagonist"),
    (lambda: ProbesConfig(stimuli=StimuliSpec(family="order-only"), sites=("heda_out",)), "head_out"),
    (lambda: ProbesConfig(stimuli=StimuliSpec(family="order-only"), positions=("fnal",)), "final"),
    (lambda: ProbesConfig(stimuli=StimuliSpec(family="order-only"), targets=("world_stat",)), "world_state"),
    (lambda: ProbesConfig(stimuli=StimuliSpec(family="order-only"), evaluation="holdot"), "holdout"),
    (lambda: PatchingConfig(pairs_path="p", sites=("heds",)), "heads"),
    (lambda: PatchingConfig(pairs_path="p", positions=("roles,heads=contrst",)), "contrast"),
    (lambda: PatchingConfig(pairs_path="p", positions=("haeds=final",)), "heads"),
    (lambda: PatchingConfig(pairs_path="p", method="exat"), "exact"),
    (lambda: SteeringConfig(target="protagonist_beleif"), "protagonist_belief"),
    (lambda: SteeringConfig(mode="project-out"), "project_out"),
    (lambda: ValidateConfig(head_position="fianl"), "final"),
    (lambda: ValidateConfig(attribution_path="embedings"), "embeddings"),
    (lambda: PairsConfig(family="unexpected-transfer", contrasts=("presnt",)), "present"),
    (lambda: PairsConfig(family="kosoi"), "kosoy"),
    (lambda: BehaviourConfig(stimuli=(StimuliSpec(family="order-only"),), scoring="logprb"), "logprob"),
    (lambda: ExecutorOptions(executor="slurn"), "slurm"),
    (lambda: FreeTextConfig(family="strange-story"), "strange-stories"),
    (lambda: Site("resid_pots", 0), "resid_post"),
    (lambda: Site("heads", 0), "head_out"),
])
def test_a_misspelt_word_is_refused_with_the_nearest(build, suggestion) -> None:
    with pytest.raises(TomlensError) as err:
        build()
    _said(err, suggestion)


def test_a_role_far_from_every_known_one_is_left_to_the_stories() -> None:
    """A user's own span (here `gift`) is not refused for being unknown to tomlens."""
    assert ProbesConfig(stimuli=StimuliSpec(family="order-only"), positions=("gift",)).positions == ("gift",)
    assert PatchingConfig(pairs_path="p", positions=("roles,heads=gift:first",)).positions


def test_every_closed_set_on_the_command_line_refuses_in_one_line_with_the_nearest() -> None:
    checked = 0
    for command, action in _all_visible(build_parser()):
        parser = _parser_of(command)
        closed = parser.get_default(CLOSED_SETS) or {}
        if action.dest not in closed:
            continue
        what, allowed = closed[action.dest]
        word = allowed[0]
        with pytest.raises(TomlensError) as err:
            check_choices(argparse.Namespace(**{CLOSED_SETS: closed, action.dest: word + "x"}))
        assert "did you mean" in err.value.problem and err.value.fix == f"use one of {', '.join(allowed)}", command
        check_choices(argparse.Namespace(**{CLOSED_SETS: closed, action.dest: word}))
        checked += 1
    assert checked >= 20


def _parser_of(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in command.split():
        parser = _subparsers(parser)[word]
    return parser


def test_pairs_with_a_misspelt_contrast_prints_one_line_and_no_usage(capsys, tmp_path) -> None:
    from tomlens.cli import main

    out = tmp_path / "pairs.jsonl"
    assert main(["pairs", "unexpected-transfer", "--contrast", "presnt", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown contrast 'presnt': did you mean 'present'?" in err and "usage:" not in err
    assert not out.exists()
    assert main(["patch", "--pairs", "p.jsonl", "--out", str(tmp_path / "o"), "--direction", "denoies"]) == 2
    assert "did you mean 'denoise'?" in capsys.readouterr().err


# -- every setting checked before a model loads; nothing written on a refused run ------------------------
def _no_model(*args: object, **kwargs: object) -> None:
    raise AssertionError("a model was loaded")


def test_a_misspelt_position_in_an_experiment_refuses_before_anything(tmp_path, monkeypatch, capsys) -> None:
    from tomlens.cli import main

    monkeypatch.setattr(ModelSpec, "load", _no_model)
    file = tmp_path / "e.toml"
    file.write_text('name = "e"\n[model]\nname = "tiny-llama"\n'
                    '[probes]\nstimuli = {family = "order-only", n = 2}\n')
    out = tmp_path / "run"
    assert main(["run", str(file), "--out", str(out), "--set", 'probes.positions=["protagnist"]']) == 2
    assert "did you mean 'protagonist'?" in capsys.readouterr().err
    assert not out.exists()
    assert main(["run", str(file), "--out", str(out), "--set", 'probes.sites=["resid_pots"]']) == 2
    assert "did you mean 'resid_post'?" in capsys.readouterr().err
    assert not out.exists()


def test_run_experiment_checks_every_model_before_writing(tmp_path, monkeypatch) -> None:
    """Each model's stages are checked (a store this process cannot write, say) before config.json."""
    from tomlens.runs import experiment

    monkeypatch.setattr(ModelSpec, "load", _no_model)
    seen: list[str] = []

    def refuse_the_second(config: object) -> None:
        seen.append(config.model.name)  # type: ignore[attr-defined]
        if len(seen) > 1:
            raise TomlensError("store not writable", "fix it")

    monkeypatch.setattr(experiment, "check_store_writable", refuse_the_second)
    config = experiment.ExperimentConfig.from_dict({
        "name": "two", "models": [{"name": "tiny-llama"}, {"name": "tiny-gpt2"}],
        "cache": {"stimuli": {"family": "order-only", "n": 1}}})
    with pytest.raises(TomlensError, match="store not writable"):
        experiment.run_experiment(config, tmp_path / "run", progress=False)
    assert seen == ["tiny-llama", "tiny-gpt2"] and not (tmp_path / "run").exists()


def test_a_users_own_span_near_a_known_role_is_left_to_the_stories_to_confirm() -> None:
    """A user's file may name a span `cues` or `location`: only the stories can say it is missing."""
    for position in ("cues", "location", "objects"):
        assert ProbesConfig(stimuli=StimuliSpec(path="mine.jsonl"), positions=(position,)).positions == (position,)
        assert CacheConfig(stimuli=StimuliSpec(path="mine.jsonl"), positions=(position,)).positions == (position,)
    with pytest.raises(TomlensError, match="did you mean"):  # a generated family's roles are known
        ProbesConfig(stimuli=StimuliSpec(family="order-only"), positions=("cues",))


# -- the Python API: a keyword is the setting of the same name ------------------------------------------
# Public modules a researcher calls; each public function's keywords are read from its signature.
PYTHON_API_PACKAGES = ("tomlens.probes", "tomlens.patching", "tomlens.steering", "tomlens.activations",
                       "tomlens.behaviour", "tomlens.audit")
# Old spellings of a setting's name (old -> new); `target` is retired only where it takes several names.
RETIRED_KEYWORDS = {"n_perm": "n_permutations", "selection_fraction": "select_fraction", "target": "targets"}
# Functions still spelling an idea the old way, each with the reason (an entry that is no longer true fails).
KEYWORD_EXCEPTIONS: dict[tuple[str, str, str], str] = {}  # (module, function, keyword) -> why it keeps an old name
# Keywords of the probe API and the config setting (of ProbesConfig) they must be spelt as.
PROBE_API_KEYWORDS = {
    "tomlens.probes.sweep.run_probe_sweep": ("targets", "sites", "positions", "probe", "seed"),
    "tomlens.probes.sweep.lay_out_sweep": ("targets", "sites", "positions", "probe", "seed"),
    "tomlens.probes.selection.select_and_evaluate": ("sites", "seed", "select_fraction", "n_permutations", "probe"),
    "tomlens.probes.selection.selection_stage": ("sites", "seed", "select_fraction", "n_permutations", "probe"),
    "tomlens.probes.selection.max_statistic_null": ("n_permutations", "seed"),
    "tomlens.probes.selection.permute_labels": ("n_permutations", "seed"),
}


def _public_functions() -> list[tuple[str, str, typing.Callable[..., object]]]:
    import importlib
    import inspect
    import pkgutil

    out = []
    for package in PYTHON_API_PACKAGES:
        root = importlib.import_module(package)
        names = [package, *(m.name for m in pkgutil.walk_packages(root.__path__, package + "."))]
        for name in names:
            module = importlib.import_module(name)
            out += [(name, f, fn) for f, fn in vars(module).items()
                    if not f.startswith("_") and inspect.isfunction(fn) and fn.__module__ == name]
    return out


def _takes_several(annotation: object) -> bool:
    """Whether a parameter's annotation admits a sequence of names (`str | Sequence[str]`)."""
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return any(word in text for word in ("Sequence", "list[", "tuple[", "Iterable"))


def test_no_public_python_function_spells_a_setting_the_old_way() -> None:
    import inspect

    found = set()
    for module, name, fn in _public_functions():
        for p in inspect.signature(fn).parameters.values():
            if p.name in RETIRED_KEYWORDS and (p.name != "target" or _takes_several(p.annotation)):
                found.add((module, name, p.name))
    assert found == set(KEYWORD_EXCEPTIONS), found ^ set(KEYWORD_EXCEPTIONS)


@pytest.mark.parametrize("path, keywords", PROBE_API_KEYWORDS.items())
def test_the_probe_api_keywords_are_the_probe_settings_names(path: str, keywords: tuple[str, ...]) -> None:
    import importlib
    import inspect

    module, name = path.rsplit(".", 1)
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    settings = _setting_names(ProbesConfig)
    for keyword in keywords:
        assert keyword in params and keyword in settings, (path, keyword)


def _planted_acts() -> object:
    import torch
    from helpers import TensorActivations

    from tomlens.stimuli import generate

    stimuli = generate("unexpected-transfer", n=3, seed=0)
    resid = torch.randn(len(stimuli), 2, 4, generator=torch.Generator().manual_seed(0))
    return TensorActivations(list(stimuli), {("resid_post", "final"): resid}, {"model": {"model": "planted"}})


def test_the_old_target_keyword_still_works_for_one_release_with_a_line(capsys, monkeypatch) -> None:
    import tomlens.probes.sweep as sweep

    acts = _planted_acts()
    new = sweep.lay_out_sweep(acts, targets=["protagonist_belief", "world_state"], sites=("resid_post",))
    assert capsys.readouterr().err == ""
    old = sweep.lay_out_sweep(acts, target=["protagonist_belief", "world_state"], sites=("resid_post",))
    assert old.names == new.names == ["protagonist_belief", "world_state"]
    assert "lay_out_sweep: argument target= is now targets= (one name per idea)" in capsys.readouterr().err
    with pytest.raises(TomlensError, match="both target= and targets="):
        sweep.lay_out_sweep(acts, target="world_state", targets="world_state", sites=("resid_post",))
    seen: list[object] = []  # run_probe_sweep reads the old keyword too, before laying anything out
    monkeypatch.setattr(sweep, "lay_out_sweep", lambda acts, targets, **_: seen.append(targets) or _stop())
    with pytest.raises(_Stop):
        sweep.run_probe_sweep(acts, target="world_state", sites=("resid_post",))
    assert seen == ["world_state"] and "run_probe_sweep: argument target= is now targets=" in capsys.readouterr().err


def test_the_old_n_perm_keyword_gives_the_same_null_with_a_line(capsys) -> None:
    import torch

    from tomlens.probes.selection import max_statistic_null, permute_labels

    y, groups = torch.tensor([0, 1] * 6), torch.arange(12) // 2
    units = [torch.randn(3, 12, 4, generator=torch.Generator().manual_seed(1))]
    new = max_statistic_null(units, y, groups, folds=3, n_permutations=5, seed=0, device="cpu")
    assert capsys.readouterr().err == ""
    old = max_statistic_null(units, y, groups, folds=3, n_perm=5, seed=0, device="cpu")
    assert old[0] == new[0] and torch.equal(old[1], new[1]) and old[1].numel() == 5
    assert "max_statistic_null: argument n_perm= is now n_permutations=" in capsys.readouterr().err
    assert torch.equal(permute_labels(y, groups, n_perm=4, seed=0, within=True),
                       permute_labels(y, groups, 4, 0, True))
