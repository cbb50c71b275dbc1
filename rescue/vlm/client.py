"""The VLM client: one bounded subgoal per case, with a receipt for every attempt.

It speaks to any OpenAI-compatible endpoint through the `openai` SDK (Chat
Completions or Responses; the request and reply formats are `rescue.vlm.exchange`).
Infrastructure failures are retried by `tenacity` with the SDK's own retries
switched off; a response that arrived but is unusable is never asked again
(DESIGN §4). Answers are parsed and matched to their requests by
`rescue.vlm.answers`. Optionally several waiting cases share one call: a
contact sheet of their views, one answer each.

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
import hashlib
import json
import random
import secrets
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
)

from rescue.core.configuration.vlm_config import VLMConfig
from rescue.core.images import VLM_VIEWS, contact_sheet, encode_png
from rescue.core.prompts import Template, load_template, prompt_sha256, render
from rescue.core.records import Receipt, ReceiptRef
from rescue.core.reported_model import mismatch
from rescue.study.files import fsync_dir, write_atomic
from rescue.study.ledger import LabBudget
from rescue.study.receipts import ReceiptLog, artifact_path
from rescue.vlm.answers import InvalidResponse, SubgoalAnswer, SubgoalRequest, check_answers, parse_answers
from rescue.vlm.limits import RequestLimiter
from rescue.vlm.servers import config_warnings
from rescue.vlm.exchange import AttemptError, Reply, classify_error, read_usage, reply_text, request_kwargs, sent_generation

log = structlog.get_logger(__name__)

_RECEIPT_STATUS = {"ok": "ok", "broker_error": "error", "invalid_response": "invalid_response", "timeout": "timeout"}


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


@dataclass
class _Pending:
    req: SubgoalRequest
    started: float  # wall clock, for receipts
    started_mono: float  # monotonic, for the deadline
    future: asyncio.Future[SubgoalAnswer] | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    token: str = field(default_factory=lambda: secrets.token_hex(16))


@dataclass
class _Call:
    call_id: str
    group: list[_Pending]
    prompt: str
    images: list[bytes]
    view_sha256: dict[str, list[str]]
    attempts: int = 0
    started: float = field(default_factory=time.time)
    sent_generation: dict[str, Any] = field(default_factory=dict)
    attempt_refs: list[ReceiptRef] = field(default_factory=list)

    @property
    def tokens(self) -> dict[str, str]:
        return {p.request_id: p.token for p in self.group}


class VLMClient:
    """Asks the VLM for subgoals; every attempt and every outcome leaves a receipt."""

    def __init__(
        self, config: VLMConfig, receipts: ReceiptLog, artifacts_dir: Path | str | None = None, advisor: str | None = None,
        budget: LabBudget | None = None,
    ) -> None:
        """`artifacts_dir` (e.g. `<study>/vlm/`): where the images sent, prompts and raw responses are kept.
        `advisor`: the advisor this client asks for (DESIGN §11), named in every receipt; None: a study's one `[vlm]`.
        `budget`: the lab budget every call is counted against once its outcome line is written (None: none).

        Raises `MissingAPIKey` when the study's key came from its config file and was not supplied again.
        """
        self.config = config
        self.advisor = advisor
        self.receipts = receipts
        self.budget = budget
        self.artifacts_dir = Path(artifacts_dir) if artifacts_dir is not None else None
        self.template: Template = load_template(config.prompt_template, config.prompt_root)
        self._key = config.resolved_api_key()
        import openai  # imported with the first client: a command that asks no VLM never pays for the SDK

        self._client = openai.AsyncOpenAI(
            base_url=config.base_url,
            api_key=self._key,
            max_retries=0,  # tenacity retries; nested retries would hide attempts
            timeout=config.request_timeout_s,
        )
        self._limiter = RequestLimiter(config.max_concurrent_calls, config.requests_per_minute)
        for warning in config_warnings(config):
            # Said once per client, before any call: a setting the endpoint would drop or refuse.
            log.warning("vlm.config_warning", warning=warning, model=config.model, server=config.server)
        self._pending: list[_Pending] = []
        self._window: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._other_models: set[str] = set()  # reported models that are not the requested one, warned about

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
        view_pngs = {p.request_id: [encode_png(p.req.views[n]) for n in VLM_VIEWS] for p in group}
        if len(group) == 1:
            images = view_pngs[group[0].request_id]
            instruction, remaining = group[0].req.instruction, str(group[0].req.remaining_steps)
        else:
            sheet = contact_sheet([[p.req.views[n] for n in VLM_VIEWS] for p in group])
            images = [encode_png(sheet)]
            instruction = remaining = "given per request in the list below (one image row each)"
        text = render(
            self.template,
            instruction=instruction,
            remaining_steps=remaining,
            view_names=", ".join(VLM_VIEWS),
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

    async def _send(self, kwargs: dict[str, Any]) -> Reply:
        if self.config.api == "chat":
            raw = await self._client.chat.completions.with_raw_response.create(**kwargs)
        else:
            raw = await self._client.responses.with_raw_response.create(**kwargs)
        body_text = raw.text
        provider_id = raw.headers.get("x-request-id")
        raw_body = body_text.encode("utf-8")
        body_sha = _sha(raw_body)
        try:
            body = json.loads(body_text)
        except ValueError:
            raise AttemptError("invalid_response", "response body is not JSON", False, None, provider_id, body_sha,
                               raw_body) from None
        if not isinstance(body, dict):
            raise AttemptError("invalid_response", "response body is not a JSON object", False, None, provider_id, body_sha,
                               raw_body)
        text, n_outputs, refusal = reply_text(body, self.config.api)
        return Reply(
            text=text,
            refusal=refusal,
            body_sha256=body_sha,
            provider_id=provider_id,
            model=body.get("model") if isinstance(body.get("model"), str) else None,
            usage=read_usage(body, self.config.api),
            n_outputs=n_outputs,
            body=raw_body,
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
        write_atomic(path, data, durable_entry=True)
        if new_dir:
            fsync_dir(self.artifacts_dir.parent)
        return sha

    def _write(self, call: _Call, receipt: Receipt) -> ReceiptRef:
        ref = self.receipts.write(receipt)
        if receipt.kind != "outcome":
            call.attempt_refs.append(ref)
        elif self.budget is not None:
            # The receipt first (the evidence), then the lab's ledger; a crash between them is found again
            # in the receipts when the ledger is next opened for this study.
            self.budget.record(receipt)
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
            arms={p.req.case_id: p.req.arm for p in call.group if p.req.arm is not None},
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
            sent_generation=call.sent_generation,
            advisor=self.advisor,
            **fields,
        )

    async def _attempt(self, call: _Call, kwargs: dict[str, Any], deadline_at: float) -> Reply:
        async with self._limiter.slot():
            return await self._limited_attempt(call, kwargs, deadline_at)

    async def _limited_attempt(self, call: _Call, kwargs: dict[str, Any], deadline_at: float) -> Reply:
        call.attempts += 1
        started = time.time()
        # Evidence first: a kill while the request is in flight still leaves this line. What the call
        # sends is kept once a line names it (so the artifacts folder holds only named files), and
        # before it is sent, hence before the call's outcome line.
        self._write(call, self._receipt(call, "attempt_started", started, status="started"))
        for png in call.images:
            self._keep(png, ".png")
        self._keep(call.prompt.encode("utf-8"), ".txt")
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
            err = exc if isinstance(exc, AttemptError) else classify_error(exc)
            self._write(
                call,
                self._receipt(
                    call, "attempt", started,
                    status="invalid_response" if err.kind == "invalid_response" else "error",
                    error_kind=err.kind, error=str(err), provider_request_id=err.provider_id,
                    response_sha256=err.response_sha256,
                ),
            )
            if err.body is not None:
                self._keep(err.body, ".txt")  # a body that arrived but is not JSON is kept too
            raise err from None
        self._write(
            call,
            self._receipt(
                call, "attempt", started, status="ok", provider_request_id=reply.provider_id,
                model_reported=reply.model, usage=reply.usage, response_sha256=reply.body_sha256,
            ),
        )
        self._keep(reply.body, ".txt")
        return reply

    def _wait(self, state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        cfg = self.config
        if isinstance(exc, AttemptError) and exc.retry_after is not None:
            # The server knows when it will take us again, but never holds a case beyond our own cap.
            return min(exc.retry_after, cfg.backoff_max_s)
        backoff = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2 ** (state.attempt_number - 1))
        return backoff + random.uniform(0.0, cfg.backoff_jitter_s)

    async def _retrying_send(self, call: _Call, kwargs: dict[str, Any], deadline_at: float) -> Reply:
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
        kwargs = request_kwargs(self.config, call.prompt, call.images, call.tokens)
        call.sent_generation = sent_generation(kwargs)
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
            advisor=self.advisor,
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
            answered = rstatus in ("ok", "declined")
            rerror = receipt.request_errors.get(p.request_id) or (None if answered else receipt.error)
            answers.append(
                SubgoalAnswer(
                    status=rstatus,
                    subgoal=receipt.subgoals.get(p.request_id),
                    call_id=call.call_id,
                    request_id=p.request_id,
                    error_kind=None if answered else (receipt.error_kind or rstatus),
                    error=rerror,
                    receipt=receipt,
                    receipt_ref=ref,
                )
            )
        return answers

    def _judge(self, call: _Call, reply: Reply) -> tuple[str, dict[str, Any]]:
        """Turn a delivered reply into per-request subgoals or reasons for rejection."""
        tokens = call.tokens
        common = {
            "provider_request_id": reply.provider_id,
            "model_reported": reply.model,
            "usage": reply.usage,
            "response_sha256": reply.body_sha256,
        }
        other = mismatch(self.config.model, reply.model)
        if other is not None and self.config.refuses_other_models:
            # Another model's answer is no evidence about this one: refused like an unusable answer.
            error = f"{other} ([vlm] require_model_match)"
            return "invalid_response", common | {
                "error_kind": "model_mismatch",
                "error": error,
                "subgoals": {rid: None for rid in tokens},
                "request_errors": {rid: error for rid in tokens},
            }
        if other is not None and reply.model not in self._other_models:
            self._other_models.add(reply.model)  # said once per model and client; every receipt keeps it
            log.warning("vlm.model_mismatch", advisor=self.advisor, requested=self.config.model, reported=reply.model,
                        detail=f"{other}; its answers are applied ([vlm] require_model_match = false)")
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
            items = parse_answers(reply.text, self.config.structured, bool(self.config.may_decline))
        except InvalidResponse as exc:
            errors = {rid: str(exc) for rid in tokens}
            subgoals: dict[str, str | None] = {rid: None for rid in tokens}
        else:
            subgoals, errors = check_answers(items, tokens, self.config.max_subgoal_chars, bool(self.config.may_decline))

        def request_status(rid: str) -> str:
            # A valid answer without a subgoal kept the instruction (an advisor that may decline, DESIGN §18).
            return "invalid_response" if rid in errors else "ok" if subgoals.get(rid) is not None else "declined"

        per_request = {rid: (request_status(rid), errors.get(rid)) for rid in tokens}
        n_bad = len(errors)
        # The call is ok when any case got a usable subgoal; rejected cases are named per request.
        status = "ok" if n_bad < len(tokens) else "invalid_response"
        extra: dict[str, Any] = {"subgoals": subgoals, "request_errors": errors, "per_request": per_request}
        if n_bad:
            extra["error_kind"] = "invalid_response"
            extra["error"] = "; ".join(sorted(set(errors.values())))
        return status, common | extra
