"""A test tier's wall time against the last recorded one, from the log of a run.

    SKIP_SETUP=1 bash scripts/test.sh slow 2>&1 | tee slow.log
    .venv/bin/python benchmarks/tier_time.py slow slow.log

It reads pytest's closing line ("N passed ... in S s") and the ten longest modules the run printed, and says
the tier's time as a ratio of the figure recorded in RECORDED below (docs/benchmarks.md, "The test tiers").
The ratio is what to compare across machines: the same tier took twice as long on one 2-core machine as on
another, so a change is measured side by side, not against an absolute figure.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# The last recorded wall time of each tier, with its command, commit and date (docs/benchmarks.md, and earlier rounds in
# docs/benchmarks-history.md).
RECORDED = {
    "slow": {"seconds": 1465.1, "tests": 304, "commit": "7090cdd", "date": "2026-12-05",
             "command": "SKIP_SETUP=1 bash scripts/test.sh slow -q"},
    "fast": {"seconds": 52.2, "tests": 847, "commit": "fb878a3", "date": "2026-12-05",
             "command": "CI=true bash .ci/run (its fast tier)"},
}
_CLOSING = re.compile(r"(\d+) passed.* in ([0-9.]+)s")
_MODULE = re.compile(r"^\s*([0-9.]+)\s+(tests/\S+\.py)$")


def read_log(text: str) -> tuple[int, float, list[tuple[float, str]]]:
    """Tests passed, the tier's wall seconds, and the longest modules the run printed, from a pytest log."""
    lines = text.splitlines()
    closing = [i for i, line in enumerate(lines) if _CLOSING.search(line)]
    if not closing:
        raise ValueError("no closing line of pytest ('N passed in S s') in the log")
    last = _CLOSING.search(lines[closing[-1]])
    passed, seconds = int(last.group(1)), float(last.group(2))
    # The modules the last run printed: between the closing line before it (another tier's, in .ci/run's log) and it.
    since = closing[-2] + 1 if len(closing) > 1 else 0
    modules = [(float(m.group(1)), m.group(2)) for m in map(_MODULE.match, lines[since:closing[-1]]) if m]
    return passed, seconds, modules


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in RECORDED:
        print(f"usage: tier_time.py {{{','.join(RECORDED)}}} LOG", file=sys.stderr)
        return 2
    tier, log = argv
    try:
        passed, seconds, modules = read_log(Path(log).read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError) as exc:
        print(f"tier_time.py: {log}: {exc}", file=sys.stderr)
        return 2
    last = RECORDED[tier]
    print(f"{tier} tier: {passed} passed in {seconds:.0f} s; recorded {last['tests']} in {last['seconds']:.0f} s "
          f"({last['commit']}, {last['date']}): ratio {seconds / last['seconds']:.2f}")
    for took, module in modules:
        print(f"{took:8.1f}  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
