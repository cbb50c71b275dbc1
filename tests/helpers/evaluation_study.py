"""An evaluation study as `rescue eval` leaves one: libero_object tasks 3 and 4, initial states 0-4, the chosen
episodes successful."""

from __future__ import annotations

from pathlib import Path

from conftest import resolved_config

from rescue.core.digest import digest_text
from rescue.core.figures.evaluation import episode_cases
from rescue.core.manifest import parse_manifest
from rescue.core.records import ArmResult, Assistance
from rescue.study.folder import classify_case, create_study
from rescue.study.journal import Journal


def evaluation_study(folder: Path, succeed: set[str]) -> Path:
    """An evaluation of libero_object tasks 3 and 4, initial states 0-4, by the embedded policy's factory."""
    cases = episode_cases("libero_object", [3, 4], 5, 280)
    data = "".join(c.model_dump_json(exclude_none=True) + "\n" for c in cases).encode()
    config = resolved_config(8, arms=("control",), policy={"factory": "my_lab.policies:pi05_libero"})
    create_study(folder, parse_manifest(data, "episodes.jsonl"), config)
    with Journal.open(folder) as journal:
        for case in cases:
            assert journal.claim(case.case_id, "w0")
            ok = case.case_id in succeed
            arm = ArmResult(case_id=case.case_id, arm="control", status="complete", success=ok, steps=120 if ok else 280,
                            fingerprint=digest_text(case.case_id), assistance=Assistance(status="control"))
            verdict = classify_case(config, case, {"control": arm}, {}, interrupted=False)
            journal.finish_case(case.case_id, [arm], verdict, None)
    return folder
