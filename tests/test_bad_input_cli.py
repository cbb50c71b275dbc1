"""Bad input found at once by the commands a user types: one line naming what and where, exit 2, nothing written."""

from __future__ import annotations

import json
import os

import pytest
from conftest import rescue_cli

from rescue.core.catalog import parse_ids

pytestmark = pytest.mark.e2e

CASE = {"case_id": "a", "suite": "libero_object", "task_id": 0, "init_state_index": 0, "env_seed": 0, "horizon": 280}


@pytest.mark.parametrize("command", [["manifest", "check"], ["run"], ["submit"]])
def test_a_fifo_as_a_manifest_is_refused_without_hanging(tmp_path, command):
    fifo = tmp_path / "m.jsonl"
    os.mkfifo(fifo)  # nobody ever writes: a reader that blocks on it would hang until the timeout
    extra = ["--queue", str(tmp_path / "q")] if command == ["submit"] else ["--study", str(tmp_path / "s")] \
        if command == ["run"] else []
    out = rescue_cli(*command, str(fifo), *extra, check=False, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == f"{fifo}: is a FIFO (named pipe), not a file; give the manifest as a regular file"
    assert not (tmp_path / "s").exists() and not (tmp_path / "q" / "jobs").exists()


def test_dev_zero_as_a_manifest_is_refused_at_once(tmp_path):
    out = rescue_cli("submit", "/dev/zero", "--queue", str(tmp_path / "q"), check=False, timeout=60)
    assert out.returncode == 2 and "/dev/zero: is a character device" in out.stderr


def test_a_manifest_of_pilot_cases_only_runs_only_as_a_pilot_run(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(dict(CASE, pilot=True)) + "\n")
    for command in (["manifest", "check", str(path)], ["run", str(path), "--study", str(tmp_path / "s")]):
        out = rescue_cli(*command, check=False)
        assert out.returncode == 2 and "main cohort is empty" in out.stderr and "--pilot-run" in out.stderr
    assert not (tmp_path / "s").exists()
    assert rescue_cli("manifest", "check", str(path), "--pilot-run").returncode == 0


def test_task_ranges_are_ranges_and_bad_ones_are_named(tmp_path):
    assert parse_ids("0-3") == [0, 1, 2, 3] and parse_ids("0-2,7") == [0, 1, 2, 7] and parse_ids("5") == [5]
    for bad in ("3-1", "-1", "a", "0-", "1,,2"):
        with pytest.raises(ValueError):
            parse_ids(bad)
    out = rescue_cli("eval", "--tasks", "0-x", "--study", str(tmp_path / "e"), check=False)
    assert out.returncode == 2 and out.stderr.strip() == "rescue: --tasks '0-x': '0-x' is not an id or a range like 0-3"
    assert not (tmp_path / "e").exists()


def test_usage_of_a_folder_that_is_not_there_is_one_line(tmp_path):
    out = rescue_cli("usage", str(tmp_path / "nowhere"), check=False)
    assert out.returncode == 2 and out.stderr == f"rescue: {tmp_path / 'nowhere'}: no such folder\n"
    assert not (tmp_path / "nowhere").exists()


def test_report_on_a_wrong_path_creates_nothing(tmp_path):
    out = rescue_cli("report", str(tmp_path / "nowhere" / "study"), check=False)
    assert out.returncode == 2 and "is not a study folder" in out.stderr
    assert not (tmp_path / "nowhere").exists()


def test_failures_of_another_episode_protocol_are_refused_by_a_study_of_this_one(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(dict(CASE, env_seed=7, tags={"episode_protocol": "openpi"})) + "\n")
    out = rescue_cli("run", str(path), "--study", str(tmp_path / "s"), check=False)  # the embedded policy: rescue
    assert out.returncode == 2 and not (tmp_path / "s").exists()
    assert "episodes of the 'openpi' episode protocol, this study runs 'rescue'" in out.stderr
    assert "episode_protocol = 'openpi'" in out.stderr


def _study_commands(tmp_path, flag: str, bad: str) -> list[list[str]]:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps(CASE) + "\n")
    return {
        "--config": [["run", str(manifest), "--study", str(tmp_path / "s"), "--config", bad],
                     ["submit", str(manifest), "--queue", str(tmp_path / "q"), "--config", bad],
                     ["eval", "--tasks", "0", "--study", str(tmp_path / "e"), "--config", bad],
                     ["serve", "--queue", str(tmp_path / "q"), "--port", "0", "--config", bad]],
        "--service-config": [["submit", str(manifest), "--queue", str(tmp_path / "q"), "--service-config", bad]],
    }[flag]


@pytest.mark.parametrize("flag", ["--config", "--service-config"])
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "huge"])
def test_a_config_that_is_not_a_bounded_regular_file_is_one_line_at_once(tmp_path, flag, kind):
    """A FIFO would hang the reader, /dev/zero exhaust its memory: both are refused before a byte is read."""
    bad = {"fifo": tmp_path / "c.toml", "dev-zero": "/dev/zero", "folder": tmp_path, "huge": tmp_path / "big.toml"}[kind]
    if kind == "fifo":
        os.mkfifo(bad)  # nobody ever writes
    if kind == "huge":
        with open(bad, "wb") as f:
            f.truncate(2 * 1024 * 1024)  # sparse, past the 1 MiB bound
    for command in _study_commands(tmp_path, flag, str(bad)):
        # The timeout bounds the hang this test is about (a blocked reader), not the command's speed.
        out = rescue_cli(*command, check=False, timeout=120)
        line = out.stderr.strip()
        assert out.returncode == 2 and len(line.splitlines()) == 1 and "Traceback" not in line, (command, out.stderr)
        expected = {"fifo": "is a FIFO (named pipe), not a file", "dev-zero": "is a character device, not a file",
                    "folder": "is a folder, not a file", "huge": "bytes long, at most 1048576"}[kind]
        assert f"{bad}: " in line and expected in line, (command, line)
        assert not (tmp_path / "s").exists() and not (tmp_path / "e").exists() and not (tmp_path / "q" / "jobs").exists()


def test_a_service_config_named_by_the_environment_gets_the_same_guard(tmp_path):
    fifo = tmp_path / "service.toml"
    os.mkfifo(fifo)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps(CASE) + "\n")
    env = {**os.environ, "RESCUE_SERVICE_CONFIG": str(fifo)}
    import subprocess
    import sys

    from conftest import ROOT, cli_env

    out = subprocess.run([sys.executable, "-m", "rescue.cli", "submit", str(manifest), "--queue", str(tmp_path / "q")],
                         cwd=ROOT, env={**cli_env(), **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().endswith("is a FIFO (named pipe), not a file; give the service "
                                                               "configuration file as a regular file"), out.stderr


def test_results_to_import_that_are_not_a_regular_file_are_named_as_results(tmp_path):
    fifo = tmp_path / "results.jsonl"
    os.mkfifo(fifo)
    for kind in ("from-openpi", "from-lerobot"):
        out = rescue_cli("manifest", kind, str(fifo), "--out", str(tmp_path / "m.jsonl"), check=False, timeout=120)
        assert out.returncode == 2 and out.stderr.strip() == (f"{fifo}: is a FIFO (named pipe), not a file; give the "
                                                              "results file as a regular file"), out.stderr
    assert not (tmp_path / "m.jsonl").exists()


def test_a_prompt_template_that_is_not_a_regular_file_is_one_line(tmp_path):
    """`prompt_root` + `prompt_template` name a FIFO: refused before the study starts, without hanging."""
    root = tmp_path / "prompts"
    root.mkdir()
    os.mkfifo(root / "mine.txt")
    config = tmp_path / "c.toml"
    config.write_text(f'[vlm]\nprompt_template = "mine"\nprompt_root = "{root}"\n')
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps(CASE) + "\n")
    out = rescue_cli("run", str(manifest), "--study", str(tmp_path / "s"), "--config", str(config), check=False,
                     timeout=300)
    line = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"{root / 'mine.txt'}: is a FIFO (named pipe), not a file; give the prompt template as a regular file" in line


def test_a_suite_typo_or_a_task_the_suite_lacks_on_the_command_line_is_named_as_in_a_manifest(tmp_path):
    out = rescue_cli("eval", "--suite", "libero_objet", "--study", str(tmp_path / "e"), check=False)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith("rescue: --suite 'libero_objet': unknown suite; did you mean libero_object")
    out = rescue_cli("eval", "--tasks", "0-12", "--study", str(tmp_path / "e"), check=False)
    assert out.returncode == 2 and out.stderr.strip() == "rescue: --tasks '0-12': libero_object has tasks 0-9, not 10-12"
    out = rescue_cli("compare", "--policy-a", "x:y", "--policy-b", "x:z", "--suite", "libero_goall",
                     "--study", str(tmp_path / "c"), check=False)
    assert out.returncode == 2 and "did you mean libero_goal" in out.stderr, out.stderr
    assert not (tmp_path / "e").exists() and not (tmp_path / "c").exists()


def test_a_config_key_typo_says_which_key_it_may_mean(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('contnuations = 2\n[policy]\nreplan_intervl = 8\n[[advisor]]\nname = "a"\nmodle = "x"\n')
    (tmp_path / "m.jsonl").write_text(json.dumps(CASE) + "\n")
    out = rescue_cli("run", str(tmp_path / "m.jsonl"), "--config", str(config), "--study", str(tmp_path / "s"), check=False)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    for said in ("policy.replan_intervl: unknown key; did you mean replan_interval?",
                 "advisors.0.modle: unknown key; did you mean model?", "contnuations: unknown key; did you mean continuations?"):
        assert said in out.stderr
    assert not (tmp_path / "s").exists()


def test_a_folder_that_is_not_a_study_is_not_sent_to_resume(tmp_path):
    (tmp_path / "m.jsonl").write_text(json.dumps(CASE) + "\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine\n")
    out = rescue_cli("run", str(tmp_path / "m.jsonl"), "--study", str(tmp_path / "other"), check=False)
    assert out.returncode == 2 and "resume" not in out.stderr and "give --study a new folder" in out.stderr, out.stderr
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]


def test_eval_help_shows_each_default_once_and_no_vlm_flags():
    out = rescue_cli("eval", "--help")
    options = " ".join(out.stdout.split()).split(" --")[1:]  # each option with its help, on one line
    assert options and "(default: None)" not in out.stdout
    assert not [o for o in options if o.count("default") > 1], [o for o in options if o.count("default") > 1]
    assert "--replan-interval" in out.stdout
    assert not any(flag in out.stdout for flag in ("--vlm-url", "--vlm-model", "--batch-size", "--continuations"))
    assert "--vlm-url" in rescue_cli("run", "--help").stdout


def test_one_flag_one_meaning_the_workers_count_has_its_own_name_and_the_old_spelling_says_so(tmp_path):
    # `rescue run --warm-simulators DIR` names a folder; the worker's count is `--keep-simulators N`. The count's
    # old spelling is still taken, with one line; a bind beyond loopback without a key stops either before it serves.
    queue = str(tmp_path / "q")
    new = rescue_cli("serve", "--queue", queue, "--host", "0.0.0.0", "--keep-simulators", "1", check=False, timeout=60)
    old = rescue_cli("serve", "--queue", queue, "--host", "0.0.0.0", "--warm-simulators", "1", check=False, timeout=60)
    assert new.returncode == old.returncode == 2
    assert new.stderr.splitlines() == ["rescue: binding 0.0.0.0 (beyond loopback) needs an API key: --api-key-env VAR with VAR set"]
    assert old.stderr.splitlines() == ["rescue serve: --warm-simulators N is now --keep-simulators N", *new.stderr.splitlines()]
    assert "--keep-simulators" in rescue_cli("serve", "--help").stdout
    assert "--warm-simulators" not in rescue_cli("serve", "--help").stdout
