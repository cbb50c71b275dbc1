"""A VLM call's question and answers: the request, the answer schema, parsing and checking (pure).

Each answer must echo our request id and per-request token; a batched call gets one
answer per request, matched by id.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from rescue.core.images import VLM_VIEWS
from rescue.core.records import Answer, Receipt


@dataclass
class SubgoalRequest:
    """One case's question: its instruction, step budget and the three current views."""

    case_id: str
    instruction: str
    remaining_steps: int
    views: dict[str, np.ndarray]
    arm: str | None = None  # the arm asking (`assisted@early`), recorded in the call's receipts; None: not said

    def __post_init__(self) -> None:
        if set(self.views) != set(VLM_VIEWS):
            raise ValueError(f"views must be exactly {VLM_VIEWS}, got {sorted(self.views)}")
        for name, view in self.views.items():
            if not (isinstance(view, np.ndarray) and view.dtype == np.uint8 and view.ndim == 3 and view.shape[2] == 3):
                raise ValueError(f"view {name} must be a uint8 HxWx3 array")


class SubgoalAnswer(Answer):
    """What a VLM call gave one case (an `Answer` of source `vlm`), with the call's outcome receipt itself."""

    call_id: str
    """Our id of the call."""
    request_id: str
    """Our id of this case's request within the call."""
    receipt: Receipt | None = None
    """The call's outcome receipt; None when none was written."""


class AnswerItem(BaseModel):
    """One answer of the structured output."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    token: str
    subgoal: str


class AnswerSheet(BaseModel):
    """The structured output: one answer per request, in row order."""

    model_config = ConfigDict(extra="forbid")

    answers: list[AnswerItem]


class DecliningItem(BaseModel):
    """One answer of an advisor that may decline (DESIGN §18): keep the instruction, or a subgoal."""

    model_config = ConfigDict(extra="forbid")

    request_id: str
    token: str
    keep_instruction: bool
    subgoal: str


class DecliningSheet(BaseModel):
    """The structured output of an advisor that may decline: one answer per request, in row order."""

    model_config = ConfigDict(extra="forbid")

    answers: list[DecliningItem]


def answer_schema(tokens: dict[str, str], may_decline: bool = False) -> dict[str, Any]:
    """The JSON schema of `AnswerSheet` (of `DecliningSheet` for an advisor that may decline), narrowed to exactly
    these request ids and tokens."""
    sheet = DecliningSheet if may_decline else AnswerSheet
    schema = sheet.model_json_schema()
    item = schema["$defs"]["DecliningItem" if may_decline else "AnswerItem"]
    item["additionalProperties"] = False
    item["properties"]["request_id"]["enum"] = list(tokens)
    item["properties"]["token"]["enum"] = list(tokens.values())
    schema["additionalProperties"] = False
    schema["properties"]["answers"]["minItems"] = len(tokens)
    schema["properties"]["answers"]["maxItems"] = len(tokens)
    return schema


class InvalidResponse(Exception):
    """The body arrived but cannot be read as answers."""


_LINE = re.compile(r"^\s*(REQUEST_ID|TOKEN|SUBGOAL|KEEP_INSTRUCTION)\s*:\s*(.*?)\s*$", re.IGNORECASE)


def _json_object(text: str) -> Any | None:
    candidates = [text]
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.DOTALL)
    if fenced:
        candidates.append(fenced.group(1))
    if "{" in text and "}" in text:
        candidates.append(text[text.index("{") : text.rindex("}") + 1])
    for c in candidates:
        try:
            return json.loads(c)
        except ValueError:
            continue
    return None


def _items_from_json(obj: Any) -> list[dict[str, Any]]:
    if isinstance(obj, dict) and isinstance(obj.get("answers"), list):
        items = obj["answers"]
    elif isinstance(obj, dict) and "subgoal" in obj:
        items = [obj]
    else:
        raise InvalidResponse("JSON answer has neither `answers` nor `subgoal`")
    if not all(isinstance(i, dict) for i in items):
        raise InvalidResponse("an answer is not a JSON object")
    return items


def parse_answers(text: str, structured: bool, may_decline: bool = False) -> list[dict[str, Any]]:
    """Read answers from a reply: strict JSON when structured, else JSON or `SUBGOAL:` (and `KEEP_INSTRUCTION:`)
    lines."""
    if structured:
        sheet = DecliningSheet if may_decline else AnswerSheet
        try:
            return [a.model_dump() for a in sheet.model_validate_json(text).answers]
        except ValidationError as exc:
            raise InvalidResponse(f"structured output does not match the schema: {exc.errors()[0]['msg']}") from None
    obj = _json_object(text.strip())
    if obj is not None:
        return _items_from_json(obj)
    items: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        key, value = m.group(1).lower(), m.group(2)
        if key == "request_id" or key in current:
            # A new request id, or a repeated field, starts another answer.
            if current:
                items.append(current)
            current = {"request_id": current.get("request_id")} if key != "request_id" else {}
        current[key] = value
    if current:
        items.append(current)
    if not items:
        raise InvalidResponse("reply holds neither a JSON object nor a SUBGOAL line")
    return items


def keeps(item: dict[str, Any]) -> bool:
    """Whether an answer says "keep the instruction" (a JSON true, or a line `KEEP_INSTRUCTION: yes`/`true`)."""
    value = item.get("keep_instruction")
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes")
    return value is True


def check_answers(
    items: list[dict[str, Any]], tokens: dict[str, str], max_chars: int, may_decline: bool = False
) -> tuple[dict[str, str | None], dict[str, str]]:
    """Match answers to request ids; return (subgoal or None, reason) per request id. With `may_decline`, an answer
    that keeps the instruction is valid without a subgoal: its subgoal is None and it has no reason."""
    by_id: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for item in items:
        by_id[item.get("request_id")].append(item)
    stray = sorted(str(k) for k in by_id if k not in tokens)
    subgoals: dict[str, str | None] = {}
    errors: dict[str, str] = {}
    for rid, token in tokens.items():
        got = by_id.get(rid, [])
        subgoal = got[0].get("subgoal") if len(got) == 1 else None
        if not got:
            errors[rid] = "no answer carries this request id" + (f" (unknown ids: {', '.join(stray)})" if stray else "")
        elif len(got) > 1:
            errors[rid] = f"{len(got)} answers for one request"
        elif got[0].get("token") != token:
            errors[rid] = "token does not match the request's token"
        elif may_decline and keeps(got[0]):
            subgoals[rid] = None
            continue
        elif not isinstance(subgoal, str) or not subgoal.strip():
            errors[rid] = "subgoal is empty"
        elif len(subgoal.strip()) > max_chars:
            errors[rid] = f"subgoal has {len(subgoal.strip())} characters, more than {max_chars}"
        if rid in errors:
            subgoals[rid] = None
        else:
            subgoals[rid] = subgoal.strip()
    return subgoals, errors
