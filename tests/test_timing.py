"""tomlens.timing: one timed forward (warm-up, GPU synchronised around the clock) and one way to
write a duration, shared by decoding's estimate, validation's plan and patching's plan."""

from __future__ import annotations

import torch

from tomlens import timing


def test_time_call_warms_up_and_synchronises_around_the_timed_call(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    seconds = timing.time_call(lambda: events.append("call"))
    # warm-up, then the timed call between two synchronisations (queued kernels finish before the clock)
    assert events == ["call", "sync", "call", "sync"] and seconds >= 0
    events.clear()
    timing.time_call(lambda: events.append("call"), warm_up=False)
    assert events == ["sync", "call", "sync"]


def test_format_seconds():
    assert [timing.format_seconds(s) for s in (0.2, 42, 600, 9000)] == ["0 s", "42 s", "10 min", "2.5 h"]


def test_every_estimate_uses_the_shared_helpers(monkeypatch):
    """Decoding, validation and the patching plan time and print through tomlens.timing."""
    from tomlens.behaviour import generate
    from tomlens.patching import plan
    from tomlens.runs import validate

    calls: list[str] = []
    monkeypatch.setattr(timing, "time_call", lambda fn, **kw: calls.append("timed") or 2.0)

    class Fake:
        def __call__(self, *a, **kw):
            raise AssertionError("time_call runs the model, not the caller")

    class S:
        text = "x"

    assert validate._time_forward(Fake(), [S(), S()]) == 1.0 and calls == ["timed"]
    assert plan._fmt_seconds(600) == timing.format_seconds(600) == "10 min"
    assert generate.format_seconds is timing.format_seconds
