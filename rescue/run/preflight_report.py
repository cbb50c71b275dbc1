"""What preflight found: one verdict per check, and the report a study should not start without."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

CheckVerdict = Literal["pass", "warn", "fail"]


class Check(BaseModel):
    """One preflight check and what it found."""

    name: str
    verdict: CheckVerdict
    detail: str


class PreflightReport(BaseModel):
    """Every check's verdict; a study should not start unless `ok`."""

    checks: list[Check]
    policy_url: str | None = None
    policy_rng_control: bool | None = None  # None: never reached the server

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings do not fail)."""
        return bool(self.checks) and all(c.verdict != "fail" for c in self.checks)

    def render(self) -> str:
        """The policy server, one line per check, then the overall verdict."""
        control = {None: "unknown", True: "true", False: "false (prefix equality not guaranteed by the server)"}
        lines = [f"policy {self.policy_url or '(not reached)'}: policy_rng_control = {control[self.policy_rng_control]}"]
        lines += [f"{c.verdict.upper():4}  {c.name}: {c.detail}" for c in self.checks]
        lines.append("preflight: " + ("ok" if self.ok else "FAILED"))
        return "\n".join(lines)
