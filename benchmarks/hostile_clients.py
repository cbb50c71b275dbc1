"""The policy server's memory with hostile clients, beside a normal one, against the server of an older commit.

N clients each send 60 MiB of a 61 MiB frame and stop, keeping their sockets open; meanwhile a normal client
asks the policy for a chunk every 0.5 s. The server's resident memory is sampled every 0.5 s for S seconds.
Both servers run as `rescue-serve policy POLICY`: this checkout's, and the one of commit OLD (its `serve/`,
taken with `git archive`), with the same policy (the embedded vision-language policy by default) and
defaults. Printed per server: RSS before the clients, the peak, at the end, and how long after the clients
began it was back within 50 MB of where it started ("let go"); the normal client's answers, failures and
slowest answer; how the hostile clients ended (close code and reason, or still open).

Run: .venv/bin/python benchmarks/hostile_clients.py [--clients 10] [--seconds 60] [--old a046adb]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import ensure_stopped, free_port, wait_healthy  # noqa: E402
from raw_websocket import closed_with, frame_header, open_websocket, read_frame  # noqa: E402

from rescue.policy.client import WebsocketPolicyClient  # noqa: E402

MIB = 1 << 20
POLICY = "rescue.embedded.vision_language:make_policy"
OBSERVATION = {"observation/image": np.zeros((224, 224, 3), np.uint8),
               "observation/wrist_image": np.zeros((224, 224, 3), np.uint8),
               "observation/state": np.zeros(8, np.float32), "prompt": "put the bowl on the plate"}


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def _old_serve(rev: str, into: Path) -> Path:
    """The `serve/` of commit `rev`, unpacked under `into`."""
    archive = subprocess.run(["git", "archive", rev, "serve"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into / "serve"


def _hostile(port: int, wait_s: float, outcomes: list) -> None:
    """Announce 61 MiB, send 60, stop; note how the server ended it within `wait_s`."""
    sock = open_websocket(port, timeout=wait_s)
    try:
        read_frame(sock)
        sock.sendall(frame_header(61 * MIB))
        sock.sendall(bytes(60 * MIB))
        try:
            closed = closed_with(sock)
            outcomes.append(f"closed {closed[0]} ({closed[1]})" if closed else "connection ended without a close")
        except TimeoutError:
            outcomes.append("still open")
    finally:
        sock.close()


async def _normal(url: str, until: float) -> dict:
    """Ask for a chunk every 0.5 s until `until`: answers, failures, slowest answer."""
    answers, failures, slowest = 0, [], 0.0
    client = await WebsocketPolicyClient.connect(url, connect_timeout_s=60)
    try:
        while time.monotonic() < until:
            start = time.monotonic()
            try:
                await client.infer(OBSERVATION)
                answers += 1
                slowest = max(slowest, time.monotonic() - start)
            except Exception as exc:  # a failure is a figure here, not the end of the run
                failures.append(f"{type(exc).__name__}: {exc}")
                break
            await asyncio.sleep(0.5)
    finally:
        await client.close()
    return {"answers": answers, "failures": failures, "slowest_s": round(slowest, 3)}


def measure(name: str, serve_path: Path, clients: int, seconds: float, policy: str) -> dict:
    """One server, its hostile clients and its normal client, sampled for `seconds`."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(serve_path), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-m", "rescue_serve.cli", "policy", policy, "--port", str(port)],
                            cwd=serve_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_healthy(port, name, proc)
        url = f"ws://127.0.0.1:{port}/"
        asyncio.run(_normal(url, time.monotonic() + 1))  # the policy is built and has answered once
        before = _rss_mb(proc.pid)
        end = time.monotonic() + seconds
        outcomes: list[str] = []
        threads = [threading.Thread(target=_hostile, args=(port, seconds, outcomes), daemon=True)
                   for _ in range(clients)]
        samples: list[tuple[float, float]] = []

        def sample() -> None:
            start = time.monotonic()
            while time.monotonic() < end:
                samples.append((round(time.monotonic() - start, 1), _rss_mb(proc.pid)))
                time.sleep(0.5)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for thread in threads:
            thread.start()
        normal = asyncio.run(_normal(url, end))
        sampler.join()
        for thread in threads:
            thread.join(timeout=1)
        outcomes += ["still open"] * (clients - len(outcomes))
        peak_at = max(range(len(samples)), key=lambda i: samples[i][1])
        # When the server was back within 50 MB of where it started, after its peak (None: never, in the run).
        released = next((t for t, rss in samples[peak_at:] if rss < before + 50), None)
        return {"server": name, "rss_before_mb": round(before), "rss_peak_mb": round(samples[peak_at][1]),
                "rss_end_mb": round(samples[-1][1]), "released_after_s": released, "normal_client": normal,
                "hostile_clients": dict(Counter(outcomes)), "samples": samples}
    finally:
        ensure_stopped(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--old", default="a046adb", help="the commit whose server is measured beside this one")
    parser.add_argument("--policy", default=POLICY)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(f"old ({args.old})", _old_serve(args.old, Path(tmp)), args.clients, args.seconds, args.policy),
                measure("this checkout", ROOT / "serve", args.clients, args.seconds, args.policy)]
    print(f"{args.clients} clients each sending 60 MiB of a 61 MiB frame, {args.seconds:g} s, policy {args.policy}")
    print(f"{'server':<16} {'RSS before':>11} {'peak':>7} {'end':>7} {'let go':>7}  normal client"
          f"{'':<23} hostile clients")
    for run in runs:
        normal = run["normal_client"]
        said = f"{normal['answers']} answers, {len(normal['failures'])} failures, slowest {normal['slowest_s']} s"
        released = "never" if run["released_after_s"] is None else f"{run['released_after_s']:g} s"
        print(f"{run['server']:<16} {run['rss_before_mb']:>8} MB {run['rss_peak_mb']:>4} MB {run['rss_end_mb']:>4} MB "
              f"{released:>7}  {said:<35} {run['hostile_clients']}")
    print(json.dumps([{k: v for k, v in run.items() if k != "samples"} for run in runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
