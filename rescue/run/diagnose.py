"""How a policy behaved, not only whether it succeeded (DESIGN §6, seed 000).

A pure module over plain records: per policy query, the stage the policy
reported (and the rule wrapper's voted stage), the end-effector position in
the world frame, which rules fired and the chunk digests before and after
them. From the arms of one or more compared configurations (policies or rule
settings, same instances) it derives success counts, the median first step
each stage is entered, episodes reaching each stage, rule firings by rule,
chunks rewritten and their share of predicted chunks, end-effector path
length, and the same figures restricted to the instances where every
configuration failed (so episode length is controlled). Outputs: per-instance
CSV rows, a transitions JSON, a summary table and (matplotlib, imported only
there) a stage-timeline plot.

The path length is summed over the end-effector positions at policy queries
(every C steps), so it under-counts motion that turns within a chunk.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rescue.core.digest import digest_array
from rescue.core.records import QueryRecord

SCHEMA = "rescue.run.diagnose/1"
StageSource = Literal["auto", "policy", "wrapper"]


def ee_position(obs: dict) -> tuple[float, float, float] | None:
    """The end-effector position from a simulator observation or a policy input (None if absent).

    The privileged observation has `robot0_eef_pos`; openpi-libero's
    `observation/state` starts with the same three floats.
    """
    for key in ("robot0_eef_pos", "observation/state", "state"):
        value = obs.get(key)
        if value is not None:
            arr = np.asarray(value, dtype=np.float64).reshape(-1)
            if arr.size >= 3:
                return (float(arr[0]), float(arr[1]), float(arr[2]))
    return None


def query_record(step: int, obs: dict, reply: dict, stage_key: str, rules_query: dict | None = None) -> QueryRecord:
    """The record of one query: obs is what the simulator returned, reply the (post-rule) policy reply.

    rules_query is the rule wrapper's `last_query` (None without a wrapper): it
    carries the voted stage, the firings and the digests before/after the rules.
    """
    vote = reply.get(stage_key)
    stage = None if vote is None else int(vote)
    if rules_query is not None:
        return QueryRecord(
            step=step,
            stage=stage,
            wrapper_stage=rules_query.get("stage"),
            ee_pos=ee_position(obs),
            fired=list(rules_query.get("fired", [])),
            chunk_before=rules_query.get("before"),
            chunk_after=rules_query.get("after"),
        )
    chunk = digest_array(np.asarray(reply["actions"]))
    return QueryRecord(step=step, stage=stage, ee_pos=ee_position(obs), chunk_before=chunk, chunk_after=chunk)


class ArmBehaviour(BaseModel):
    """One arm of one compared configuration, reduced to what the diagnostics need."""

    model_config = ConfigDict(extra="forbid")

    config: str
    """The compared configuration (a policy, a rule setting, a study)."""
    case_id: str
    success: bool | None
    """None: the arm did not complete (infrastructure error); it joins no failure set."""
    steps: int
    queries: list[QueryRecord] = Field(default_factory=list)


def from_arm_result(config: str, arm: Any) -> ArmBehaviour:
    """An ArmBehaviour from a journal's arm record (anything with case_id, success, steps, queries)."""
    queries = [q if isinstance(q, QueryRecord) else QueryRecord.model_validate(q) for q in getattr(arm, "queries", None) or []]
    success = arm.success if getattr(arm, "status", "complete") == "complete" else None
    return ArmBehaviour(config=config, case_id=arm.case_id, success=success, steps=arm.steps, queries=queries)


class ArmMetrics(BaseModel):
    """Per-arm figures: one CSV row."""

    config: str
    case_id: str
    success: bool | None
    steps: int
    chunks: int
    """Predicted chunks (policy queries)."""
    first_entry: dict[int, int]
    """Stage -> first step the arm was at that stage."""
    max_stage: int | None
    firings: dict[str, int]
    rewritten: int
    """Chunks a rule changed."""
    path_length: float | None
    """End-effector path length over the queries, metres (None without positions)."""
    transitions: list[tuple[int, int | None, int]]
    """(step, from stage, to stage) each time the stage changed."""
    all_failed: bool = False
    """Whether every compared configuration failed this instance."""


def study_arms(studies: Sequence[Path], only: Sequence[str] | None = None) -> list[ArmBehaviour]:
    """Every arm of these studies (only the arms named, when given), each labelled `<study folder>:<arm>`."""
    from rescue.study.folder import open_journal

    arms = []
    for study in studies:
        with open_journal(study) as journal:
            for by_arm in journal.all_arms().values():
                for name, arm in by_arm.items():
                    if only is None or name in only:
                        arms.append(from_arm_result(f"{study.name}:{name}", arm))
    return arms


def stage_of(q: QueryRecord, source: StageSource = "auto") -> int | None:
    """The stage of a query: the wrapper's voted stage, the policy's report, or the first present ("auto")."""
    if source == "policy":
        return q.stage
    if source == "wrapper":
        return q.wrapper_stage
    return q.wrapper_stage if q.wrapper_stage is not None else q.stage


def arm_metrics(arm: ArmBehaviour, source: StageSource = "auto") -> ArmMetrics:
    """The per-arm figures of one arm."""
    first: dict[int, int] = {}
    transitions: list[tuple[int, int | None, int]] = []
    current: int | None = None
    for q in sorted(arm.queries, key=lambda q: q.step):
        stage = stage_of(q, source)
        if stage is None:
            continue
        first.setdefault(stage, q.step)
        if stage != current:
            transitions.append((q.step, current, stage))
            current = stage
    positions = [q.ee_pos for q in sorted(arm.queries, key=lambda q: q.step) if q.ee_pos is not None]
    path = None
    if positions:
        pts = np.asarray(positions, dtype=np.float64)
        path = float(np.linalg.norm(np.diff(pts, axis=0), axis=1).sum()) if len(pts) > 1 else 0.0
    return ArmMetrics(
        config=arm.config,
        case_id=arm.case_id,
        success=arm.success,
        steps=arm.steps,
        chunks=len(arm.queries),
        first_entry=first,
        max_stage=max(first) if first else None,
        firings=dict(Counter(name for q in arm.queries for name in q.fired)),
        rewritten=sum(q.rewritten for q in arm.queries),
        path_length=path,
        transitions=transitions,
    )


class ConfigSummary(BaseModel):
    """One configuration's figures over a set of instances."""

    config: str
    episodes: int
    successes: int
    median_first_step: dict[int, float]
    """Stage -> median first step over the episodes that entered it."""
    episodes_reaching: dict[int, int]
    """Stage -> episodes that were ever at that stage."""
    firings: dict[str, int]
    firing_share: dict[str, float]
    """Rule -> firings / predicted chunks."""
    chunks: int
    rewritten: int
    rewritten_share: float | None
    mean_steps: float | None
    mean_path_length: float | None


def summarise(config: str, rows: Sequence[ArmMetrics], stages: Iterable[int]) -> ConfigSummary:
    """The figures of one configuration over its rows."""
    chunks = sum(r.chunks for r in rows)
    firings: Counter[str] = Counter()
    for r in rows:
        firings.update(r.firings)
    paths = [r.path_length for r in rows if r.path_length is not None]
    median, reaching = {}, {}
    for s in stages:
        entries = [r.first_entry[s] for r in rows if s in r.first_entry]
        reaching[s] = len(entries)
        if entries:
            median[s] = float(statistics.median(entries))
    return ConfigSummary(
        config=config,
        episodes=len(rows),
        successes=sum(r.success is True for r in rows),
        median_first_step=median,
        episodes_reaching=reaching,
        firings=dict(sorted(firings.items())),
        firing_share={k: v / chunks for k, v in sorted(firings.items())} if chunks else {},
        chunks=chunks,
        rewritten=sum(r.rewritten for r in rows),
        rewritten_share=sum(r.rewritten for r in rows) / chunks if chunks else None,
        mean_steps=float(np.mean([r.steps for r in rows])) if rows else None,
        mean_path_length=float(np.mean(paths)) if paths else None,
    )


class Diagnosis(BaseModel):
    """Everything `rescue diagnose` prints and writes, for one set of compared configurations."""

    schema_: str = Field(default=SCHEMA, alias="schema")
    configs: list[str]
    stages: list[int]
    arms: list[ArmMetrics]
    all_failed: list[str]
    """Instances every configuration ran and failed."""
    summary: dict[str, ConfigSummary]
    summary_all_failed: dict[str, ConfigSummary]


def diagnose(arms: Sequence[ArmBehaviour], source: StageSource = "auto") -> Diagnosis:
    """Per-arm and per-configuration figures, also over the instances where all configurations failed."""
    configs = list(dict.fromkeys(a.config for a in arms))
    rows = [arm_metrics(a, source) for a in arms]
    stages = sorted({s for r in rows for s in r.first_entry})
    outcome: dict[str, dict[str, bool | None]] = {}
    for r in rows:
        outcome.setdefault(r.case_id, {})[r.config] = r.success
    failed = sorted(
        case for case, by in outcome.items() if set(by) == set(configs) and all(v is False for v in by.values())
    )
    for r in rows:
        r.all_failed = r.case_id in failed
    summary = {c: summarise(c, [r for r in rows if r.config == c], stages) for c in configs}
    restricted = {c: summarise(c, [r for r in rows if r.config == c and r.all_failed], stages) for c in configs}
    return Diagnosis(configs=configs, stages=stages, arms=rows, all_failed=failed, summary=summary, summary_all_failed=restricted)


# --- outputs ---------------------------------------------------------------------


def csv_rows(diag: Diagnosis) -> list[dict[str, Any]]:
    """One row per arm: outcome, first step of each stage, firings by rule, rewritten chunks, path."""
    rules = sorted({k for r in diag.arms for k in r.firings})
    out = []
    for r in diag.arms:
        row: dict[str, Any] = {
            "config": r.config,
            "case_id": r.case_id,
            "success": "" if r.success is None else int(r.success),
            "steps": r.steps,
            "chunks": r.chunks,
            "max_stage": "" if r.max_stage is None else r.max_stage,
        }
        row.update({f"first_step_stage_{s}": r.first_entry.get(s, "") for s in diag.stages})
        row.update({f"firings_{k}": r.firings.get(k, 0) for k in rules})
        row["rewritten"] = r.rewritten
        row["path_length_m"] = "" if r.path_length is None else round(r.path_length, 6)
        row["all_failed"] = int(r.all_failed)
        out.append(row)
    return out


def write_csv(diag: Diagnosis, path: str | Path) -> Path:
    """Write the per-instance CSV."""
    rows = csv_rows(diag)
    buf = io.StringIO()
    if rows:
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    Path(path).write_text(buf.getvalue())
    return Path(path)


def transitions_json(diag: Diagnosis) -> dict[str, Any]:
    """Stage transitions per configuration and instance: [{step, from, to}, ...]."""
    out: dict[str, Any] = {"schema": SCHEMA, "configs": {}}
    for r in diag.arms:
        out["configs"].setdefault(r.config, {})[r.case_id] = [
            {"step": step, "from": prev, "to": new} for step, prev, new in r.transitions
        ]
    return out


def write_transitions(diag: Diagnosis, path: str | Path) -> Path:
    """Write the transitions JSON."""
    Path(path).write_text(json.dumps(transitions_json(diag), indent=1, sort_keys=True) + "\n")
    return Path(path)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _num(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}" if isinstance(x, float) and not x.is_integer() else f"{x:g}{unit}"


def summary_lines(summary: dict[str, ConfigSummary], stages: Sequence[int]) -> list[tuple[str, list[str]]]:
    """The summary table's rows: (label, one cell per configuration)."""
    cols = list(summary.values())
    rules = sorted({k for c in cols for k in c.firings})
    rows = [("success", [f"{c.successes}/{c.episodes}" for c in cols])]
    rows += [(f"median first step, stage {s}", [_num(c.median_first_step.get(s)) for c in cols]) for s in stages]
    rows += [(f"episodes reaching stage {s}", [str(c.episodes_reaching.get(s, 0)) for c in cols]) for s in stages]
    rows += [(f"firings: {k}", [str(c.firings.get(k, 0)) for c in cols]) for k in rules]
    rows += [(f"share of chunks: {k}", [_pct(c.firing_share.get(k, 0.0) if c.chunks else None) for c in cols]) for k in rules]
    rows += [
        ("predicted chunks", [str(c.chunks) for c in cols]),
        ("chunks rewritten", [str(c.rewritten) for c in cols]),
        ("share rewritten", [_pct(c.rewritten_share) for c in cols]),
        ("mean steps", [_num(c.mean_steps) for c in cols]),
        ("mean ee path", [_num(c.mean_path_length, " m") for c in cols]),
    ]
    return rows


def summary_table(diag: Diagnosis) -> str:
    """The terminal summary: all instances, then the instances where every configuration failed."""
    parts = []
    for title, summary in (
        (f"all instances ({len({r.case_id for r in diag.arms})})", diag.summary),
        (f"instances all configurations failed ({len(diag.all_failed)})", diag.summary_all_failed),
    ):
        rows = summary_lines(summary, diag.stages)
        head = [title, *diag.configs]
        width = [max(len(head[0]), *(len(label) for label, _ in rows))]
        width += [max(len(h), *(len(r[1][i]) for r in rows)) for i, h in enumerate(diag.configs)]
        lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(head, width)))]
        lines.append("  ".join("-" * w for w in width))
        for label, cells in rows:
            lines.append("  ".join([label.ljust(width[0]), *(c.rjust(w) for c, w in zip(cells, width[1:]))]))
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


# Markers for the firings a timeline shows (rules firing on most chunks would hide the others).
MARKERS = {"stage_rollback": "x", "gripper_recovery": "o", "chunk_compression": "|"}


def plot_timelines(
    diag: Diagnosis,
    arms: Sequence[ArmBehaviour],
    case_ids: Sequence[str],
    path: str | Path,
    source: StageSource = "auto",
    mark: Sequence[str] = ("stage_rollback", "gripper_recovery"),
) -> Path:
    """A stage-timeline plot: one panel per instance, one step line per configuration, the `mark` rules' firings marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(case_ids), 1, figsize=(9, 2.4 * len(case_ids)), squeeze=False, sharex=True)
    for ax, case in zip(axes[:, 0], case_ids):
        for i, arm in enumerate(a for a in arms if a.case_id == case):
            qs = sorted((q for q in arm.queries if stage_of(q, source) is not None), key=lambda q: q.step)
            if not qs:
                continue
            offset = 0.06 * (i - 1)  # keep overlapping lines apart
            steps = [q.step for q in qs] + [arm.steps]
            stages = [stage_of(q, source) + offset for q in qs]
            line = ax.step(steps, stages + stages[-1:], where="post", label=f"{arm.config} ({'ok' if arm.success else 'fail'})")[0]
            for rule in mark:
                fired = [(q.step, stage_of(q, source) + offset) for q in qs if rule in q.fired]
                if fired:
                    ax.plot(*zip(*fired), MARKERS.get(rule, "+"), color=line.get_color(), markersize=4, fillstyle="none")
        ax.set_title(case + (" (all failed)" if case in diag.all_failed else ""), fontsize=9)
        ax.set_ylabel("stage")
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("step   " + ", ".join(f"{MARKERS.get(r, '+')} {r}" for r in mark))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
