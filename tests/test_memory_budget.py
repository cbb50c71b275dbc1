"""A simulator holds a bounded amount of memory whatever the number of tasks it serves (DESIGN §12).

The runs are the CLI's, as a user starts them: an evaluation over the 10 libero_object tasks on one
simulator, and a rescue study (control and assisted arms; assisted arms let go of their simulator while
the VLM thinks, and may continue on the other one from a snapshot) over the same 10 tasks on two. The
peak resident memory (VmHWM) of every process the CLI starts is sampled throughout; each simulator's
must stay under the budget configured (the 2.5 GB floor, and 2.2 GB), and its log must show that envs
were closed to keep it there. The reference is the same cases run where no env is ever closed (`UnboundedAdapter`, in two runs
of 5 tasks, so the reference itself stays near 4 GB): every arm's fingerprint, trace chain (which covers
every query's observation, images, instruction and actions), steps, success, state and render at q
must be the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ROOT, cli_env, descendants, events_of

from rescue.env.memory import DEFAULT_MAX_RSS_GB
from rescue.study.journal import Journal
from rescue.study.layout import SIMULATOR_LOG

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

TASKS, H = range(10), 40
BUDGET = DEFAULT_MAX_RSS_GB * 1e9
STUDY_BUDGET_GB = 2.2
UNBOUNDED = 'adapter = "tests.unbounded_adapter:UnboundedAdapter"'
CLOSED = "rescue: closed the env of"


class PeakSampler(threading.Thread):
    """The peak resident memory (VmHWM, bytes) of every process descended from `root`, sampled every 50 ms."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.peaks, self.cmdlines = root, {}, {}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.05):
            for pid in self._descendants():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue  # gone meanwhile
                hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
                self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
                if cmdline:  # a process that exited (a zombie until reaped) has none left
                    self.cmdlines[pid] = cmdline

    def _descendants(self) -> set[int]:
        return {self.root, *descendants(self.root)}

    def stop(self) -> None:
        self._done.set()
        self.join()

    def simulators(self) -> dict[int, int]:
        """Peak per simulator process (the spawned children that serve an adapter)."""
        return {pid: peak for pid, peak in self.peaks.items() if "spawn_main" in self.cmdlines.get(pid, "")}


def _run(*args: str, timeout: float = 900) -> PeakSampler:
    """`rescue ARGS` in a fresh process, its processes' peak memory sampled."""
    # Simulators of the run's own (no warm pool's): their memory is what is measured.
    proc = subprocess.Popen([sys.executable, "-m", "rescue.cli", *args], cwd=ROOT, env=cli_env(own_simulators=True),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = PeakSampler(proc.pid)
    sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sampler.stop()
    assert proc.returncode == 0, f"rescue {' '.join(args)} exited {proc.returncode}\n{out}"
    return sampler


def _manifest(path: Path, tasks) -> Path:
    lines = [json.dumps({"case_id": f"object-{t}-ep0", "suite": "libero_object", "task_id": t, "init_state_index": 0,
                         "env_seed": 0, "horizon": H, "group": "object"}) for t in tasks]
    path.write_text("\n".join(lines) + "\n")
    return path


def _outcomes(study: Path) -> dict[tuple[str, str], dict]:
    """Per (case, arm): what the arm's trajectory was, as its record's digests."""
    with Journal.open(study, readonly=True) as journal:
        records = {(row.case_id, row.arm): json.loads(row.data) for row in journal.arm_rows()}
    return {
        key: {"status": r["status"], "fingerprint": r["fingerprint"], "trace": [row["chain"] for row in r["trace"]][-1:],
              "rows": len(r["trace"]), "steps": r["steps"], "success": r["success"], "q_state": r.get("q_state"),
              "q_render": r.get("q_render"), "restored_render": r.get("restored_render")}
        for key, r in records.items()
    }


def _closed(study: Path) -> int:
    log = study / SIMULATOR_LOG
    return log.read_text(errors="replace").count(CLOSED) if log.exists() else 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The rescue study of the 10 cases where no env is ever closed: two runs of 5 tasks, one simulator each."""
    root = tmp_path_factory.mktemp("reference")
    config = root / "unbounded.toml"
    config.write_text(f"[env]\n{UNBOUNDED}\n")
    outcomes, peaks = {}, []
    for part, tasks in enumerate((TASKS[:5], TASKS[5:])):
        study = root / f"part{part}"
        sampler = _run("run", str(_manifest(root / f"part{part}.jsonl", tasks)), "--study", str(study),
                       "--config", str(config), "--simulators", "1")
        assert _closed(study) == 0
        # No budget configured: the run's simulators share half the memory available when it started.
        (budget,) = [e for e in events_of(study) if e["event"] == "env.memory_budget"]
        assert budget["gb"] >= DEFAULT_MAX_RSS_GB and "GB available when the run started" in budget["source"], budget
        outcomes.update(_outcomes(study))
        peaks += sampler.simulators().values()
    print(f"\nreference (5 envs per simulator, none closed): simulator peaks {[f'{p / 1e9:.2f} GB' for p in peaks]}")
    return outcomes


def _report(name: str, sampler: PeakSampler) -> dict[int, int]:
    sims = sampler.simulators()
    others = {pid: peak for pid, peak in sampler.peaks.items() if pid not in sims}
    print(f"\n{name}: simulator peaks {[f'{p / 1e9:.2f} GB' for p in sims.values()]}, "
          f"other processes {[f'{p / 1e9:.2f} GB' for p in others.values()]}")
    return sims


def test_an_eval_over_ten_tasks_on_one_simulator_stays_under_the_budget_and_replays_the_reference(tmp_path, reference):
    # The floor: what a simulator may hold whatever the machine (the default is a share of its memory).
    study, config = tmp_path / "eval", tmp_path / "floor.toml"
    config.write_text(f"[env]\nmax_simulator_rss_gb = {DEFAULT_MAX_RSS_GB}\n")
    sampler = _run("eval", "--suite", "libero_object", "--tasks", "0-9", "--episodes", "1", "--horizon", str(H),
                   "--simulators", "1", "--study", str(study), "--config", str(config))
    sims = _report("eval on one simulator", sampler)
    assert len(sims) == 1
    assert all(peak < BUDGET for peak in sims.values()), sims
    assert _closed(study) >= 5  # ten tasks do not fit: envs were closed on the way
    ours = _outcomes(study)
    assert sorted(ours) == sorted(key for key in reference if key[1] == "control")
    for key, outcome in ours.items():
        expected = {**reference[key], "q_state": outcome["q_state"], "q_render": outcome["q_render"]}
        assert outcome == expected, key  # an eval's control arm is the study's (an eval renders nothing at q)


def test_a_study_over_ten_tasks_on_two_simulators_stays_under_the_budget_and_replays_the_reference(tmp_path, reference):
    # The budget a study's configuration sets is the one its simulators keep (here tighter than the default).
    study, config = tmp_path / "study", tmp_path / "budget.toml"
    config.write_text(f"[env]\nmax_simulator_rss_gb = {STUDY_BUDGET_GB}\n")
    sampler = _run("run", str(_manifest(tmp_path / "m.jsonl", TASKS)), "--study", str(study), "--simulators", "2",
                   "--config", str(config))
    sims = _report("study on two simulators", sampler)
    assert len(sims) == 2
    assert all(peak < STUDY_BUDGET_GB * 1e9 for peak in sims.values()), sims
    assert _closed(study) >= 5
    assert f"(memory budget {STUDY_BUDGET_GB:g} GB)" in (study / SIMULATOR_LOG).read_text(errors="replace")
    ours = _outcomes(study)
    assert sorted(ours) == sorted(reference)
    for key in sorted(reference):
        mine, theirs = ours[key], reference[key]
        # Where an arm continued after the VLM wait (on one simulator or the other) is not a result.
        mine, theirs = ({k: v for k, v in o.items() if k != "restored_render"} for o in (mine, theirs))
        assert mine == theirs, key
