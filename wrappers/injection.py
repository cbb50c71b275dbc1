"""The assisted arm's instruction: the original task plus one VLM subgoal (DESIGN §2)."""

from __future__ import annotations

_HEAD = "\nImmediate next actions: "
_TAIL = "\nThen complete the original task."


def inject(original: str, subgoal: str) -> str:
    """Return the instruction the policy sees from the query point on."""
    step = subgoal.strip()
    if not step:
        raise ValueError("subgoal is empty after strip")
    return original + _HEAD + step + _TAIL


def parse_injection(instruction: str) -> tuple[str, str | None]:
    """Split an instruction into (original, subgoal); subgoal is None if nothing was injected."""
    # Benchmark instructions are single lines, so the first marker is the seam;
    # the round trip below rejects anything inject() could not have produced.
    cut = instruction.find(_HEAD)
    if cut < 0 or not instruction.endswith(_TAIL):
        return instruction, None
    original = instruction[:cut]
    subgoal = instruction[cut + len(_HEAD) : len(instruction) - len(_TAIL)]
    if not subgoal.strip() or inject(original, subgoal) != instruction:
        return instruction, None
    return original, subgoal
