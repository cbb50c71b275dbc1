"""A policy that samples, behind openpi's own server, as our users serve pi0 (DESIGN §13).

The embedded vision-language policy draws fresh noise on every call; `python -m rescue.embedded.openpi_stand_in`
serves it with the real `openpi_server` package and openpi's empty metadata: no action horizon, no RNG
extension, one sampling stream for the life of the process. Against it, with the default configuration (only C
given, as openpi's metadata has none):
- a study forks at q and gives valid cases (not `unknown`), exits 0 and verifies;
- `continuations = 4` gives each case's successes of 4 per arm, which `rescue verify` re-derives (a forged
  continuation is caught);
- preflight names the mode, and says the disagreement of its determinism check is the policy sampling;
- `fork_at_q = false` stops after the first case with exit 3 and one line naming the fix;
- docs/own-vla.md's laptop walkthrough (eval, manifest, preflight, run with continuations, verify, report) runs
  as written.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, arm_rows, case_states, cli_env, ensure_stopped, export_of, free_port, rescue_cli, wait_healthy, write_cases

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

HORIZON = 48  # q = 24 at C = 8: a prefix of three queries, three after it
CONFIG = "[policy]\nreplan_interval = 8\n"  # all a user must give: openpi's metadata has no action_horizon


@contextlib.contextmanager
def stand_in() -> Iterator[str]:
    """`python -m rescue.embedded.openpi_stand_in` on a free port, as a user starts it; its ws:// URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rescue.embedded.openpi_stand_in", "--port", str(port)], cwd=ROOT,
                            env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_healthy(port, "the stand-in", proc)
        yield f"ws://127.0.0.1:{port}"
    finally:
        ensure_stopped(proc)
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with stand_in() as url:
        yield url


def _config(tmp_path: Path, top: str = "") -> Path:
    """The study's TOML: top-level keys, then the [policy] table."""
    path = tmp_path / "vla.toml"
    path.write_text(top + CONFIG)
    return path


def test_a_study_against_the_sampling_policy_forks_at_q_by_default_and_its_cases_are_valid(server, tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 3, horizon=HORIZON)
    study = tmp_path / "study"
    # All a user types: openpi's metadata has no action_horizon, so C comes from the flag.
    run = rescue_cli("run", str(manifest), "--study", str(study), "--policy-url", server, "--replan-interval", "8")
    assert run.returncode == 0
    said = " ".join(run.stdout.split())  # the terminal's lines wrap where its width says
    assert "forked at q from one snapshot" in said and "no RNG control" in said
    config = json.loads((study / "config.json").read_text())
    # The mode is resolved and disclosed in the study's identity.
    assert (config["fork_at_q"], config["policy"]["rng_control"], config["policy"]["stateless"]) == (True, False, True)
    assert config["policy"]["replan_interval"] == 8
    assert rescue_cli("verify", str(study)).returncode == 0
    export = export_of(study)
    assert export["study"]["mode"] == "fork" and export["study"]["policy_rng_control"] is False
    assert all(c["label"] in ("rescued", "not_rescued") for c in export["cases"]), [c["reason"] for c in export["cases"]]
    rows = {k: json.loads(v) for k, v in arm_rows(study).items()}
    for (case_id, arm), row in rows.items():
        assert row["mode"] == "fork" and row["policy_rng_control"] is False
        # The follower continued on a fresh connection: no replay of the prefix through a policy that samples.
        assert row["prefix_replayed"] is (None if arm == "control" else False)
        # Every arm's prefix is the one prefix, and the state at q one state.
        control = rows[(case_id, "control")]
        q = 24
        assert [r for r in row["trace"] if r["step"] < q] == [r for r in control["trace"] if r["step"] < q]
        assert row["q_state"] == control["q_state"] is not None
    # The policy samples: the two arms' chunks after q differ even where nothing else could have.
    assert export["summary"]["reproduction"]["controls"] == 3


def test_continuations_give_each_arm_its_successes_of_k_and_verify_rederives_them(server, tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 2, horizon=HORIZON)
    study = tmp_path / "study"
    rescue_cli("run", str(manifest), "--study", str(study), "--config", str(_config(tmp_path, "continuations = 4\n")),
               "--policy-url", server, "--simulators", "2")
    assert rescue_cli("verify", str(study)).returncode == 0
    rows = {k: json.loads(v) for k, v in arm_rows(study).items()}
    assert {arm for _, arm in rows} == {"control", "assisted", *(f"{a}#{k}" for a in ("control", "assisted") for k in (2, 3, 4))}
    export = export_of(study)
    for case in export["cases"]:
        for arm in ("control", "assisted"):
            count = case["continuations"][arm]
            names = [arm, *(f"{arm}#{k}" for k in (2, 3, 4))]
            assert count["continuations"] == 4
            assert count["successes"] == sum(bool(rows[(case["case_id"], n)]["success"]) for n in names)
        # One VLM call at q for the arm, applied by all four of its continuations.
        calls = {rows[(case["case_id"], n)]["assistance"]["call_id"] for n in ("assisted", "assisted#2", "assisted#3", "assisted#4")}
        assert len(calls) == 1 and None not in calls
        states = {rows[(case["case_id"], n)]["q_state"] for n in names}
        assert len(states) == 1
    estimate = export["summary"]["versus_control"]["estimate"]
    assert estimate["continuations"] == 4 and estimate["k"] <= 2 and 0.0 <= estimate["p"] <= 1.0

    # A continuation's success flipped (its digest recomputed): the counts no longer re-derive.
    from rescue.core.records import ArmResult
    from rescue.study.journal import arm_digest

    copy = shutil.copytree(study, tmp_path / "forged")
    case_id = export["cases"][0]["case_id"]
    con = sqlite3.connect(copy / "journal.sqlite")
    data = json.loads(con.execute("SELECT data FROM arms WHERE case_id = ? AND arm = 'assisted#3'", (case_id,)).fetchone()[0])
    data["success"] = not data["success"]
    forged = ArmResult.model_validate(data)
    con.execute("UPDATE arms SET data = ?, digest = ? WHERE case_id = ? AND arm = 'assisted#3'",
                (forged.model_dump_json(), arm_digest(forged), case_id))
    con.commit()
    con.close()
    out = rescue_cli("verify", str(copy), check=False)
    assert out.returncode == 1 and "continuations" in out.stdout, out.stdout


def test_preflight_names_the_fork_mode_and_reads_the_disagreement_as_sampling(server, tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 1, horizon=HORIZON)
    out = rescue_cli("preflight", str(manifest), "--cases", "1", "--clients", "2", "--idle-s", "1",
                     "--config", str(_config(tmp_path)), "--policy-url", server).stdout.splitlines()
    assert any(line.startswith("PASS  mode: forked at q") and "without a replay" in line for line in out), out
    determinism = next(line for line in out if line[6:].startswith("determinism"))
    assert determinism.startswith("PASS") and "it samples" in determinism and "forks at q" in determinism, determinism
    assert out[-1] == "preflight: ok"
    # Told not to fork, the same disagreement fails, naming the fix.
    out = rescue_cli("preflight", str(manifest), "--cases", "1", "--clients", "2", "--idle-s", "1",
                     "--config", str(_config(tmp_path, "fork_at_q = false\n")), "--policy-url", server,
                     check=False).stdout.splitlines()
    determinism = next(line for line in out if line[6:].startswith("determinism"))
    assert determinism.startswith("FAIL") and "unset fork_at_q" in determinism, determinism


def test_independent_replays_of_the_sampling_policy_stop_the_study_after_its_first_case(server, tmp_path):
    manifest = write_cases(tmp_path / "m.jsonl", 5, horizon=HORIZON)
    study = tmp_path / "study"
    run = rescue_cli("run", str(manifest), "--study", str(study), "--config", str(_config(tmp_path, "fork_at_q = false\n")),
                     "--policy-url", server, "--cases-in-flight", "1", check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 3 and "Traceback" not in out, out
    stopped = [line for line in out.splitlines() if line.startswith("rescue: the study stopped")]
    assert len(stopped) == 1 and "a policy that samples" in stopped[0] and "fork_at_q unset or true" in stopped[0], out
    states = list(case_states(study).values())
    assert states.count("finished") == 1 and states.count("pending") == 4


def _blocks(markdown: str, heading: str) -> dict[str, str]:
    """The fenced code blocks under one heading of a document, by language."""
    section = markdown.split(heading, 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"```(\w+)\n(.*?)```", section, re.DOTALL)}


def test_the_laptop_walkthrough_runs_as_written(tmp_path):
    # docs/own-vla.md, "On a laptop": its TOML and its commands, run as a user would run them (only the port and
    # the studies' folder moved to this test's own).
    blocks = _blocks((ROOT / "docs" / "own-vla.md").read_text(), "## On a laptop")
    port = free_port()
    toml = blocks["toml"].replace("8010", str(port))
    (tmp_path / "stand_in.toml").write_text(toml)
    lines = [line.split("#")[0].strip() for line in blocks["bash"].splitlines() if line.strip()]
    assert lines[0] == "python -m rescue.embedded.openpi_stand_in --port 8010 &"
    server = subprocess.Popen([sys.executable, "-m", "rescue.embedded.openpi_stand_in", "--port", str(port)], cwd=tmp_path,
                              env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(port, "the stand-in", server)
        outputs = []
        for line in lines[1:]:
            args = shlex.split(line.replace("studies/", f"{tmp_path}/studies/").replace("stand_in", f"{tmp_path}/stand_in"))
            assert args[0] == "rescue", line
            outputs.append(rescue_cli(*args[1:]))
    finally:
        ensure_stopped(server)
    run = " ".join(outputs[3].stdout.split())  # the terminal's lines wrap where its width says
    assert "forked at q from one snapshot" in run and "3 continuations per arm" in run
    assert "paired estimates over continuations" in run
    study = tmp_path / "studies" / "stand-in-rescue"
    export = export_of(study)
    assert all(set(c["continuations"]) == {"control", "assisted"} for c in export["cases"])
    assert (study / "report.html").is_file()
