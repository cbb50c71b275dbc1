"""A headless Chromium driven over the DevTools protocol on a pipe (no port, no network), for report tests.

The browser reads commands on fd 3 and writes answers on fd 4, NUL-separated JSON
(`--remote-debugging-pipe`). One page target is attached with a flat session; a test
navigates, evaluates JavaScript in the page (the Performance API included) and reads
the results back.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run")


def chromium_exe() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("headless Chromium is required: install Debian's `chromium` (apt-get install -y chromium)")
    return exe


class Browser:
    """One headless Chromium with one page, driven by DevTools commands."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 900) -> None:
        to_browser, self._w = os.pipe()
        self._r, from_browser = os.pipe()

        def fds() -> None:
            # The browser wants exactly fds 3 and 4. Not pass_fds: that needs 3 and 4 open in this process
            # already, and close_fds would close them again after this hook. Moved out of the way first, so
            # that neither end is one of 3 and 4 (dup2 onto itself would keep it close-on-exec).
            a, b = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser))
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [chromium_exe(), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe",
             f"--window-size={width},{height}", "about:blank"],
            close_fds=False, preexec_fn=fds, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buf, self._id, self.events = b"", 0, []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.requested: list[str] = []
        self.page("Page.enable")
        self.page("Runtime.enable")
        self.page("Network.enable")  # file:// loads leave no resource-timing entries; requests are seen here
        self.page("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    def _send(self, method: str, params: dict | None, session: str | None) -> int:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        return self._id

    def _next(self, until: float) -> dict:
        while b"\0" not in self._buf:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError("Chromium did not answer in time")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed its DevTools pipe")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 60) -> dict:
        """Send one command and return its result (events met meanwhile are kept in `events`)."""
        want = self._send(method, params, session)
        until = time.monotonic() + timeout
        while True:
            msg = self._next(until)
            if msg.get("id") == want:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self.events.append(msg)

    def page(self, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        """A command to the page's session."""
        return self.call(method, params, self.session, timeout)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        """The first event of this kind from the page (kept ones first)."""
        for i, msg in enumerate(self.events):
            if msg.get("method") == method and msg.get("sessionId") == self.session:
                return self.events.pop(i)
        until = time.monotonic() + timeout
        while True:
            msg = self._next(until)
            if msg.get("method") == method and msg.get("sessionId") == self.session:
                return msg
            self.events.append(msg)

    def open(self, url: str, timeout: float = 60) -> None:
        """Navigate and wait for the load event; `requests()` then lists what this page asked for."""
        self.events = [m for m in self.events if m.get("method") not in ("Page.loadEventFired", "Network.requestWillBeSent")]
        self.requested = []
        self.page("Page.navigate", {"url": url})
        self.wait_event("Page.loadEventFired", timeout)

    def requests(self) -> list[str]:
        """Every URL the page requested since it was opened (the page itself included), in order."""
        self.js("0")  # a round trip: events sent before its answer are in by now
        keep = []
        for msg in self.events:
            if msg.get("method") == "Network.requestWillBeSent" and msg.get("sessionId") == self.session:
                self.requested.append(msg["params"]["request"]["url"])
            else:
                keep.append(msg)
        self.events = keep
        return list(self.requested)

    def js(self, expression: str, timeout: float = 60) -> Any:
        """Evaluate in the page (promises awaited) and return the value as JSON."""
        out = self.page("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, timeout)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression[:80]}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def until(self, expression: str, timeout: float = 20) -> Any:
        """Poll an expression until it is truthy; its value."""
        end = time.monotonic() + timeout
        while True:
            value = self.js(expression)
            if value:
                return value
            if time.monotonic() > end:
                raise TimeoutError(f"never true: {expression}")
            time.sleep(0.05)

    def screenshot(self, path: Path, full: bool = False) -> Path:
        """A PNG of the viewport (or the whole page)."""
        params: dict[str, Any] = {"format": "png"}
        if full:
            params["captureBeyondViewport"] = True
            size = self.page("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        path.write_bytes(base64.b64decode(self.page("Page.captureScreenshot", params)["data"]))
        return path

    def close(self) -> None:
        """Close the browser and wait for it (killed if it does not go)."""
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
