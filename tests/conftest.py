"""Shared test fixtures: offline Hugging Face, tiny models built once per session, the embedded model.

The offline switches are set before anything imports transformers, so no test can reach the hub.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

TINY_NAMES: tuple[str, ...] = ("tiny-gpt2", "tiny-llama", "tiny-neox")


def pytest_sessionstart(session: pytest.Session) -> None:
    """CI runs the suite on 1 and on 2 threads (`make test THREADS=n`); a run that silently used
    another count would test one reduction order twice."""
    import torch

    want = os.environ.get("OMP_NUM_THREADS")
    if want and want.isdigit() and torch.get_num_threads() != int(want):
        raise pytest.UsageError(f"OMP_NUM_THREADS={want} but torch runs on {torch.get_num_threads()} threads")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say what the numbers were computed on (printed under -q too): threads and CPU kernels."""
    import torch

    terminalreporter.write_line(
        f"torch {torch.__version__}: {torch.get_num_threads()} threads "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
        f"CPU kernels {torch.backends.cpu.get_cpu_capability()}"
    )


def _clean(model: Any) -> Any:
    """A shared model handed to a test: no hooks left by an earlier test, eval mode, left padding."""
    model.reset_hooks(including_permanent=True)
    model.eval()
    model.tokenizer.padding_side = "left"
    return model


@pytest.fixture(scope="session")
def load_tiny() -> Callable[..., Any]:
    """Factory `load_tiny(name="tiny-gpt2", seed=0)`: one fp32 bridge per (name, seed) per session.

    Tests must not change the returned model's weights or settings (use `load_model` for a private
    copy); hooks are cleared on every call.
    """
    from tomlens.models import load_model

    cache: dict[tuple[str, int], Any] = {}

    def _load(name: str = "tiny-gpt2", seed: int = 0) -> Any:
        key = (name, seed)
        if key not in cache:
            cache[key] = load_model(name, dtype="float32", seed=seed)
        return _clean(cache[key])

    return _load


@pytest.fixture(params=TINY_NAMES)
def tiny_model(request: pytest.FixtureRequest, load_tiny: Callable[..., Any]) -> Any:
    """Each tiny model in turn; narrow with `@pytest.mark.parametrize("tiny_model", [...], indirect=True)`."""
    return load_tiny(request.param)


@pytest.fixture(scope="session")
def embedded_model() -> Any:
    """The real embedded SmolLM2-135M in fp32 (converted once into the tomlens cache); slow tests only."""
    from tomlens.models import load_model

    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture
def smollm2(embedded_model: Any) -> Any:
    return _clean(embedded_model)
