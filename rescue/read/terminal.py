"""Terminal renderings of a study's figures (pure: data in, rich renderables out)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from rescue.core.figures.evaluation import EvalSummary
from rescue.core.arms import arm_advisor, is_assisted, query_point_of, shown
from rescue.core.figures.stats import ArmFigures, Summary, ranked
from rescue.read.asking_view import tests_table, ways_table
from rescue.read.harm_view import breakdown_table, evaluation_name, harm_table, net_sentence
from rescue.read.stopping_view import stop_sentence

LABEL_ORDER = ("rescued", "not_rescued", "unknown", "initial_state_deviation")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def summary_table(summary: Summary, title: str, n_fixed: int | None = None) -> Table:
    """DESIGN §3 summary: counts, R/N, R/M, R/E, the 2x2 of M, McNemar and the paired CI."""
    t = Table(title=title, show_header=False)
    t.add_row("cases (N, fixed)", str(summary.n if n_fixed is None else n_fixed))
    if n_fixed is not None and n_fixed != summary.n:
        t.add_row("of which have a verdict", f"{summary.n} (the figures below cover these only)")
    for label in LABEL_ORDER:
        t.add_row(label, str(summary.counts.get(label, 0)))
    t.add_row("M (valid, complete, no deviation, exact prefix)", str(summary.m))
    t.add_row("E (M with the subgoal applied, valid evidence)", str(summary.e))
    t.add_row("R/N  R/M  R/E", f"{_pct(summary.r_over_n)}  {_pct(summary.r_over_m)}  {_pct(summary.r_over_e)}")
    vc = summary.versus_control
    p = vc.pairs
    t.add_row(
        "2x2 of M",
        f"assisted-only {p.first_only}, control-only {p.second_only}, both success {p.both_success}, both fail {p.both_fail}",
    )
    t.add_row("exact McNemar p (discordant pairs)", _p(vc.mcnemar_p))
    if vc.diff is not None and vc.diff_ci is not None:
        lo, hi = vc.diff_ci
        t.add_row(f"paired difference, {int(summary.confidence * 100)}% CI", f"{_pct(vc.diff)} [{_pct(lo)}, {_pct(hi)}]")
    rep = summary.reproduction
    if rep is not None:
        t.add_row("control failed again (failure reproduction)", f"{rep.failed} of {rep.controls} ({_pct(rep.rate)})")
    return t


def _sham(figures: list[ArmFigures]) -> ArmFigures | None:
    return next((f for f in figures if f.arm == "sham"), None)


def sham_table(summary: Summary) -> Table:
    """The placebo comparison: the sham arm's own labels against control, and assisted against sham over K."""
    sham = _sham(summary.arms)
    versus = summary.comparison(summary.arm, "sham")
    t = Table(title="sham arm (placebo)", show_header=False)
    t.add_row("sham vs control", "  ".join(f"{k} {sham.counts.get(k, 0)}" for k in LABEL_ORDER))
    t.add_row("sham M / E", f"{sham.m} / {sham.e}")
    p = versus.pairs
    t.add_row(
        f"assisted vs sham, K = {versus.k} (both subgoals applied, three arms valid)",
        f"assisted-only {p.first_only}, sham-only {p.second_only}, both success {p.both_success}, both fail {p.both_fail}",
    )
    t.add_row("exact McNemar p (assisted vs sham)", _p(versus.mcnemar_p))
    if versus.diff is not None and versus.diff_ci is not None:
        lo, hi = versus.diff_ci
        t.add_row("effect of the VLM's content, 95% CI", f"{_pct(versus.diff)} [{_pct(lo)}, {_pct(hi)}]")
    return t


def _p(p: float) -> str:
    return f"{p:.2g}" if p < 0.001 else f"{p:.4f}"


def asking_arms(summary: Summary) -> list[ArmFigures]:
    """The figures of every arm that asks a VLM (the primary, further advisors, extra query points)."""
    return [f for f in summary.figures() if is_assisted(f.arm)]


def advisor_table(summary: Summary, infos: Any = None) -> Table:
    """The arms that ask ranked by R/E (advisors, DESIGN §11; query points, DESIGN §14): each one's labels, M, E,
    R/N, R/M, R/E, and its paired comparison with control and with the sham arm."""
    models = {a.arm: f"{a.model} · {a.prompt_template}" for a in infos or []}
    figures = asking_arms(summary)
    t = Table(title="advisors, ranked by R/E" if not any(query_point_of(f.arm) for f in figures) else "arms that ask, ranked by R/E")
    sham = _sham(summary.arms) is not None
    cols = ["rank", "arm", "model · prompt", "R", "M", "E", "R/N", "R/M", "R/E", "vs control: b / c, p"]
    if sham:
        cols.append("vs sham: K, b / c, p")
    for col in cols:
        t.add_column(col)
    for i, a in enumerate(ranked(figures), start=1):
        name = shown(a.arm)
        vc = a.versus_control
        row = [str(i), name + (" (primary)" if a.arm == summary.arm else ""), models.get(a.arm, ""), str(a.r), str(a.m),
               str(a.e), _pct(a.r_over_n), _pct(a.r_over_m), _pct(a.r_over_e),
               f"{vc.pairs.first_only} / {vc.pairs.second_only}, {_p(vc.mcnemar_p)}"]
        if sham:
            s = summary.comparison(a.arm, "sham")
            row.append("n/a" if s is None else f"{s.k}, {s.pairs.first_only} / {s.pairs.second_only}, {_p(s.mcnemar_p)}")
        t.add_row(*row)
    return t


def advisor_pairs_table(summary: Summary) -> Table:
    """Every pair of arms compared within a family (advisors, query points) over the cases both have in E: the 2x2,
    exact McNemar, Holm-adjusted p, Newcombe CI."""
    t = Table(title="advisors paired (cases in E for both)")
    for col in ("first vs second", "K", "first-only", "second-only", "both", "neither", "McNemar p", "Holm p",
                "first - second, 95% CI"):
        t.add_column(col)
    for pair in [c for c in summary.comparisons if c.holm_p is not None]:
        q = pair.pairs
        ci = "n/a" if pair.diff is None or pair.diff_ci is None else f"{_pct(pair.diff)} {_ci(pair.diff_ci)}"
        first, second = shown(pair.first), shown(pair.second)
        t.add_row(f"{first} vs {second}", str(pair.k), str(q.first_only), str(q.second_only),
                  str(q.both_success), str(q.both_fail), _p(pair.mcnemar_p), _p(pair.holm_p), ci)
    return t


def advisor_usage_table(by_advisor: dict[str, Any], title: str = "VLM usage per advisor", what: str = "advisor") -> Table:
    """Per advisor (or per query point): calls and their statuses, tokens by kind, latency, cost (declared price only)."""
    t = Table(title=title)
    for col in (what, "calls", "not ok", "input", "cached input", "output", "reasoning", "median latency", "cost"):
        t.add_column(col)
    for name, u in by_advisor.items():
        tokens = [str(u.tokens[k].total) if u.tokens[k].total is not None else f"{u.tokens[k].known_sum}+?"
                  for k in ("input", "cached_input", "output", "reasoning")]
        lat = "-" if u.latency.median_s is None else f"{u.latency.median_s:.2f} s"
        t.add_row(name, str(u.calls), str(u.calls - u.by_status.get("ok", 0)), *tokens, lat,
                  "unknown (no price declared)" if u.cost is None else f"{u.cost:.4f}")
    return t


def group_table(summary: Summary) -> Table:
    """Per group: the fixed count, each label, rescued / fixed, the primary against control over the group's M
    (assisted only / control only, exact McNemar p); with a sham arm, the sham's rescues and
    assisted against sham over the group's K (assisted only / sham only, exact McNemar p)."""
    t = Table(title="per group")
    shams = _sham(summary.arms) is not None
    for col in ("group", "cases", *LABEL_ORDER, "R/N", "a/c only", "p vs control",
                *(("sham R", "K", "a/s only", "p vs sham") if shams else ())):
        t.add_column(col)
    for group, b in sorted(summary.per_group.items()):
        row = [group, str(b.n), *(str(b.counts.get(k, 0)) for k in LABEL_ORDER), _pct(b.rate)]
        c = b.versus_control
        row += ["-", "-"] if c is None else [f"{c.pairs.first_only}/{c.pairs.second_only}", _p(c.mcnemar_p)]
        if shams:
            s = _sham(b.arms)
            versus = next((c for c in b.comparisons if (c.first, c.second) == (summary.arm, "sham")), None)
            row += ["-"] * 4 if s is None or versus is None else [
                str(s.r), str(versus.k), f"{versus.pairs.first_only}/{versus.pairs.second_only}", _p(versus.mcnemar_p)]
        t.add_row(*row)
    return t


def usage_table(usage: Any) -> Table:
    """VLM calls, statuses, tokens (a total only when every call reported the counter), latency."""
    t = Table(title="VLM usage", show_header=False)
    t.add_row("calls (deduplicated)", f"{usage.calls} ({', '.join(f'{k} {v}' for k, v in sorted(usage.by_status.items()))})")
    for name, tally in usage.tokens.items():
        total = tally.total if tally.total is not None else f"unknown ({tally.known_sum} known, {tally.calls_without} call(s) lack it)"
        t.add_row(f"{name} tokens", str(total))
    lat = usage.latency
    if lat.median_s is not None:
        t.add_row("latency", f"sum {lat.sum_s:.2f} s, median {lat.median_s:.2f} s, range {lat.min_s:.2f}-{lat.max_s:.2f} s")
    return t


def mode_line(study: Any) -> str | None:
    """How the study's arms ran, in one line (DESIGN §13); None for an export that does not say."""
    if study.mode is None:
        return None
    if study.mode == "independent":
        return "arms: each run whole from the initial state (independent replays)"
    how = ("followers replayed the prefix through their own policy connection (the server gives RNG control)"
           if study.policy_rng_control is not False else
           "followers continued on fresh policy connections (the server gives no RNG control: every continuation "
           "is a new draw of the policy, the control arm a new draw from the historical initial state)")
    k = f"; {study.continuations} continuations per arm" if study.continuations > 1 else ""
    return f"arms: forked at q from one snapshot; {how}{k}"


def estimate_table(summary: Summary) -> Table:
    """With K continuations per arm: every comparison's paired estimate (mean difference in success probability,
    bootstrap interval, exact sign-flip p) over the cases whose continuations all count (DESIGN §13)."""
    t = Table(title="paired estimates over continuations (DESIGN §13)")
    for col in ("first vs second", "cases", "K", "first rate", "second rate", "difference, 95% CI", "p (sign-flip)"):
        t.add_column(col)
    rows = [f.versus_control for f in summary.figures()] + list(summary.comparisons)
    for c in rows:
        e = c.estimate if c is not None else None
        if e is None:
            continue
        t.add_row(f"{c.first} vs {c.second}", str(e.k), str(e.continuations), _pct(e.first_rate), _pct(e.second_rate),
                  f"{_pct(e.diff)} {_ci(e.diff_ci)}", _p(e.p))
    return t


def render_summary(export: Any) -> Group:
    """A rescue study's export as tables: summary, per group, pilot apart, usage."""
    parts: list[Any] = []
    main = export.coverage["main"]
    if not main.complete:
        parts.append(Text(f"{main.n_pending} case(s) never started and {main.n_in_flight} in flight: "
                          "they stay in N and outside these figures until run"))
    summary = export.summary
    mode = mode_line(export.study)
    if mode is not None:
        parts.append(Text(mode))
    title = "rescue study"
    if arm_advisor(summary.arm):
        title += f" (the primary advisor's arm: {arm_advisor(summary.arm)})"
    if export.stopping is not None:
        parts.append(Text(stop_sentence(export.stopping)))
    if summary.asking is not None:
        # The answer to "whether and when to ask" first (DESIGN §18).
        parts.append(Text(summary.asking.reading))
    if summary.harm is not None:
        what = evaluation_name(export.study.baseline, summary.harm)
        parts += [Text(net_sentence(f, what)) for f in summary.harm.arms]
    # N counts the failures; historical successes have their own denominator (the harm table).
    successes = sum(1 for c in export.cases if not c.pilot and c.outcome == "success")
    parts += [summary_table(summary, title, main.n_manifest - successes), group_table(summary)]
    if summary.harm is not None:
        parts += [harm_table(summary.harm), breakdown_table(summary.harm.per_group, "group")]
    if summary.asking is not None:
        parts.append(ways_table(summary.asking))
        if summary.asking.comparisons or summary.asking.budgets:
            parts.append(tests_table(summary.asking))
    if _sham(summary.arms) is not None:
        parts.append(sham_table(summary))
    if summary.versus_control.estimate is not None:
        parts.append(estimate_table(summary))
    if len(asking_arms(summary)) > 1:
        parts.append(advisor_table(summary, export.study.advisors))
        if any(c.holm_p is not None for c in summary.comparisons):
            parts.append(advisor_pairs_table(summary))
    if export.summary.pilot is not None:
        parts.append(Text(f"pilot cases (not in N): {', '.join(export.summary.pilot_ids)}"))
        parts.append(summary_table(export.summary.pilot, "pilot"))
    parts.append(usage_table(export.usage))
    if getattr(export, "usage_by_advisor", None):
        parts.append(advisor_usage_table(export.usage_by_advisor))
    if getattr(export, "usage_by_query_point", None):
        parts.append(advisor_usage_table({shown(a): u for a, u in export.usage_by_query_point.items()},
                                         "VLM usage per query point", "query point's arm"))
    parts.append(Text("the words (q, C, H, N, M, E, K, R/N, prefix proof) are explained in docs/glossary.md"))
    return Group(*parts)


def _eval_table(title: str, first: str, rows: list[tuple[str, Any]]) -> Table:
    t = Table(title=title)
    for col in (first, "episodes", "success", "failure", "unknown", "unexecuted", "success rate"):
        t.add_column(col)
    for name, r in rows:
        t.add_row(name.removeprefix("libero_"), str(r.n), str(r.success), str(r.failure), str(r.unknown), str(r.unexecuted), _pct(r.rate))
    return t


def render_eval(summary: EvalSummary) -> Group:
    """An evaluation's success per task, per group and overall, unknown and unexecuted shown."""
    return Group(
        _eval_table("baseline evaluation", "task", [*sorted(summary.per_task.items()), ("overall", summary.overall)]),
        _eval_table("per group", "group", sorted(summary.per_group.items())),
    )


def _ci(ci: tuple[float, float] | None) -> str:
    return "n/a" if ci is None else f"[{_pct(ci[0])}, {_pct(ci[1])}]"


def render_compare(comparison: Any) -> Group:
    """A paired comparison: wins, losses, ties, both rates, McNemar, both intervals, excluded pairs."""
    c, k = comparison, comparison.counts
    v, two = k.versus, k.versus.pairs  # B first: a win is the table's first_only, a loss its second_only
    conf = f"{int(round(c.confidence * 100))}%"
    head = Text(f"B = {c.b_name}\nA = {c.a_name}\na win: B succeeded where A failed; differences are B - A")
    t = Table(title="paired comparison", show_header=False)
    t.add_row("episode pairs", str(k.n))
    t.add_row("paired (completed, same initial state)", str(v.k))
    t.add_row("wins / losses / ties", f"{two.first_only} / {two.second_only} / {two.both_success + two.both_fail}")
    t.add_row("ties: both success / both fail", f"{two.both_success} / {two.both_fail}")
    t.add_row("excluded: fingerprint mismatch", str(k.fingerprint_mismatch))
    t.add_row("excluded: unknown / unexecuted / unmatched", f"{k.unknown} / {k.unexecuted} / {k.unmatched}")
    t.add_row("success, paired episodes: A / B", f"{_pct(c.a_rate)} / {_pct(c.b_rate)}")
    t.add_row("success, all episodes: A / B", f"{_pct(c.a.overall.rate)} / {_pct(c.b.overall.rate)}")
    t.add_row("exact McNemar p", _p(v.mcnemar_p))
    t.add_row(f"B - A, Newcombe {conf} CI", f"{_pct(v.diff)} {_ci(v.diff_ci)}")
    t.add_row(f"B - A, task-bootstrap {conf} CI", _ci(c.bootstrap_ci))
    t.add_row("bootstrap seed, resamples", f"{c.bootstrap_seed}, {c.bootstrap_reps}")
    tasks = Table(title="per task")
    tasks.add_column("task", no_wrap=True)
    for col in ("pairs", "paired", "wins", "losses", "ties", "excluded"):
        tasks.add_column(col)
    for name, p in c.per_task.items():
        pt = p.versus.pairs
        tasks.add_row(name.removeprefix("libero_"), *(str(x) for x in (
            p.n, pt.k, pt.first_only, pt.second_only, pt.both_success + pt.both_fail, p.n - pt.k)))
    sides = Table(title="each side over all its episodes")
    for col in ("side", "episodes", "success", "failure", "unknown", "unexecuted", "success rate"):
        sides.add_column(col)
    for label, s in (("A", c.a.overall), ("B", c.b.overall)):
        sides.add_row(label, str(s.n), str(s.success), str(s.failure), str(s.unknown), str(s.unexecuted), _pct(s.rate))
    parts: list[Any] = [head, t, tasks, sides]
    for status, ids in c.excluded.items():
        parts.append(Text(f"excluded ({status.replace('_', ' ')}): {', '.join(ids)}"))
    return Group(*parts)


def _tokens(tally: Any) -> str:
    return str(tally.total) if tally.total is not None else f"{tally.known_sum}+? ({tally.calls_without} unreported)"


def _cost(g: Any) -> str:
    if g.cost is not None:
        return f"{g.cost:.4f}"
    return "unknown" if not g.cost_known else f"{g.cost_known:.4f}+? ({g.calls_without_cost} unpriced)"


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def lab_usage_table(title: str, first: str, groups: list[Any]) -> Table:
    """One grouping of a lab's calls: calls, tokens by kind, declared cost, latency quantiles."""
    t = Table(title=title)
    t.add_column(first, overflow="fold")
    for col in ("calls", "not ok", "input", "output", "reasoning", "cost", "p50 s", "p90 s", "p99 s", "max s"):
        t.add_column(col, justify="right")
    for g in groups:
        lat = g.latency
        t.add_row(g.key, str(g.calls), str(g.calls - g.by_status.get("ok", 0)), _tokens(g.tokens["input"]),
                  _tokens(g.tokens["output"]), _tokens(g.tokens["reasoning"]), _cost(g), _seconds(lat.p50_s),
                  _seconds(lat.p90_s), _seconds(lat.p99_s), _seconds(lat.max_s))
    return t


def render_lab_usage(usage: Any) -> Group:
    """`rescue usage`: the lab's calls per model, endpoint, study and day, and their total."""
    where = ", ".join(usage.folders) or "no folder (the default studies/ and queue/ do not exist here)"
    parts: list[Any] = [Text(f"{len(usage.studies)} stud{'y' if len(usage.studies) == 1 else 'ies'} under {where}; "
                             "cost in the unit each study declared its [vlm] price in")]
    for title, first, groups in (("per model", "model", usage.by_model), ("per endpoint", "endpoint", usage.by_endpoint),
                                 ("per study", "study", usage.by_study), ("per day (UTC)", "day", usage.by_day),
                                 ("all calls", "", [usage.total])):
        if usage.total.calls:
            parts.append(lab_usage_table(title, first, groups))
    for ledger in usage.ledgers:
        parts.append(Text(f"lab budget ledger {ledger.path}: {ledger.calls} calls, {ledger.cost:.4f} spent, "
                          f"{ledger.held:.4f} held by {ledger.holds} arm(s) in flight"
                          + (f", {ledger.calls_without_cost} call(s) of unknown cost" if ledger.calls_without_cost else "")))
    for line in usage.skipped:
        parts.append(Text(f"not read: {line}"))
    return Group(*parts)


def render_catalog(catalog: Any, suite: str | None = None) -> Group | Table:
    """The suites that run here with what each changes in its base (measured), or one suite's tasks."""
    if suite is not None:
        return _suite_tasks(catalog, suite)
    t = Table(title=f"{catalog.benchmark} suites that run here ({catalog.source})")
    for column in ("suite", "kind", "tasks", "H", "initial states = base's", "model vs base", "wording vs base",
                   "@base-inits"):
        t.add_column(column)
    for name, entry in catalog.suites.items():
        summary = entry.versus_base()
        if summary is None:
            t.add_row(name, "none", str(len(entry.tasks)), str(entry.horizon), "", "", "", "")
            continue
        variant = "yes" if catalog.variant_problem(f"{name}@base-inits") is None else "no"
        model = "same" if not summary.model_differs else ", ".join(summary.model_differs)
        wording = "same" if not summary.wording_differs else f"differs ({summary.wording_differs}/{summary.tasks})"
        t.add_row(name, entry.perturbation, str(len(entry.tasks)), str(entry.horizon),
                  f"{summary.init_states_equal}/{summary.init_states_compared}", model, wording, variant)
    note = Text(f"{len(catalog.unavailable)} more suites and task folders cannot run here "
                "(`rescue catalog SUITE` says why for one; catalog_libero.json lists them).")
    return Group(t, note)


def _suite_tasks(catalog: Any, name: str) -> Group:
    """One suite: how it pairs with its base, then per task its base task, initial states, model and words."""
    entry = catalog.suite(name)
    if entry is None:
        return Group(Text(catalog.refusal(name) or f"unknown suite {name!r}; {catalog.hint(name)}"))
    pairing = catalog.pairing(name)
    head = Text(f"{name}: base {entry.base}, perturbation {entry.perturbation}, H {entry.horizon}, "
                f"instruction from {entry.instruction_source}" + (f"\n{pairing}" if pairing else ""))
    t = Table(title=f"{name} tasks")
    for column in ("task", "base task", "initial states = base's", "model vs base", "instruction", "task.language"):
        t.add_column(column)
    for i, task in enumerate(entry.tasks):
        v = task.versus_base
        t.add_row(str(i), "" if v is None else f"{v.base_task} ({v.matched_by})",
                  f"{task.init_states}" if v is None else f"{v.init_states_equal}/{v.init_states_compared}",
                  "" if v is None else ("same" if not v.model_differs else ", ".join(v.model_differs)),
                  task.instruction, task.task_language or "")
    return Group(head, t)
