"""`module:attr` names, resolved in one place, including the names modules had before they moved.

Studies store factory strings (`[policy] factory`, `[env] adapter`) in their configuration, and
the configuration's sha256 is part of their identity; a study created before the package was
laid out in floors names modules that have moved since. Those strings stay as they were written
(the digest holds, the policy server announces the name the study gave it); only resolving them
goes through this table.
"""

from __future__ import annotations

import pkgutil
from typing import Any

# The policy served on loopback when none is named (`[policy] factory`, `rescue serve-policy`, the demo):
# the embedded vision-language policy.
EMBEDDED_POLICY = "rescue.embedded.vision_language:make_policy"

# Where each module lived before the package was laid out in floors, or before it was renamed -> where it lives now.
MOVED: dict[str, str] = {
    "rescue.querypoint": "rescue.core.querypoint",
    "rescue.digest": "rescue.core.digest",
    "rescue.classify": "rescue.core.classify",
    "rescue.stats": "rescue.core.figures.stats",
    "rescue.proofs": "rescue.core.proofs",
    "rescue.prompts": "rescue.core.prompts",
    "rescue.identity": "rescue.core.configuration.identity",
    "rescue.catalog": "rescue.core.catalog",
    "rescue.manifest": "rescue.core.manifest",
    "rescue.records": "rescue.core.records",
    "rescue.observation": "rescue.core.observation",
    "rescue.sham": "rescue.core.sham",
    "rescue.failfast": "rescue.core.failfast",
    "rescue.evaluation": "rescue.core.figures.evaluation",
    "rescue.config": "rescue.core.configuration.config",
    "rescue.vlm.settings": "rescue.core.configuration.vlm_config",
    "rescue.layout": "rescue.study.layout",
    "rescue.journal": "rescue.study.journal",
    "rescue.study": "rescue.study.folder",
    "rescue.owner": "rescue.study.owner",
    "rescue.files": "rescue.study.files",
    "rescue.logs": "rescue.study.logs",
    "rescue.vlm.receipts": "rescue.study.receipts",
    "rescue.vlm.usage": "rescue.study.usage",
    "rescue.status": "rescue.read.status",
    "rescue.export": "rescue.read.export",
    "rescue.verify": "rescue.read.verify",
    "rescue.report": "rescue.read.terminal",
    "rescue.htmlreport": "rescue.read.html.report",
    "rescue.report_html.cases": "rescue.read.html.cases",
    "rescue.report_html.page": "rescue.read.html.render",
    "rescue.report_html.plots": "rescue.read.html.plots",
    "rescue.report_html.reading": "rescue.read.html.significance",
    "rescue.report_html.video": "rescue.read.html.video",
    "rescue.report_html": "rescue.read.html",
    "rescue.arm": "rescue.run.arm",
    "rescue.engine": "rescue.run.engine",
    "rescue.services": "rescue.run.peers",
    "rescue.studies": "rescue.run.commands",
    "rescue.preflight": "rescue.run.preflight",
    "rescue.compare": "rescue.run.compare",
    "rescue.diagnose": "rescue.run.diagnose",
    "rescue.policy.ws_client": "rescue.policy.client",
    "rescue.policy.ws_server": "rescue_serve.server",
    "rescue.policy.server": "rescue_serve.server",
    "rescue.policy.msgpack_numpy": "rescue_serve.msgpack_numpy",
    "rescue.policy.expert": "rescue.embedded.expert",
    "rescue.policy.learned": "rescue.embedded.learned",
    "rescue.policy.locator": "rescue.embedded.locator",
    "rescue.policy.phases": "rescue.embedded.phases",
    "rescue.policy.scripted": "rescue.embedded.scripted",
    "rescue.policy.variants": "rescue.embedded.variants",
    "rescue.policy.vision_language": "rescue.embedded.vision_language",
    "rescue.vlm.endpoint": "rescue.embedded.endpoint",
    "rescue.vlm.advisor": "rescue.embedded.decision",
    "rescue.vlm.vision": "rescue.embedded.subgoal_model",
    # The core's rooms: its configuration and its figures have folders of their own.
    **{f"rescue.core.{m}": f"rescue.core.configuration.{m}"
       for m in ("config", "vlm_config", "config_files", "schema", "identity", "names")},
    **{f"rescue.core.{m}": f"rescue.core.figures.{m}"
       for m in ("stats", "exact_stats", "comparison", "harm_figures", "harm", "success_sample", "evaluation",
                 "baseline", "continuations", "robustness")},
    # Renamed beside a namesake on another floor (core/configuration/config.py, run/compare.py).
    "rescue.service.config": "rescue.service.settings",
    "rescue.read.html.compare": "rescue.read.html.side_by_side",
    # "wire" is the policy's protocol (rescue_serve.wire); a VLM call's request and reply are an exchange.
    "rescue.vlm.wire": "rescue.vlm.exchange",
}


def current_module(module: str) -> str:
    """A module's current dotted name, given a name it may have had before it moved."""
    for old in sorted(MOVED, key=len, reverse=True):
        if module == old or module.startswith(old + "."):
            return MOVED[old] + module[len(old):]
    return module


def resolve(spec: str) -> Any:
    """The object a `module:attr` (or `module.attr`) name refers to, old module names included."""
    module, sep, attr = spec.partition(":")
    return pkgutil.resolve_name(current_module(module) + sep + attr)
