"""One exchange with a VLM's API: the request as the `openai` SDK sends it, the reply body read back.

Chat Completions and Responses differ in where images, the schema, the generation settings,
the text and the token counts go; this module is the one place that knows both (which field each
generation setting goes as, on each server, is `rescue.vlm.servers`). Failures
are classified here for the retry decision (connection, timeout, 408, 409, 429, 5xx retry;
everything else does not).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

from rescue.core.configuration.vlm_config import VLMConfig
from rescue.core.records import Usage
from rescue.vlm.answers import answer_schema
from rescue.vlm.servers import WIRE, WIRE_FIELDS, generation_fields, server_of


def data_url(png: bytes) -> str:
    """A PNG as a base64 data URL (what both APIs take as an image)."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


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
        body: bytes | None = None,
    ):
        super().__init__(message)
        self.kind = kind
        self.retryable = retryable
        self.retry_after = retry_after
        self.provider_id = provider_id
        self.response_sha256 = response_sha256
        self.body = body  # the raw body that arrived (kept once the attempt's line names it)


def retry_after(headers: Any) -> float | None:
    """Seconds a server asks us to wait (`retry-after-ms` or `retry-after`, seconds or a date), or None."""
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


def classify_error(exc: Exception) -> AttemptError:
    """An SDK exception as an AttemptError: its kind, and whether a retry may help."""
    import openai  # imported when a client exists (an `openai` import costs 0.4 s; a run that asks no VLM needs none)

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
            return AttemptError("rate_limit", message, True, retry_after(headers), provider_id)
        if status == 408:
            return AttemptError("timeout", message, True, retry_after(headers), provider_id)
        if status == 409 or status >= 500:
            return AttemptError("server", message, True, retry_after(headers), provider_id)
        # Kinds no retry can fix, named so a study can stop on them (rescue/failfast.py).
        kind = {401: "auth", 403: "permission", 404: "not_found"}.get(status, "client")
        return AttemptError(kind, message, False, None, provider_id)
    if isinstance(exc, openai.APIResponseValidationError):
        return AttemptError("invalid_response", str(exc), False, None, None)
    return AttemptError("client", f"{type(exc).__name__}: {exc}", False, None, None)


def request_kwargs(cfg: VLMConfig, prompt: str, images: list[bytes], tokens: dict[str, str]) -> dict[str, Any]:
    """The SDK call's arguments for one prompt, its images and the request ids and tokens it must answer."""
    urls = [data_url(png) for png in images]
    schema = answer_schema(tokens, bool(cfg.may_decline))
    if cfg.api == "chat":
        content: list[dict[str, Any]] = [{"type": "text", "text": prompt}]
        content += [{"type": "image_url", "image_url": {"url": u, "detail": cfg.image_detail}} for u in urls]
        kwargs: dict[str, Any] = {"model": cfg.model, "messages": [{"role": "user", "content": content}]}
        if cfg.structured:
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "subgoal_answers", "strict": True, "schema": schema},
            }
    else:
        content = [{"type": "input_text", "text": prompt}]
        content += [{"type": "input_image", "image_url": u, "detail": cfg.image_detail} for u in urls]
        kwargs = {"model": cfg.model, "input": [{"role": "user", "content": content}]}
        if cfg.structured:
            kwargs["text"] = {
                "format": {"type": "json_schema", "name": "subgoal_answers", "strict": True, "schema": schema}
            }
    # Each setting under the name the server reads, and none it would drop (rescue.vlm.servers).
    return kwargs | generation_fields(cfg)


def sent_generation(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The generation fields of an SDK call's arguments, as they go on the wire (what receipts record)."""
    return {k: kwargs[k] for k in WIRE_FIELDS if k in kwargs}


def probe_kwargs(cfg: VLMConfig) -> dict[str, Any]:
    """A minimal chat call capped at one output token under the name the server reads (a start's check)."""
    return {
        "model": cfg.model,
        "messages": [{"role": "user", "content": "Reply with OK."}],
        str(WIRE[server_of(cfg)]["chat"]["max_output_tokens"]): 1,
    }


@dataclass
class Reply:
    """A delivered reply: its text (or refusal), the body's digest, the provider's ids and the token counts."""

    text: str
    refusal: str | None
    body_sha256: str
    provider_id: str | None
    model: str | None
    usage: Usage
    n_outputs: int
    body: bytes = b""
    """The raw body, kept as `<body_sha256>.txt` once the attempt's receipt line names it."""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_usage(body: dict[str, Any], api: str) -> Usage:
    """The token counts a reply body reports (None where it reports none)."""
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


def reply_text(body: dict[str, Any], api: str) -> tuple[str, int, str | None]:
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
