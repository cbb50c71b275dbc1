"""What produced a study, as the report's header says it: policy, profiles, VLM, tool, dates, digests.

Everything comes from the study's own records: its resolved configuration
(what the policy server announced included), the journal's meta, and the
receipts (what the VLM said it was). A fact the study does not record is
said to be unrecorded, never guessed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from rescue import __version__
from rescue.core.figures.baseline import Baseline, BaselineSource
from rescue.core.configuration.config import StudyConfig
from rescue.core.configuration.vlm_config import endpoint_host, url_without_secrets
from rescue.core.episode_protocol import PROTOCOLS
from rescue.core.records import Receipt

# Meta keys under which a study may record the tool that created it (see the report's note on this).
VERSION_KEYS = ("rescue_version", "version")
COMMIT_KEYS = ("git_commit", "commit")


def vlm_host(base_url: str) -> str:
    """The VLM endpoint's host (and port), or `local` for the bundled endpoint."""
    if base_url == "local":
        return "local (the bundled endpoint on loopback)"
    return endpoint_host(base_url)


def episode_protocol(config: StudyConfig, recorded: Iterable[str | None] = ()) -> str:
    """The study's episode protocol (DESIGN §10): its configuration's, else the one its arms recorded, else
    `rescue` (the protocol of every study made before there were others)."""
    named = getattr(config.env, "episode_protocol", None)
    if named:
        return named
    seen = {p for p in recorded if p}
    return seen.pop() if len(seen) == 1 else "rescue"


def _protocol_text(config: StudyConfig, recorded: list[str | None]) -> str:
    name = episode_protocol(config, recorded)
    known = PROTOCOLS.get(name)
    text = f"{name} ({known.description})" if known is not None else name
    told = getattr(config.env, "instruction", None)
    if told is not None and known is not None:
        words = "the suite's own (perturbed) words" if told == "perturbed" else "task.language"
        chosen = "" if told == known.instruction else ", chosen by [env] instruction instead of the protocol's own"
        text += f"; the policy is told {words}{chosen}"
    others = sorted({p for p in recorded if p and p != name})
    if others:
        text += f"; arms recorded another: {', '.join(others)}"
    return text


def created_text(created_at: float | None) -> str:
    """The creation time as a UTC date, or `unknown`."""
    return datetime.fromtimestamp(created_at, UTC).strftime("%Y-%m-%d %H:%M UTC") if created_at else "unknown"


def _kv(items: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {'not sent' if v is None else v}" for k, v in items.items())


def tool_text(meta: dict[str, Any], config: StudyConfig) -> str:
    """Which rescue created the study (version, commit) as far as it recorded it, and which wrote this page."""
    version = next((meta[k] for k in VERSION_KEYS if meta.get(k)), None)
    commit = next((meta[k] for k in COMMIT_KEYS if meta.get(k)), None) or getattr(config, "commit", None)
    made = f"created by rescue {version}" if version else "the study records no tool version"
    if commit:
        made += f" at commit {commit}" + (" with uncommitted changes" if meta.get("git_dirty") else "")
    elif version:
        made += " (no commit recorded)"
    return f"{made}; this page written by rescue {__version__}"


def _policy(config: StudyConfig) -> tuple[str, str]:
    p = config.policy
    where = f"server {url_without_secrets(p.url)}" if p.url else f"factory {p.factory} (served on loopback)"
    announced = p.announced or {}
    said = _kv(announced) if announced else "nothing (its metadata names no policy, action horizon or observation)"
    return where, said


def _sham(config: StudyConfig) -> str:
    s = config.sham
    if not s.on:
        return "no sham arm"
    if s.source == "fixed":
        extra = f" ({len(s.by_task)} task(s) with their own text)" if s.by_task else ""
        return f"fixed text \u201c{s.text}\u201d{extra}"
    return f"permuted: each case gets its declared donor's VLM answer (donor seed {s.seed})"


def provenance_rows(config: StudyConfig, meta: dict[str, Any], receipts: Iterable[Receipt],
                    protocols: Iterable[str | None] = ()) -> list[tuple[str, str, str]]:
    """(key, heading, text) of each fact of the header, in reading order (`protocols`: what the arms recorded)."""
    where, said = _policy(config)
    v = config.vlm
    reported = Counter(r.model_reported for r in receipts if r.model_reported)
    reported_text = ", ".join(f"{m} ({n} call(s))" for m, n in reported.most_common()) or "no answer yet"
    p = config.policy
    rows = [
        ("policy", "policy", where),
        ("announced", "the server announced", said),
        ("observation", "observation profile",
         f"{p.observation or 'unknown'}" + (f" (definition sha256 {p.observation_sha256[:16]}…)" if p.observation_sha256 else "")),
        ("episode_protocol", "episode protocol", _protocol_text(config, list(protocols))),
        ("interval", "replanning interval C and query point",
         f"C = {p.replan_interval} env steps; q = {config.query_rule}"),
        ("arms", "arms", ", ".join(config.arms) + f" ({_mode(config)})"),
        ("sham", "sham arm", _sham(config)),
        ("rules", "rules between policy and simulator", ", ".join(config.rules.enabled) or "none"),
        ("vlm_host", "VLM endpoint (host)", vlm_host(v.base_url)),
        ("vlm_model", "VLM model", f"{v.model} requested; reported: {reported_text}"),
        ("vlm_api", "VLM API", _api_text(v)),
        ("generation", "generation settings", _kv(v.generation())),
        ("tool", "tool", tool_text(meta, config)),
        ("created", "created", created_text(meta.get("created_at"))),
        ("config_sha256", "config sha256", meta.get("config_sha256") or "not recorded"),
        ("manifest_sha256", "manifest sha256",
         (meta.get("manifest_sha256") or "not recorded")
         + (f" ({meta['manifest_source'].rsplit('/', 1)[-1]})" if meta.get("manifest_source") else "")),
    ]
    if config.advisors:
        # Several advisors (DESIGN §11): the VLM rows name each one's, in declared order, the primary first.
        receipts = list(receipts)
        per = {}
        for a in config.advisors:
            seen = Counter(r.model_reported for r in receipts if r.model_reported and r.advisor == a.name)
            per[a.name] = ", ".join(f"{m} ({n} call(s))" for m, n in seen.most_common()) or "no answer yet"
        texts = {
            "vlm_host": lambda a: vlm_host(a.base_url) + (f" (service endpoint {a.endpoint})" if a.endpoint else ""),
            "vlm_model": lambda a: f"{a.model} requested; reported: {per[a.name]}",
            "vlm_api": _api_text,
            "generation": lambda a: _kv(a.generation()) + (f"; price per million tokens: {_kv(a.price.model_dump())}"
                                                            if a.price is not None else ""),
        }
        rows = [(key, head.replace("VLM", "advisors'") if key in texts else head,
                 " · ".join(f"{a.name}{' (primary)' if i == 0 else ''}: {texts[key](a)}" for i, a in enumerate(config.advisors))
                 if key in texts else text) for key, head, text in rows]
    return rows


def _api_text(v: Any) -> str:
    return (f"{v.api} ({'structured output' if v.structured else 'free text'}), prompt template "
            f"{v.prompt_template}, image detail {v.image_detail}, up to {v.batch_size} case(s) per call")


def _source_text(s: BaselineSource, n: int) -> str:
    if s.kind == "evaluation":
        where = f"evaluation study {s.eval_study}" + (f" (config sha256 {s.eval_config_sha256[:12]}…)" if s.eval_config_sha256 else "")
    else:
        name = {"lerobot": "LeRobot", "openpi": "openpi"}.get(s.kind, "imported")
        where = f"{name} results file {s.results_file or 'of unrecorded name'}" + (
            f" (sha256 {s.results_sha256[:12]}…)" if s.results_sha256 else "")
    parts = [f"policy {s.policy}" if s.policy else "policy not recorded"]
    if s.episodes is not None and s.successes is not None:
        rate = f" ({100 * s.success_rate:.1f}%)" if s.success_rate is not None else ""
        parts.append(f"{s.successes} of {s.episodes} episodes succeeded{rate}"
                     + (f", {s.failures} failed" if s.failures is not None else ""))
    else:
        parts.append("its success rate not recorded")
    parts.append(f"episode protocol {s.episode_protocol or 'not recorded'}")
    if s.suites or s.tasks or s.inits:
        parts.append(f"{s.suites or 'suite not recorded'}, tasks {s.tasks or '?'}, initial states {s.inits or '?'}")
    taken = f"failures of initial states {s.taken_inits} only" if s.taken_inits else "every failure taken"
    if s.taken_limit is not None:
        taken += f", at most {s.taken_limit}"
    parts.append(taken if s.kind == "evaluation" else "every failure taken")
    share = "" if s.cases == n else f" ({s.cases} of the {n} cases)"
    return f"{where}{share}: " + "; ".join(parts)


def baseline_sentences(baseline: Baseline, n: int) -> list[str]:
    """Where the failures came from, one sentence per source (and one for cases no source names)."""
    out = [f"The failures come from {_source_text(s, n)}." for s in baseline.sources]
    if baseline.by_hand:
        whose = "The manifest" if not baseline.sources else f"For {baseline.by_hand} of the {n} cases the manifest"
        out.append(f"{whose} names no baseline evaluation: written by hand (no case carries an eval_study or "
                   "results_sha256 tag, as `rescue manifest from-eval`, `from-lerobot` and `from-openpi` write them).")
    return out


def _mode(config) -> str:
    """How the arms ran (DESIGN §13): forked at q, with or without a replay of the prefix, K continuations."""
    if not config.fork_at_q:
        return "each run whole"
    if config.policy.rng_control is False:
        how = ("forked at q from one snapshot; each continued on a fresh policy connection: the server gives no RNG "
               "control, so every continuation is a new draw of the policy")
    else:
        how = "forked at q from one snapshot"
    return how + (f"; {config.continuations} continuations per arm" if config.continuations > 1 else "")
