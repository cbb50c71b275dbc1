"""After a crash, a kill or a drain: started-unfinished cases recorded unknown, and the never-claimed complement.

Nothing started is ever run again: resume settles what was claimed, a continuation runs what never was.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from rescue.core.configuration.config import StudyConfig
from rescue.core.manifest import Case
from rescue.study.folder import (
    SHAM_DONORS_KEY,
    classify_case,
    load_study_config,
    outcome_receipts,
)
from rescue.study.journal import Journal
from rescue.study.layout import StudyLayout

log = structlog.get_logger(__name__)


def settle(journal: Journal, config: StudyConfig, receipts_path: Path, reason: str = "interrupted") -> list[str]:
    """Give every unsettled case its final state and verdict: a claimed case becomes `interrupted`,
    `unknown` (rule 2), and so does one a recovery left interrupted without a verdict. One
    transaction per case, so a recovery stopped half-way (a full disk, a kill) leaves every case
    either settled or still to settle, and running it again finishes the job. Returns their ids."""
    ids = journal.unsettled_ids()
    if not ids:
        return []
    receipts = outcome_receipts(receipts_path)
    donors = dict(journal.meta().get(SHAM_DONORS_KEY) or {})
    for case_id in ids:
        case = journal.case(case_id)
        verdict = classify_case(config, case, journal.arms(case_id), receipts, interrupted=True, donors=donors)
        journal.interrupt(case_id, verdict, reason)
        log.info("case.classified", case_id=case_id, label=verdict.label, rule=verdict.rule, reason=reason)
    return ids


def recover(study_dir: Path, reason: str = "interrupted") -> list[str]:
    """Turn started-unfinished cases into `unknown` (with `reason`); return their ids."""
    layout = StudyLayout.of(study_dir)
    config = load_study_config(layout.root)
    journal = Journal.open(layout.root)
    try:
        return settle(journal, config, layout.receipts, reason)
    finally:
        journal.close()


def complement_manifest(prior_study: Path) -> list[Case]:
    """The never-claimed cases of a prior study, in manifest order (a continuation's cohort)."""
    journal = Journal.open(prior_study)
    try:
        pending = set(journal.pending_ids())
        return [c for c in journal.cases() if c.case_id in pending]
    finally:
        journal.close()
