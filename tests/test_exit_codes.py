"""The exit-code table of docs/reference.md is what the commands do.

The table is read from the page. Every code it lists has at least one real command here that
exits with it, for a reason the code's row gives, and says why in one line without a traceback;
every command run here exits with a code the table lists. A code documented and never produced,
a command whose code moves, or a reason moved to another row fails this module.

The commands are the cheapest that produce each code: bad input, dead URLs, copies of
`tests/data/study_before_floors` (finished, claimed and pending cases), and a silent local peer.
The few that start a simulator process (a run or a resume) never build a task: no case runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable

import pytest
from conftest import ROOT, cli_env, ensure_stopped, rescue_cli, resolved_config, write_cases

pytestmark = pytest.mark.e2e

REFERENCE = ROOT / "docs" / "reference.md"
OLD = ROOT / "tests" / "data" / "study_before_floors"
SCRIPTED = "rescue.embedded.scripted:make_policy"
DEAD = "127.0.0.1:9"  # the discard port: nothing listens on it
SIGINT_BIT = 1 << (signal.SIGINT - 1)


@cache
def documented() -> dict[int, str]:
    """The exit-code table of docs/reference.md: each code's meaning as the page writes it."""
    section = REFERENCE.read_text().split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|\s*(\d+)\s*\|(.+)\|\s*$", section, flags=re.M)
    codes = [int(code) for code, _ in rows]
    assert codes and len(codes) == len(set(codes)), f"the exit-code table lists {codes}"
    return {int(code): meaning.strip() for code, meaning in rows}


def listed(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """A finished command, whose exit code must be one the table lists."""
    assert proc.returncode in documented(), (
        f"{proc.args} exited {proc.returncode}, a code docs/reference.md does not list\n{proc.stdout}\n{proc.stderr}")
    return proc


def rescue(*args: str) -> subprocess.CompletedProcess:
    """`rescue ARGS` run to its end in a fresh process; its exit code must be listed."""
    return listed(rescue_cli(*args, check=False, timeout=120))


def _as_a_terminal_starts_it() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Foreground:
    """`rescue ARGS` as a shell's foreground job: its own process group, SIGINT at its default
    disposition (a harness that ignores SIGINT would pass that on, and prove nothing)."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_as_a_terminal_starts_it,
        )
        status = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        ignored = int(next(line for line in status if line.startswith("SigIgn")).split()[1], 16)
        assert not ignored & SIGINT_BIT, "the command started with SIGINT ignored"
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(pipe, lines), daemon=True)
                        for pipe, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line)

    def wait_for(self, prefix: str, timeout: float = 120) -> None:
        """Until a line of its stdout starts with `prefix`."""
        deadline = time.time() + timeout
        while not any(line.startswith(prefix) for line in self.out):
            assert self.proc.poll() is None or self.readers[0].is_alive(), f"it exited {self.proc.returncode}: {self.err}"
            assert time.time() < deadline, f"no line {prefix!r} on its stdout: {self.out}"
            time.sleep(0.05)

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to every process of the foreground group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def result(self, timeout: float = 120) -> subprocess.CompletedProcess:
        """Its end (killed with its group if it outlives `timeout`); its exit code must be listed."""
        try:
            self.proc.wait(timeout)
        finally:
            ensure_stopped(self.proc)
        for reader in self.readers:
            reader.join(10)
        return listed(subprocess.CompletedProcess(self.proc.args, self.proc.returncode, "".join(self.out),
                                                  "".join(self.err)))


@dataclass(frozen=True)
class Trigger:
    """A command that must exit with `code` for the reason `meaning` (words of that code's row)."""

    name: str
    code: int
    meaning: str
    says: str
    """What its one line says (the last of stderr; for `stream="stdout"`, one of stdout, stderr empty)."""
    run: Callable[[Path], subprocess.CompletedProcess]
    stream: str = "stderr"
    alone: bool = True
    """The line is all of stderr (no usage, no log event before it)."""
    sim: bool = False
    """It starts a simulator process."""


TRIGGERS: list[Trigger] = []


def trigger(code: int, meaning: str, says: str, stream: str = "stderr", alone: bool = True, sim: bool = False):
    """Register the decorated command as one that exits with `code`."""

    def register(run: Callable[[Path], subprocess.CompletedProcess]):
        TRIGGERS.append(Trigger(run.__name__, code, meaning, says, run, stream, alone, sim))
        return run

    return register


def old_study(tmp_path: Path) -> Path:
    """A copy of the stored study: object-3-ep0 and ep1 finished, ep2 claimed, ep3 and ep4 pending."""
    study = tmp_path / "study"
    shutil.copytree(OLD, study)
    return study


def manifest(tmp_path: Path, n: int = 1) -> str:
    """A good manifest of n short libero_object cases."""
    return str(write_cases(tmp_path / "m.jsonl", n, horizon=48))


def claim_all(study: Path) -> None:
    """Claim every pending case for a worker that is gone, as a crash leaves them."""
    from rescue.study.journal import Journal

    with Journal.open(study) as journal:
        for case_id in journal.pending_ids():
            assert journal.claim(case_id, "gone")


# --- 0 -------------------------------------------------------------------------------------------


@trigger(0, "done: the command did its work", "1 cases (0 pilot)", "stdout")
def manifest_check_of_a_good_manifest(tmp_path):
    return rescue("manifest", "check", manifest(tmp_path))


@trigger(0, "`verify`: nothing disagreed", "checked: 5 cases", "stdout")
def verify_of_an_untouched_study(tmp_path):
    return rescue("verify", str(old_study(tmp_path)))


@trigger(0, "`resume`, `eval`: every case has a verdict", "3 started-unfinished case(s) recorded as unknown",
         "stdout", sim=True)
def resume_that_leaves_every_case_with_a_verdict(tmp_path):
    study = old_study(tmp_path)
    claim_all(study)  # nothing is left to run: ep2-ep4 become unknown (interrupted), ep0 and ep1 keep theirs
    return rescue("resume", str(study))


@trigger(0, "`status --watch` and the servers", "rescue study", "stdout")
def ctrl_c_of_status_watch(tmp_path):
    watch = Foreground("status", str(old_study(tmp_path)), "--watch", "60")
    watch.wait_for("")
    time.sleep(0.5)  # the look is printed: it sleeps until the next one
    watch.ctrl_c()
    return watch.result()


@trigger(0, "the servers (`serve`, `serve-vlm`, `serve-policy`) end this way on Ctrl-C", "http://127.0.0.1:",
         "stdout")
def ctrl_c_of_a_server(tmp_path):
    server = Foreground("serve-vlm", "--port", "0")
    server.wait_for("")
    server.ctrl_c()
    return server.result()


# --- 1 -------------------------------------------------------------------------------------------


@trigger(1, "`verify` found a disagreement", "is not named by any receipt line", "stdout")
def verify_of_a_tampered_study(tmp_path):
    study = old_study(tmp_path)
    (study / "vlm" / ("0" * 64 + ".png")).write_bytes(b"never sent")
    return rescue("verify", str(study))


@trigger(1, "a file that cannot be written", "rescue: File exists (")
def export_through_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("")
    return rescue("export", str(old_study(tmp_path)), "--partial", "--out", str(tmp_path / "file" / "export.json"))


# --- 2 -------------------------------------------------------------------------------------------


@trigger(2, "a command line `rescue` does not take", "rescue run: error: the following arguments are required: target",
         alone=False)
def run_without_a_manifest(tmp_path):
    return rescue("run")


@trigger(2, "a manifest", "unknown_suite.jsonl:1: suite: unknown suite 'libero_nonexistent'")
def check_of_a_manifest_with_an_unknown_suite(tmp_path):
    return rescue("manifest", "check", str(ROOT / "tests" / "manifests" / "unknown_suite.jsonl"))


@trigger(2, "a config", "not valid TOML")
def run_with_a_broken_config(tmp_path):
    config = tmp_path / "study.toml"
    config.write_text("[policy\nurl = 1")
    proc = rescue("run", manifest(tmp_path), "--config", str(config), "--study", str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()
    return proc


@trigger(2, "a policy factory that cannot be imported", "policy.factory 'nowhere:make_policy' cannot be loaded")
def run_with_a_policy_factory_that_names_nothing(tmp_path):
    proc = rescue("run", manifest(tmp_path), "--policy-factory", "nowhere:make_policy", "--study", str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()
    return proc


@trigger(2, "a policy factory that cannot be imported", "rescue serve-policy: --policy 'nowhere:make_policy' cannot be loaded")
def serve_policy_with_a_factory_that_names_nothing(tmp_path):
    return rescue("serve-policy", "--policy", "nowhere:make_policy", "--port", "0")


@trigger(2, "a folder that is not a study", "is not a study folder")
def verify_of_a_folder_that_is_not_a_study(tmp_path):
    return rescue("verify", str(tmp_path))


@trigger(2, "a study owned by another process", f"is in use by process {os.getpid()}")
def resume_of_a_study_another_process_owns(tmp_path):
    from rescue.study.owner import own_study

    study = old_study(tmp_path)
    with own_study(study):  # this process is the other one
        return rescue("resume", str(study))


@trigger(2, "a Ray cluster that cannot be joined", f"cannot join the Ray cluster at {DEAD}")
def run_on_a_ray_cluster_nobody_runs(tmp_path):
    proc = rescue("run", manifest(tmp_path), "--backend", "ray", "--address", DEAD, "--study", str(tmp_path / "s"))
    assert not (tmp_path / "s").exists()
    return proc


# --- 3 -------------------------------------------------------------------------------------------


@trigger(3, "a policy server or VLM endpoint that did not answer", f"http://{DEAD}/v1 is not reachable")
def run_whose_vlm_endpoint_is_not_reachable(tmp_path):
    proc = rescue("run", manifest(tmp_path), "--vlm-url", f"http://{DEAD}/v1", "--study", str(tmp_path / "s"))
    assert "nothing was claimed" in proc.stderr and not (tmp_path / "s").exists()
    return proc


@trigger(3, "SIGINT/SIGTERM", "cases without a verdict: SIGTERM stopped it claiming", alone=False, sim=True)
def sigterm_of_a_run(tmp_path):
    run = Foreground("run", manifest(tmp_path, 2), "--study", str(tmp_path / "s"), "--simulators", "1",
                     "--cases-in-flight", "1")
    run.wait_for("rescue: 0/2 cases")  # the study runs under its signal handling; its simulator still starts
    os.kill(run.proc.pid, signal.SIGTERM)  # as `kill`, Slurm or systemd stop a job: no new claim
    return run.result()


# --- 4 -------------------------------------------------------------------------------------------


@trigger(4, "every one is `unknown`", "every one of the 2 cases is unknown", sim=True)
def resume_that_leaves_every_case_unknown(tmp_path):
    from rescue.core.manifest import load_manifest
    from rescue.study.folder import create_study

    config = resolved_config(8, env={"simulators": 1})
    announced = {"action_horizon": 8, "observation": "privileged", "policy": SCRIPTED}
    config = config.model_copy(update={"policy": config.policy.model_copy(
        update={"factory": SCRIPTED, "observation": "privileged", "announced": announced})})
    study = tmp_path / "s"
    create_study(study, load_manifest(manifest(tmp_path, 2)), config)
    claim_all(study)  # both in flight when their run died: resume records them unknown (interrupted)
    return rescue("resume", str(study))


# --- 5 -------------------------------------------------------------------------------------------


@trigger(5, "`rescue export` of an unfinished study without `--partial`", "is unfinished (2 of 5 main cases")
def export_of_an_unfinished_study(tmp_path):
    study = old_study(tmp_path)
    proc = rescue("export", str(study))
    assert "nothing written" in proc.stderr and not (study / "export.json").exists()
    return proc


# --- 130 -----------------------------------------------------------------------------------------


@trigger(130, "Ctrl-C outside a running study's signal handling", "rescue: interrupted")
def ctrl_c_while_the_policy_server_is_asked_for_its_metadata(tmp_path):
    study = tmp_path / "s"
    with socket.socket() as silent:  # takes the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        run = Foreground("run", manifest(tmp_path), "--study", str(study),
                         "--policy-url", f"ws://127.0.0.1:{silent.getsockname()[1]}")
        conn, _ = silent.accept()  # the start waits for the server's metadata
        with conn:
            run.ctrl_c()
            proc = run.result()
    assert not study.exists()
    return proc


def test_every_code_of_the_table_has_a_command_here_and_no_other_code_does():
    codes = documented()
    assert sorted(codes) == sorted({t.code for t in TRIGGERS})
    for t in TRIGGERS:
        assert t.meaning in codes[t.code], f"{t.name}: {t.meaning!r} is not in the row of {t.code}: {codes[t.code]!r}"


@pytest.mark.parametrize(
    "t", [pytest.param(t, id=f"{t.code}-{t.name}", marks=[pytest.mark.sim] if t.sim else []) for t in TRIGGERS]
)
def test_the_command_exits_with_its_documented_code_saying_why_in_one_line(t, tmp_path):
    proc = t.run(tmp_path)
    output = f"{proc.args} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == t.code, output
    assert t.meaning in documented()[t.code]
    assert "Traceback" not in proc.stdout + proc.stderr, output
    if t.stream == "stdout":
        assert proc.stderr == "" and t.says in " ".join(proc.stdout.split()), output  # as rich wraps it
        return
    lines = proc.stderr.strip().splitlines()
    assert t.says in lines[-1], output
    assert len(lines) == 1 or not t.alone, output
