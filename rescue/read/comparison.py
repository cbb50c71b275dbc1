"""Reading a comparison's figures (`comparison.json`, written by `rescue compare`) of this version or an earlier one."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from rescue.core.figures.comparison import COMPARISON_SCHEMA, Comparison
from rescue.read.legacy import upgrade_comparison
from rescue.study.folder import StudyError

# Every version `read_comparison` reads; None: a document written before the format was versioned.
READABLE_COMPARISONS = (COMPARISON_SCHEMA, "rescue-comparison/1", None)


class ComparisonError(StudyError):
    """A file that is not a readable comparison document."""


def read_comparison(path: str | os.PathLike[str]) -> Comparison:
    """A comparison document as `rescue compare` wrote it, in today's shape whatever its version (it keeps its
    version in `schema_version`); ComparisonError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ComparisonError(f"{path}: not a readable comparison ({exc})") from None
    version = data.get("schema_version") if isinstance(data, dict) else COMPARISON_SCHEMA
    if not isinstance(data, dict) or version not in READABLE_COMPARISONS:
        readable = ", ".join(v for v in READABLE_COMPARISONS if v)
        raise ComparisonError(f"{path}: comparison schema {version!r}; this version reads {readable}")
    try:
        return Comparison.model_validate(upgrade_comparison(data) if version != COMPARISON_SCHEMA else data)
    except (ValidationError, KeyError, TypeError) as exc:
        raise ComparisonError(f"{path}: not a {version or 'rescue-comparison/1'} document ({exc})") from None
