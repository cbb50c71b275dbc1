"""The VLM client: one bounded subgoal per case, with a receipt for every attempt.

It speaks to any OpenAI-compatible endpoint through the `openai` SDK (Chat
Completions or Responses). Infrastructure failures (connection, timeout, 408,
409, 429, 5xx) are retried by `tenacity` with the SDK's own retries switched
off; a response that arrived but is unusable is never asked again (DESIGN §4).
Each answer must echo our request id and per-request token. Optionally several
waiting cases share one call: a contact sheet of their views, one answer each.

Every attempt leaves an `attempt_started` line before it is sent and an
`attempt` line when it ends; every call ends with one `outcome` line, which
lists the references of its attempt lines. With an artifacts folder the
client also keeps what the call saw (DESIGN §9): the PNGs as sent, the
rendered prompt and the raw response body, each named by its sha256 and
fsynced before the outcome line is written. The `openai` SDK must be 1.66.0
or newer (the first with `client.responses.create`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import random
import re
import secrets
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Literal

import numpy as np
import openai
import structlog
from PIL import Image
from pydantic import BaseModel, ConfigDict, ValidationError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
)

from rescue.prompts import Template, load_template, prompt_sha256, render
from rescue.records import Receipt, ReceiptRef, Usage
from rescue.vlm.limits import RequestLimiter
from rescue.vlm.receipts import ReceiptLog, artifact_path
from rescue.vlm.settings import VLMConfig

log = structlog.get_logger(__name__)

# The fixed camera order of every request and of every contact-sheet row.
VIEW_NAMES = ("agentview", "frontview", "robot0_eye_in_hand")

AnswerStatus = Literal["ok", "broker_error", "invalid_response", "timeout"]
_RECEIPT_STATUS = {"ok": "ok", "broker_error": "error", "invalid_response": "invalid_response", "timeout": "timeout"}


@dataclass
class SubgoalRequest:
    """One case's question: its instruction, step budget and the three current views."""

    case_id: str
    instruction: str
    remaining_steps: int
    views: dict[str, np.ndarray]

    def __post_init__(self) -> None:
        if set(self.views) != set(VIEW_NAMES):
            raise ValueError(f"views must be exactly {VIEW_NAMES}, got {sorted(self.views)}")
        for name, view in self.views.items():
            if not (isinstance(view, np.ndarray) and view.dtype == np.uint8 and view.ndim == 3 and view.shape[2] == 3):
                raise ValueError(f"view {name} must be a uint8 HxWx3 array")


class SubgoalAnswer(BaseModel):
    """What the VLM call gave one case, with the call's outcome receipt."""

    status: AnswerStatus
    subgoal: str | None = None
    call_id: str
    request_id: str
    error_kind: str | None = None
    error: str | None = None
    receipt: Receipt | None = None
    receipt_ref: ReceiptRef | None = None
    """Where the call's outcome line was written (file, line, sha256 of its bytes)."""


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


def answer_schema(tokens: dict[str, str]) -> dict[str, Any]:
    """The JSON schema of `AnswerSheet`, narrowed to exactly these request ids and tokens."""
    schema = AnswerSheet.model_json_schema()
    item = schema["$defs"]["AnswerItem"]
    item["additionalProperties"] = False
    item["properties"]["request_id"]["enum"] = list(tokens)
    item["properties"]["token"]["enum"] = list(tokens.values())
    schema["additionalProperties"] = False
    schema["properties"]["answers"]["minItems"] = len(tokens)
    schema["properties"]["answers"]["maxItems"] = len(tokens)
    return schema


# ---- answers: parse and check (pure) ------------------------------------------------


class InvalidResponse(Exception):
    """The body arrived but cannot be read as answers."""


_LINE = re.compile(r"^\s*(REQUEST_ID|TOKEN|SUBGOAL)\s*:\s*(.*?)\s*$", re.IGNORECASE)


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


def parse_answers(text: str, structured: bool) -> list[dict[str, Any]]:
    """Read answers from a reply: strict JSON when structured, else JSON or `SUBGOAL:` lines."""
    if structured:
        try:
            return [a.model_dump() for a in AnswerSheet.model_validate_json(text).answers]
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


def check_answers(
    items: list[dict[str, Any]], tokens: dict[str, str], max_chars: int
) -> tuple[dict[str, str | None], dict[str, str]]:
    """Match answers to request ids; return (subgoal or None, reason) per request id."""
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
        elif not isinstance(subgoal, str) or not subgoal.strip():
            errors[rid] = "subgoal is empty"
        elif len(subgoal.strip()) > max_chars:
            errors[rid] = f"subgoal has {len(subgoal.strip())} characters, more than {max_chars}"
        if rid in errors:
            subgoals[rid] = None
        else:
            subgoals[rid] = subgoal.strip()
    return subgoals, errors


# ---- images -------------------------------------------------------------------------


def encode_png(pixels: np.ndarray) -> bytes:
    """PNG bytes of an RGB array (what is sent and what receipts hash)."""
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def contact_sheet(rows: list[list[np.ndarray]]) -> np.ndarray:
    """One image: a row per case, its views side by side in fixed order, cells padded black."""
    cell_h = max(v.shape[0] for row in rows for v in row)
    cell_w = max(v.shape[1] for row in rows for v in row)
    cols = max(len(row) for row in rows)
    sheet = np.zeros((cell_h * len(rows), cell_w * cols, 3), dtype=np.uint8)
    for r, row in enumerate(rows):
        for c, view in enumerate(row):
            h, w = view.shape[:2]
            sheet[r * cell_h : r * cell_h + h, c * cell_w : c * cell_w + w] = view
    return sheet


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# ---- errors -------------------------------------------------------------------------


class AttemptError(Exception):
    """One failed attempt, classified for the retry decision."""

    def __init__(
        self,
        kind: str,
        message: str,
        retryable: bool,
        retry_after: float | None,
        provider_id: str | None,
        response_sha256: str | None = None,
    ):
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.retry_after = retry_after
        self.provider_id = provider_id
        self.response_sha256 = response_sha256


def _retry_after(headers: Any) -> float | None:
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def _classify(exc: Exception) -> AttemptError:
    if isinstance(exc, openai.APITimeoutError):
        return AttemptError("timeout", str(exc), True, None, None)
    if isinstance(exc, openai.APIConnectionError):
        return AttemptError("connection", f"{exc}: {exc.__cause__!r}", True, None, None)
    if isinstance(exc, openai.APIStatusError):
        status, headers = exc.status_code, exc.response.headers
        provider_id = headers.get("x-request-id")
        message = exc.message
        if status == 429 and "insufficient_quota" in {exc.code, exc.type}:
            return AttemptError("quota", message, False, None, provider_id)
        if status == 429:
            return AttemptError("rate_limit", message, True, _retry_after(headers), provider_id)
        if status == 408:
            return AttemptError("timeout", message, True, _retry_after(headers), provider_id)
        if status == 409 or status >= 500:
            return AttemptError("server", message, True, _retry_after(headers), provider_id)
        # Kinds no retry can fix, named so a study can stop on them (rescue/failfast.py).
        kind = {401: "auth", 403: "permission", 404: "not_found"}.get(status, "client")
        return AttemptError(kind, message, False, None, provider_id)
    if isinstance(exc, openai.APIResponseValidationError):
        return AttemptError("invalid_response", str(exc), False, None, None)
    return AttemptError("client", f"{type(exc).__name__}: {exc}", False, None, None)


# ---- the client ---------------------------------------------------------------------


@dataclass
class _Pending:
    req: SubgoalRequest
    started: float  # wall clock, for receipts
    started_mono: float  # monotonic, for the deadline
    future: asyncio.Future[SubgoalAnswer] | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    token: str = field(default_factory=lambda: secrets.token_hex(16))


@dataclass
class _Reply:
    text: str
    refusal: str | None
    body_sha256: str
    provider_id: str | None
    model: str | None
    usage: Usage
    n_outputs: int


@dataclass
class _Call:
    call_id: str
    group: list[_Pending]
    prompt: str
    images: list[bytes]
    view_sha256: dict[str, list[str]]
    attempts: int = 0
    started: float = field(default_factory=time.time)
    attempt_refs: list[ReceiptRef] = field(default_factory=list)

    @property
    def tokens(self) -> dict[str, str]:
        return {p.request_id: p.token for p in self.group}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _usage(body: dict[str, Any], api: str) -> Usage:
    u = body.get("usage") or {}
    if api == "chat":
        names = ("prompt_tokens", "prompt_tokens_details", "completion_tokens", "completion_tokens_details")
    else:
        names = ("input_tokens", "input_tokens_details", "output_tokens", "output_tokens_details")
    in_details, out_details = u.get(names[1]) or {}, u.get(names[3]) or {}
    return Usage(
        input_tokens=_int(u.get(names[0])),
        cached_input_tokens=_int(in_details.get("cached_tokens")),
        output_tokens=_int(u.get(names[2])),
        reasoning_tokens=_int(out_details.get("reasoning_tokens")),
    )


def _reply_text(body: dict[str, Any], api: str) -> tuple[str, int, str | None]:
    """The model's text, how many separate outputs carried text or a refusal, and the refusal if any."""
    texts: list[str] = []
    refusals: list[str] = []
    if api == "chat":
        for choice in body.get("choices") or []:
            message = choice.get("message") or {}
            if isinstance(message.get("refusal"), str) and message["refusal"].strip():
                refusals.append(message["refusal"])
            elif isinstance(message.get("content"), str):
                texts.append(message["content"])
    else:
        for item in body.get("output") or []:
            if item.get("type") != "message":
                continue
            parts = item.get("content") or []
            refused = [p.get("refusal") for p in parts if p.get("type") == "refusal" and isinstance(p.get("refusal"), str)]
            if refused:
                refusals.append(" ".join(refused))
            else:
                texts.append("".join(p.get("text", "") for p in parts if p.get("type") == "output_text"))
    n = len(texts) + len(refusals)
    return (texts[0] if texts else ""), n, (refusals[0] if refusals else None)


class VLMClient:
    """Asks the VLM for subgoals; every attempt and every outcome leaves a receipt."""

    def __init__(self, config: VLMConfig, receipts: ReceiptLog, artifacts_dir: Path | str | None = None) -> None:
        """`artifacts_dir` (e.g. `<study>/vlm/`): where the images sent, prompts and raw responses are kept.

        Raises `MissingAPIKey` when the study's key came from its config file and was not supplied again.
        """
        self.config = config
        self.receipts = receipts
        self.artifacts_dir = Path(artifacts_dir) if artifacts_dir is not None else None
        self.template: Template = load_template(config.prompt_template, config.prompt_root)
        self._key = config.resolved_api_key()
        self._client = openai.AsyncOpenAI(
            base_url=config.base_url,
            api_key=self._key,
            max_retries=0,  # tenacity retries; nested retries would hide attempts
            timeout=config.request_timeout_s,
        )
        self._limiter = RequestLimiter(config.max_concurrent_calls, config.requests_per_minute)
        self._pending: list[_Pending] = []
        self._window: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()

    async def ask(self, req: SubgoalRequest) -> SubgoalAnswer:
        """One subgoal for one case; waits for batch partners when batching is on."""
        pending = _Pending(req, time.time(), time.monotonic())
        if self.config.batch_size <= 1:
            return (await self._call([pending]))[0]
        pending.future = asyncio.get_running_loop().create_future()
        self._pending.append(pending)
        if len(self._pending) >= self.config.batch_size:
            self._flush()
        elif self._window is None:
            self._window = asyncio.create_task(self._close_window())
        return await pending.future

    async def aclose(self) -> None:
        """Send any partly filled batch, wait for calls in flight, close the HTTP client."""
        if self._pending:
            self._flush()
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        await self._client.close()

    # -- batching --

    async def _close_window(self) -> None:
        await asyncio.sleep(self.config.batch_window_s)
        self._window = None
        if self._pending:
            self._flush()

    def _flush(self) -> None:
        group, self._pending = self._pending[: self.config.batch_size], self._pending[self.config.batch_size :]
        if self._window is not None and not self._pending:
            self._window.cancel()
            self._window = None
        task = asyncio.create_task(self._run_group(group))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _run_group(self, group: list[_Pending]) -> None:
        try:
            answers = await self._call(group)
        except asyncio.CancelledError:
            for p in group:
                if p.future is not None:
                    p.future.cancel()
            raise
        except Exception as exc:  # the waiting asks must learn of it; nobody awaits this task
            for p in group:
                if p.future is not None and not p.future.done():
                    p.future.set_exception(exc)
            return
        for p, answer in zip(group, answers):
            if p.future is not None and not p.future.done():
                p.future.set_result(answer)

    # -- one call --

    def _build(self, group: list[_Pending]) -> _Call:
        view_pngs = {p.request_id: [encode_png(p.req.views[n]) for n in VIEW_NAMES] for p in group}
        if len(group) == 1:
            images = view_pngs[group[0].request_id]
            instruction, remaining = group[0].req.instruction, str(group[0].req.remaining_steps)
        else:
            sheet = contact_sheet([[p.req.views[n] for n in VIEW_NAMES] for p in group])
            images = [encode_png(sheet)]
            instruction = remaining = "given per request in the list below (one image row each)"
        text = render(
            self.template,
            instruction=instruction,
            remaining_steps=remaining,
            view_names=", ".join(VIEW_NAMES),
            max_chars=self.config.max_subgoal_chars,
        )
        requests = [
            {
                "row": i,
                "request_id": p.request_id,
                "token": p.token,
                "instruction": p.req.instruction,
                "remaining_steps": p.req.remaining_steps,
            }
            for i, p in enumerate(group)
        ]
        prompt = text.rstrip("\n") + "\n\nREQUESTS (JSON, image row i belongs to requests[i]):\n"
        prompt += json.dumps({"requests": requests}, ensure_ascii=False) + "\n"
        return _Call(
            call_id=uuid.uuid4().hex,
            group=group,
            prompt=prompt,
            images=images,
            view_sha256={rid: [_sha(b) for b in pngs] for rid, pngs in view_pngs.items()},
        )

    def _request_kwargs(self, call: _Call) -> dict[str, Any]:
        cfg = self.config
        urls = [_data_url(png) for png in call.images]
        schema = answer_schema(call.tokens)
        if cfg.api == "chat":
            content: list[dict[str, Any]] = [{"type": "text", "text": call.prompt}]
            content += [{"type": "image_url", "image_url": {"url": u, "detail": cfg.image_detail}} for u in urls]
            kwargs: dict[str, Any] = {"model": cfg.model, "messages": [{"role": "user", "content": content}]}
            if cfg.structured:
                kwargs["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "subgoal_answers", "strict": True, "schema": schema},
                }
            wire = {
                "max_completion_tokens": cfg.max_output_tokens,
                "temperature": cfg.temperature,
                "seed": cfg.seed,
                "reasoning_effort": cfg.reasoning_effort,
            }
        else:
            content = [{"type": "input_text", "text": call.prompt}]
            content += [{"type": "input_image", "image_url": u, "detail": cfg.image_detail} for u in urls]
            kwargs = {"model": cfg.model, "input": [{"role": "user", "content": content}]}
            if cfg.structured:
                kwargs["text"] = {
                    "format": {"type": "json_schema", "name": "subgoal_answers", "strict": True, "schema": schema}
                }
            wire = {
                "max_output_tokens": cfg.max_output_tokens,
                "temperature": cfg.temperature,
                "reasoning": {"effort": cfg.reasoning_effort} if cfg.reasoning_effort is not None else None,
            }
        # Unset settings are not sent; `store` always is, so a provider never keeps a call by default.
        kwargs |= {k: v for k, v in wire.items() if v is not None}
        kwargs["store"] = cfg.store
        return kwargs

    async def _send(self, kwargs: dict[str, Any]) -> _Reply:
        if self.config.api == "chat":
            raw = await self._client.chat.completions.with_raw_response.create(**kwargs)
        else:
            raw = await self._client.responses.with_raw_response.create(**kwargs)
        body_text = raw.text
        provider_id = raw.headers.get("x-request-id")
        body_sha = self._keep(body_text.encode("utf-8"), ".txt")
        try:
            body = json.loads(body_text)
        except ValueError:
            raise AttemptError("invalid_response", "response body is not JSON", False, None, provider_id, body_sha) from None
        if not isinstance(body, dict):
            raise AttemptError("invalid_response", "response body is not a JSON object", False, None, provider_id, body_sha)
        text, n_outputs, refusal = _reply_text(body, self.config.api)
        return _Reply(
            text=text,
            refusal=refusal,
            body_sha256=body_sha,
            provider_id=provider_id,
            model=body.get("model") if isinstance(body.get("model"), str) else None,
            usage=_usage(body, self.config.api),
            n_outputs=n_outputs,
        )

    def _redact(self, text: str | None) -> str | None:
        # Some providers echo the key (or part of it) in error messages.
        if text is None or len(self._key) < 4 or self._key == "none":
            return text
        return text.replace(self._key, "[redacted]")

    def _keep(self, data: bytes, suffix: str) -> str:
        """Keep one artifact as `<sha256><suffix>` (atomic, fsynced; kept once); return its sha256."""
        sha = _sha(data)
        if self.artifacts_dir is None:
            return sha
        path = artifact_path(self.artifacts_dir, sha, suffix)
        if path.is_file():
            return sha  # content-addressed: an existing complete file holds these bytes
        new_dir = not self.artifacts_dir.is_dir()
        self.artifacts_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        for folder in [self.artifacts_dir] + ([self.artifacts_dir.parent] if new_dir else []):
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return sha

    def _write(self, call: _Call, receipt: Receipt) -> ReceiptRef:
        ref = self.receipts.write(receipt)
        if receipt.kind != "outcome":
            call.attempt_refs.append(ref)
        return ref

    def _receipt(self, call: _Call, kind: str, started: float, **fields: Any) -> Receipt:
        finished = None if kind == "attempt_started" else time.time()
        fields["error"] = self._redact(fields.get("error"))
        if kind == "outcome":
            fields["attempt_refs"] = list(call.attempt_refs)
        return Receipt(
            kind=kind,
            call_id=call.call_id,
            attempt=call.attempts,
            request_ids=[p.request_id for p in call.group],
            tokens=call.tokens,
            case_ids=[p.req.case_id for p in call.group],
            model_requested=self.config.model,
            endpoint_kind=self.config.api,
            prompt_template=self.template.name,
            prompt_template_sha256=self.template.sha256,
            prompt_sha256=prompt_sha256(call.prompt),
            image_sha256=call.view_sha256,
            sent_image_sha256=[_sha(b) for b in call.images],
            started_at=started,
            finished_at=finished,
            latency_s=None if finished is None else finished - started,
            generation=self.config.generation(),
            **fields,
        )

    async def _attempt(self, call: _Call, kwargs: dict[str, Any], deadline_at: float) -> _Reply:
        async with self._limiter.slot():
            return await self._limited_attempt(call, kwargs, deadline_at)

    async def _limited_attempt(self, call: _Call, kwargs: dict[str, Any], deadline_at: float) -> _Reply:
        call.attempts += 1
        started = time.time()
        # Evidence first: a kill while the request is in flight still leaves this line.
        self._write(call, self._receipt(call, "attempt_started", started, status="started"))
        try:
            reply = await self._send(kwargs)
        except asyncio.CancelledError:
            timed_out = time.monotonic() >= deadline_at - 1e-3
            self._write(
                call,
                self._receipt(
                    call, "attempt", started,
                    status="timeout" if timed_out else "error",
                    error_kind="timeout" if timed_out else "cancelled",
                    error="deadline reached during the attempt" if timed_out else "cancelled",
                ),
            )
            raise
        except Exception as exc:
            err = exc if isinstance(exc, AttemptError) else _classify(exc)
            self._write(
                call,
                self._receipt(
                    call, "attempt", started,
                    status="invalid_response" if err.kind == "invalid_response" else "error",
                    error_kind=err.kind, error=str(err), provider_request_id=err.provider_id,
                    response_sha256=err.response_sha256,
                ),
            )
            raise err from None
        self._write(
            call,
            self._receipt(
                call, "attempt", started, status="ok", provider_request_id=reply.provider_id,
                model_reported=reply.model, usage=reply.usage, response_sha256=reply.body_sha256,
            ),
        )
        return reply

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        cfg = self.config
        if isinstance(exc, AttemptError) and exc.retry_after is not None:
            # The server knows when it will take us again, but never holds a case beyond our own cap.
            return min(exc.retry_after, cfg.backoff_max_s)
        backoff = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2 ** (state.attempt_number - 1))
        return backoff + random.uniform(0.0, cfg.backoff_jitter_s)

    async def _retrying_send(self, call: _Call, kwargs: dict[str, Any], deadline_at: float) -> _Reply:
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.config.max_attempts),
            wait=self._wait,
            retry=retry_if_exception(lambda e: isinstance(e, AttemptError) and e.retryable),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._attempt(call, kwargs, deadline_at)
        raise AssertionError("unreachable: tenacity reraises the last error")

    async def _call(self, group: list[_Pending]) -> list[SubgoalAnswer]:
        call = self._build(group)
        kwargs = self._request_kwargs(call)
        # What the call sees is on disk before anything is sent, hence before its outcome line.
        for png in call.images:
            self._keep(png, ".png")
        self._keep(call.prompt.encode("utf-8"), ".txt")
        deadline_at = min(p.started_mono for p in group) + self.config.deadline_s
        fields: dict[str, Any] = {}
        try:
            async with asyncio.timeout(max(0.0, deadline_at - time.monotonic())):
                reply = await self._retrying_send(call, kwargs, deadline_at)
        except TimeoutError:
            status, fields = "timeout", {"error_kind": "timeout", "error": f"no answer within {self.config.deadline_s} s"}
        except AttemptError as err:
            status = "invalid_response" if err.kind == "invalid_response" else "broker_error"
            fields = {
                "error_kind": err.kind,
                "error": str(err),
                "provider_request_id": err.provider_id,
                "response_sha256": err.response_sha256,  # a body that arrived but is not JSON is kept too
            }
        except asyncio.CancelledError:
            # The caller gave up (shutdown); the call still gets its outcome line.
            self._write(
                call,
                self._receipt(
                    call, "outcome", call.started, status="error", error_kind="cancelled",
                    error="cancelled by the caller", request_status={p.request_id: "broker_error" for p in group},
                ),
            )
            raise
        else:
            status, fields = self._judge(call, reply)
        per_request = fields.pop("per_request", None)
        receipt_status = fields.pop("receipt_status", None) or _RECEIPT_STATUS[status]
        receipt = self._receipt(
            call, "outcome", call.started,
            status=receipt_status,
            request_status={rid: s for rid, (s, _) in per_request.items()} if per_request else {
                p.request_id: status for p in group
            },
            **fields,
        )
        ref = self._write(call, receipt)
        log.info(
            "vlm.call",
            call_id=call.call_id,
            case_ids=receipt.case_ids,
            status=status,
            error_kind=receipt.error_kind,
            latency_s=round(receipt.latency_s, 3),
            attempts=call.attempts,
            provider_request_id=receipt.provider_request_id,
        )
        answers = []
        for p in group:
            rstatus = receipt.request_status[p.request_id]
            rerror = receipt.request_errors.get(p.request_id) or (receipt.error if rstatus != "ok" else None)
            answers.append(
                SubgoalAnswer(
                    status=rstatus,
                    subgoal=receipt.subgoals.get(p.request_id),
                    call_id=call.call_id,
                    request_id=p.request_id,
                    error_kind=None if rstatus == "ok" else (receipt.error_kind or rstatus),
                    error=rerror,
                    receipt=receipt,
                    receipt_ref=ref,
                )
            )
        return answers

    def _judge(self, call: _Call, reply: _Reply) -> tuple[str, dict[str, Any]]:
        """Turn a delivered reply into per-request subgoals or reasons for rejection."""
        tokens = call.tokens
        common = {
            "provider_request_id": reply.provider_id,
            "model_reported": reply.model,
            "usage": reply.usage,
            "response_sha256": reply.body_sha256,
        }
        if reply.refusal is not None and reply.n_outputs == 1:
            # A refusal is an answer, not a missing one: unusable, never asked again, named as such.
            error = f"the model refused: {reply.refusal[:500]}"
            return "invalid_response", common | {
                "receipt_status": "refusal",
                "error_kind": "refusal",
                "error": error,
                "subgoals": {rid: None for rid in tokens},
                "request_errors": {rid: error for rid in tokens},
            }
        try:
            if reply.n_outputs != 1:
                raise InvalidResponse(f"{reply.n_outputs} outputs instead of one")
            items = parse_answers(reply.text, self.config.structured)
        except InvalidResponse as exc:
            errors = {rid: str(exc) for rid in tokens}
            subgoals: dict[str, str | None] = {rid: None for rid in tokens}
        else:
            subgoals, errors = check_answers(items, tokens, self.config.max_subgoal_chars)
        per_request = {rid: ("invalid_response" if rid in errors else "ok", errors.get(rid)) for rid in tokens}
        n_bad = len(errors)
        # The call is ok when any case got a usable subgoal; rejected cases are named per request.
        status = "ok" if n_bad < len(tokens) else "invalid_response"
        extra: dict[str, Any] = {"subgoals": subgoals, "request_errors": errors, "per_request": per_request}
        if n_bad:
            extra["error_kind"] = "invalid_response"
            extra["error"] = "; ".join(sorted(set(errors.values())))
        return status, common | extra
