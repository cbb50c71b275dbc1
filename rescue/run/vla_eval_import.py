"""`rescue manifest from-vla-eval`: a vla-eval run's recording (or aggregate) as a manifest, successes included.

The file is read here (SQLite read-only, or JSON); what its rows mean is rescue.core.vla_eval_records'. Each
case carries the harness's identity of its episode (suite, task, initial state, env seed, horizon, its reset
ordinal in its shard process) and the run's provenance (eval id, harness version, model server, the file's
sha256); with `successes`, historical successes are sampled as `from-eval` samples them, through the same
sampler and frame tags. Errored episodes are counted apart, with their reasons, in no denominator.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from rescue.core.catalog import format_ids, libero_catalog
from rescue.core.configuration.config_files import ConfigError
from rescue.core.episode_protocol import RESET_ORDINAL_TAG
from rescue.core.figures.evaluation import case_id_of, suite_group
from rescue.core.manifest import Case, read_manifest_bytes
from rescue.core.results import ResultsError
from rescue.core.figures.success_sample import DESIGN, SamplingFrame, frame_tags, sample_successes
from rescue.core.vla_eval_records import Entry, Episode, Row, Run, aggregate_rows, read_run
from rescue.run.commands import PROTOCOL_TAG
from rescue.study.files import write_manifest

SQLITE_MAGIC = b"SQLite format 3\x00"


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if text else {}
    except (TypeError, ValueError):
        return {}


def read_recording(path: Path, source: str) -> tuple[list[Entry], list[Row], str | None]:
    """The entries and rows (in row order) of a `recording-<eval_id>.sqlite`, and the run's eval id."""
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error as exc:
        raise ResultsError([f"{source}: cannot be opened as SQLite ({exc})"]) from None
    try:
        tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        missing = {"eval_metadata", "episode_results"} - tables
        if missing:
            raise ResultsError([f"{source}: no {', '.join(sorted(missing))} table: not a vla-eval recording"])
        run_id = None
        if "run_metadata" in tables:
            found = con.execute("SELECT eval_id FROM run_metadata").fetchone()
            run_id = found[0] if found else None
        entries = [Entry(eval_id=e, name=n, metadata=_json(m))
                   for e, n, m in con.execute("SELECT eval_id, safe_name, metadata FROM eval_metadata")]
        rows = [Row(order=rowid, sid=sid, eid=eid, eval_id=eval_id, task_name=task or "", episode_id=int(episode or 0),
                    status=status or "", steps=int(steps or 0), context=_json(context), failure_reason=reason)
                for rowid, sid, eid, eval_id, task, episode, status, steps, context, reason in con.execute(
                    "SELECT rowid, sid, eid, eval_id, task_name, episode_id, status, steps, context, failure_reason "
                    "FROM episode_results ORDER BY rowid")]
    except sqlite3.DatabaseError as exc:
        raise ResultsError([f"{source}: not a readable SQLite database ({exc})"]) from None
    finally:
        con.close()
    return entries, rows, run_id


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_vla_eval(path: Path) -> tuple[Run, str, str | None]:
    """The run a recording or an aggregate holds, the file's sha256 and the run's eval id."""
    source = str(path)
    if not path.is_file():
        raise ResultsError([f"{source}: no such file (a vla-eval recording-<eval_id>.sqlite or its *_aggregate.json)"])
    with path.open("rb") as f:
        head = f.read(len(SQLITE_MAGIC))
    if head == SQLITE_MAGIC:
        entries, rows, run_id = read_recording(path, source)
        sha = _sha256(path)
    else:
        data = read_manifest_bytes(path, "vla-eval aggregate")  # bounded, as a manifest is read
        try:
            aggregate = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ResultsError([f"{source}: neither a vla-eval recording (SQLite) nor its aggregate JSON ({exc})"]) from None
        entries, rows = aggregate_rows(aggregate, source)
        run_id, sha = entries[0].eval_id or None, hashlib.sha256(data).hexdigest()
    return read_run(entries, rows, libero_catalog(), source), sha, run_id


def _case_ids(episodes: list[Episode]) -> dict[tuple[str, str], str]:
    """A case id per episode (by sid, eid): `object-3-ep7`, then `.<entry>` when two entries share it."""
    plain = {(e.sid, e.eid): case_id_of(e.suite, e.task_id, e.episode_id) for e in episodes}
    twice = {cid for cid, n in Counter(plain.values()).items() if n > 1}
    return {(e.sid, e.eid): plain[(e.sid, e.eid)] + (f".{e.entry}" if plain[(e.sid, e.eid)] in twice else "")
            for e in episodes}


def manifest_from_vla_eval(path: Path, out: Path, successes: int | Literal["all"] | None = None,
                           seed: int = 0) -> tuple[list[Case], Run]:
    """Write the failure manifest of a vla-eval run (with `successes`, its successes too: all, or a seeded sample of
    that many stratified by task, every case tagged with the sampling frame, DESIGN §17)."""
    if successes not in (None, "all") and successes < 0:
        raise ConfigError(f"--successes {successes}: a sample size is 0 or more, or 'all'")
    run, sha, run_id = read_vla_eval(path)
    episodes = sorted(run.episodes, key=lambda e: (e.entry, e.suite, e.task_id, e.episode_id))
    failed = [e for e in episodes if e.status == "fail"]
    won = [e for e in episodes if e.status == "success"]
    ids = _case_ids(episodes)
    reasons = run.error_reasons
    provenance: dict[str, Any] = {
        "source": f"vla-eval run {path.name}",
        "results_file": path.name, "results_sha256": sha, PROTOCOL_TAG: "vla-eval",
        "vla_eval_run": run_id, "eval_episodes": len(episodes), "eval_successes": len(won), "eval_failures": len(failed),
        "eval_errors": len(run.errors),
        "eval_error_reasons": ", ".join(f"{reason} x{n}" for reason, n in sorted(reasons.items())) or None,
        "eval_suites": ",".join(sorted({e.suite for e in episodes})),
        "eval_tasks": format_ids(e.task_id for e in episodes), "eval_inits": format_ids(e.init_state_index for e in episodes),
    }

    def case(e: Episode, outcome: str | None = None) -> Case:
        tags = {**provenance, "vla_eval_id": e.eval_id, "vla_eval_version": e.harness_version,
                "vla_eval_server": e.model_server, "vla_eval_entry": e.entry, "vla_eval_profile": e.profile,
                "vla_eval_episode": e.episode_id, "vla_eval_steps": e.steps, "shard_process": e.sid,
                RESET_ORDINAL_TAG: e.reset_ordinal}
        return Case(case_id=ids[(e.sid, e.eid)], suite=e.suite, task_id=e.task_id, init_state_index=e.init_state_index,
                    env_seed=e.env_seed, horizon=e.horizon, group=suite_group(e.suite), outcome=outcome,
                    tags={k: v for k, v in tags.items() if v is not None})

    cases = [case(e) for e in failed]
    if successes is not None:
        won_cases = [case(e, "success") for e in won]
        sampled = None if successes == "all" or successes >= len(won_cases) else successes
        chosen = sample_successes(won_cases, sampled, seed)
        frame = SamplingFrame(failures=len(failed), successes=len(won_cases), sampled=sampled,
                              seed=None if sampled is None else seed, design=DESIGN)
        per_task = {t: SamplingFrame(failures=sum(c.task == t for c in cases), successes=sum(c.task == t for c in won_cases))
                    for t in sorted({c.task for c in cases + won_cases})}
        cases = [c.model_copy(update={"outcome": c.historical_outcome, "tags": {**c.tags, **frame_tags(frame, per_task[c.task])}})
                 for c in cases + chosen]
    write_manifest(cases, out)
    return cases, run
