"""A vla-eval run's records read as episodes, each with the harness's own identity (pure; DESIGN §19).

What vla-eval 0.8.0 records (`recording-<eval_id>.sqlite`, or one benchmark entry's `*_aggregate.json` that
`vla-eval export` writes), read from its source: per benchmark entry, `eval_metadata` (the entry's config with
its `params`, `server_info` = the model server's HELLO, the harness version), and per episode one
`episode_results` row (shard process `sid`, `episode_id` = the run's episode number, `status` success, fail or
error with a `failure_reason`, `steps`, a `context` holding `suite`, `task_id`, `task_idx` and `episode_idx` = the
initial-state index). From these, for each episode:
- the env seed: the entry's params, then the server's `observation_params`, then 7 (rescue.core.vla_eval_settings);
- the horizon: the entry's `max_steps`, then the params', then the suite's;
- the reset ordinal: how many resets the episode's env had before it. The harness builds a task's env, seeds it
  once, and resets it for every episode of that task its shard process runs in a row; another task rebuilds it.
  So it is the number of rows right before this one, in row order within the same shard process and entry,
  of the same task (errored episodes count: their reset happened);
- reruns: the latest row of an episode wins (as `vla-eval export` dedups), the earlier ones still count as resets.
`error` rows are kept apart with their reason and never counted as failures. An aggregate keeps neither row order
nor the rows a rerun replaced, so it is read only when one unsharded process ran every episode in it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rescue.core.catalog import Catalog
from rescue.core.results import ResultsError
from rescue.core.vla_eval_observation import name_for
from rescue.core.vla_eval_settings import LIBERO_PARAMS, base_suite, env_seed, horizon, merged_params, refusal

# The harness's LIBERO benchmarks this simulator can replay, and the params each one's constructor takes (the
# server's observation_params reach the benchmark only through those).
LIBERO = "vla_eval.benchmarks.libero.benchmark:LIBEROBenchmark"
LIBERO_PRO = "vla_eval.benchmarks.libero_pro.benchmark:LIBEROProBenchmark"
ACCEPTED = {LIBERO: LIBERO_PARAMS,
            LIBERO_PRO: frozenset({"suite", "perturbation", "seed", "num_steps_wait", "send_wrist_image", "send_state"})}
# Refused by name: what they run is not what the simulator here builds.
NOT_HERE = {
    "vla_eval.benchmarks.libero_plus.benchmark:LIBEROPlusBenchmark":
        "LIBERO-Plus replaces LIBERO's tasks with its own perturbed variants (its own fork of LIBERO)",
    "vla_eval.benchmarks.libero_mem.benchmark:LIBEROMemBenchmark":
        "LIBERO-Mem's tasks and initial states ship in the harness's own image",
}
# LIBERO-PRO suites its `perturbation` param (or the suffix) has the user generate with LIBERO-PRO's
# perturbation.py: their BDDL and initial states are not the files the installed benchmark ships.
GENERATED = ("swap", "object", "lan", "task", "env")


@dataclass(frozen=True)
class Entry:
    """One benchmark entry of the run (an `eval_metadata` row, or an aggregate's head)."""

    eval_id: str
    name: str
    metadata: dict[str, Any]


@dataclass(frozen=True)
class Row:
    """One `episode_results` row, in row order (`order`: its rowid, or its place in an aggregate)."""

    order: int
    sid: str
    eid: str
    eval_id: str
    task_name: str
    episode_id: int
    status: str
    steps: int
    context: dict[str, Any]
    failure_reason: str | None = None


@dataclass(frozen=True)
class Episode:
    """One episode of the run as rescue replays it: the harness's identity and outcome."""

    suite: str
    task_id: int
    init_state_index: int
    episode_id: int
    env_seed: int
    horizon: int
    reset_ordinal: int
    status: str
    steps: int
    sid: str
    eid: str
    eval_id: str
    entry: str
    model_server: str
    harness_version: str
    profile: str
    failure_reason: str | None = None


@dataclass
class Run:
    """The run's episodes (the latest row of each) and its errored ones apart."""

    episodes: list[Episode] = field(default_factory=list)
    errors: list[Episode] = field(default_factory=list)

    @property
    def error_reasons(self) -> Counter:
        """How many errored episodes per failure reason."""
        return Counter(e.failure_reason or "unknown" for e in self.errors)


def _where(entry: Entry, row: Row) -> str:
    return f"{entry.name} episode {row.episode_id} (task {row.task_name!r})"


def _entry_problem(entry: Entry) -> str | None:
    config = entry.metadata.get("config") or {}
    benchmark = str(config.get("benchmark", ""))
    if benchmark in NOT_HERE:
        return f"{entry.name}: {benchmark.rsplit(':', 1)[-1]} cannot be replayed here: {NOT_HERE[benchmark]}"
    if benchmark not in ACCEPTED:
        return (f"{entry.name}: benchmark {benchmark or '(none)'} is not one rescue replays (LIBERO's "
                f"LIBEROBenchmark and LIBERO-PRO's LIBEROProBenchmark are)")
    if str(config.get("mode", "sync")) != "sync":
        return f"{entry.name}: mode {config.get('mode')!r}: only sync runs (one action per observation) are replayed"
    if config.get("throughput_mode"):
        return f"{entry.name}: throughput_mode reuses initial states across episodes; its episodes are not LIBERO's"
    params = config.get("params") or {}
    perturbation = params.get("perturbation")
    suite = str(params.get("suite", ""))
    if benchmark == LIBERO_PRO and ((perturbation not in (None, "none")) or suite.rsplit("_", 1)[-1] in GENERATED):
        return (f"{entry.name}: LIBERO-PRO suite {suite}{'_' + str(perturbation) if perturbation not in (None, 'none') else ''} "
                "was generated on the harness's side by LIBERO-PRO's perturbation.py; the simulator here cannot build "
                "those files (its LIBERO-PRO ships its own)")
    return None


def _params(entry: Entry) -> dict[str, Any]:
    config = entry.metadata.get("config") or {}
    server = entry.metadata.get("server_info") or {}
    accepted = ACCEPTED[str(config.get("benchmark"))]
    announced = {k: v for k, v in (server.get("observation_params") or {}).items() if k in accepted}
    return merged_params(dict(config.get("params") or {}), announced)


def _ordinals(rows: list[Row]) -> dict[tuple[str, str], int]:
    """Each row's reset ordinal, by (sid, eid): the rows of its task right before it in its process and entry."""
    out: dict[tuple[str, str], int] = {}
    last: dict[tuple[str, str], tuple[Any, int]] = {}
    for row in sorted(rows, key=lambda r: r.order):
        key = (row.sid, row.eval_id)
        task = row.context.get("task_id")
        previous = last.get(key)
        ordinal = previous[1] + 1 if previous is not None and previous[0] == task else 0
        last[key] = (task, ordinal)
        out[(row.sid, row.eid)] = ordinal
    return out


def _latest(rows: list[Row]) -> list[Row]:
    """The latest row of each episode (entry, task, episode number, task index), in row order."""
    chosen: dict[Any, Row] = {}
    for row in sorted(rows, key=lambda r: r.order):
        task_idx = row.context.get("task_idx")
        key = (row.eval_id, row.task_name, row.episode_id, task_idx) if task_idx is not None else ("row", row.order)
        chosen[key] = row
    return sorted(chosen.values(), key=lambda r: r.order)


def read_run(entries: list[Entry], rows: list[Row], catalog: Catalog, source: str) -> Run:
    """The run's episodes; ResultsError naming every row and entry that cannot be replayed here."""
    problems = [p for e in entries if (p := _entry_problem(e)) is not None]
    if problems:
        raise ResultsError([f"{source}: {p}" for p in problems])
    by_id = {e.eval_id: e for e in entries}
    ordinals = _ordinals(rows)
    run = Run()
    for row in _latest(rows):
        entry = by_id.get(row.eval_id)
        if entry is None:
            problems.append(f"{source}: episode {row.episode_id} names entry {row.eval_id!r}, which has no eval_metadata")
            continue
        params = _params(entry)
        where = f"{source}: {_where(entry, row)}"
        problem = refusal(params)
        seed = env_seed(params)
        suite, task_id, index = row.context.get("suite"), row.context.get("task_id"), row.context.get("episode_idx")
        if problem is not None:
            problems.append(f"{where}: {problem}")
            continue
        if seed is None:
            problems.append(f"{where}: the env was seeded with {params.get('env_seed', params.get('seed'))!r}, no seed")
            continue
        if not isinstance(suite, str) or type(task_id) is not int or type(index) is not int or index < 0:
            problems.append(f"{where}: its context names no suite, task_id and episode_idx ({row.context})")
            continue
        if catalog.suite(suite) is None:
            problems.append(f"{where}: suite {suite!r} cannot be built here: "
                            f"{catalog.refusal(suite) or catalog.hint(suite)}")
            continue
        task = catalog.task(suite, task_id)
        if task is None or index >= task.init_states:
            problems.append(f"{where}: {suite} has no task {task_id} with initial state {index}")
            continue
        if row.task_name != task.told("task.language"):
            problems.append(f"{where}: the run named the task {row.task_name!r}; here {suite} task {task_id} is "
                            f"{task.told('task.language')!r} (another LIBERO)")
            continue
        if row.status not in ("success", "fail", "error"):
            problems.append(f"{where}: status {row.status!r} (success, fail or error)")
            continue
        config, server = entry.metadata.get("config") or {}, entry.metadata.get("server_info") or {}
        episode = Episode(
            suite=suite, task_id=task_id, init_state_index=index, episode_id=row.episode_id, env_seed=seed,
            horizon=horizon(config.get("max_steps"), params, base_suite(suite) if config.get("benchmark") == LIBERO_PRO else suite),
            reset_ordinal=ordinals[(row.sid, row.eid)],
            status=row.status, steps=row.steps, sid=row.sid, eid=row.eid, eval_id=row.eval_id, entry=entry.name,
            model_server=str(server.get("model_server", "")),
            harness_version=str(entry.metadata.get("harness_version", "")), profile=name_for(params),
            failure_reason=row.failure_reason)
        (run.errors if row.status == "error" else run.episodes).append(episode)
    if problems:
        raise ResultsError(problems)
    if not run.episodes and not run.errors:
        raise ResultsError([f"{source}: no episodes"])
    return run


def aggregate_rows(aggregate: dict[str, Any], source: str) -> tuple[list[Entry], list[Row]]:
    """One `*_aggregate.json`'s entry and rows, when its order is known: one unsharded process ran them all (task
    after task, each task's episodes in order); else ResultsError saying to import the recording."""
    if not isinstance(aggregate, dict) or not isinstance(aggregate.get("tasks"), list):
        raise ResultsError([f"{source}: tasks: expected vla-eval's aggregate (`vla-eval export`), a list of tasks"])
    entry = Entry(eval_id=str(aggregate.get("eval_id", "")), name=str(aggregate.get("benchmark", "")),
                  metadata={"config": aggregate.get("config") or {}, "server_info": aggregate.get("server_info") or {},
                            "harness_version": aggregate.get("harness_version", "")})
    raw = [(t, e) for t in aggregate["tasks"] if isinstance(t, dict) for e in t.get("episodes") or [] if isinstance(e, dict)]
    sids = {e.get("sid") for _, e in raw}
    if "shard" in aggregate or len(sids) > 1:
        raise ResultsError([f"{source}: a sharded run ({max(len(sids), 2)} shard processes or more): its aggregate keeps "
                            "neither the order each process reset its envs in nor the rows a rerun replaced; import its "
                            "recording-<eval_id>.sqlite instead"])
    rows = []
    for task, ep in raw:
        status = "error" if ep.get("failure_reason") else ("success" if (ep.get("metrics") or {}).get("success") else "fail")
        context = {k: ep.get(k) for k in ("suite", "task_id", "episode_idx", "task_idx", "name") if k in ep}
        rows.append(Row(order=0, sid=str(ep.get("sid", "")), eid=str(ep.get("eid", "")), eval_id=entry.eval_id,
                        task_name=str(task.get("task", ep.get("name", ""))), episode_id=int(ep.get("episode_id", 0)),
                        status=status, steps=int(ep.get("steps") or 0), context=context,
                        failure_reason=ep.get("failure_reason")))
    # An unsharded run goes task by task (its task list's order), each task's episodes in order.
    rows.sort(key=lambda r: (r.context.get("task_idx", 0), r.episode_id))
    return [entry], [Row(**{**r.__dict__, "order": i}) for i, r in enumerate(rows)]
