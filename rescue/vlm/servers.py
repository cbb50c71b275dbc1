"""What each VLM server reads: the field every generation setting goes on the wire as, and the
settings OpenAI's model families refuse (pure; `[vlm] server` names the server).

The `openai` SDK sends whatever it is given, and an OpenAI-compatible server reads only the fields of
its own request model. Read from each server's source:
- Ollama (`openai/openai.go` ChatCompletionRequest, `openai/responses.go` ResponsesRequest): chat reads
  `max_tokens` (its num_predict), `seed`, `temperature`, `response_format` (a json_schema's `schema`
  becomes its format), `reasoning_effort`/`reasoning.effort` (none, low, medium, high only);
  `/v1/responses` reads `max_output_tokens`; neither has `store`. Unknown fields are dropped silently
  (gin's JSON binding), so `max_completion_tokens` caps nothing there (ollama/ollama#7125).
- vLLM (`vllm/entrypoints/openai/chat_completion/protocol.py`): chat reads `max_completion_tokens`,
  `seed`, `temperature`, `reasoning_effort`, `response_format` json_schema (name, schema, strict) and has
  no `store`; every unknown field is logged ("The following fields were present in the request but
  ignored"), never refused. Its ResponsesRequest has `store` (kept only with
  VLLM_ENABLE_RESPONSES_API_STORE=1).
- SGLang (`python/sglang/srt/entrypoints/openai/protocol.py`): like vLLM's fields; chat has no `store`
  and drops unknown fields silently; its ResponsesRequest has `store`.
A setting a server does not read is not sent, so a receipt (`sent_generation`) never claims a cap
that nobody applied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from rescue.core.configuration.vlm_config import VLMConfig

Server = Literal["openai", "vllm", "ollama", "sglang"]
Api = Literal["chat", "responses"]
# The configured generation settings, by their VLMConfig names.
SETTINGS = ("max_output_tokens", "temperature", "seed", "reasoning_effort", "store")

_OPENAI_CHAT = {
    "max_output_tokens": "max_completion_tokens",
    "temperature": "temperature",
    "seed": "seed",
    "reasoning_effort": "reasoning_effort",
    "store": "store",
}
_OPENAI_RESPONSES = {
    "max_output_tokens": "max_output_tokens",
    "temperature": "temperature",
    "seed": None,  # the Responses API has no seed (VLMConfig refuses one)
    "reasoning_effort": "reasoning.effort",  # dotted: a nested object on the wire
    "store": "store",
}
# Server -> API -> setting -> the field it is sent as; None: the server does not read it, so it is not sent.
WIRE: dict[Server, dict[Api, dict[str, str | None]]] = {
    "openai": {"chat": _OPENAI_CHAT, "responses": _OPENAI_RESPONSES},
    "vllm": {"chat": {**_OPENAI_CHAT, "store": None}, "responses": _OPENAI_RESPONSES},
    "sglang": {"chat": {**_OPENAI_CHAT, "store": None}, "responses": _OPENAI_RESPONSES},
    "ollama": {
        "chat": {**_OPENAI_CHAT, "max_output_tokens": "max_tokens", "store": None},
        "responses": {**_OPENAI_RESPONSES, "store": None},
    },
}
# Every top-level field a generation setting can be sent as (what a receipt's `sent_generation` holds).
WIRE_FIELDS: tuple[str, ...] = tuple(sorted({
    name.split(".")[0] for apis in WIRE.values() for fields in apis.values() for name in fields.values() if name
}))
# The reasoning efforts a server accepts where it refuses the rest (Ollama: HTTP 400 "invalid reasoning value").
_EFFORTS: dict[tuple[Server, Api], frozenset[str]] = {
    ("ollama", "chat"): frozenset({"none", "low", "medium", "high"}),
    ("ollama", "responses"): frozenset({"none", "low", "medium", "high", "max"}),
}
_EFFORT_ORDER = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
OLLAMA_PORT = 11434  # Ollama's default port: a base URL on it without `server = "ollama"` loses its cap


def _listed(efforts: frozenset[str]) -> str:
    return ", ".join(e for e in _EFFORT_ORDER if e in efforts)


def server_of(cfg: VLMConfig) -> Server:
    """The server the calls are shaped for (None in the configuration: the OpenAI wire)."""
    return cfg.server or "openai"


def wire_names(cfg: VLMConfig) -> dict[str, str | None]:
    """Setting -> the field it is sent as on this configuration's server and API (None: not sent)."""
    return WIRE[server_of(cfg)][cfg.api]


def generation_fields(cfg: VLMConfig) -> dict[str, Any]:
    """The generation fields of every call, as sent: unset settings are left out, and so is every
    setting the server does not read; `store` is sent wherever it is read, so a provider never keeps
    a call by default."""
    out: dict[str, Any] = {}
    for setting, name in wire_names(cfg).items():
        value = getattr(cfg, setting)
        if name is None or value is None:
            continue
        head, _, leaf = name.partition(".")
        if leaf:
            out.setdefault(head, {})[leaf] = value
        else:
            out[head] = value
    return out


@dataclass(frozen=True)
class Family:
    """A family of OpenAI models and the reasoning settings OpenAI's API takes for it."""

    name: str
    pattern: str
    efforts: frozenset[str]
    """The reasoning efforts it takes; empty: not a reasoning model (`reasoning_effort` is refused)."""
    temperature: Literal["any", "default only", "with effort none"]
    """`default only`: any temperature but 1 is refused; `with effort none`: only with reasoning_effort none."""


# First match wins. From OpenAI's errors ("Unsupported parameter: 'reasoning_effort' is not supported with
# this model", "'temperature' does not support 0 with this model. Only the default (1) value is supported",
# "'minimal' is not supported with the 'gpt-5.1' model. Supported values are: 'none', 'low', 'medium',
# and 'high'") and its reasoning guide (models before gpt-5.1 take no `none`; `xhigh` came with gpt-5.1-codex-max).
_NO_EFFORT: frozenset[str] = frozenset()
FAMILIES: tuple[Family, ...] = (
    Family("gpt-5 chat", r"gpt-5(\.\d+)?-chat", _NO_EFFORT, "any"),
    Family("gpt-4 / gpt-4o / gpt-4.1", r"(gpt-4|chatgpt-4o|gpt-3\.5)", _NO_EFFORT, "any"),
    Family("o-series", r"o[134](-|$)", frozenset({"low", "medium", "high"}), "default only"),
    Family("gpt-5-pro", r"gpt-5-pro", frozenset({"high"}), "default only"),
    Family("gpt-5", r"gpt-5(-|$)", frozenset({"minimal", "low", "medium", "high"}), "default only"),
    Family("gpt-5.1-codex-max", r"gpt-5\.1-codex-max", frozenset({"none", "low", "medium", "high", "xhigh"}),
           "with effort none"),
    Family("gpt-5.1", r"gpt-5\.1(-|$)", frozenset({"none", "low", "medium", "high"}), "with effort none"),
    Family("gpt-5.2 and later", r"gpt-5\.\d+(-|$)", frozenset({"none", "low", "medium", "high", "xhigh"}),
           "with effort none"),
)


def openai_family(model: str) -> Family | None:
    """The OpenAI family a model name belongs to (a dated snapshot too; `openai/` prefix ignored), or None."""
    name = model.rsplit("/", 1)[-1].strip().lower()
    return next((f for f in FAMILIES if re.match(f.pattern, name)), None)


def _family_warnings(cfg: VLMConfig) -> list[str]:
    family = openai_family(cfg.model)
    if family is None:
        return []
    out = []
    effort, temperature = cfg.reasoning_effort, cfg.temperature
    where = f"with model {cfg.model!r} ({family.name} family)"
    if effort is not None and not family.efforts:
        out.append(f"vlm.reasoning_effort = {effort!r} {where}: OpenAI refuses it for a model that does not reason "
                   "(HTTP 400 unsupported_parameter); unset it, or name a reasoning model (o-series, gpt-5)")
    elif effort is not None and effort not in family.efforts:
        out.append(f"vlm.reasoning_effort = {effort!r} {where}: OpenAI takes only "
                   f"{_listed(family.efforts)} for it (HTTP 400 unsupported_value)")
    if temperature is not None and temperature != 1.0:
        if family.temperature == "default only":
            out.append(f"vlm.temperature = {temperature:g} {where}: OpenAI takes only the default temperature (1) "
                       "for this reasoning model (HTTP 400 unsupported_value); unset it")
        elif family.temperature == "with effort none" and effort not in (None, "none"):
            out.append(f"vlm.temperature = {temperature:g} {where}: OpenAI takes a temperature only with "
                       f"reasoning_effort 'none', not {effort!r} (HTTP 400 unsupported_value); unset one of them")
    return out


def config_warnings(cfg: VLMConfig) -> list[str]:
    """Settings the named server would drop or refuse, or the named OpenAI model family does not take,
    one line each (empty: none). Warnings, not errors: a provider may change what it takes."""
    server = server_of(cfg)
    out: list[str] = []
    if cfg.base_url == "local":
        return out  # the bundled endpoint reads every setting
    if cfg.server is None and re.search(rf":{OLLAMA_PORT}(/|$)", cfg.base_url):
        out.append(f"vlm.base_url {cfg.base_url!r} is on Ollama's port but vlm.server is unset: the OpenAI wire's "
                   "max_completion_tokens is dropped there (no cap); set vlm.server = \"ollama\"")
    if server != "openai" and "api.openai.com" in cfg.base_url:
        out.append(f"vlm.server = {server!r} with base_url {cfg.base_url!r}: OpenAI's API gets {server}'s field names; "
                   "unset vlm.server")
    names = wire_names(cfg)
    if cfg.store and names["store"] is None:
        out.append(f"vlm.store = true is not sent: {server}'s {cfg.api} endpoint has no store field and keeps nothing")
    elif cfg.store and server == "vllm" and cfg.api == "responses":
        out.append("vlm.store = true: vLLM keeps a response only when it runs with VLLM_ENABLE_RESPONSES_API_STORE=1")
    efforts = _EFFORTS.get((server, cfg.api))
    if efforts is not None and cfg.reasoning_effort is not None and cfg.reasoning_effort not in efforts:
        out.append(f"vlm.reasoning_effort = {cfg.reasoning_effort!r}: {server}'s {cfg.api} endpoint takes only "
                   f"{_listed(efforts)} (others are refused with HTTP 400)")
    if server == "openai":
        out += _family_warnings(cfg)
    return out
