"""The vla-eval-libero profiles' arithmetic and what a server's HELLO asks of a study, against the harness's own
functions (no simulator: the step-by-step conformance is tests/test_vla_eval_conformance.py)."""

from __future__ import annotations

import numpy as np
import pytest
from vla_eval.benchmarks.libero.benchmark import LIBEROBenchmark, _quat_to_axisangle_robosuite
from vla_eval.orchestrator import _merge_observation_params
from vla_eval.rotation import matrix_to_quat as their_matrix_to_quat
from vla_eval.rotation import quat_to_axisangle

from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.identity import IdentityError
from rescue.core.observation import compose_state, get_profile, shape_observation
from rescue.core.vla_eval_observation import axisangle_antipodal, axisangle_no_flip, matrix_to_quat, name_for
from rescue.core.configuration.vla_eval_study import study_with_server
from rescue.core.vla_eval_settings import LIBERO_PARAMS, env_seed, horizon, merged_params

pytestmark = pytest.mark.fast

RNG = np.random.default_rng(11)
QUATS = [q / np.linalg.norm(q) for q in RNG.normal(size=(500, 4))] + [
    np.array([0.0, 0.0, 0.0, 1.0]), np.array([0.0, 0.0, 0.0, -1.0]), np.array([0.3, 0.0, 0.0, 1.2])]


def test_the_axis_angles_are_the_harnesss_bit_for_bit():
    for q in QUATS:
        assert quat_to_axisangle(q).tobytes() == axisangle_antipodal(q).tobytes()
        assert _quat_to_axisangle_robosuite(q).tobytes() == axisangle_no_flip(q).tobytes()
    # The flip is not a no-op: half of all quaternions have w < 0.
    assert sum(not np.array_equal(axisangle_antipodal(q), axisangle_no_flip(q)) for q in QUATS) > 200


def test_the_rotation_matrix_quaternion_is_the_harnesss():
    from scipy.spatial.transform import Rotation

    for q in QUATS[:200]:
        m = Rotation.from_quat(q).as_matrix().astype(np.float32)
        assert their_matrix_to_quat(m).tobytes() == matrix_to_quat(m).tobytes()


def test_states_are_float64_with_a_float32_axis_angle_and_controller_states_float32():
    raw = {"robot0_eef_pos": RNG.normal(size=3), "robot0_eef_quat": QUATS[0], "robot0_gripper_qpos": RNG.normal(size=2),
           "controller/ee_pos": RNG.normal(size=3), "controller/ee_ori_mat": np.eye(3)}
    profile = get_profile("vla-eval-libero+state")
    frames = {"agentview": RNG.integers(0, 256, size=(256, 256, 3), dtype=np.uint8)}
    obs = shape_observation(profile, raw, frames)
    theirs = np.concatenate([raw["robot0_eef_pos"], quat_to_axisangle(raw["robot0_eef_quat"]), raw["robot0_gripper_qpos"]])
    assert obs["states"].dtype == np.float64 and obs["states"].tobytes() == theirs.tobytes()
    controller = np.concatenate([raw["controller/ee_pos"].astype(np.float32), quat_to_axisangle(their_matrix_to_quat(
        np.eye(3, dtype=np.float32))), raw["robot0_gripper_qpos"].astype(np.float32)])
    assert obs["controller_states"].dtype == np.float32 and obs["controller_states"].tobytes() == controller.tobytes()
    assert np.array_equal(obs["images/agentview"], frames["agentview"][::-1, ::-1])
    assert set(obs) == {"images/agentview", "states", "controller_states"}
    assert set(shape_observation(get_profile("vla-eval-libero"), raw, frames)) == {"images/agentview"}
    assert compose_state(("eef_axisangle_vla_eval_no_flip",), raw).tobytes() == \
        _quat_to_axisangle_robosuite(raw["robot0_eef_quat"]).tobytes()


def test_a_servers_observation_params_name_the_variant():
    assert name_for({}) == "vla-eval-libero"
    assert name_for({"send_wrist_image": True, "send_state": True}) == "vla-eval-libero+wrist+state"
    # OpenVLA-OFT's server: env seed 0 and robosuite's axis-angle.
    oft = {"env_seed": 0, "quat_no_antipodal": True, "send_wrist_image": True, "send_state": True}
    assert name_for(oft) == "vla-eval-libero+wrist+state+no-antipodal"
    assert get_profile(name_for(oft)).state.parts[1] == "eef_axisangle_vla_eval_no_flip"


def test_params_merge_as_the_harness_merges_them():
    # The run's config wins; keys LIBEROBenchmark does not take are dropped.
    for configured, announced in (({"env_seed": 7}, {"env_seed": 0}), ({}, {"env_seed": 0, "bogus": 1}),
                                  ({"seed": 3}, {"send_state": True}), ({"env_seed": None}, {"env_seed": 0})):
        assert merged_params(configured, announced) == _merge_observation_params(LIBEROBenchmark, configured, announced)
    assert LIBERO_PARAMS == set(_merge_observation_params(LIBEROBenchmark, {}, {k: 1 for k in LIBERO_PARAMS}))
    assert env_seed(merged_params({}, {"env_seed": 0})) == 0
    assert env_seed(merged_params({"env_seed": 7}, {"env_seed": 0})) == 7
    assert env_seed(merged_params({"seed": 3}, {})) == 3 and env_seed({}) == 7
    assert env_seed(merged_params({"env_seed": None}, {"env_seed": 0})) == 7  # None in the config: `seed` decides
    assert horizon(None, {}, "libero_spatial") == 220 and horizon(40, {"max_steps": 50}, "libero_10") == 40
    assert horizon(None, {"max_steps": 50}, "libero_10") == 50 and horizon(None, {}, "libero_90") == 400


def _hello(**params) -> dict:
    return {"wire": "vla-eval", "policy": "Pi0ModelServer", "observation_params": params}


def test_a_study_takes_the_variant_its_server_asks_for_unless_it_names_one():
    config = StudyConfig(policy={"url": "vla-eval+ws://gpu:8000", "replan_interval": 10})
    assert study_with_server(config, _hello(send_state=True)).policy.observation == "vla-eval-libero+state"
    named = config.model_copy(update={"policy": config.policy.model_copy(update={"observation": "vla-eval-libero+wrist"})})
    assert study_with_server(named, _hello(send_state=True)).policy.observation == "vla-eval-libero+wrist"


@pytest.mark.parametrize(("params", "policy", "said"), [
    ({"absolute_action": True}, {"replan_interval": 10}, "absolute_action = true"),
    ({"num_steps_wait": 5}, {"replan_interval": 10}, "num_steps_wait = 5 is not supported"),
    ({}, {}, "set \\[policy\\] replan_interval .* to its chunk_size"),
])
def test_what_cannot_be_honoured_is_refused_in_one_line(params, policy, said):
    config = StudyConfig(policy={"url": "vla-eval+ws://gpu:8000", **policy})
    with pytest.raises(IdentityError, match=said) as err:
        study_with_server(config, _hello(**params))
    assert "\n" not in str(err.value)


def test_rules_are_refused_against_a_vla_eval_server():
    config = StudyConfig(policy={"url": "vla-eval+ws://gpu:8000", "replan_interval": 10},
                         rules={"enabled": ["gripper_recovery"]})
    with pytest.raises(IdentityError, match="keeps its chunk on its side"):
        study_with_server(config, _hello())
