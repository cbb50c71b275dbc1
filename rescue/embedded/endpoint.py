"""A local OpenAI-compatible endpoint that answers with `rescue.embedded.decision.propose_subgoal`.

It serves `/v1/chat/completions`, `/v1/responses` and `/v1/models` on aiohttp,
reads only the request's text and data-URL images, and can inject the faults a
real provider shows (rate limits, 5xx, dropped connections, quota, bad answers,
refusals) so the client's retries and receipts can be tested against a real
HTTP peer. It answers the project's structured prompt (a REQUESTS JSON block,
one answer per request) and, like any VLM, a free-form question with images:
then the reply is one plain-text subgoal (`{"subgoal": ...}` when the request
asks for JSON output).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import math
import random
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from PIL import Image
from pydantic import BaseModel, field_validator

from rescue.embedded.decision import parse_goal, propose_subgoal, sees_progress
from rescue.embedded.faults import Fault
from rescue.embedded.scene import wrong_object_subgoal

# The generation settings a request may carry (both APIs); the endpoint records them as received.
GENERATION_KEYS = (
    "max_completion_tokens", "max_tokens", "max_output_tokens", "temperature", "seed",
    "reasoning_effort", "reasoning", "store",
)
REFUSAL = "I'm sorry, but I can't help with that request."
ANSWER_MODES = ("model", "wrong-object", "keep")
VIEWS_PER_ROW = 3


class EndpointOptions(BaseModel):
    """Latency and fault injection. A fault hits the first `fault_count` requests (quota: all)."""

    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    fault: Fault = "none"
    fault_count: int = 1
    retry_after_s: int = 1
    overlong_chars: int = 4000
    usage_details: bool = True  # False: omit cached/reasoning counters like many compatible servers
    model: str = "rescue-advisor-v0"
    # When set, other keys get a 401 that echoes the presented key, as some providers do.
    expected_api_key: str | None = None
    # How a request is answered: `model` (the subgoal model on the views; asked by an advisor that may decline, it
    # keeps the instruction when it sees no sign of failure: rescue.embedded.decision.sees_progress),
    # `wrong-object` (a subgoal naming another object of the instruction's scene), `fixed:TEXT` (always TEXT),
    # `keep` (keep the instruction whenever the request offers it, else the model's subgoal): loopback advisors
    # for controls.
    answer: str = "model"

    @field_validator("answer")
    @classmethod
    def _answer_mode(cls, value: str) -> str:
        if value in ANSWER_MODES or (value.startswith("fixed:") and value[len("fixed:"):].strip()):
            return value
        raise ValueError(f"answer {value!r}: one of {', '.join(ANSWER_MODES)}, or fixed:TEXT")

    def keeps(self, instruction: str, views: list[Image.Image]) -> bool:
        """Whether it keeps the instruction, asked by an advisor that may decline (DESIGN §18)."""
        if self.answer == "keep":
            return True
        return self.answer == "model" and sees_progress(instruction, views)

    def subgoal(self, instruction: str, views: list[Image.Image], remaining_steps: int) -> str:
        """The subgoal this endpoint answers a request with, as its answer mode says."""
        if self.answer == "wrong-object":
            return wrong_object_subgoal(instruction)
        if self.answer.startswith("fixed:"):
            return self.answer[len("fixed:"):].strip()
        return propose_subgoal(instruction, views, remaining_steps)


@dataclass
class ReceivedRequest:
    """What one request carried (no headers: they may hold a key)."""

    index: int
    path: str
    model: str | None
    structured: bool
    n_images: int
    request_ids: list[str]
    outcome: str
    key_matched: bool | None = None
    generation: dict[str, Any] = field(default_factory=dict)  # the settings of GENERATION_KEYS as sent
    free_form: bool = False  # no REQUESTS block: answered with one plain subgoal


@dataclass
class EndpointState:
    """The request counter and the log of received requests, in memory."""

    options: EndpointOptions
    counter: int = 0
    requests: list[ReceivedRequest] = field(default_factory=list)


STATE = web.AppKey("state", EndpointState)


# ---- reading a request --------------------------------------------------------------


def _decode_image(url: str) -> Image.Image:
    m = re.match(r"data:image/[a-z]+;base64,(.*)$", url, re.DOTALL)
    if m is None:
        raise ValueError("only base64 data URLs are accepted")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(m.group(1), validate=True)))
        image.load()
    except (binascii.Error, OSError) as exc:
        raise ValueError(f"image does not decode: {exc}") from None
    return image.convert("RGB")


def _parts(body: dict[str, Any], path: str) -> tuple[str, list[Image.Image]]:
    """Concatenated text and decoded images of the request's messages."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages") or []
    else:
        raw = body.get("input")
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw or []
    texts: list[str] = []
    images: list[Image.Image] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
            continue
        for part in content or []:
            kind = part.get("type")
            if kind in {"text", "input_text"}:
                texts.append(part.get("text", ""))
            elif kind == "image_url":
                url = part.get("image_url")
                images.append(_decode_image(url["url"] if isinstance(url, dict) else url))
            elif kind == "input_image":
                images.append(_decode_image(part.get("image_url", "")))
    return "\n".join(texts), images


def _requests_block(text: str) -> list[dict[str, Any]]:
    """The JSON list of requests the client appends to its prompt."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and '"requests"' in line:
            return list(json.loads(line)["requests"])
    raise ValueError("no REQUESTS JSON block in the prompt")


_VERB = re.compile(r"\b(?:pick up|put|place|move|open|close|shut|turn|switch|push|lift|grasp|grab)\b", re.IGNORECASE)


def free_form_instruction(text: str) -> str:
    """The task a free-form question names: the first sentence tail the instruction grammar reads, else the text."""
    for sentence in re.split(r"[.,?!;\n\"\u201c\u201d]+", text):
        for verb in _VERB.finditer(sentence):
            tail = sentence[verb.start() :].strip()
            if parse_goal(tail) is not None:
                return tail
    return " ".join(text.split())


def free_form_remaining(text: str, default: int = 100) -> int:
    """The step budget a free-form question states ("120 steps left"), else `default`."""
    m = re.search(r"(\d+)\s+(?:more\s+|remaining\s+)?(?:environment\s+)?steps", text, re.IGNORECASE)
    return int(m.group(1)) if m else default


def _rows(images: list[Image.Image], n: int) -> list[list[Image.Image]]:
    """The views of each request: three images each, or one contact sheet cut into n rows of three."""
    if len(images) == VIEWS_PER_ROW * n:
        return [images[i * VIEWS_PER_ROW : (i + 1) * VIEWS_PER_ROW] for i in range(n)]
    if len(images) == 1:
        sheet = images[0]
        cell_h, cell_w = sheet.height // n, sheet.width // VIEWS_PER_ROW
        return [
            [sheet.crop((c * cell_w, r * cell_h, (c + 1) * cell_w, (r + 1) * cell_h)) for c in range(VIEWS_PER_ROW)]
            for r in range(n)
        ]
    raise ValueError(f"{len(images)} images for {n} requests")


def _offers_keeping(body: dict[str, Any], path: str, text: str) -> bool:
    """Whether the request offers "keep the instruction" (DESIGN §18): its answer schema has `keep_instruction`, or
    (free text) its prompt names it."""
    if _structured(body, path):
        fmt = (body.get("response_format") or {}) if path.endswith("/chat/completions") else (body.get("text") or {})
        return "keep_instruction" in json.dumps(fmt)
    return "keep_instruction" in text


def _structured(body: dict[str, Any], path: str) -> bool:
    if path.endswith("/chat/completions"):
        fmt = body.get("response_format") or {}
    else:
        fmt = (body.get("text") or {}).get("format") or {}
    return fmt.get("type") in {"json_schema", "json_object"}


def _image_tokens(image: Image.Image) -> int:
    # The familiar high-detail tile estimate: a base cost plus one per 512-pixel tile.
    return 85 + 170 * math.ceil(image.width / 512) * math.ceil(image.height / 512)


# ---- answering ----------------------------------------------------------------------


def _answers(
    requests: list[dict[str, Any]], rows: list[list[Image.Image]], fault: str, options: EndpointOptions,
    may_decline: bool = False,
) -> list[dict[str, Any]]:
    answers: list[dict[str, Any]] = []
    for req, views in zip(requests, rows):
        instruction = str(req.get("instruction", ""))
        answer: dict[str, Any] = {"request_id": str(req["request_id"]), "token": str(req["token"])}
        if may_decline:
            # Offered "keep the instruction" (the prompt or the schema says so), it decides first whether to advise.
            answer["keep_instruction"] = options.keeps(instruction, views)
        kept = answer.get("keep_instruction") is True
        answer["subgoal"] = "" if kept else options.subgoal(instruction, views, int(req.get("remaining_steps", 0)))
        answers.append(answer)
    if fault == "wrong_request_id" and answers:
        answers[0]["request_id"] = uuid.uuid4().hex
    return answers


def _reply_text(answers: list[dict[str, Any]], structured: bool, options: EndpointOptions, fault: str) -> str:
    if fault == "overlong_subgoal":
        for a in answers:
            a["subgoal"] = (a["subgoal"] + "; ") * (options.overlong_chars // (len(a["subgoal"]) + 2) + 1)
    if fault == "empty_subgoal":
        for a in answers:
            a["subgoal"] = "   "
    if structured:
        text = json.dumps({"answers": answers})
    else:
        text = "\n\n".join(f"REQUEST_ID: {a['request_id']}\nTOKEN: {a['token']}\n"
                             + (f"KEEP_INSTRUCTION: {'yes' if a['keep_instruction'] else 'no'}\n"
                                if "keep_instruction" in a else "")
                             + f"SUBGOAL: {a['subgoal']}" for a in answers)
    if fault == "malformed_json":
        # Cut mid-object, the way a truncated generation looks.
        text = text[: max(1, len(text) // 2)] if structured else "I think the robot should try again."
    return text


def _usage(path: str, text: str, images: list[Image.Image], reply: str, details: bool) -> dict[str, Any]:
    n_in = len(text) // 4 + sum(_image_tokens(i) for i in images)
    n_out = max(1, len(reply) // 4)
    if path.endswith("/chat/completions"):
        usage: dict[str, Any] = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        if details:
            usage["prompt_tokens_details"] = {"cached_tokens": 0}
            usage["completion_tokens_details"] = {"reasoning_tokens": 0}
        return usage
    usage = {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out}
    if details:
        usage["input_tokens_details"] = {"cached_tokens": 0}
        usage["output_tokens_details"] = {"reasoning_tokens": 0}
    return usage


def _completion(path: str, model: str, reply: str, usage: dict[str, Any], refused: bool = False) -> dict[str, Any]:
    created = int(time.time())
    if path.endswith("/chat/completions"):
        message = {"role": "assistant", "content": None, "refusal": reply} if refused else {
            "role": "assistant", "content": reply, "refusal": None
        }
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
            "usage": usage,
        }
    part = {"type": "refusal", "refusal": reply} if refused else {"type": "output_text", "text": reply, "annotations": []}
    return {
        "id": "resp_" + uuid.uuid4().hex,
        "object": "response",
        "created_at": created,
        "status": "completed",
        "model": model,
        "output": [
            {
                "type": "message",
                "id": "msg_" + uuid.uuid4().hex,
                "role": "assistant",
                "status": "completed",
                "content": [part],
            }
        ],
        "usage": usage,
    }


def _error(status: int, message: str, kind: str, code: str | None, headers: dict[str, str]) -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": code, "param": None}}
    return web.json_response(body, status=status, headers=headers)


async def _handle_generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    options = state.options
    index = state.counter
    state.counter += 1
    headers = {"x-request-id": "req_" + uuid.uuid4().hex}
    body = await request.json()
    path = request.path
    hit = options.fault == "quota" or (options.fault != "none" and index < options.fault_count)
    fault = options.fault if hit else "none"
    record = ReceivedRequest(index, path, body.get("model"), _structured(body, path), 0, [], "ok")
    record.generation = {k: body[k] for k in GENERATION_KEYS if k in body}
    state.requests.append(record)
    if options.expected_api_key is not None:
        presented = request.headers.get("Authorization", "").removeprefix("Bearer ")
        record.key_matched = presented == options.expected_api_key
        if not record.key_matched:
            record.outcome = "401"
            return _error(401, f"Incorrect API key provided: {presented}.", "invalid_request_error", "invalid_api_key", headers)

    delay = options.latency_s + random.uniform(0.0, options.latency_jitter_s)
    if delay > 0:
        await asyncio.sleep(delay)
    if fault == "drop":
        record.outcome = "dropped"
        # No status line at all: the client sees the connection close mid-request.
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=204)  # never reaches the client: the transport is gone
    if fault == "rate_limit":
        record.outcome = "429"
        headers["retry-after"] = str(options.retry_after_s)
        return _error(429, "Rate limit reached, retry later.", "requests", "rate_limit_exceeded", headers)
    if fault == "quota":
        record.outcome = "429-quota"
        return _error(429, "You exceeded your current quota.", "insufficient_quota", "insufficient_quota", headers)
    if fault == "server_error":
        record.outcome = "500"
        return _error(500, "The server had an error while processing your request.", "server_error", None, headers)

    try:
        text, images = _parts(body, path)
        if not images:
            raise ValueError("the request carries no image")
        try:
            requests = _requests_block(text)
        except ValueError:
            requests = None  # a free-form question
        rows = _rows(images, len(requests)) if requests is not None else []
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        record.outcome = "400"
        return _error(400, f"Bad request: {exc}", "invalid_request_error", None, headers)
    record.n_images = len(images)
    if fault == "refusal":
        record.outcome = "refusal"
        usage = _usage(path, text, images, REFUSAL, options.usage_details)
        return web.json_response(_completion(path, options.model, REFUSAL, usage, refused=True), headers=headers)
    if requests is None:
        record.free_form = True
        # Decided like any request: from the images and the question's own words.
        subgoal = options.subgoal(free_form_instruction(text), images, free_form_remaining(text))
        reply = json.dumps({"subgoal": subgoal}) if record.structured else subgoal
    else:
        record.request_ids = [str(r.get("request_id")) for r in requests]
        answers = _answers(requests, rows, fault, options, _offers_keeping(body, path, text))
        reply = _reply_text(answers, record.structured, options, fault)
    usage = _usage(path, text, images, reply, options.usage_details)
    return web.json_response(_completion(path, options.model, reply, usage), headers=headers)


async def _handle_models(request: web.Request) -> web.Response:
    options = request.app[STATE].options
    model = options.model
    # Like OpenAI's, listing models needs the key: it is the cheapest check that a key works.
    presented = request.headers.get("Authorization", "").removeprefix("Bearer ")
    if options.expected_api_key is not None and presented != options.expected_api_key:
        return _error(401, f"Incorrect API key provided: {presented}.", "invalid_request_error", "invalid_api_key", {})
    return web.json_response(
        {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "local"}]}
    )


def make_app(options: EndpointOptions) -> web.Application:
    """The aiohttp application (routes and in-memory state)."""
    app = web.Application(client_max_size=256 * 1024**2)
    app[STATE] = EndpointState(options=options)
    app.router.add_post("/v1/chat/completions", _handle_generate)
    app.router.add_post("/v1/responses", _handle_generate)
    app.router.add_get("/v1/models", _handle_models)
    return app


def endpoint_state(runner: web.AppRunner) -> EndpointState:
    """The counter and request log of a started endpoint."""
    return runner.app[STATE]


async def start_endpoint(
    options: EndpointOptions | None = None, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Start serving; return the runner (call `cleanup()` to stop) and the base URL ending in /v1."""
    # Cancel handlers whose client went away, so a slow fault does not hold shutdown.
    runner = web.AppRunner(make_app(options or EndpointOptions()), handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]  # port 0 -> real port
    return runner, f"http://{bound[0]}:{bound[1]}/v1"


async def serve_until_signalled(options: EndpointOptions, host: str = "127.0.0.1", port: int = 0) -> None:
    """`rescue serve-vlm`: serve the endpoint until SIGINT or SIGTERM; OSError when it cannot listen."""
    runner, base_url = await start_endpoint(options, host, port)
    print(f"serving an OpenAI-compatible endpoint at {base_url} (answer={options.answer}, fault={options.fault})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
