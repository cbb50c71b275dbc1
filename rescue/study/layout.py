"""The study folder: every file name a study holds, in one place.

No other module spells a file name of the study folder. Paths derived from a
case id are confined to the folder: a case id that would escape it (``..``,
an absolute path, a separator) is refused here even though the manifest
refuses such ids first.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# Where a study folder goes when the command names none (relative to the working directory);
# the service's queue (`rescue serve --queue`, default `queue/`) keeps its jobs' studies itself.
STUDIES = "studies"

# The lab's receipts folder (beside `studies/`): the ledger of budgeted studies' VLM calls (rescue/study/ledger.py).
LAB_RECEIPTS = "receipts"
LAB_LEDGER = "ledger.sqlite"

JOURNAL = "journal.sqlite"
MANIFEST = "manifest.jsonl"
CONFIG = "config.json"
RECEIPTS = "receipts/receipts.jsonl"  # relative: the receipts index stores it as written
VLM_ARTIFACTS = "vlm"
EVENTS = "events.jsonl"
SIMULATOR_LOG = "simulator.log"
POLICY_LOG = "policy.log"
FRAMES = "frames"
EXPORT_JSON = "export.json"
EXPORT_CSV = "export.csv"
REPORT = "report.html"
LOCK = ".owner.lock"
# The report's images, videos and raw records live beside it in one folder that travels with it.
REPORT_FILES_SUFFIX = "_files"


def report_files(report: str | os.PathLike[str]) -> Path:
    """The folder of a report's assets: `report.html` -> `report_files/` beside it."""
    path = Path(report)
    return path.with_name(path.stem + REPORT_FILES_SUFFIX)

# What a name derived from a case id, an arm or a keyframe may contain.
_SAFE_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@~-]{0,199}$")


class LayoutError(ValueError):
    """A path that would leave the study folder."""


def arm_file(arm: str) -> str:
    """An arm's name as a file name may hold it: a continuation's `#k` as `~k` (a `#` would end a link's path)."""
    return safe_part(arm.replace("#", "~"), "arm")


def safe_part(name: str, what: str = "name") -> str:
    """A single path component, or LayoutError when it could escape or confuse a file system."""
    if not _SAFE_PART.match(name) or ".." in name:
        raise LayoutError(f"{what} {name!r} is not a safe file name")
    return name


@dataclass(frozen=True)
class StudyLayout:
    """Where each file of one study folder lives."""

    root: Path

    @classmethod
    def of(cls, study_dir: str | os.PathLike[str]) -> StudyLayout:
        """The layout of the study folder at `study_dir`."""
        return cls(Path(study_dir))

    @property
    def journal(self) -> Path:
        return self.root / JOURNAL

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def receipts(self) -> Path:
        return self.root / RECEIPTS

    def receipts_file(self, name: str) -> Path:
        """A receipts file named (relative to the study) in the receipts index, confined to the study."""
        parts = Path(name).parts
        if Path(name).is_absolute() or not parts:
            raise LayoutError(f"receipts file {name!r} is not relative to the study folder")
        for part in parts:
            safe_part(part, "receipts path component")
        return self.root.joinpath(*parts)

    @property
    def vlm_artifacts(self) -> Path:
        return self.root / VLM_ARTIFACTS

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def simulator_log(self) -> Path:
        return self.root / SIMULATOR_LOG

    @property
    def policy_log(self) -> Path:
        """The output of the policy processes (when the in-process policy is served from processes of its own)."""
        return self.root / POLICY_LOG

    @property
    def frames(self) -> Path:
        return self.root / FRAMES

    def keyframe(self, case_id: str, arm: str, name: str) -> Path:
        """The PNG of one keyframe of one arm of one case."""
        folder = safe_part(case_id, "case id")
        file = f"{arm_file(arm)}-{safe_part(name, 'keyframe name')}.png"
        return self.frames / folder / file

    @property
    def export_json(self) -> Path:
        return self.root / EXPORT_JSON

    @property
    def export_csv(self) -> Path:
        return self.root / EXPORT_CSV

    @property
    def report(self) -> Path:
        return self.root / REPORT

    @property
    def lock(self) -> Path:
        return self.root / LOCK

    def is_study(self) -> bool:
        """Whether the folder holds a study (its journal exists)."""
        return self.journal.is_file()
