"""Evaluate the learned policy on held-out official initial states, and the effect of a subgoal.

    python -m rescue.embedded.training.evaluate_policy --out models/eval_libero_object.json

Episodes follow the arm runner's rules (reset, policy RNG reset to the env
seed, a query every C steps with the instruction as `prompt`, stop on
success, at most H steps). Every baseline failure is then replayed twice from
the same initial state and seed: with the correct sub-instruction injected at
the query point q (the phase `situation_phase` reads off the state at q), and
with a wrong one (a phase three steps further round the cycle). The prefix
before q is identical in all three runs, so any difference is the subgoal's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rescue.core.catalog import parse_ids
from rescue.core.querypoint import query_point
from rescue.embedded.expert import situation_phase
from rescue.embedded.learned import DEFAULT_CHECKPOINT, LearnedPolicy
from rescue.embedded.phases import PHASES, parse_pick_place, sub_instruction
from rescue.env.libero import SUITE_HORIZON, LiberoAdapter
from wrappers.injection import inject


def wrong_phase(phase: str) -> str:
    """A deliberately wrong phase: three further round the cycle of phases."""
    return PHASES[(PHASES.index(phase) + 3) % len(PHASES)]


def episode(adapter, policy, case: dict, horizon: int, subgoal_at_q=None) -> dict:
    """One arm: returns success, steps, and (when injecting) the phase and subgoal used at q."""
    reset = adapter.reset(case)
    original = instruction = reset.instruction
    policy.reset()
    policy.reset_rng(int(case["env_seed"]))
    c = policy.action_horizon
    q = query_point(horizon, c)
    obs, step, out = reset.obs, 0, {}
    while step < horizon:
        if subgoal_at_q is not None and step >= q and "subgoal" not in out:
            phase, subgoal = subgoal_at_q(obs, original)
            out.update(phase_at_q=phase, subgoal=subgoal)
            instruction = inject(original, subgoal)
        chunk = policy.infer({**obs, "prompt": instruction})["actions"]
        result = adapter.run_chunk(chunk[:c], min(c, horizon - step))
        step += result.steps
        obs = result.obs
        if result.success:
            return {**out, "success": True, "steps": step}
    return {**out, "success": False, "steps": step}


def correct_subgoal(obs: dict, original: str) -> tuple[str, str]:
    """The phase the state at q calls for, and its sub-instruction."""
    phase = situation_phase(obs)
    return phase, sub_instruction(phase, parse_pick_place(original))


def wrong_subgoal(obs: dict, original: str) -> tuple[str, str]:
    """A wrong phase for the state at q, and its sub-instruction."""
    phase = wrong_phase(situation_phase(obs))
    return phase, sub_instruction(phase, parse_pick_place(original))


def evaluate(checkpoint: Path, suite: str, tasks: list[int], inits: list[int], horizon: int | None) -> dict:
    """Baseline success per task over the given initial states, then the subgoal effect on its failures."""
    horizon = horizon or SUITE_HORIZON[suite]
    adapter, policy = LiberoAdapter(), LearnedPolicy(checkpoint)
    start = time.time()
    baseline, failures = {}, []
    for task in tasks:
        wins = 0
        for idx in inits:
            case = {"suite": suite, "task_id": task, "init_state_index": idx, "env_seed": idx}
            res = episode(adapter, policy, case, horizon)
            wins += res["success"]
            if not res["success"]:
                failures.append(case)
        baseline[str(task)] = {"n": len(inits), "success": wins, "rate": wins / len(inits)}
        print(json.dumps({"task": task, **baseline[str(task)]}), flush=True)
    effect = []
    for case in failures:
        row = {"task": case["task_id"], "init_state_index": case["init_state_index"]}
        for arm, fn in (("correct", correct_subgoal), ("wrong", wrong_subgoal)):
            res = episode(adapter, policy, case, horizon, fn)
            row[arm] = {"phase": res["phase_at_q"], "subgoal": res["subgoal"], "success": res["success"]}
        effect.append(row)
        print(json.dumps(row), flush=True)
    adapter.close()
    n_fail = len(failures)
    return {
        "checkpoint": checkpoint.name,
        "suite": suite,
        "horizon": horizon,
        "query_step": query_point(horizon, policy.action_horizon),
        "initial_states": inits,
        "baseline": baseline,
        "baseline_overall": sum(b["success"] for b in baseline.values()) / (len(tasks) * len(inits)),
        "failures": n_fail,
        "rescued_by_correct": sum(r["correct"]["success"] for r in effect),
        "rescued_by_wrong": sum(r["wrong"]["success"] for r in effect),
        "subgoal_runs": effect,
        "seconds": round(time.time() - start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--suite", default="libero_object")
    parser.add_argument("--tasks", default="0-9")
    parser.add_argument("--inits", default="0-9", help="official initial states (0-9 are held out from rescue.embedded.training)")
    parser.add_argument("--horizon", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = evaluate(args.checkpoint, args.suite, parse_ids(args.tasks), parse_ids(args.inits), args.horizon)
    text = json.dumps(result, indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
    summary = {k: v for k, v in result.items() if k not in {"subgoal_runs", "baseline"}}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
