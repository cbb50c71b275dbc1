"""Every persisted record is its documentation: a docstring under every field, published schemas current."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Literal, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rescue.core.figures.comparison import Comparison
from rescue.core.configuration.config import StudyConfig
from rescue.core.manifest import Case
from rescue.core.records import ArmResult, CaseRecord, Receipt
from rescue.core.verdicts import Verdict
from rescue.core.figures.stats import Summary
from rescue.read import schemas
from rescue.read.export import StudyExport
from rescue.read.lab_usage import LabUsage
from rescue.run.commands import Ablation
from rescue.run.compare import ComparePlan
from rescue.service.queue import JobSpec, JobState
from rescue.study.usage import UsageSummary

pytestmark = pytest.mark.fast

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "docs" / "schemas"

# The models written to a study folder (config, manifest, journal rows and meta, receipts),
# a queue job or an export; every model they hold is reached through their field types.
PERSISTED: tuple[type[BaseModel], ...] = (
    StudyConfig, Case, ArmResult, Verdict, Receipt, Summary, CaseRecord, StudyExport, UsageSummary, JobSpec, JobState,
    ComparePlan, Comparison, Ablation, LabUsage,
)


def undocumented(roots: tuple[type, ...], seen: set[type] | None = None) -> list[str]:
    """`Model.field` of every field without a description, in the roots and every model their fields hold.

    `seen`, when given, collects every model and dataclass walked.
    """
    seen = set() if seen is None else seen
    missing: list[str] = []

    def visit_type(tp: object, owner: type[BaseModel]) -> None:
        origin = get_origin(tp)
        if origin is Literal:
            return
        if origin is Annotated:
            visit_type(get_args(tp)[0], owner)
            return
        for arg in get_args(tp):  # list, dict, tuple, Optional and Union members
            visit_type(arg, owner)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            visit_model(tp)
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            visit_dataclass(tp, owner)

    def visit_model(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            if not (field.description or "").strip():
                missing.append(f"{model.__qualname__}.{name}")
            visit_type(field.annotation, model)

    def visit_dataclass(cls: type, owner: type[BaseModel]) -> None:
        # A plain dataclass has its descriptions from the config of the model holding it: read them there.
        if cls in seen:
            return
        seen.add(cls)
        defs = owner.model_json_schema(mode="serialization").get("$defs", {})
        props = next((d.get("properties", {}) for d in defs.values() if d.get("title") == cls.__name__), {})
        hints = get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not (props.get(field.name, {}).get("description") or "").strip():
                missing.append(f"{cls.__qualname__}.{field.name}")
            visit_type(hints[field.name], owner)

    for root in roots:
        visit_model(root)
    return sorted(set(missing))


def test_every_field_of_every_persisted_model_is_documented():
    missing = undocumented(PERSISTED)
    assert not missing, "fields without a docstring (one under each, and use_attribute_docstrings=True): " + ", ".join(missing)


def test_the_walk_reaches_the_models_the_roots_hold():
    seen: set[type] = set()
    undocumented(PERSISTED, seen)
    names = {cls.__name__ for cls in seen}
    # Held in a list, a dict, an Optional, a subclass's parent fields, a plain dataclass.
    assert {"TraceRow", "QueryRecord", "ReceiptRef", "Usage", "Coverage", "Breakdown", "TokenTally",
            "ArmFigures", "PairedComparison", "VLMConfig", "ShamConfig", "RulesConfig", "ActionLayout", "EpisodeRow"} <= names


@dataclasses.dataclass
class _Layout:
    documented: int = 0
    """A documented dataclass field."""
    bare: int = 0


class _Inner(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    documented: int = 0
    """A documented field."""
    bare: int = 0


class _NoConfig(BaseModel):
    # Docstrings without use_attribute_docstrings never reach the schema.
    hidden: int = 0
    """Written, but pydantic does not read it."""


class _Outer(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    inner: dict[str, list[_Inner | None]] = Field(default_factory=dict)
    """Nested in containers and an Optional."""
    plain: _NoConfig | int = 0
    """A Union member."""
    layout: _Layout = Field(default_factory=_Layout)
    """A dataclass."""


def test_the_check_fails_on_an_undocumented_field():
    assert undocumented((_Outer,)) == ["_Inner.bare", "_Layout.bare", "_NoConfig.hidden"]


def test_the_published_schemas_are_current():
    assert sorted(p.name for p in SCHEMA_DIR.glob("*.json")) == sorted(schemas.SCHEMAS)
    assert schemas.stale_files(SCHEMA_DIR) == [], f"run `{schemas.COMMAND}`"


def test_the_schema_check_names_a_stale_file(tmp_path, capsys):
    schemas.write_schemas(tmp_path)
    assert schemas.main(["--check", "--out", str(tmp_path)]) == 0
    arm = tmp_path / "arm.schema.json"
    arm.write_text(arm.read_text(encoding="utf-8").replace('"description"', '"Description"', 1), encoding="utf-8")
    (tmp_path / "receipt.schema.json").unlink()
    assert schemas.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "arm.schema.json: stale" in err and "receipt.schema.json: stale" in err
    assert "export.schema.json" not in err


def test_a_schema_is_its_model_with_descriptions():
    schema = json.loads(schemas.schema_text(ArmResult))
    assert schema["properties"]["steps"]["description"] == ArmResult.model_fields["steps"].description
    assert "api_key" not in json.loads(schemas.schema_text(StudyConfig))["$defs"]["VLMConfig"]["properties"]


def test_a_job_spec_written_before_its_version_loads_as_version_1():
    old = {"job_id": "job-1", "name": "n", "submitted_at": 1.0, "cases": 2, "manifest_sha256": "a", "config_sha256": "b"}
    spec = JobSpec.model_validate_json(json.dumps(old))
    assert spec.schema_version == 1
    assert json.loads(spec.model_dump_json())["schema_version"] == 1
    with pytest.raises(ValidationError):
        JobSpec.model_validate_json(json.dumps({**old, "schema_version": 2}))
