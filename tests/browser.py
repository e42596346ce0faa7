"""A report opened in a real headless Chromium, over the DevTools protocol on a pipe (no websocket
library, no network): console errors and uncaught exceptions, plotly's rendered SVG roots, traces
and data per figure, every request the page made (the network is blocked: every host name fails
to resolve, so a report that needs the internet shows it), the page's width, and PNG screenshots
of the window and of each figure. Shared by the browser tests (`from browser import ...`).
`find_browser` only finds a Chromium; installing one is CI's job (`.ci/run`), never a test's.

Why a pipe: `--remote-debugging-pipe` speaks the protocol over file descriptors 3 and 4 (JSON
messages ending in NUL), so every console message and exception arrives as an event with its
level, which stderr logging does not promise across Chromium versions.
"""

from __future__ import annotations

import io
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
INSTALL_TIMEOUT_S = 600


def find_browser(install: bool = False) -> tuple[str | None, str]:
    """(path, "") of a Chromium, or (None, why not). $TOMLENS_CHROMIUM wins; else one on PATH. Only
    with `install=True` (by hand, never from a test: tests must not run apt-get), as root with
    apt-get, `apt-get install -y chromium` is tried once."""
    env = os.environ.get("TOMLENS_CHROMIUM")
    if env:
        return (env, "") if Path(env).is_file() else (None, f"$TOMLENS_CHROMIUM={env} is not a file")
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found, ""
    apt = shutil.which("apt-get")
    if not install or apt is None or os.geteuid() != 0:
        how = "not installed by tests" if not install else \
            "apt-get " + ("missing" if apt is None else "needs root")
        return None, ("no Chromium on PATH (tried " + ", ".join(NAMES) + f"; {how}): run .ci/run (it installs "
                      "Debian's `chromium` as root), `apt-get install chromium`, or set TOMLENS_CHROMIUM")
    try:
        done = subprocess.run([apt, "install", "-y", "-q", "chromium"], capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    except subprocess.TimeoutExpired:
        return None, f"`apt-get install chromium` took over {INSTALL_TIMEOUT_S} s"
    found = shutil.which("chromium")
    if found:
        return found, ""
    return None, f"no Chromium on PATH and `apt-get install -y chromium` failed: {done.stderr.strip()[-400:]}"


@dataclass
class Page:
    """What a loaded page showed."""

    errors: list[str]  # console errors, uncaught exceptions and error log entries, in order
    plots: dict[str, int]  # figure div id -> number of plotly SVG roots rendered in it
    scroll_width: int  # the document's width in CSS pixels (> the window: a horizontal scroll bar)
    png: bytes  # a screenshot of the window
    figure_pngs: dict[str, bytes] = field(default_factory=dict)  # figure div id -> a screenshot of it
    messages: list[str] = field(default_factory=list)  # every console message, for failure output
    data: dict[str, int] = field(default_factory=dict)  # figure div id -> len(gd._fullData) (-1: not a plot)
    traces: dict[str, int] = field(default_factory=dict)  # figure div id -> trace nodes drawn in its SVG
    requests: list[str] = field(default_factory=list)  # the URL of every request the page made

    @property
    def remote_requests(self) -> list[str]:
        """Requests to anything but the file itself and inline data: a report must need nothing else."""
        return [u for u in self.requests if not u.startswith(("file:", "data:"))]


class _Pipe:
    """The DevTools protocol over Chromium's fds 3 (it reads) and 4 (it writes)."""

    def __init__(self, exe: str, width: int, height: int) -> None:
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()
        self._profile = tempfile.mkdtemp(prefix="tomlens-chromium-")
        args = [exe, "--headless", "--remote-debugging-pipe", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
                "--mute-audio", f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
                # no network: every host name fails to resolve (the requests are still reported)
                "--host-resolver-rules=MAP * ~NOTFOUND"]
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox

        def fds() -> None:  # in the child: the protocol's fds are 3 and 4, inheritable (moved up
            import fcntl  # first, since os.dup2 onto itself would keep close-on-exec)

            r, w = fcntl.fcntl(to_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(args + ["about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, preexec_fn=fds, close_fds=False)
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            for m in self._read(deadline - time.monotonic()):
                if m.get("id") == self._id:
                    if "error" in m:
                        raise RuntimeError(f"{method}: {m['error']}")
                    return m.get("result", {})
                self.events.append(m)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer to {method} in {timeout} s")

    def wait_event(self, method: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e.get("method") == method for e in self.events):
                return True
            self.events.extend(self._read(deadline - time.monotonic()))
        return any(e.get("method") == method for e in self.events)

    def _read(self, timeout: float) -> list[dict[str, Any]]:
        ready, _, _ = select.select([self._from_r], [], [], max(0.0, timeout))
        if ready:
            chunk = os.read(self._from_r, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe: " + self._stderr())
            self._buf += chunk
        *done, self._buf = self._buf.split(b"\0")
        return [json.loads(d) for d in done if d]

    def _stderr(self) -> str:
        self.proc.kill()
        return (self.proc.communicate(timeout=10)[1] or b"").decode(errors="replace")[-800:]

    def close(self) -> None:
        try:
            os.write(self._to_w, json.dumps({"id": self._id + 1, "method": "Browser.close"}).encode() + b"\0")
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            for fd in (self._to_w, self._from_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            if self.proc.stderr is not None:
                self.proc.stderr.close()
            shutil.rmtree(self._profile, ignore_errors=True)


_PLOTS_JS = """(() => {
  const out = {};
  document.querySelectorAll('div.plotly-graph-div').forEach((d, i) => {
    out[d.id || ('unnamed-' + i)] = d.querySelectorAll('svg.main-svg').length;
  });
  return JSON.stringify(out);
})()"""

# Per figure: how many traces plotly holds (gd._fullData) and how many it drew (a trace group or a
# heatmap image in the SVG): an empty figure has SVG roots and axes but neither.
_DRAWN_JS = """(() => {
  const out = {};
  document.querySelectorAll('div.plotly-graph-div').forEach((d, i) => {
    out[d.id || ('unnamed-' + i)] = [Array.isArray(d._fullData) ? d._fullData.length : -1,
                                     d.querySelectorAll('svg.main-svg g.trace, svg.main-svg g.hm').length];
  });
  return JSON.stringify(out);
})()"""

_RECT_JS = """(() => { const d = document.getElementById(%s); if (!d) return null; d.scrollIntoView();
  const r = d.getBoundingClientRect(); return [r.x + window.scrollX, r.y + window.scrollY, r.width, r.height]; })()"""


def _errors(events: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    errors, messages = [], []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            messages.append(f"console.{p.get('type')}: {text}")
            if p.get("type") in ("error", "assert"):
                errors.append(f"console.{p.get('type')}: {text}")
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            errors.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            entry = p["entry"]
            errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
    return errors, messages


class Browser:
    """One headless Chromium for several pages (starting it costs about a second): `with
    Browser(exe) as b: page = b.load(path)`. Each page opens in a fresh tab, closed after."""

    def __init__(self, exe: str) -> None:
        self._pipe = _Pipe(exe, 1280, 900)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._pipe.close()

    def load(self, path: str | Path, *, width: int = 1280, height: int = 900, settle_s: float = 15.0) -> Page:
        """Open `path` at `width` x `height`, wait for the load event and for every figure div to hold
        a rendered plot (up to `settle_s`), then read the errors, the plots, the width and screenshots."""
        import base64

        b = self._pipe
        b.events.clear()
        target = b.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = b.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        try:
            for domain in ("Page", "Runtime", "Log", "Network"):
                b.send(f"{domain}.enable", session=session)
            b.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                           "mobile": False}, session=session)
            b.send("Page.navigate", {"url": Path(path).resolve().as_uri()}, session=session)
            if not b.wait_event("Page.loadEventFired", 60):
                raise TimeoutError(f"{path} did not finish loading in 60 s")

            def evaluate(expr: str) -> Any:
                r = b.send("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session=session)
                return r.get("result", {}).get("value")

            deadline = time.monotonic() + settle_s
            plots = json.loads(evaluate(_PLOTS_JS))
            while time.monotonic() < deadline and not all(plots.values()):
                time.sleep(0.2)
                plots = json.loads(evaluate(_PLOTS_JS))
            time.sleep(0.3)  # the last relayout of responsive figures
            b.events.extend(b._read(0.1))
            scroll = int(evaluate("document.documentElement.scrollWidth"))
            png = base64.b64decode(b.send("Page.captureScreenshot", {"format": "png"}, session=session)["data"])
            drawn = json.loads(evaluate(_DRAWN_JS))
            fig_pngs = {}
            for div in plots:
                rect = evaluate(_RECT_JS % json.dumps(div))
                if rect and rect[2] > 0 and rect[3] > 0:
                    clip = {"x": rect[0], "y": rect[1], "width": rect[2], "height": rect[3], "scale": 1}
                    fig_pngs[div] = base64.b64decode(b.send("Page.captureScreenshot", {
                        "format": "png", "clip": clip, "captureBeyondViewport": True}, session=session)["data"])
            b.events.extend(b._read(0.1))
            mine = [e for e in b.events if e.get("sessionId") == session]
            errors, messages = _errors(mine)
            requests = [e["params"]["request"]["url"] for e in mine if e.get("method") == "Network.requestWillBeSent"]
            return Page(errors, plots, scroll, png, fig_pngs, messages, data={k: v[0] for k, v in drawn.items()},
                        traces={k: v[1] for k, v in drawn.items()}, requests=requests)
        finally:
            b.send("Target.closeTarget", {"targetId": target})


def load(exe: str, path: str | Path, **kwargs: Any) -> Page:
    """`Browser(exe).load(path, **kwargs)` in a browser of its own."""
    with Browser(exe) as b:
        return b.load(path, **kwargs)


def colours(png: bytes) -> int:
    """How many distinct colours a PNG holds (1: blank)."""
    from PIL import Image

    with Image.open(io.BytesIO(png)) as im:
        rgb = im.convert("RGB")
        found = rgb.getcolors(maxcolors=1 << 16)
        return len(found) if found is not None else 1 << 16
