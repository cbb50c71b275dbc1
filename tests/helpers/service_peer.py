"""A `rescue serve` as a hostile submitter meets it: the worker with a secret of its own in its environment and its
output in pipes, HTTP requests as any client sends them, and a recording peer on loopback."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Self

from conftest import ROOT, cli_env, ensure_stopped


SECRET = "worker-secret-9d1c"


class Recorder:
    """An aiohttp application on loopback, in a thread of the test, recording every request it gets."""

    def __init__(self, app=None):
        from aiohttp import web

        self.requests: list[dict] = []

        @web.middleware
        async def record(request, handler):
            self.requests.append({"method": request.method, "path": request.path,
                                  "authorization": request.headers.get("Authorization")})
            return await handler(request)

        async def answer(request):
            return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

        if app is None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", answer)
        app.middlewares.append(record)
        self.app = app
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Self:
        from aiohttp import web

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            runner = web.AppRunner(self.app)
            self.loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
            self._runner = runner
            self._ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(runner.cleanup())

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


def serve(queue: Path, port: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    """`rescue serve` as a terminal starts it: its own process group, the worker's secret in its environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "rescue.cli", "serve", "--queue", str(queue), "--port", str(port), *extra],
        cwd=ROOT, env={**cli_env(), "WORKER_SECRET": SECRET, **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def call(port: int, method: str, path: str, body: bytes | str | dict | None = None,
         headers: dict | None = None) -> tuple[int, str]:
    """One HTTP request as any client sends it; (status, body text)."""
    if isinstance(body, dict):
        body = json.dumps(body)
        headers = {"Content-Type": "application/json", **(headers or {})}
    if isinstance(body, str):
        body = body.encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", errors="replace")
    finally:
        conn.close()


def wait_up(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"rescue serve exited {proc.returncode}: {proc.stderr.read()}"
        try:
            if call(port, "GET", "/healthz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("rescue serve never answered /healthz")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    ensure_stopped(proc)
