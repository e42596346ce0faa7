"""An activation store the user cannot write is one clear `TomlensError` naming the folder and the
way out (another --store, or write permission), raised before the model does any work, not a bare
PermissionError halfway through a run. Root ignores file permissions, so the tests on real
permission bits skip as root; the two at the end, which make the operating system say "no" through
a monkeypatch, run for everyone (CI runs as root)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tomlens.activations import cache_activations
from tomlens.activations import store as st
from tomlens.errors import TomlensError
from tomlens.stimuli.records import Stimulus

pytestmark = pytest.mark.unit
as_user = pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission bits")


class _Poison:
    """A model member that fails the test as soon as anything reads or calls it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> object:
        raise AssertionError(f"the model was used ({self._name}.{attr}) before the store was checked")

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise AssertionError(f"the model was used ({self._name}()) before the store was checked")


class UntouchableModel:
    """Has every member of the `Model` protocol (the suite's run-time type check asks), and fails
    the test if anything uses one: the store must be refused first."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise AssertionError("the model was run before the store was checked")


for _name in ("cfg", "tokenizer", "hook_dict", "blocks", "hooks", "parameters", "named_parameters"):
    setattr(UntouchableModel, _name, _Poison(_name))


@pytest.fixture
def read_only(tmp_path: Path):
    folder = tmp_path / "store"
    folder.mkdir()
    folder.chmod(0o500)
    yield folder
    folder.chmod(0o700)  # so pytest can remove it


def _stimulus() -> Stimulus:
    return Stimulus(id="s0", text="Sally puts the ball in the basket.", options=("basket", "box"), answer="basket")


def _says_folder_and_fix(error: TomlensError, folder: Path) -> None:
    assert str(folder) in error.problem and "cannot write" in error.problem
    assert error.fix is not None and "--store" in error.fix and "chmod u+w" in error.fix


@as_user
def test_caching_into_a_read_only_store_is_refused_before_the_model_is_used(read_only):
    with pytest.raises(TomlensError) as caught:
        cache_activations(UntouchableModel(), [_stimulus()], "resid_post:0", "final", store=read_only, progress=False)
    _says_folder_and_fix(caught.value, read_only)


@as_user
def test_a_store_folder_not_made_yet_under_a_read_only_one_is_refused_naming_both(read_only):
    inside = read_only / "activations" / "here"
    with pytest.raises(TomlensError) as caught:
        st.check_writable(inside)
    _says_folder_and_fix(caught.value, inside)
    assert f"{read_only} is not writable" in caught.value.problem


@as_user
def test_a_writable_store_passes_and_a_read_only_request_folder_in_it_is_one_clear_error(tmp_path):
    st.check_writable(tmp_path / "not-yet")  # made on first use: nothing to refuse
    request = tmp_path / "key"
    request.mkdir()
    request.chmod(0o500)  # e.g. made by another user of a shared store
    try:
        with pytest.raises(TomlensError) as caught:
            with st.writer_lock(request):
                pass
    finally:
        request.chmod(0o700)
    _says_folder_and_fix(caught.value, request)


def test_a_store_the_system_refuses_is_refused_before_the_model_is_used_whoever_runs(tmp_path, monkeypatch):
    store = tmp_path / "store"
    store.mkdir()
    real_access = os.access
    monkeypatch.setattr(st.os, "access", lambda p, mode: False if Path(p) == store else real_access(p, mode))
    with pytest.raises(TomlensError) as caught:
        cache_activations(UntouchableModel(), [_stimulus()], "resid_post:0", "final", store=store, progress=False)
    _says_folder_and_fix(caught.value, store)


def test_a_lock_file_the_system_refuses_is_one_clear_error_whoever_runs(tmp_path, monkeypatch):
    request = tmp_path / "key"
    request.mkdir()

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("builtins.open", refuse)
    with pytest.raises(TomlensError) as caught:
        with st.writer_lock(request):
            pass
    _says_folder_and_fix(caught.value, request)


def test_an_experiment_with_a_refused_store_stops_before_loading_its_model(tmp_path, monkeypatch):
    from tomlens.runs.base import ModelSpec
    from tomlens.runs.experiment import ExperimentConfig, run_experiment

    store = tmp_path / "store"
    store.mkdir()
    real_access = os.access
    monkeypatch.setattr(st.os, "access", lambda p, mode: False if Path(p) == store else real_access(p, mode))
    monkeypatch.setattr(ModelSpec, "load", lambda self: pytest.fail("the model loaded before the store was checked"))
    config = ExperimentConfig.from_dict({
        "name": "ro", "model": {"name": "tiny-llama"},
        "cache": {"stimuli": {"family": "order-only", "n": 2}, "sites": ["resid_post"], "store": str(store)}})
    with pytest.raises(TomlensError) as caught:
        run_experiment(config, tmp_path / "out", progress=False)
    _says_folder_and_fix(caught.value, store)
