"""A study's identity is fixed at creation; resume and continuation refuse a server that announces otherwise."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest
from conftest import rescue_cli, write_cases
from helpers.policy_server import serve_policy
from pydantic import ValidationError

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.config_files import load_config
from rescue.core.configuration.identity import IdentityError, identity_changes, resolve_interval
from rescue.core.manifest import load_manifest
from rescue.run.commands import new_study
from rescue.run.peers import config_with_identity
from rescue.study.folder import load_study_config

pytestmark = pytest.mark.fast


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file's sha256, and the journal's rows (SQLite's own -wal/-shm files come and go with readers)."""
    files = {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.endswith(("-wal", "-shm"))
    }
    con = sqlite3.connect(f"file:{folder / 'journal.sqlite'}?mode=ro", uri=True)
    try:
        files["rows"] = hashlib.sha256("\n".join(con.iterdump()).encode()).hexdigest()
    finally:
        con.close()
    return files


def test_resolution_is_pure_and_names_what_changed():
    config = config_with_identity(StudyConfig(policy={"url": "ws://x"}), {"action_horizon": 8, "policy": "p"})
    assert config.policy.replan_interval == 8 and config.policy.observation == "openpi-libero"
    assert config.policy.announced == {"action_horizon": 8, "policy": "p"}
    # A configured C wins over the announced chunk length (openpi's LIBERO client runs 5 of 10).
    assert config_with_identity(StudyConfig(policy={"url": "ws://x", "replan_interval": 5}), {"action_horizon": 10}).interval == 5
    with pytest.raises(IdentityError, match="replan_interval"):
        resolve_interval(None, {})  # openpi's empty metadata and no C configured
    assert identity_changes({"action_horizon": 8}, {"action_horizon": 8}) == []
    (line,) = identity_changes({"action_horizon": 8}, {"action_horizon": 10})
    assert "action_horizon" in line and "8" in line and "10" in line
    # C is in the configuration, so the sha256 covers it.
    assert config.sha256() != config.model_copy(update={"policy": config.policy.model_copy(update={"replan_interval": 4})}).sha256()


def test_the_episode_protocol_is_resolved_into_the_identity_and_a_changed_one_is_refused():
    from rescue.core.episode_protocol import get_protocol
    from rescue.run.peers import check_identity

    external = config_with_identity(StudyConfig(policy={"url": "ws://x", "replan_interval": 5}), {})
    bundled = config_with_identity(StudyConfig(), {"action_horizon": 8})
    chosen = config_with_identity(StudyConfig(policy={"url": "ws://x", "replan_interval": 5}, env={"episode_protocol": "lerobot"}), {})
    assert (external.env.episode_protocol, bundled.env.episode_protocol, chosen.env.episode_protocol) == ("openpi", "rescue", "lerobot")
    assert external.env.episode_protocol_sha256 == get_protocol("openpi").sha256()
    assert external.sha256() != chosen.sha256()  # part of the digest once set
    check_identity(external, {})
    edited = external.model_copy(update={"env": external.env.model_copy(update={"episode_protocol_sha256": "0" * 64})})
    with pytest.raises(IdentityError, match="episode protocol 'openpi'"):
        check_identity(edited, {})
    # A protocol that does not exist is refused with the configuration, before anything is resolved.
    with pytest.raises(ValidationError, match="no episode protocol 'mine'"):
        StudyConfig(env={"episode_protocol": "mine"})


@pytest.mark.e2e
def test_resume_and_continuation_refuse_a_server_announcing_another_horizon(tmp_path):
    manifest = load_manifest(write_cases(tmp_path / "m.jsonl", 2))
    first, url_a = serve_policy("rescue.embedded.scripted:make_policy")  # announces action_horizon 8
    try:
        study = new_study(tmp_path / "study", manifest, load_config(None, {"policy.url": url_a}))
    finally:
        first.kill()
        first.wait()
    pinned = load_study_config(study)
    assert pinned.policy.replan_interval == 8 and pinned.policy.announced["action_horizon"] == 8

    # The same port now serves a policy that plans 10 actions per chunk.
    port = url_a.rsplit(":", 1)[1]
    second, _ = serve_policy("identity_policies:make_ten_step_policy", int(port))
    try:
        before = _snapshot(study)
        proc = rescue_cli("resume", str(study), check=False)
        assert proc.returncode != 0
        message = proc.stderr + proc.stdout
        assert "action_horizon" in message and "8" in message and "10" in message, message
        assert "Traceback" not in message
        assert _snapshot(study) == before  # nothing written: no claim, no recovery, no log

        proc = rescue_cli("run", str(tmp_path / "next"), "--continue-from", str(study), check=False)
        assert proc.returncode != 0 and "action_horizon" in proc.stderr + proc.stdout
        assert not (tmp_path / "next").exists()
        assert _snapshot(study) == before
    finally:
        second.kill()
        second.wait()


def test_an_older_studys_config_digest_holds_after_later_settings_were_added():
    # A config.json written before [vlm] max_concurrent_calls / requests_per_minute / startup_check or [sham] by_task
    # existed lacks them; loaded today it must hash as it did then, or verify would fail every older study.
    from rescue.core.configuration.config import HASHED_UNLESS_DEFAULT, HASHED_WHEN_SET
    from rescue.core.digest import canonical_json, digest_text

    now = StudyConfig().model_dump(mode="json")
    older = {sec: ({k: v for k, v in part.items() if (sec, k) not in HASHED_WHEN_SET} if isinstance(part, dict) else part)
             for sec, part in now.items() if (None, sec) not in HASHED_WHEN_SET and (None, sec, part) not in HASHED_UNLESS_DEFAULT}
    # vlm: the two limits, startup_check, server, price, lab_budget, lab_ledger, require_model_match, may_decline;
    # sham: by_task, advisor; the top level: advisors, triggers, asking.
    assert len(older["vlm"]) == len(now["vlm"]) - 9 and len(older["sham"]) == len(now["sham"]) - 2
    assert {"triggers", "asking"} <= set(now) and not {"triggers", "asking"} & set(older)
    assert "advisors" in now and "advisors" not in older
    assert StudyConfig.model_validate(older).sha256() == digest_text(canonical_json(older))
    # Once set, a limit is part of the digest.
    limited = StudyConfig.model_validate({**older, "vlm": {**older["vlm"], "max_concurrent_calls": 4}})
    assert limited.sha256() != StudyConfig.model_validate(older).sha256()


def test_the_rules_read_the_gripper_opening_where_the_studys_profile_sends_it():
    # The rule wrappers read the gripper from the policy input: for an image profile that is the state
    # vector's gripper entry, not the privileged observable; a layout the config sets is kept as it is.
    from wrappers.async_rules import LIBERO_LAYOUT

    layouts = {profile: config_with_identity(StudyConfig(policy={"url": "ws://x", "observation": profile}),
                                       {"action_horizon": 8}).rules.layout
               for profile in ("openpi-libero", "lerobot-libero", "privileged")}
    assert {p: (lay.state_key, lay.gripper_state_dims) for p, lay in layouts.items()} == {
        "openpi-libero": ("observation/state", (6,)),
        "lerobot-libero": ("observation.state", (6,)),
        "privileged": ("robot0_gripper_qpos", (0,)),
    }
    assert layouts["privileged"] == LIBERO_LAYOUT
    mine = load_config(None, {"policy.url": "ws://x", "policy.observation": "openpi-libero",
                              "rules.layout": {"state_key": "observation/state", "gripper_state_dims": [7]}})
    assert config_with_identity(mine, {"action_horizon": 8}).rules.layout.gripper_state_dims == (7,)
