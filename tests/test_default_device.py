"""tomlens's default device: `$TOMLENS_DEVICE` when set, else CUDA when present, else CPU. A device the
machine lacks, or a name torch does not know, is refused with a message that names the setting.

The suite pins the default to the CPU (tests/conftest.py) so that its fp32 CPU numbers hold on a
GPU machine too, and CLI subprocesses inherit the pin."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tomlens.devices import DEVICE_ENV, default_device, resolve_device, resolve_dtype
from tomlens.errors import TomlensError

pytestmark = pytest.mark.unit


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_the_variable_decides_before_the_hardware(monkeypatch):
    _fake_gpus(monkeypatch, 2)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert default_device() == resolve_device(None) == torch.device("cpu")
    assert resolve_dtype(None, resolve_device(None)) == torch.float32  # the CPU's dtype, not bf16
    monkeypatch.setenv(DEVICE_ENV, " cuda:1 ")
    assert default_device() == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")  # a device the caller names wins
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert default_device() == torch.device("cuda") and resolve_dtype(None, default_device()) == torch.bfloat16


@pytest.mark.parametrize("gpus,want", [(0, "cpu"), (1, "cuda")])
def test_unset_or_empty_it_follows_the_hardware(monkeypatch, gpus, want):
    _fake_gpus(monkeypatch, gpus)
    for value in (None, "", "  "):
        if value is None:
            monkeypatch.delenv(DEVICE_ENV, raising=False)
        else:
            monkeypatch.setenv(DEVICE_ENV, value)
        assert default_device() == torch.device(want)


@pytest.mark.parametrize("value,gpus,words", [
    ("toaster", 1, "unknown device"),
    ("gpu", 1, "unknown device"),
    ("cuda", 0, "CUDA is not available"),
    ("cuda:1", 1, "has 1 CUDA device"),
])
def test_an_unknown_or_missing_device_is_refused_naming_the_variable(monkeypatch, value, gpus, words):
    _fake_gpus(monkeypatch, gpus)
    monkeypatch.setenv(DEVICE_ENV, value)
    with pytest.raises(TomlensError, match=words) as err:
        resolve_device(None)
    assert f"{DEVICE_ENV}={value!r}" in err.value.problem and DEVICE_ENV in (err.value.fix or "")


def test_a_device_the_caller_names_is_checked_the_same_way(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(TomlensError, match="has 1 CUDA device"):
        resolve_device("cuda:3")
    with pytest.raises(TomlensError, match="unknown device"):
        resolve_device("toaster")
    _fake_gpus(monkeypatch, 0)
    with pytest.raises(TomlensError, match="CUDA is not available"):
        resolve_device("cuda")


def test_the_suite_pins_the_cpu_and_subprocesses_inherit_it():
    assert os.environ[DEVICE_ENV] == "cpu"
    out = subprocess.run([sys.executable, "-c", "from tomlens.devices import default_device; print(default_device())"],
                         capture_output=True, text=True, check=True, env=os.environ.copy())
    assert out.stdout.strip() == "cpu"
