"""Stop a study that fails for one infrastructure reason, before it burns its cohort (pure).

When the first K arms of a study all end in the same infrastructure error
(the policy lacks an observation key, the server refuses connections) or the
first K assisted arms all get the same systematic VLM error (401, 403, a
model that does not exist, no quota), running the rest would only turn every
case into `unknown`. The study stops claiming instead; the cases that ran
keep their results (no retries), and `rescue resume` after the fix runs the
never-claimed ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rescue.core.records import ArmResult
from rescue.core.arms import continuation, is_assisted

# VLM error kinds that no retry and no other case can fix.
SYSTEMATIC_VLM_ERRORS = frozenset({"auth", "permission", "not_found", "quota", "connection", "model_mismatch"})

_FIXES = {
    "KeyError": "the policy reads an observation key the study's observation profile does not send: "
    "choose the profile it was trained with ([policy] observation = \"openpi-libero\", \"lerobot-libero\" or \"privileged\")",
    "BadActionChunk": "the policy answers actions the simulator cannot run (rescue/core/actions.py says which): "
    "check its output (un-normalisation, action dimensions) and that the URL serves the policy meant",
    "ConnectionRefusedError": "start the policy server, or fix [policy] url",
    "PolicyConnectionClosed": "check that the policy server is up and keeps connections open",
    "auth": "the VLM endpoint rejects the API key: set the variable named by [vlm] api_key_env",
    "permission": "the VLM API key may not use this model or endpoint",
    "not_found": "the VLM endpoint does not know the model or path: fix [vlm] model or [vlm] base_url",
    "quota": "the VLM account is out of quota",
    "connection": "the VLM endpoint cannot be reached: fix [vlm] base_url",
    "model_mismatch": "the VLM endpoint answers as another model than [vlm] model: fix [vlm] base_url (is another "
    "server on that port?) or [vlm] model; behind a proxy that renames models, set [vlm] require_model_match = false",
}


class PeerUnreachable(RuntimeError):
    """A peer the study needs (policy server, VLM endpoint) does not answer, or refuses us, before
    the first claim: the command stops with nothing run (exit 3), naming the URL and the fix."""


def one_line(text: str) -> str:
    """One line that names an error: the exception line of a traceback, else the first line."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        return lines[-1]
    return lines[0]


def error_line(exc: BaseException) -> str:
    """How an arm record names the exception it ended in: its kind, then its one line.

    The kind is the exception's class name, or its `arm_error_kind` when it has one
    (a lost Ray worker says `worker_lost`)."""
    return f"{getattr(exc, 'arm_error_kind', type(exc).__name__)}: {one_line(str(exc))}"


# The same failure at another step is the same cause: a policy that answers NaN does so wherever it is.
_STEP = re.compile(r"\bstep \d+")


def arm_cause(arm: ArmResult) -> str | None:
    """The infrastructure error an arm ended in, as a comparable one-line signature (None: it ran);
    the step it happened at is left out (`step N`)."""
    if arm.status == "error" and arm.error:
        return _STEP.sub("step N", one_line(arm.error))
    return None


def vlm_cause(arm: ArmResult) -> str | None:
    """The systematic VLM error an assisted arm's single call ended in (None: none, or a passing one)."""
    a = arm.assistance
    if is_assisted(arm.arm) and a.error_kind in SYSTEMATIC_VLM_ERRORS:
        return f"VLM {a.error_kind}: {one_line(a.error or '')}"
    return None


def fix_for(cause: str) -> str:
    """A hint at the fix for a cause, when one is known."""
    for key, fix in _FIXES.items():
        if key in cause:
            return fix
    return "fix the cause"


@dataclass
class FailFast:
    """Watches the first K arms (and the first K VLM calls of each advisor's assisted arm) of a study."""

    k: int = 3
    arms: list[str | None] = field(default_factory=list)
    # By assisted arm: a study of several advisors (DESIGN §11) stops when one advisor's first K calls fail alike.
    calls: dict[str, list[str | None]] = field(default_factory=dict)

    def observe(self, results: list[ArmResult]) -> str | None:
        """Record a finished case's arms; the shared cause once the first K all failed alike, else None."""
        if self.k <= 0:
            return None
        for arm in results:
            if len(self.arms) < self.k:
                self.arms.append(arm_cause(arm))
            # An arm's continuations share its one call: only the first's counts.
            asked = is_assisted(arm.arm) and continuation(arm.arm) == 1 and arm.status == "complete"
            calls = self.calls.setdefault(arm.arm, []) if asked else None
            if calls is not None and len(calls) < self.k:
                calls.append(vlm_cause(arm))
        for name, seen in (("arms", self.arms), *((_calls_of(a), c) for a, c in self.calls.items())):
            if len(seen) == self.k and seen[0] is not None and all(c == seen[0] for c in seen):
                cause = seen[0]
                seen.append(None)  # say it once
                return (
                    f"the first {self.k} {name} all failed with "
                    f"{cause}; {fix_for(cause)}, then `rescue resume` runs the cases never started"
                )
        return None


def _calls_of(arm: str) -> str:
    return "VLM calls" if arm == "assisted" else f"VLM calls of {arm}"


def sampling_without_control(arms: list[ArmResult]) -> str | None:
    """Why a case's independent arms can never share a prefix, when they show it: without RNG control, the policy
    answered the first observation, the same in every arm, with different chunks (it samples). None otherwise."""
    firsts = [a.trace[0] for a in arms if a.trace and a.policy_rng_control is False]
    if len(firsts) < 2:
        return None
    same_input = len({(r.state, tuple(sorted(r.images.items())), r.instruction) for r in firsts}) == 1
    if same_input and len({r.actions for r in firsts}) > 1:
        return ("the policy server gives no RNG control and answered the same first observation differently in the "
                "case's arms (a policy that samples): independent replays of it never share a prefix; run the study "
                "again with fork_at_q unset or true (the default for such a server: every arm continues from one "
                "snapshot at q), or serve the policy with RNG control (`rescue serve-policy`, docs/own-vla.md)")
    return None
