"""A small study to profile with a sampling profiler (py-spy), simulator processes included.

Run:
  .venv/bin/pip install py-spy
  MUJOCO_GL=egl .venv/bin/py-spy record --subprocesses --format raw -o /tmp/study.folded -- \\
      .venv/bin/python benchmarks/profile_study.py
  .venv/bin/python benchmarks/profile_study.py --top /tmp/study.folded
The second command prints the functions with the most samples at the top of the stack (self time)
and the project functions with the most samples anywhere in the stack (inclusive time).
"""

from __future__ import annotations

import sys
from collections import Counter

from common import cases, timed_study

from rescue.core.config import StudyConfig


def top(path: str, k: int = 15) -> None:
    """Summarise py-spy's folded stacks: self samples per frame and inclusive samples per project frame."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in open(path, encoding="utf-8"):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            if "rescue/" in frame or "wrappers/" in frame:
                inclusive[frame] += n
    print(f"{total} samples")
    print("self time:")
    for frame, n in own.most_common(k):
        print(f"  {100 * n / total:5.1f}%  {frame}")
    print("inclusive time, project frames:")
    for frame, n in inclusive.most_common(k):
        print(f"  {100 * n / total:5.1f}%  {frame}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--top":
        top(sys.argv[2])
    else:
        print(f"{timed_study(cases(4, 160), StudyConfig()):.1f} s")
