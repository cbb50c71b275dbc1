"""A study whose policy is a vla-eval model server: the harness's own `PredictModelServer`s (a deterministic numpy
model, one that samples) served by its own serving code on loopback, driven through the CLI as a user does.

- preflight names the server's fork modes and checks q against its chunk boundary: passes at C = its
  chunk_size, fails in one line at a C whose q falls mid-chunk;
- a rescue study against the deterministic server forks at q, each follower on a fresh session, verifies and
  exports; against the sampling one it gets K continuations per arm and verifies;
- an `error` frame ends its arm with the server's words and the study goes on; a server that dies mid-arm
  ends the arm, never as a policy failure;
- a chunk cut by the horizon does not leak into the next arm: every arm's session predicts at its step 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import export_of, rescue_cli
from vla_eval_peers import log_rows, vla_eval_server

from rescue.study.journal import Journal

pytestmark = [pytest.mark.sim, pytest.mark.e2e]

CHUNK = 5
HORIZON = 40  # q = 20 = 4 chunks of 5
SUITE = {"suite": "libero_object", "task_id": 0, "env_seed": 7}


def _manifest(path: Path, n: int, horizon: int = HORIZON, **extra) -> Path:
    lines = [{"case_id": f"object-0-ep{i}", "init_state_index": i, "horizon": horizon, **SUITE, **extra} for i in range(n)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _config(tmp_path: Path, interval: int = CHUNK, top: str = "") -> Path:
    path = tmp_path / f"vla-eval-{interval}.toml"
    path.write_text(f"{top}[policy]\nreplan_interval = {interval}\n[env]\nepisode_protocol = \"vla-eval\"\n")
    return path


def _predict_steps(path: Path) -> dict[str, list[int]]:
    """The steps each session predicted at (its own step count since its episode_start)."""
    out: dict[str, list[int]] = {}
    for row in log_rows(path, "predict"):
        out.setdefault(row["session"], []).append(row["step"])
    return out


def test_preflight_names_the_modes_and_refuses_a_q_off_the_chunk_boundary(tmp_path):
    manifest = _manifest(tmp_path / "m.jsonl", 1)
    with vla_eval_server(chunk_size=CHUNK) as url:
        runs = {c: rescue_cli("preflight", str(manifest), "--config", str(_config(tmp_path, c)), "--policy-url", url,
                              "--cases", "1", "--clients", "2", "--idle-s", "1", check=False) for c in (CHUNK, 3)}
    good, bad = (" ".join(runs[c].stdout.split()) for c in (CHUNK, 3))
    assert runs[CHUNK].returncode == 0, good
    assert "is stateful and chunked on its side with no RNG control" in good
    assert "Valid: fork at q on a chunk boundary" in good and "independent replays of a deterministic server" in good
    assert "profile vla-eval-libero+wrist+state" in good
    assert "PASS chunk boundary object-0-ep0: a fresh session from q = 20 answers as the running one" in good
    assert runs[3].returncode != 0
    assert ("FAIL chunk boundary object-0-ep0: q = 21 is not on a chunk boundary of the server: a fresh session from q "
            "answers otherwise than the running one") in bad


def test_a_rescue_study_against_the_deterministic_server_verifies_and_exports(tmp_path):
    manifest = _manifest(tmp_path / "m.jsonl", 2)
    log = tmp_path / "server.jsonl"
    study = tmp_path / "study"
    with vla_eval_server(chunk_size=CHUNK, log_path=str(log)) as url:
        run = rescue_cli("run", str(manifest), "--study", str(study), "--config", str(_config(tmp_path)),
                         "--policy-url", url, "--simulators", "2", check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    config = json.loads((study / "config.json").read_text())
    assert config["fork_at_q"] is True and config["policy"]["rng_control"] is False
    assert config["policy"]["observation"] == "vla-eval-libero+wrist+state"
    assert config["policy"]["announced"] == {"policy": "DeterministicModel", "wire": "vla-eval",
                                             "observation_params": {"send_wrist_image": True, "send_state": True}}
    assert rescue_cli("verify", str(study)).returncode == 0
    export = export_of(study)
    assert export["study"]["mode"] == "fork"
    with Journal.open(study) as journal:
        arms = journal.all_arms()
    for case_id, by_arm in arms.items():
        assert {arm.status for arm in by_arm.values()} == {"complete"}, case_id
        assert {arm.episode_protocol for arm in by_arm.values()} == {"vla-eval"}
        # One trace row per chunk of the server's: its replans, at 0, 5, 10, ...
        assert [row.step for row in by_arm["control"].trace][:4] == [0, 5, 10, 15]
    # Every session (the leader's; each follower's, fresh at q) predicts at its own step 0 and every 5 after.
    for steps in _predict_steps(log).values():
        assert steps == list(range(0, 5 * len(steps), 5))
    assert len(_predict_steps(log)) == 2 * 2  # per case: the leader and the assisted follower


def test_a_sampling_server_gets_k_continuations_per_arm(tmp_path):
    manifest = _manifest(tmp_path / "m.jsonl", 1)
    study = tmp_path / "study"
    with vla_eval_server("sampling", chunk_size=CHUNK) as url:
        run = rescue_cli("run", str(manifest), "--study", str(study), "--config", str(_config(tmp_path)),
                         "--policy-url", url, "--continuations", "2", check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert rescue_cli("verify", str(study)).returncode == 0
    with Journal.open(study) as journal:
        arms = journal.all_arms()["object-0-ep0"]
    assert set(arms) == {"control", "assisted", "control#2", "assisted#2"}
    assert {arm.status for arm in arms.values()} == {"complete"}
    # The continuations share the prefix and part after q: the server samples.
    q_rows = [[row.actions for row in arms[name].trace if row.step >= 20] for name in ("control", "control#2")]
    assert q_rows[0] != q_rows[1]
    assert [row.actions for row in arms["control"].trace if row.step < 20] == \
           [row.actions for row in arms["control#2"].trace if row.step < 20]


def test_an_error_frame_ends_its_arm_with_the_servers_words_and_the_study_goes_on(tmp_path):
    manifest = _manifest(tmp_path / "m.jsonl", 2, horizon=10)
    study = tmp_path / "study"
    with vla_eval_server(chunk_size=CHUNK, fail_at_call=2) as url:
        rescue_cli("eval", "--suite", "libero_object", "--tasks", "0", "--episodes", "2", "--horizon", "10",
                   "--study", str(study), "--config", str(_config(tmp_path)), "--policy-url", url,
                   "--simulators", "1", "--cases-in-flight", "1", check=False)
    with Journal.open(study) as journal:
        arms = {case_id: by_arm["control"] for case_id, by_arm in journal.all_arms().items()}
    failed = [arm for arm in arms.values() if arm.status == "error"]
    assert len(failed) == 1 and "observation_failed: ValueError: the model refuses call 2" in failed[0].error_detail
    assert [arm.status for arm in arms.values() if arm is not failed[0]] == ["complete"]


def test_a_server_that_dies_mid_arm_ends_the_arm_not_as_a_policy_failure(tmp_path):
    study = tmp_path / "study"
    with vla_eval_server(chunk_size=CHUNK, die_at_call=2) as url:
        rescue_cli("eval", "--suite", "libero_object", "--tasks", "0", "--episodes", "1", "--horizon", "10",
                   "--study", str(study), "--config", str(_config(tmp_path, top="fail_fast_arms = 1\n")),
                   "--policy-url", url, "--simulators", "1", check=False)
    with Journal.open(study) as journal:
        (arm,) = (by_arm["control"] for by_arm in journal.all_arms().values())
        verdicts = journal.verdicts()
    assert arm.status == "error" and arm.success is None and "closed" in arm.error
    assert {v.label for v in verdicts.values()} == {"unknown"}


def test_a_chunk_cut_by_the_horizon_does_not_leak_into_the_next_arm(tmp_path):
    # Horizon 12 at C = 5: each episode's last chunk is cut after 2 of its 5 actions, 3 stay in the server's buffer.
    # The next episode, run right after it, must start from a prediction of its own, as the first did.
    # The server asks for env seed 0, as OpenVLA-OFT's does: the harness would seed every episode's env with it.
    log, study = tmp_path / "server.jsonl", tmp_path / "study"
    with vla_eval_server(chunk_size=CHUNK, log_path=str(log), env_seed=0) as url:
        rescue_cli("eval", "--suite", "libero_object", "--tasks", "0", "--episodes", "2", "--horizon", "12",
                   "--study", str(study), "--config", str(_config(tmp_path)), "--policy-url", url,
                   "--simulators", "1", "--cases-in-flight", "1")
    assert list(_predict_steps(log).values()) == [[0, 5, 10], [0, 5, 10]]
    starts = [row["task"] for row in log_rows(log, "episode_start")]
    assert [(s["suite"], s["task_id"], s["episode_idx"]) for s in starts] == [("libero_object", 0, 0), ("libero_object", 0, 1)]
    with Journal.open(study) as journal:
        assert {by_arm["control"].steps for by_arm in journal.all_arms().values()} == {12}
        assert {case.env_seed for case in journal.cases()} == {0}
