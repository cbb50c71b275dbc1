"""The VLM client against loopback servers shaped like Ollama's, vLLM's and OpenAI's endpoints.

Each server reads a request the way its source does (the fields of its request model, its checks,
what it does with a field it does not know: rescue/vlm/servers.py names the sources) and records what
it applied, dropped or logged. The real VLMClient drives it over HTTP through the `openai` SDK. Each
test also runs the OpenAI wire against the same server, so it fails if the per-server wire were faked:
Ollama then applies no cap, vLLM logs `store`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from conftest import HANG_S
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from structlog.testing import capture_logs

from rescue.core.configuration.config import HASHED_UNLESS_DEFAULT, HASHED_WHEN_SET, StudyConfig
from rescue.core.configuration.vlm_config import VLMConfig
from rescue.core.digest import canonical_json, digest_text
from rescue.core.images import VLM_VIEWS
from rescue.core.records import Receipt
from rescue.study.receipts import ReceiptLog, read_receipts
from rescue.vlm.answers import SubgoalRequest
from rescue.vlm.client import VLMClient
from rescue.vlm.servers import WIRE_FIELDS, config_warnings, generation_fields, openai_family
from rescue.vlm.exchange import probe_kwargs

pytestmark = pytest.mark.fast

# request_timeout_s bounds only a hang (conftest.HANG_S).
FAST = dict(backoff_initial_s=0.01, backoff_max_s=0.05, backoff_jitter_s=0.01, request_timeout_s=HANG_S, max_attempts=2)
SUBGOAL = "grasp the black bowl between the plate and the ramekin again, lift it, then place it on the plate"
CHARS_PER_TOKEN = 4  # the fake model's tokens: four characters each


@dataclass
class Seen:
    """What one request did to the server: what it applied, and what it dropped or logged."""

    path: str
    body: dict[str, Any]
    status: int = 200
    error: str | None = None
    dropped: list[str] = field(default_factory=list)  # fields the server read past without a word (Ollama)
    logged: list[str] = field(default_factory=list)  # the server's "present in the request but ignored" lines (vLLM)
    max_new_tokens: int | None = None  # the cap the generation ran under (Ollama: options.num_predict)
    options: dict[str, Any] = field(default_factory=dict)
    format: Any = None
    finish_reason: str | None = None
    completion_tokens: int | None = None


class RequestError(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


# ---- the fake model: answers the project's prompt, stops at its cap -------------------------


def _prompt_and_images(body: dict[str, Any], path: str) -> tuple[str, list[str]]:
    texts, urls = [], []
    if path.endswith("/chat/completions"):
        for message in body["messages"]:
            content = message.get("content")
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts:
                if part["type"] == "text":
                    texts.append(part["text"])
                else:
                    url = part["image_url"]
                    urls.append(url["url"] if isinstance(url, dict) else url)
    else:
        for item in body["input"]:
            for part in item["content"]:
                if part["type"] == "input_text":
                    texts.append(part["text"])
                else:
                    urls.append(part["image_url"])
    return "\n".join(texts), urls


def generate(body: dict[str, Any], path: str, cap: int | None) -> tuple[str, str, int, int]:
    """The model's reply to the REQUESTS block (one answer each), cut at `cap` tokens: text, finish, in, out."""
    text, urls = _prompt_and_images(body, path)
    block = next(line for line in reversed(text.splitlines()) if line.startswith("{") and '"requests"' in line)
    answers = [{"request_id": r["request_id"], "token": r["token"], "subgoal": SUBGOAL} for r in json.loads(block)["requests"]]
    reply, finish = json.dumps({"answers": answers}), "stop"
    if cap is not None and math.ceil(len(reply) / CHARS_PER_TOKEN) > cap:
        reply, finish = reply[: cap * CHARS_PER_TOKEN], "length"
    return reply, finish, len(text) // CHARS_PER_TOKEN + 85 * len(urls), math.ceil(len(reply) / CHARS_PER_TOKEN)


def _decode(b64: str) -> None:
    try:
        base64.b64decode(b64, validate=True)
    except binascii.Error:
        raise RequestError("invalid message format") from None


# ---- an Ollama-shaped server (ollama/ollama openai/openai.go, openai/responses.go, middleware/openai.go) ----

# The JSON fields of its ChatCompletionRequest and ResponsesRequest; gin's binding drops any other silently.
OLLAMA_CHAT_FIELDS = frozenset({
    "model", "messages", "stream", "stream_options", "max_tokens", "seed", "stop", "temperature",
    "frequency_penalty", "presence_penalty", "top_p", "response_format", "tools", "reasoning",
    "reasoning_effort", "_debug_render_only",
})
OLLAMA_RESPONSES_FIELDS = frozenset({
    "model", "background", "conversation", "include", "input", "instructions", "max_output_tokens",
    "reasoning", "temperature", "text", "top_p", "truncation", "tools", "stream",
})
OLLAMA_IMAGE_PREFIXES = tuple(f"data:image/{t};base64," for t in ("jpeg", "jpg", "png", "webp"))


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise RequestError(f"json: cannot unmarshal {type(value).__name__} into Go struct field .{name} of type int")
    return value


def _ollama_image(url: str) -> None:
    prefix = next((p for p in OLLAMA_IMAGE_PREFIXES if url.startswith(p)), None)
    if prefix is None:
        raise RequestError("invalid image input")
    _decode(url[len(prefix):])


def ollama_chat(body: dict[str, Any], seen: Seen) -> None:
    """FromChatRequest: the options and format the runner would get."""
    seen.dropped = sorted(set(body) - OLLAMA_CHAT_FIELDS)
    if not body.get("messages"):
        raise RequestError("[] is too short - 'messages'")
    for message in body["messages"]:
        if isinstance(message.get("content"), list):
            for part in message["content"]:
                if part.get("type") == "image_url":
                    url = part["image_url"]
                    _ollama_image(url["url"] if isinstance(url, dict) else url)
                elif part.get("type") != "text":
                    raise RequestError("invalid message format")
    options: dict[str, Any] = {}
    if (cap := _int_field(body, "max_tokens")) is not None:
        options["num_predict"] = cap
    options["temperature"] = body["temperature"] if body.get("temperature") is not None else 1.0
    if (seed := _int_field(body, "seed")) is not None:
        options["seed"] = seed
    options["top_p"] = body["top_p"] if body.get("top_p") is not None else 1.0
    fmt = body.get("response_format")
    if fmt and fmt.get("type", "").strip().lower() == "json_schema" and fmt.get("json_schema"):
        seen.format = fmt["json_schema"].get("schema")  # only the schema: name and strict are read past
    elif fmt and fmt.get("type", "").strip().lower() == "json_object":
        seen.format = "json"
    effort = (body.get("reasoning") or {}).get("effort") if body.get("reasoning") is not None else body.get("reasoning_effort")
    if effort and effort not in ("high", "medium", "low", "none"):
        raise RequestError(f"invalid reasoning value: '{effort}' (must be \"high\", \"medium\", \"low\", or \"none\")")
    if effort:
        options["think"] = effort != "none" and effort
    seen.options, seen.max_new_tokens = options, options.get("num_predict")


def ollama_responses(body: dict[str, Any], seen: Seen) -> None:
    """FromResponsesRequest: the options and format the runner would get."""
    seen.dropped = sorted(set(body) - OLLAMA_RESPONSES_FIELDS)
    for item in body.get("input") or []:
        for part in item.get("content") or []:
            if part.get("type") == "input_image":
                _ollama_image(part.get("image_url", ""))
            elif part.get("type") not in ("input_text", "output_text", "input_file"):
                raise RequestError(f"unknown content type: {part.get('type')}")
    options: dict[str, Any] = {"temperature": body["temperature"] if body.get("temperature") is not None else 1.0}
    if (cap := _int_field(body, "max_output_tokens")) is not None:
        options["num_predict"] = cap
    effort = (body.get("reasoning") or {}).get("effort")
    if effort and effort not in ("none", "low", "medium", "high", "max"):
        raise RequestError(f"invalid reasoning value: \"{effort}\" (must be \"high\", \"medium\", \"low\", \"max\", or \"none\")")
    if effort:
        options["think"] = effort != "none" and effort
    fmt = ((body.get("text") or {}).get("format") or {})
    if fmt.get("type") == "json_schema":
        seen.format = fmt.get("schema")
    seen.options, seen.max_new_tokens = options, options.get("num_predict")


# ---- a vLLM-shaped server (vllm/entrypoints/openai/chat_completion/protocol.py, engine/protocol.py) ----

VLLM_LOGGER = "vllm.entrypoints.openai.protocol"
vllm_log = logging.getLogger(VLLM_LOGGER)


class OpenAIBaseModel(BaseModel):
    """vLLM's request base: extra fields allowed, and every one logged, never refused."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            names = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            if any(k not in names for k in data):
                vllm_log.warning("The following fields were present in the request but ignored: %s", data.keys() - names)
        return result


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class VLLMChatCompletionRequest(OpenAIBaseModel):
    messages: list[dict[str, Any]]
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    seed: int | None = None
    stop: str | list[str] | None = []
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "none"
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)


class VLLMResponsesRequest(OpenAIBaseModel):
    background: bool | None = False
    include: list[str] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, Any] | None = None
    model: str | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    store: bool | None = True  # vLLM keeps nothing unless VLLM_ENABLE_RESPONSES_API_STORE=1
    stream: bool | None = False
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = 0
    top_p: float | None = None
    truncation: str | None = "disabled"
    user: str | None = None
    request_id: str = Field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    priority: int = 0


def _vllm_images(urls: list[str]) -> None:
    for url in urls:
        if not url.startswith("data:image/") or ";base64," not in url:
            raise RequestError("Invalid image URL")
        _decode(url.split(";base64,", 1)[1])


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def vllm_read(body: dict[str, Any], seen: Seen) -> None:
    """Validate as vLLM does, collecting the lines its validators log for this request."""
    handler = _Lines(seen.logged)
    vllm_log.addHandler(handler)
    try:
        try:
            if seen.path.endswith("/chat/completions"):
                req: Any = VLLMChatCompletionRequest.model_validate(body)
                seen.max_new_tokens = req.max_completion_tokens or req.max_tokens
                fmt = req.response_format
                seen.format = fmt.json_schema.json_schema if fmt and fmt.json_schema else None
            else:
                req = VLLMResponsesRequest.model_validate(body)
                seen.max_new_tokens = req.max_output_tokens
                seen.format = ((req.text or {}).get("format") or {}).get("schema")
        except ValidationError as exc:
            raise RequestError(str(exc).splitlines()[0]) from None
    finally:
        vllm_log.removeHandler(handler)
    seen.options = {"temperature": req.temperature, "seed": getattr(req, "seed", None)}
    _vllm_images(_prompt_and_images(body, seen.path)[1])


# ---- an OpenAI-shaped server: the refusals of OpenAI's model families --------------------------

# Model -> (efforts it takes, empty: not a reasoning model; temperature rule), as OpenAI's API answers.
OPENAI_MODELS: dict[str, tuple[frozenset[str], str]] = {
    "gpt-4.1": (frozenset(), "any"),
    "gpt-4o-2024-08-06": (frozenset(), "any"),
    "o3": (frozenset({"low", "medium", "high"}), "default"),
    "gpt-5-mini": (frozenset({"minimal", "low", "medium", "high"}), "default"),
    "gpt-5.1": (frozenset({"none", "low", "medium", "high"}), "effort none"),
}


def openai_read(body: dict[str, Any], seen: Seen) -> None:
    efforts, rule = OPENAI_MODELS[body["model"]]
    chat = seen.path.endswith("/chat/completions")
    effort = body.get("reasoning_effort") if chat else (body.get("reasoning") or {}).get("effort")
    param = "reasoning_effort" if chat else "reasoning.effort"
    if effort is not None and not efforts:
        raise RequestError(f"Unsupported parameter: '{param}' is not supported with this model.")
    if effort is not None and effort not in efforts:
        raise RequestError(f"Unsupported value: '{effort}' is not supported with the '{body['model']}' model.")
    temperature = body.get("temperature")
    if temperature is not None and temperature != 1 and (rule == "default" or (rule == "effort none" and effort not in (None, "none"))):
        raise RequestError(f"Unsupported value: 'temperature' does not support {temperature} with this model. "
                           "Only the default (1) value is supported.")
    seen.max_new_tokens = body.get("max_completion_tokens" if chat else "max_output_tokens")


# ---- serving them ------------------------------------------------------------------------


@dataclass
class Server:
    kind: str
    seen: list[Seen] = field(default_factory=list)


READERS = {
    "ollama": {"/v1/chat/completions": ollama_chat, "/v1/responses": ollama_responses},
    "vllm": {"/v1/chat/completions": vllm_read, "/v1/responses": vllm_read},
    "openai": {"/v1/chat/completions": openai_read, "/v1/responses": openai_read},
}
SERVER = web.AppKey("server", Server)


def _reply(kind: str, path: str, body: dict[str, Any], text: str, finish: str, n_in: int, n_out: int) -> dict[str, Any]:
    created, model = int(time.time()), body.get("model")
    if path.endswith("/responses"):
        return {
            "id": f"resp_{random.randrange(999999)}", "object": "response", "created_at": created,
            "status": "completed" if finish == "stop" else "incomplete", "model": model,
            "output": [{"type": "message", "id": f"msg_{random.randrange(999999)}", "status": "completed",
                        "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}],
            "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out},
        }
    message: dict[str, Any] = {"role": "assistant", "content": text}
    usage: dict[str, Any] = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
    if kind == "ollama":  # ToChatCompletion: no details, a three-digit id
        return {"id": f"chatcmpl-{random.randrange(999)}", "object": "chat.completion", "created": created,
                "model": model, "system_fingerprint": "fp_ollama",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
    message |= {"reasoning": None, "tool_calls": []} if kind == "vllm" else {"refusal": None}
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}], "usage": usage}


async def _handle(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    body = await request.json()
    seen = Seen(request.path, body)
    server.seen.append(seen)
    try:
        READERS[server.kind][request.path](body, seen)
    except RequestError as exc:
        seen.status, seen.error = 400, exc.message
        return web.json_response({"error": {"message": exc.message, "type": "invalid_request_error",
                                            "param": None, "code": None}}, status=400)
    text, seen.finish_reason, n_in, seen.completion_tokens = generate(body, request.path, seen.max_new_tokens)
    return web.json_response(_reply(server.kind, request.path, body, text, seen.finish_reason, n_in,
                                    seen.completion_tokens))


async def start(kind: str) -> tuple[web.AppRunner, str]:
    app = web.Application(client_max_size=64 * 1024**2)
    app[SERVER] = Server(kind)
    app.router.add_post("/v1/chat/completions", _handle)
    app.router.add_post("/v1/responses", _handle)
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
    return runner, f"http://{host}:{port}/v1"


def make_request(i: int = 0) -> SubgoalRequest:
    rng = np.random.default_rng(i)
    views = {n: rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for n in VLM_VIEWS}
    instruction = "pick up the black bowl between the plate and the ramekin and place it on the plate"
    return SubgoalRequest(case_id=f"case-{i}", instruction=instruction, remaining_steps=120, views=views)


def ask(tmp_path: Path, kind: str, **config: Any) -> tuple[Any, Server, list[Receipt]]:
    """One call of the real client to a `kind`-shaped server; the answer, what the server saw, the receipts."""
    receipts = tmp_path / "r.jsonl"

    async def go():
        runner, base_url = await start(kind)
        client = VLMClient(VLMConfig(base_url=base_url, **(FAST | config)), ReceiptLog(receipts))
        try:
            return await client.ask(make_request()), runner.app[SERVER]
        finally:
            await client.aclose()
            await runner.cleanup()

    answer, server = asyncio.run(go())
    return answer, server, read_receipts(receipts)


def wire_generation(body: dict[str, Any]) -> dict[str, Any]:
    """The generation fields of a body as the server received it."""
    return {k: body[k] for k in WIRE_FIELDS if k in body}


SETTINGS = dict(max_output_tokens=8, temperature=0.0, seed=7, reasoning_effort="low")


# ---- Ollama ----------------------------------------------------------------------------


def test_ollama_caps_the_reply_at_max_output_tokens_sent_as_max_tokens(tmp_path):
    answer, server, receipts = ask(tmp_path, "ollama", server="ollama", **SETTINGS)
    [seen] = server.seen
    # The cap arrives under the name Ollama reads; max_completion_tokens and store never arrive.
    assert seen.dropped == [] and "max_completion_tokens" not in seen.body and "store" not in seen.body
    assert seen.options == {"num_predict": 8, "temperature": 0.0, "seed": 7, "top_p": 1.0, "think": "low"}
    # The reply stops at the cap, cut mid-object as a capped generation is: unusable, never asked again.
    assert seen.finish_reason == "length" and seen.completion_tokens == 8
    assert answer.status == "invalid_response"
    outcome = receipts[-1]
    assert outcome.usage.output_tokens == 8
    # Every receipt records the fields exactly as the request carried them.
    sent = {"max_tokens": 8, "temperature": 0.0, "seed": 7, "reasoning_effort": "low"}
    assert wire_generation(seen.body) == sent and all(r.sent_generation == sent for r in receipts)
    assert outcome.generation == {**SETTINGS, "store": False}  # the configured settings, as before


def test_the_openai_wire_loses_the_cap_on_ollama_and_its_receipt_says_what_was_sent(tmp_path):
    # What the old wire did to an Ollama user: the cap is dropped without a word, the model runs on.
    answer, server, receipts = ask(tmp_path, "ollama", **SETTINGS)
    [seen] = server.seen
    assert seen.dropped == ["max_completion_tokens", "store"] and "num_predict" not in seen.options
    assert seen.finish_reason == "stop" and seen.completion_tokens > 8 and answer.status == "ok"
    assert receipts[-1].usage.output_tokens > 8
    # The receipt does not pretend the cap was honoured: it names the field that went, which Ollama does not read.
    assert receipts[-1].sent_generation == {"max_completion_tokens": 8, "temperature": 0.0, "seed": 7,
                                            "reasoning_effort": "low", "store": False}


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_whole_answer_from_ollama_on_both_apis(tmp_path, api):
    settings = dict(max_output_tokens=400, temperature=0.2, reasoning_effort="medium")
    if api == "chat":
        settings["seed"] = 3
    answer, server, receipts = ask(tmp_path, "ollama", server="ollama", api=api, **settings)
    [seen] = server.seen
    assert answer.status == "ok" and answer.subgoal == SUBGOAL
    assert seen.dropped == [] and seen.max_new_tokens == 400 and seen.finish_reason == "stop"
    assert seen.options["temperature"] == 0.2 and seen.options["think"] == "medium"
    assert seen.options.get("seed") == settings.get("seed")
    # The strict schema reaches Ollama as its format (it reads the json_schema's `schema`).
    assert seen.format["properties"]["answers"]["type"] == "array"
    cap = "max_tokens" if api == "chat" else "max_output_tokens"
    assert receipts[-1].sent_generation == wire_generation(seen.body)
    assert receipts[-1].sent_generation[cap] == 400 and "store" not in receipts[-1].sent_generation


def test_an_effort_ollama_refuses_is_warned_before_and_refused_by_it(tmp_path):
    config = dict(server="ollama", reasoning_effort="minimal")
    [warning] = config_warnings(VLMConfig(base_url="http://gpu-box:11434/v1", **config))
    assert "'minimal'" in warning and "none, low, medium, high" in warning
    answer, server, receipts = ask(tmp_path, "ollama", **config)
    assert server.seen[0].status == 400 and "invalid reasoning value" in server.seen[0].error
    assert answer.status == "broker_error" and answer.error_kind == "client" and receipts[-1].attempt == 1


# ---- vLLM ------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_vllm_logs_no_field_it_ignores_and_honours_the_cap(tmp_path, api):
    settings = {k: v for k, v in SETTINGS.items() if api == "chat" or k != "seed"}
    _, server, receipts = ask(tmp_path, "vllm", server="vllm", api=api, **settings)
    [seen] = server.seen
    assert seen.logged == []  # not one "present in the request but ignored" line
    assert seen.max_new_tokens == 8 and seen.finish_reason == "length" and receipts[-1].usage.output_tokens == 8
    assert seen.options["temperature"] == 0.0 and seen.format["properties"]["answers"]["type"] == "array"
    # `store` is a field of vLLM's ResponsesRequest (sent there, kept false) but not of its chat request.
    assert ("store" in seen.body) is (api == "responses")
    assert all(r.sent_generation == wire_generation(seen.body) for r in receipts)


def test_the_openai_wire_makes_vllm_log_store(tmp_path):
    _, server, receipts = ask(tmp_path, "vllm", **SETTINGS)
    [seen] = server.seen
    assert seen.logged == ["The following fields were present in the request but ignored: {'store'}"]
    assert receipts[-1].sent_generation["store"] is False  # sent, and the receipt says so


def test_vllm_answers_whole_without_a_cap(tmp_path):
    answer, server, receipts = ask(tmp_path, "vllm", server="vllm")
    assert answer.status == "ok" and answer.subgoal == SUBGOAL and server.seen[0].logged == []
    assert receipts[-1].sent_generation == {}  # nothing set, nothing sent: the server's defaults apply


# ---- OpenAI's model families: the config check warns where the API refuses ---------------------


@pytest.mark.parametrize(
    "model, api, settings",
    [
        ("gpt-4.1", "responses", dict(max_output_tokens=200, temperature=0.0, reasoning_effort="low")),  # README's example
        ("gpt-4.1", "responses", dict(max_output_tokens=200, temperature=0.0)),
        ("gpt-4o-2024-08-06", "chat", dict(reasoning_effort="high")),
        ("o3", "chat", dict(temperature=0.0, reasoning_effort="low")),
        ("o3", "chat", dict(reasoning_effort="low")),
        ("o3", "responses", dict(reasoning_effort="minimal")),
        ("gpt-5-mini", "chat", dict(temperature=0.2)),
        ("gpt-5-mini", "chat", dict(temperature=1.0, reasoning_effort="minimal")),
        ("gpt-5-mini", "chat", dict(reasoning_effort="none")),
        ("gpt-5.1", "chat", dict(temperature=0.2, reasoning_effort="none")),
        ("gpt-5.1", "responses", dict(temperature=0.2)),
        ("gpt-5.1", "responses", dict(temperature=0.2, reasoning_effort="low")),
        ("gpt-5.1", "chat", dict(reasoning_effort="minimal")),
    ],
)
def test_the_config_check_warns_exactly_where_openai_refuses(tmp_path, model, api, settings):
    answer, server, _ = ask(tmp_path, "openai", model=model, api=api, **settings)
    refused = server.seen[0].status == 400
    warnings = config_warnings(VLMConfig(base_url="https://api.openai.com/v1", model=model, api=api, **settings))
    assert bool(warnings) is refused, (warnings, server.seen[0].error)
    assert (answer.status == "ok") is not refused
    if refused:  # the warning names the setting OpenAI named
        assert any(("temperature" in server.seen[0].error) is ("vlm.temperature" in w) for w in warnings)


def test_the_client_says_each_warning_once_when_it_is_made(tmp_path):
    config = VLMConfig(base_url="https://api.openai.com/v1", api_key="sk-test", model="gpt-4.1",
                       reasoning_effort="low")
    with capture_logs() as logs:
        VLMClient(config, ReceiptLog(tmp_path / "r.jsonl"))
    [event] = [e for e in logs if e["event"] == "vlm.config_warning"]
    assert event["log_level"] == "warning" and "gpt-4.1" in event["warning"] and "reasoning_effort" in event["warning"]


# ---- the wire table, the warnings, old records ---------------------------------------------


@pytest.mark.parametrize(
    "server, api, expected",
    [
        (None, "chat", {"max_completion_tokens": 9, "temperature": 0.5, "reasoning_effort": "low", "store": False}),
        ("openai", "responses", {"max_output_tokens": 9, "temperature": 0.5, "reasoning": {"effort": "low"}, "store": False}),
        ("ollama", "chat", {"max_tokens": 9, "temperature": 0.5, "reasoning_effort": "low"}),
        ("ollama", "responses", {"max_output_tokens": 9, "temperature": 0.5, "reasoning": {"effort": "low"}}),
        ("vllm", "chat", {"max_completion_tokens": 9, "temperature": 0.5, "reasoning_effort": "low"}),
        ("vllm", "responses", {"max_output_tokens": 9, "temperature": 0.5, "reasoning": {"effort": "low"}, "store": False}),
        ("sglang", "chat", {"max_completion_tokens": 9, "temperature": 0.5, "reasoning_effort": "low"}),
        ("sglang", "responses", {"max_output_tokens": 9, "temperature": 0.5, "reasoning": {"effort": "low"}, "store": False}),
    ],
)
def test_each_server_gets_each_setting_under_the_name_it_reads(server, api, expected):
    cfg = VLMConfig(base_url="http://x/v1", server=server, api=api, max_output_tokens=9, temperature=0.5,
                    reasoning_effort="low")
    assert generation_fields(cfg) == expected


def test_the_start_check_caps_its_one_token_under_the_servers_name():
    assert probe_kwargs(VLMConfig(base_url="http://x/v1", server="ollama"))["max_tokens"] == 1
    assert probe_kwargs(VLMConfig(base_url="http://x/v1"))["max_completion_tokens"] == 1


def test_warnings_for_a_server_that_keeps_nothing_or_a_url_that_names_another():
    assert config_warnings(VLMConfig(base_url="http://h:11434/v1", max_output_tokens=50)) == [(
        "vlm.base_url 'http://h:11434/v1' is on Ollama's port but vlm.server is unset: the OpenAI wire's "
        "max_completion_tokens is dropped there (no cap); set vlm.server = \"ollama\""
    )]
    [store] = config_warnings(VLMConfig(base_url="http://h:8000/v1", server="vllm", store=True))
    assert store.startswith("vlm.store = true is not sent: vllm's chat endpoint has no store field")
    [wrong] = config_warnings(VLMConfig(base_url="https://api.openai.com/v1", server="ollama"))
    assert "unset vlm.server" in wrong
    # The bundled endpoint and a model of no known family: nothing to say.
    assert config_warnings(VLMConfig(reasoning_effort="low", temperature=0.0)) == []
    assert config_warnings(VLMConfig(base_url="http://h:8000/v1", server="vllm", model="Qwen/Qwen2.5-VL-7B",
                                     reasoning_effort="low", temperature=0.0)) == []


@pytest.mark.parametrize(
    "model, family",
    [("gpt-4.1-mini", "gpt-4 / gpt-4o / gpt-4.1"), ("openai/gpt-4o", "gpt-4 / gpt-4o / gpt-4.1"),
     ("o4-mini-2025-04-16", "o-series"), ("gpt-5", "gpt-5"), ("gpt-5-chat-latest", "gpt-5 chat"),
     ("gpt-5.2", "gpt-5.2 and later"), ("gpt-5.1-codex-max", "gpt-5.1-codex-max"), ("omni-moderation", None),
     ("o3", "o-series"), ("olmo-2", None)],
)
def test_model_families_by_name(model, family):
    found = openai_family(model)
    assert (found.name if found else None) == family


def test_a_receipt_written_before_sent_generation_still_reads(tmp_path):
    line = json.loads(Receipt(kind="outcome", call_id="c", attempt=1, request_ids=["r"], case_ids=["k"],
                              model_requested="m", endpoint_kind="chat", prompt_template="t",
                              prompt_template_sha256="0" * 64, prompt_sha256="1" * 64, started_at=1.0,
                              status="ok").model_dump_json())
    del line["sent_generation"]
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(line) + "\n")
    [old] = read_receipts(path)
    assert old.sent_generation is None and old.generation == {}


def test_an_older_studys_digest_holds_with_server_unset_and_counts_once_set():
    assert ("vlm", "server") in HASHED_WHEN_SET
    config = StudyConfig()
    older = config.model_dump(mode="json")
    older["vlm"] = {k: v for k, v in older["vlm"].items() if (("vlm", k) not in HASHED_WHEN_SET)}
    older["sham"] = {k: v for k, v in older["sham"].items() if (("sham", k) not in HASHED_WHEN_SET)}
    older["env"] = {k: v for k, v in older["env"].items() if (("env", k) not in HASHED_WHEN_SET)}
    older["policy"] = {k: v for k, v in older["policy"].items() if (("policy", k) not in HASHED_WHEN_SET)}
    # The top level's: advisors, query points; continuations at its default.
    older = {k: v for k, v in older.items() if (None, k) not in HASHED_WHEN_SET and (None, k, v) not in HASHED_UNLESS_DEFAULT}
    assert config.sha256() == digest_text(canonical_json(older))
    assert StudyConfig(vlm=VLMConfig(server="ollama")).sha256() != config.sha256()
