"""Headless Chromium driven over the DevTools protocol (on a pipe: no websocket, no network).

    with Browser("/usr/bin/chromium") as browser:
        page = browser.visit("http://127.0.0.1:8000/", width=1280, height=900)
    page.problems     # console errors, uncaught exceptions, failed or >= 400 requests
    page.png          # the screenshot

`png_colours(data)` counts the distinct colours of a PNG, to tell a page from a blank one.
"""

from __future__ import annotations

import base64
import io
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
                  "--disable-default-apps", "--mute-audio", "--hide-scrollbars", "--remote-debugging-pipe")


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    """Chromium did not start, answer or finish in time (the message holds its stderr's tail)."""


@dataclass
class Visit:
    url: str
    png: bytes = b""
    problems: list[str] = field(default_factory=list)
    title: str = ""


class Browser:
    def __init__(self, binary: str, timeout_s: float = 60.0):
        self.binary, self.timeout_s = binary, timeout_s
        self._id = 0
        self._buffer = b""
        self._events: list[dict] = []

    def __enter__(self) -> "Browser":
        self._profile = tempfile.mkdtemp(prefix="docs-chromium-")
        self._stderr = open(os.path.join(self._profile, "stderr.txt"), "w+b")  # noqa: SIM115
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        args = [self.binary, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}", "about:blank"]
        # Chromium reads the protocol on fd 3 and writes it on fd 4
        script = f'exec "$0" "$@" 3<&{to_child_r} 4>&{from_child_w} {to_child_r}<&- {from_child_w}>&-'
        self._proc = subprocess.Popen(["bash", "-c", script, *args], pass_fds=(to_child_r, from_child_w),
                                      stdin=subprocess.DEVNULL, stdout=self._stderr, stderr=self._stderr)
        os.close(to_child_r)
        os.close(from_child_w)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._proc.poll() is None:
                try:
                    self._send("Browser.close", timeout_s=10)
                except BrowserError:
                    pass
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
        finally:
            os.close(self._to_child)
            os.close(self._from_child)
            self._stderr.close()
            shutil.rmtree(self._profile, ignore_errors=True)

    # ------------------------------------------------------------------------------- protocol

    def stderr_tail(self) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-3000:]

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"no answer from Chromium in time; its stderr:\n{self.stderr_tail()}")
            ready, _, _ = select.select([self._from_child], [], [], min(left, 1.0))
            if not ready:
                if self._proc.poll() is not None:
                    raise BrowserError(f"Chromium exited ({self._proc.returncode}); its stderr:\n{self.stderr_tail()}")
                continue
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise BrowserError(f"Chromium closed the protocol pipe; its stderr:\n{self.stderr_tail()}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _send(self, method: str, params: dict | None = None, session: str | None = None,
              timeout_s: float | None = None) -> dict:
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    # ----------------------------------------------------------------------------------- visit

    def visit(self, url: str, width: int = 1280, height: int = 900, settle_s: float = 1.0) -> Visit:
        """Load `url` in a fresh tab, wait for the load event and a quiet network, take a screenshot."""
        visit = Visit(url)
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for method in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
            self._send(method, session=session)
        self._send("Emulation.setDeviceMetricsOverride",
                   {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=session)
        state = {"loaded": False, "last": time.monotonic()}

        def record(event: dict) -> None:
            if event.get("sessionId") != session:
                return
            method, params = event.get("method", ""), event.get("params", {})
            if method.startswith("Network."):
                state["last"] = time.monotonic()
            if method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                visit.problems.append("uncaught exception: " + str(details.get("exception", {}).get(
                    "description") or details.get("text")))
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                visit.problems.append("console." + params["type"] + ": " + " ".join(
                    str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                visit.problems.append(f"console error: {entry.get('text')} ({entry.get('url', '')})")
            elif method == "Network.responseReceived" and params["response"]["status"] >= 400:
                visit.problems.append(f"HTTP {params['response']['status']}: {params['response']['url']}")
            elif method == "Network.loadingFailed" and not params.get("canceled"):
                visit.problems.append(f"request failed: {params.get('errorText')}")
            elif method == "Page.loadEventFired":
                state["loaded"] = True
                state["last"] = time.monotonic()

        self._send("Page.navigate", {"url": url}, session=session)
        deadline = time.monotonic() + self.timeout_s
        # loaded, and no network activity for settle_s (a worker's own requests finish in its own session)
        while not (state["loaded"] and time.monotonic() - state["last"] >= settle_s):
            if time.monotonic() > deadline:
                raise BrowserError(f"{url} did not finish loading in {self.timeout_s} s")
            try:
                self._events.append(self._read(min(deadline, time.monotonic() + 0.25)))
            except BrowserError as err:
                if "no answer" not in str(err):
                    raise
            while self._events:
                record(self._events.pop(0))
        visit.title = self._send("Runtime.evaluate", {"expression": "document.title", "returnByValue": True},
                                 session=session)["result"].get("value", "")
        shot = self._send("Page.captureScreenshot", {"format": "png"}, session=session)
        visit.png = base64.b64decode(shot["data"])
        while self._events:
            record(self._events.pop(0))
        self._send("Target.closeTarget", {"targetId": target})
        return visit


# ----------------------------------------------------------------------------------- the screenshot


def png_colours(data: bytes) -> int:
    """The number of distinct colours in a PNG."""
    from PIL import Image  # noqa: PLC0415 - Pillow comes with the test extra (matplotlib's dependency)

    with Image.open(io.BytesIO(data)) as image:
        return len(image.convert("RGB").getcolors(maxcolors=1 << 24))
