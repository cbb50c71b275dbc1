"""The report's templates: one jinja2 environment over `templates/`, shipped with the package.

Every value a template prints is escaped (autoescape), so text from a study (a subgoal, a reason, a
case id, a prompt) can never become markup; `None` prints as nothing. Numbers are formatted by the
filters below, the same everywhere: `pct` a share as a percentage, `ci` an interval, `p` a p-value,
`json` a value as the JSON the page's figures carry in `data-value`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from importlib import resources
from typing import Any

import jinja2
from markupsafe import Markup

from rescue.core.arms import is_assisted, shown
from rescue.read.harm_view import interval_text

def pct(x: float | None) -> str:
    """A share as a percentage with two decimals, or n/a."""
    return "n/a" if x is None else f"{100 * x:.2f}%"


def ci_text(ci: Any) -> str:
    """A confidence interval as two percentages, or n/a."""
    return "n/a" if ci is None else f"[{pct(ci[0])}, {pct(ci[1])}]"


def p_text(p: float) -> str:
    """A p-value: four decimals, or two significant digits below 0.001 (never 0.0000)."""
    return f"{p:.2g}" if p < 0.001 else f"{p:.4f}"


def ok_mark(x: bool | None) -> str:
    """A success as a tick or a cross; nothing when unknown."""
    return "" if x is None else ("\u2714" if x else "\u2718")


def _json(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def interval_json(ci: Any) -> str:
    """A net change's interval as `[low, high, exact]` JSON (`null` without one)."""
    return _json(None if ci is None else [ci.low, ci.high, ci.exact])


def arm_name(arm: str) -> str:
    """An arm as the tables name it: an advisor's arm by its advisor's name (a query point's with its `@name`)."""
    return shown(arm)


def pair_of(pairs: Iterable[Any], row: str, col: str) -> Any:
    """The comparison of two advisors (by name) in either order."""
    by = {(arm_name(q.first), arm_name(q.second)): q for q in pairs}
    return by.get((row, col)) or by.get((col, row))


def _helpers() -> dict[str, Any]:
    from rescue.core.figures.asking import way_name
    from rescue.core.figures.stats import LABELS, ranked
    from rescue.read.asking_view import duty_text, net_text, per_call_text
    from rescue.read.html.paths import path_plot
    from rescue.read.html.significance import significance_reading

    return {
        "LABELS": LABELS, "ranked": ranked, "significance_reading": significance_reading,
        "level": lambda confidence: f"{round(confidence * 100)}%",
        "arm_name": arm_name, "shown_keys": lambda by_arm: {shown(a): u for a, u in by_arm.items()}, "pair_of": pair_of,
        "any_sham": lambda rows: any(b.figures_of("sham") is not None for b in rows.values()),
        "infos_by_arm": lambda infos: {a.arm: a for a in infos or []}, "path_plot": path_plot, "static": static,
        "way_name": way_name, "duty_text": duty_text, "net_text": net_text, "per_call_text": per_call_text,
    }


@functools.cache
def environment() -> jinja2.Environment:
    """The templates' environment (autoescaped, strict about undefined names)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("rescue.read.html", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=lambda x: "" if x is None else x,
    )
    env.filters.update(pct=pct, ci=ci_text, p=p_text, ok=ok_mark, json=_json, arm_name=arm_name,
                       interval_text=interval_text, interval_json=interval_json)
    env.tests["assisted"] = is_assisted
    env.globals.update(_helpers())
    return env


def render(template: str, **context: Any) -> Markup:
    """A template rendered to markup (safe to place in another template)."""
    return Markup(environment().get_template(template).render(**context))


def macro(template: str, name: str, *args: Any, **kwargs: Any) -> str:
    """One macro of a template, called from Python (a panel, a table placed by code), as markup text."""
    return str(getattr(environment().get_template(template).module, name)(*args, **kwargs))


@functools.cache
def static(name: str) -> Markup:
    """A file of `templates/` taken as it is (the page's style sheet and script)."""
    return Markup(resources.files("rescue.read.html").joinpath("templates", name).read_text(encoding="utf-8"))
