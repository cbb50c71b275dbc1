"""How a VLM is asked: endpoint, model, generation settings, declared prices and advisors.

No SDK import, so the read side loads a study's VLM settings without the runtime.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from rescue.core.arms import ADVISOR_NAME
from rescue.core.prompts import DEFAULT_ROOT

# The default prompt template, and the one an advisor that may decline is asked with instead (DESIGN §18).
DEFAULT_TEMPLATE = "subgoal_v1"
DECLINING_TEMPLATE = "subgoal_or_keep_v1"
# What a masked SecretStr dumps as; older study folders stored it in config.json.
_MASK = "**********"
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class MissingAPIKey(ValueError):
    """The study's key came from its config file, which is never stored, and none was supplied again."""


class TokenPrice(BaseModel):
    """A declared price per million tokens of each kind, in whatever unit it is declared in (USD, say)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    input: float = Field(ge=0)
    """The price of a million input tokens (images included); cached input tokens too unless `cached_input` is set."""
    output: float = Field(ge=0)
    """The price of a million output tokens; reasoning tokens are output tokens (as OpenAI counts and bills them)."""
    cached_input: float | None = Field(default=None, ge=0)
    """The price of a million input tokens served from the provider's prompt cache; None: the `input` price."""

    def cost(self, input_tokens: int | None, cached_input_tokens: int | None, output_tokens: int | None) -> float | None:
        """The cost of these totals; None when a count the price needs is unknown (never guessed)."""
        if input_tokens is None or output_tokens is None:
            return None
        if self.cached_input is None or self.cached_input == self.input:
            return (input_tokens * self.input + output_tokens * self.output) / 1e6
        if cached_input_tokens is None:
            return None
        fresh = input_tokens - cached_input_tokens
        return (fresh * self.input + cached_input_tokens * self.cached_input + output_tokens * self.output) / 1e6


def url_without_secrets(url: str) -> str:
    """A URL as text: no user or password, no query string (either may carry a key)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else url


def endpoint_host(base_url: str) -> str:
    """A VLM endpoint as a report names it: `local`, else its host and port (a URL's user, password and query
    may carry a key)."""
    if base_url == "local":
        return "local"
    parts = urlsplit(base_url)
    if not parts.hostname:
        return base_url
    return f"{parts.hostname}:{parts.port}" if parts.port else parts.hostname


class VLMConfig(BaseModel):
    """Everything that decides how the VLM is asked. It holds no secret in its dumps: `api_key` is excluded."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    base_url: str = "local"
    """Base URL of the OpenAI-compatible API; `local`: the bundled endpoint on loopback."""
    api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)
    """Used for calls, never written (not in dumps, receipts or logs); prefer `api_key_env`."""
    api_key_from_config: bool = False
    """Set when `api_key` was given: a resumed study must be given the key again (see `missing_key_message`)."""
    api_key_env: str = "OPENAI_API_KEY"
    """The environment variable the key is read from when `api_key` is not given."""
    model: str = "rescue-advisor-v0"
    """The model every call asks for."""
    api: Literal["chat", "responses"] = "chat"
    """Which API the calls use: chat completions or responses."""
    structured: bool = True
    """Whether calls ask for structured output (a strict JSON schema of the answers); False: free text, parsed."""
    deadline_s: float = 1200.0
    """Seconds from a request (a batch: its first) to its answer, retries and backoff included; then `timeout`."""
    request_timeout_s: float = 120.0
    """Seconds one HTTP attempt may take."""
    max_attempts: int = 5
    """HTTP attempts per call at most (infrastructure retries, recorded in the receipts)."""
    backoff_initial_s: float = 1.0
    """Seconds before the first retry; doubled before each further one."""
    backoff_max_s: float = 60.0
    """The longest wait between attempts, seconds; also the cap on a server's Retry-After."""
    backoff_jitter_s: float = 1.0
    """Up to this many random seconds added to each backoff."""
    max_subgoal_chars: int = 1500
    """Longest subgoal accepted, in characters; a longer answer is rejected (`invalid_response`)."""
    prompt_template: str = DEFAULT_TEMPLATE
    """Name of the prompt template (a file in the prompts folder)."""
    prompt_root: str | None = None
    """Folder of the prompt templates; None: the shipped prompts folder."""
    # One limit for the whole study, however many simulators or cluster nodes feed it (None: none).
    max_concurrent_calls: int | None = Field(default=None, gt=0)
    """Requests in flight at once; None: no limit."""
    requests_per_minute: float | None = Field(default=None, gt=0)
    """Requests start at most this often, evenly spaced; retries count. None: no limit."""
    batch_size: int = 1
    """Cases per call at most; 1: every case gets its own call."""
    batch_window_s: float = 60.0
    """Seconds a partly filled batch waits for more cases before it is sent."""
    image_format: Literal["png"] = "png"
    """How the images are encoded (PNG only)."""
    image_detail: Literal["auto", "low", "high"] = "auto"
    """The `detail` hint sent with each image."""
    # Generation settings (DESIGN §9): part of the study's identity, recorded in every receipt.
    # None: not sent (the provider's default applies).
    max_output_tokens: int | None = Field(default=None, gt=0)
    """Sent as `max_completion_tokens` (chat; `max_tokens` to Ollama, see `server`) or `max_output_tokens`
    (responses); None: not sent."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    """Sampling temperature; None: not sent."""
    seed: int | None = None
    """Sampling seed; chat only: the Responses API has no seed. None: not sent."""
    reasoning_effort: ReasoningEffort | None = None
    """Sent as `reasoning_effort` (chat) or `reasoning.effort` (responses), only when set."""
    store: bool = False
    """Whether the provider may store the request and response (sent on both APIs wherever the server
    reads it; Ollama's endpoints and vLLM's and SGLang's chat have no such field)."""
    server: Literal["openai", "vllm", "ollama", "sglang"] | None = None
    """What serves `base_url`: it decides the field each generation setting is sent as, and drops the
    ones that server does not read (rescue/vlm/servers.py). None: the OpenAI wire (OpenAI, the bundled
    endpoint); `ollama`: the cap as `max_tokens` on chat, no `store`; `vllm`, `sglang`: no `store` on chat.
    Receipts record the fields as sent (`sent_generation`)."""
    startup_check: Literal["models", "call", "none"] | None = None
    """What a start asks the endpoint before the first claim: `models` (None: the default) lists its
    models (the cheapest request that needs the key; a server without `/models` passes), `call` sends
    one minimal chat call (1 output token), `none` asks nothing."""
    price: TokenPrice | None = None
    """The declared price per million tokens of each kind (`{input = 2.0, output = 8.0}`); usage then has a cost.
    None: the cost is unknown (never guessed)."""
    lab_budget: float | None = Field(default=None, gt=0)
    """The lab's cap on the declared cost of VLM calls, shared by every study whose calls go into the same ledger
    (rescue/study/ledger.py), in the unit of `price`: a case is claimed only when its calls' estimated cost fits
    under it, else the study stops claiming (exit 3). Needs a declared price. None: no cap, no ledger."""
    lab_ledger: str | None = None
    """The folder of the lab's ledger (`ledger.sqlite`), made absolute when the study is created; None: `receipts/`
    in the working directory then. Only with `lab_budget`."""
    require_model_match: bool | None = None
    """Whether an answer from an endpoint that reports another model than `model` is refused
    (`invalid_response`, error kind `model_mismatch`; rescue/core/reported_model.py says what matches).
    None: true, since an answer of another model is no evidence about the one the study names. False
    (e.g. a proxy that reports its deployment's own name): the answer is applied, and preflight, the
    terminal summary and the report warn."""

    may_decline: bool | None = None
    """Whether the advisor may answer "keep the instruction" (DESIGN §18): its answers then carry
    `keep_instruction`, and a declined arm runs on unchanged, labelled `declined`. None: false. With the default
    prompt template, its declining counterpart (`subgoal_or_keep_v1`) is asked."""

    @property
    def refuses_other_models(self) -> bool:
        """`require_model_match` resolved: True unless set false."""
        return self.require_model_match is not False

    @model_validator(mode="before")
    @classmethod
    def _key_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("api_key") is not None:
            data = dict(data)
            key = data["api_key"]
            if (key.get_secret_value() if isinstance(key, SecretStr) else key) == _MASK:
                data["api_key"] = None  # a mask written by an older version is not a key
            data["api_key_from_config"] = True
        return data

    @model_validator(mode="after")
    def _declining_prompt(self) -> "VLMConfig":
        # An advisor that may decline is told so: the default template's counterpart offers "keep the instruction".
        if self.may_decline and self.prompt_template == DEFAULT_TEMPLATE:
            self.prompt_template = DECLINING_TEMPLATE
        return self

    @model_validator(mode="after")
    def _seed_needs_chat(self) -> "VLMConfig":
        if self.seed is not None and self.api == "responses":
            raise ValueError("the Responses API has no seed: unset vlm.seed or use vlm.api = 'chat'")
        return self

    def generation(self) -> dict[str, Any]:
        """The generation settings as recorded in receipts (None: not sent)."""
        return {
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "reasoning_effort": self.reasoning_effort,
            "store": self.store,
        }

    def missing_key_message(self) -> str | None:
        """Why no key can be sent, and how to supply it again (None: a key is at hand or none is needed)."""
        if self.api_key is not None or os.environ.get(self.api_key_env) or not self.api_key_from_config:
            return None
        return (
            "this study's VLM key was given as [vlm] api_key and is never stored in the study; "
            f"supply it again by setting the environment variable {self.api_key_env} "
            "(the study's vlm.api_key_env) before resuming"
        )

    def resolved_api_key(self) -> str:
        """The key to send: explicit, else from `api_key_env`, else a placeholder for local servers."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        message = self.missing_key_message()
        if message is not None:
            raise MissingAPIKey(message)
        return os.environ.get(self.api_key_env) or "none"


class AdvisorConfig(VLMConfig):
    """One advisor (DESIGN §11): a named VLM configuration (endpoint, model, API, prompt template, generation
    settings, batching). A study of several runs one assisted arm per advisor, `assisted:<name>`."""

    name: str = Field(pattern=rf"^{ADVISOR_NAME}$")
    """The advisor's name: letters, digits, `_`, `.` or `-`; its arm is `assisted:<name>` and every receipt of its
    calls names it."""
    endpoint: str | None = None
    """The service endpoint (`rescue serve`'s `[vlm.<name>]`) this advisor's URL and key came from; None: the
    configuration gave them (`base_url`, `api_key_env`)."""

    @model_validator(mode="after")
    def _lab_budget_in_vlm(self) -> "AdvisorConfig":
        if self.lab_budget is not None or self.lab_ledger is not None:
            raise ValueError("the lab budget is one for the study's calls: set lab_budget (and lab_ledger) in [vlm]")
        return self

    @model_validator(mode="before")
    @classmethod
    def _prompt_file(cls, data: Any) -> Any:
        # `prompt = "prompts/subgoal_v1.txt"`: a template file, stored as its name and folder.
        if not isinstance(data, dict) or "prompt" not in data:
            return data
        data = dict(data)
        prompt = data.pop("prompt")
        if "prompt_template" in data or "prompt_root" in data:
            raise ValueError("give prompt (a template file) or prompt_template and prompt_root, not both")
        path = Path(str(prompt))
        if path.suffix != ".txt" and len(path.parts) == 1:
            data["prompt_template"] = str(prompt)
            return data
        if path.suffix != ".txt" or not path.is_file():
            raise ValueError(f"prompt {prompt!r}: no such template file (a .txt file, relative to the working folder)")
        data["prompt_template"] = path.stem
        folder = path.parent.resolve()
        data["prompt_root"] = None if folder == DEFAULT_ROOT.resolve() else str(folder)
        return data
