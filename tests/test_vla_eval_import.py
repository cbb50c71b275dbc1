"""`rescue manifest from-vla-eval` on recordings written by the harness's own recording classes (RecordingStore,
EpisodeRecorder, as its orchestrator uses them) and on the aggregate its own exporter writes: unsharded; two shard
processes interleaved with out-of-order episodes; a rerun's duplicate; an errored episode; a server asking for env
seed 0; and what cannot be replayed here, refused by name."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import rescue_cli
from vla_eval import __version__
from vla_eval.config import EvalConfig
from vla_eval.protocol.messages import make_hello_payload
from vla_eval.recording import EpisodeRecorder, RecordingStore, db_path_for_eval, serializable_task_kwargs
from vla_eval.results.export import export_db

from rescue.core.catalog import libero_catalog
from rescue.core.manifest import load_manifest
from rescue.core.results import ResultsError
from rescue.core.figures.success_sample import sample_successes
from rescue.run.vla_eval_import import manifest_from_vla_eval

pytestmark = pytest.mark.fast

LIBERO = "vla_eval.benchmarks.libero.benchmark:LIBEROBenchmark"


def _language(suite: str, task_id: int) -> str:
    return libero_catalog().task(suite, task_id).told("task.language")


class Run:
    """A vla-eval run's recording, written as the harness's orchestrator writes it."""

    def __init__(self, folder: Path, params: dict | None = None, server_params: dict | None = None,
                 benchmark: str = LIBERO, max_steps: int | None = None, suite: str = "libero_object") -> None:
        self.eval_id = str(uuid.uuid4())
        self.folder, self.suite = folder, suite
        self.store = RecordingStore(db_path_for_eval(folder, self.eval_id))
        entry = {"benchmark": benchmark, "params": {"suite": suite, **(params or {})}, "episodes_per_task": 5,
                 "max_steps": max_steps}
        self.store.set_run_metadata(self.eval_id, {"benchmarks": [entry]})
        self.name = "LIBEROBenchmark"
        self.entry_id = f"{self.eval_id}-{self.name}"
        hello = make_hello_payload(model_server="Pi0ModelServer", capabilities={},
                                   **({"observation_params": server_params} if server_params else {}))
        config = EvalConfig.from_dict(entry)
        self.store.upsert_eval_metadata(self.entry_id, self.name, {
            "benchmark": self.name, "mode": config.mode, "config": config.to_dict(), "metric_keys": {"success": "mean"},
            "harness_version": __version__, "server_info": hello})

    @property
    def path(self) -> Path:
        return db_path_for_eval(self.folder, self.eval_id)

    def episode(self, sid: str, task_id: int, ep: int, status: str, steps: int = 30, reason: str | None = None) -> None:
        task = {"name": _language(self.suite, task_id), "suite": self.suite, "task_id": task_id, "episode_idx": ep}
        recorder = EpisodeRecorder(store=self.store, sid=sid, eid=str(uuid.uuid4()), eval_id=self.entry_id,
                                   output_dir=self.folder / "episodes", filename_stem="{task_idx}_{episode_id}_{status}",
                                   context={**serializable_task_kwargs(task), "task_idx": task_id},
                                   filename_context={"task_idx": task_id, "episode_id": ep})
        for _ in range(steps):
            recorder.record_step(action=np.zeros(7, np.float32), state=np.zeros(8, np.float32))
        recorder.close(status=status, metrics={"success": status == "success"}, task_name=task["name"], episode_id=ep,
                       steps=steps, failure_reason=reason, failure_detail="Traceback ..." if reason else None)

    def close(self) -> Path:
        self.store.close()
        return self.path


def _import(path: Path, tmp_path: Path, **kwargs) -> dict[str, dict]:
    cases, _ = manifest_from_vla_eval(path, tmp_path / "m.jsonl", **kwargs)
    assert [c.case_id for c in load_manifest(tmp_path / "m.jsonl").cases] == [c.case_id for c in cases]
    return {c.case_id: c for c in cases}


def test_an_unsharded_run_with_successes_and_an_error(tmp_path):
    run = Run(tmp_path)
    sid = str(uuid.uuid4())
    for task_id, statuses in ((0, ["fail", "success", "error", "fail"]), (1, ["success", "fail", "fail", "success"])):
        for ep, status in enumerate(statuses):
            run.episode(sid, task_id, ep, status, reason="model_act" if status == "error" else None)
    path = run.close()
    cases = _import(path, tmp_path, successes="all")
    assert sorted(cases) == ["object-0-ep0", "object-0-ep1", "object-0-ep3", "object-1-ep0", "object-1-ep1",
                             "object-1-ep2", "object-1-ep3"]
    ep3 = cases["object-0-ep3"]
    # Episode 3 of task 0 is the env's fourth reset: the errored episode 2 reset it too.
    assert (ep3.init_state_index, ep3.env_seed, ep3.horizon, ep3.tags["reset_ordinal"]) == (3, 7, 280, 3)
    assert ep3.tags["episode_protocol"] == "vla-eval" and ep3.tags["vla_eval_version"] == __version__
    assert ep3.tags["vla_eval_server"] == "Pi0ModelServer" and ep3.tags["shard_process"] == sid
    assert ep3.tags["results_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    # The error is apart: in no denominator, its reason named.
    assert (ep3.tags["eval_episodes"], ep3.tags["eval_failures"], ep3.tags["eval_successes"]) == (7, 4, 3)
    assert ep3.tags["eval_errors"] == 1 and ep3.tags["eval_error_reasons"] == "model_act x1"
    assert (ep3.tags["frame_failures"], ep3.tags["frame_successes"], ep3.tags["frame_episodes"]) == (4, 3, 7)
    assert {c.case_id for c in cases.values() if c.outcome == "success"} == {"object-0-ep1", "object-1-ep0", "object-1-ep3"}


def test_a_sample_of_successes_is_the_shared_samplers(tmp_path):
    run = Run(tmp_path)
    sid = str(uuid.uuid4())
    for task_id in range(3):
        for ep in range(5):
            run.episode(sid, task_id, ep, "success" if ep != 2 else "fail")
    cases, _ = manifest_from_vla_eval(run.close(), tmp_path / "m.jsonl", successes=4, seed=3)
    won = [c for c in cases if c.outcome == "success"]
    everyone, _ = manifest_from_vla_eval(run.path, tmp_path / "all.jsonl", successes="all")
    expected = sample_successes([c for c in everyone if c.outcome == "success"], 4, 3)
    assert [c.case_id for c in won] == [c.case_id for c in expected]
    assert {(c.tags["success_sample"], c.tags["success_seed"], c.tags["frame_successes"]) for c in cases} == {(4, 3, 12)}


def test_two_interleaved_shards_with_out_of_order_episodes_and_a_rerun(tmp_path):
    run = Run(tmp_path)
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    # The rows as two shard processes wrote them, interleaved, each claiming out of order; then a rerun (c) of one.
    for sid, task_id, ep, status in ((a, 0, 0, "fail"), (b, 1, 3, "fail"), (a, 0, 4, "fail"), (b, 1, 1, "error"),
                                     (a, 1, 0, "fail"), (b, 1, 2, "fail"), (a, 1, 4, "fail"), (c, 0, 4, "success")):
        run.episode(sid, task_id, ep, status)
    cases = _import(run.close(), tmp_path, successes="all")
    ordinal = {cid: (c.tags["shard_process"], c.tags["reset_ordinal"]) for cid, c in cases.items()}
    assert ordinal == {
        "object-0-ep0": (a, 0),
        "object-1-ep0": (a, 0), "object-1-ep4": (a, 1),  # a rebuilt its env for task 1
        "object-1-ep3": (b, 0), "object-1-ep2": (b, 2),  # b's errored ep1 was its reset 1
        "object-0-ep4": (c, 0),  # the rerun's row wins; a's earlier row still was a's reset 1
    }
    assert cases["object-0-ep4"].outcome == "success"
    assert cases["object-1-ep2"].tags["eval_errors"] == 1


def test_the_env_seed_is_the_configs_then_the_servers_then_7(tmp_path):
    seeds = {}
    for name, params, server in (("default", {}, {}), ("server", {}, {"env_seed": 0}),
                                 ("config", {"env_seed": 7}, {"env_seed": 0}), ("seed", {"seed": 3}, {})):
        run = Run(tmp_path / name, params=params, server_params=server)
        run.episode(str(uuid.uuid4()), 0, 0, "fail")
        (case,) = _import(run.close(), tmp_path / name).values()
        seeds[name] = case.env_seed
    assert seeds == {"default": 7, "server": 0, "config": 7, "seed": 3}


def test_the_aggregate_of_an_unsharded_run_gives_the_recordings_cases(tmp_path):
    run = Run(tmp_path, server_params={"env_seed": 0, "send_state": True, "quat_no_antipodal": True}, max_steps=120)
    sid = str(uuid.uuid4())
    for task_id in (2, 5):
        for ep in range(3):
            run.episode(sid, task_id, ep, ["fail", "success", "error"][ep], reason="env_step" if ep == 2 else None)
    path = run.close()
    (aggregate,) = export_db(path, tmp_path / "export")
    from_db = _import(path, tmp_path, successes="all")
    from_json = _import(tmp_path / "export" / "LIBEROBenchmark_aggregate.json", tmp_path, successes="all")
    fields = ("suite", "task_id", "init_state_index", "env_seed", "horizon", "outcome")
    assert {k: [getattr(c, f) for f in fields] + [c.tags["reset_ordinal"]] for k, c in from_db.items()} == \
           {k: [getattr(c, f) for f in fields] + [c.tags["reset_ordinal"]] for k, c in from_json.items()}
    case = from_db["object-5-ep1"]
    assert (case.env_seed, case.horizon, case.tags["vla_eval_profile"]) == (0, 120, "vla-eval-libero+state+no-antipodal")
    assert aggregate["num_errors"] == 2 and case.tags["eval_errors"] == 2


def _problems(path: Path, tmp_path: Path) -> list[str]:
    with pytest.raises(ResultsError) as err:
        manifest_from_vla_eval(path, tmp_path / "refused.jsonl")
    assert not (tmp_path / "refused.jsonl").exists()
    return err.value.problems


def test_what_cannot_be_replayed_here_is_refused_by_name(tmp_path):
    plus = Run(tmp_path / "plus", benchmark="vla_eval.benchmarks.libero_plus.benchmark:LIBEROPlusBenchmark")
    plus.episode(str(uuid.uuid4()), 0, 0, "fail")
    (line,) = _problems(plus.close(), tmp_path)
    assert "LIBEROPlusBenchmark cannot be replayed here: LIBERO-Plus replaces LIBERO's tasks" in line
    pro = Run(tmp_path / "pro", benchmark="vla_eval.benchmarks.libero_pro.benchmark:LIBEROProBenchmark",
              params={"perturbation": "swap"}, suite="libero_spatial")
    (line,) = _problems(pro.close(), tmp_path)
    assert "LIBERO-PRO suite libero_spatial_swap was generated on the harness's side" in line
    absolute = Run(tmp_path / "xvla", server_params={"absolute_action": True})
    absolute.episode(str(uuid.uuid4()), 0, 0, "fail")
    (line,) = _problems(absolute.close(), tmp_path)
    assert "absolute_action = true" in line and "X-VLA" in line


def test_a_sharded_runs_aggregate_is_refused_for_its_recording(tmp_path):
    run = Run(tmp_path)
    run.episode(str(uuid.uuid4()), 0, 0, "fail")
    run.episode(str(uuid.uuid4()), 0, 1, "fail")
    export_db(run.close(), tmp_path / "export")
    (line,) = _problems(tmp_path / "export" / "LIBEROBenchmark_aggregate.json", tmp_path)
    assert "a sharded run" in line and "import its recording-<eval_id>.sqlite instead" in line


def test_the_command_writes_a_manifest_that_checks_and_refuses_bad_input_in_one_line(tmp_path):
    run = Run(tmp_path)
    run.episode(str(uuid.uuid4()), 0, 0, "fail")
    run.episode(str(uuid.uuid4()), 0, 1, "error", reason="connection_closed")
    path = run.close()
    out = tmp_path / "m.jsonl"
    done = rescue_cli("manifest", "from-vla-eval", str(path), "--out", str(out), "--successes", "all")
    said = " ".join(done.stdout.split())
    assert "wrote 1 failure case(s) and 0 success case(s)" in said
    assert "1 errored episode(s) left out of every denominator (connection_closed x1)" in said
    rescue_cli("manifest", "check", str(out))
    bad = tmp_path / "bad.sqlite"
    bad.write_text(json.dumps({"tasks": "no"}))
    refused = rescue_cli("manifest", "from-vla-eval", str(bad), "--out", str(tmp_path / "x.jsonl"), check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().count("\n") == 0 and "tasks: expected vla-eval's aggregate" in refused.stderr


def test_a_libero_pro_suite_takes_the_step_limit_its_harness_benchmark_gives_it(tmp_path):
    # LIBEROProBenchmark limits a suite by its base's (220 for libero_spatial_*); LIBEROBenchmark by its own table,
    # where a LIBERO-PRO suite is not: 300.
    limits = {}
    for name, benchmark in (("pro", "vla_eval.benchmarks.libero_pro.benchmark:LIBEROProBenchmark"), ("plain", LIBERO)):
        run = Run(tmp_path / name, benchmark=benchmark, suite="libero_spatial_with_mug")
        run.episode(str(uuid.uuid4()), 0, 0, "fail")
        (case,) = _import(run.close(), tmp_path / name).values()
        limits[name] = (case.suite, case.horizon)
    assert limits == {"pro": ("libero_spatial_with_mug", 220), "plain": ("libero_spatial_with_mug", 300)}
