"""A restore leaves nothing behind: whatever the process did before, the continuation is bit for bit
the snapshot's process's.

Process A resets a case, runs open-loop actions to q (non-zero rotations, then exact-zero ones: OSC
keeps its orientation goal through them), snapshots, and goes on: the reference. The snapshot is then
restored (i) in A itself, (ii) in a process that never built the task, (iii) in one that built it by an
earlier restore and stepped since, (iv) in one that reset another initial state of the task (another
env seed: the fixtures stand elsewhere), and the same actions are replayed for several chunks. After
the restore and after every chunk, the full MjData, every controller attribute, the robots' buffers,
the gripper, the observables, the model fields the env writes, and the frames of agentview and the
wrist camera must all be equal. A restore that skips the controller's state, the model's run-time
fields or the site visibility fails here (it did before restores carried them: (ii) and (iii) failed).
"""

from __future__ import annotations

import numpy as np
import pytest

from rescue.env.pool import SimProcess

pytestmark = pytest.mark.sim

CASE = {"suite": "libero_goal", "task_id": 7, "init_state_index": 0, "env_seed": 7}
OTHER = {"suite": "libero_goal", "task_id": 7, "init_state_index": 3, "env_seed": 11}
PROFILE = "openpi-libero"
CHUNK, CHUNKS = 16, 3


def _actions(seed: int, n: int, zero_rotation: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = np.zeros((n, 7))
    a[:, :6] = rng.uniform(-0.5, 0.5, (n, 6))
    a[zero_rotation[0]:zero_rotation[1], 3:6] = 0.0  # exact zeros: the orientation goal stays what it was
    a[:, 6] = np.where((np.arange(n) // 12) % 2 == 0, -1.0, 1.0)
    return a


PREFIX = _actions(1, 48, (24, 48))
AFTER = _actions(2, CHUNK * CHUNKS, (0, 20))


def _continue(sim: SimProcess) -> list[dict]:
    """The probe right after the restore, then after each chunk of AFTER."""
    seen = [sim._call("probe")]
    for i in range(CHUNKS):
        sim._call("run_chunk", AFTER[i * CHUNK:(i + 1) * CHUNK], CHUNK, "always")
        seen.append(sim._call("probe"))
    return seen


def _first_difference(reference: list[dict], other: list[dict]) -> str | None:
    for i, (a, b) in enumerate(zip(reference, other)):
        changed = sorted(k for k in a if a[k] != b.get(k))
        if changed:
            return f"after chunk {i} (0: right after the restore): {', '.join(changed[:8])}"
    return None


@pytest.fixture(scope="module")
def probes():
    spec = "restore_probe:ProbeAdapter"
    a = SimProcess(spec, name="probe-a")
    others = {name: SimProcess(spec, name=f"probe-{name}") for name in ("never_built", "built_by_restore", "other_state")}
    try:
        a._call("reset", CASE, PROFILE)
        a._call("run_chunk", PREFIX, len(PREFIX), "always")
        snap = a._call("snapshot")
        reference = _continue(a)
        results = {}
        a._call("restore", snap)
        results["same_env"] = _continue(a)
        results["never_built"] = (others["never_built"]._call("restore", snap), _continue(others["never_built"]))[1]
        sim = others["built_by_restore"]
        sim._call("restore", snap)
        sim._call("run_chunk", _actions(3, 30, (0, 0)), 30, "always")
        sim._call("restore", snap)
        results["built_by_restore"] = _continue(sim)
        sim = others["other_state"]
        sim._call("reset", OTHER, PROFILE)
        sim._call("run_chunk", _actions(4, 20, (0, 0)), 20, "always")
        sim._call("restore", snap)
        results["other_state"] = _continue(sim)
        yield reference, results
    finally:
        for sim in (a, *others.values()):
            sim.stop()


@pytest.mark.parametrize("where", ["same_env", "never_built", "built_by_restore", "other_state"])
def test_a_restore_continues_bit_for_bit_wherever_it_lands(probes, where):
    reference, results = probes
    assert len(reference[0]) > 150  # the probe sees the MjData, the controller, the frames...
    assert any(k.startswith("frame.") for k in reference[0]) and any(k.startswith("controller0.") for k in reference[0])
    difference = _first_difference(reference, results[where])
    assert difference is None, difference


def test_a_snapshot_of_another_compiled_model_is_refused():
    sim = SimProcess("rescue.env.libero:LiberoAdapter", name="probe-model")
    try:
        sim._call("reset", CASE, PROFILE)
        snap = sim._call("snapshot")
        snap["model"] = "0" * 40
        with pytest.raises(Exception, match="compiled another model"):
            sim._call("restore", snap)
    finally:
        sim.stop()


# Several snapshots of one run (a fork's leader at each declared query point, DESIGN §14): each restored in a
# process that never built the task, the later ones first and then an earlier one over them, continues exactly
# as the leader went on from it.
RUN = _actions(5, 96, (40, 64))
FORKS = (16, 48, 80)


def test_every_snapshot_of_one_run_restores_exactly_in_any_order_in_another_process():
    spec = "restore_probe:ProbeAdapter"
    leader, other = SimProcess(spec, name="probe-leader"), SimProcess(spec, name="probe-several")
    try:
        leader._call("reset", CASE, PROFILE)
        snaps, seen = {}, {}
        for step in range(0, len(RUN), CHUNK):
            if step in FORKS:
                snaps[step] = leader._call("snapshot")
            seen[step] = leader._call("probe")
            leader._call("run_chunk", RUN[step:step + CHUNK], CHUNK, "always")
        seen[len(RUN)] = leader._call("probe")
        for fork in (80, 48, 16, 80):
            other._call("restore", snaps[fork])
            for step in range(fork, len(RUN) + 1, CHUNK):
                now = other._call("probe")
                changed = sorted(k for k in seen[step] if seen[step][k] != now.get(k))
                assert not changed, f"restored at {fork}, at step {step}: {', '.join(changed[:8])}"
                if step < len(RUN):
                    other._call("run_chunk", RUN[step:step + CHUNK], CHUNK, "always")
    finally:
        leader.stop()
        other.stop()
