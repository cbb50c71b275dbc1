"""How the VLM is asked: one pydantic model, part of a study's configuration (no SDK import)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

# What a masked SecretStr dumps as; older study folders stored it in config.json.
_MASK = "**********"
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class MissingAPIKey(ValueError):
    """The study's key came from its config file, which is never stored, and none was supplied again."""


class VLMConfig(BaseModel):
    """Everything that decides how the VLM is asked. It holds no secret in its dumps: `api_key` is excluded."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = "local"  # "local": the bundled endpoint on loopback
    api_key: SecretStr | None = Field(default=None, exclude=True, repr=False)
    """Used for calls, never written (not in dumps, receipts or logs); prefer `api_key_env`."""
    api_key_from_config: bool = False
    """Set when `api_key` was given: a resumed study must be given the key again (see `missing_key_message`)."""
    api_key_env: str = "OPENAI_API_KEY"
    model: str = "rescue-advisor-v0"
    api: Literal["chat", "responses"] = "chat"
    structured: bool = True
    deadline_s: float = 1200.0
    request_timeout_s: float = 120.0
    max_attempts: int = 5
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    """Also the cap on a server's Retry-After."""
    backoff_jitter_s: float = 1.0
    max_subgoal_chars: int = 1500
    prompt_template: str = "subgoal_v1"
    prompt_root: str | None = None  # None: the shipped prompts folder
    # One limit for the whole study, however many simulators or cluster nodes feed it (None: none).
    max_concurrent_calls: int | None = Field(default=None, gt=0)
    """Requests in flight at once."""
    requests_per_minute: float | None = Field(default=None, gt=0)
    """Requests start at most this often, evenly spaced; retries count."""
    batch_size: int = 1  # 1 = every case gets its own call
    batch_window_s: float = 60.0
    image_format: Literal["png"] = "png"
    image_detail: Literal["auto", "low", "high"] = "auto"
    # Generation settings (DESIGN §9): part of the study's identity, recorded in every receipt.
    # None: not sent (the provider's default applies).
    max_output_tokens: int | None = Field(default=None, gt=0)
    """Sent as `max_completion_tokens` (chat) or `max_output_tokens` (responses)."""
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    seed: int | None = None
    """Chat only: the Responses API has no seed."""
    reasoning_effort: ReasoningEffort | None = None
    """Sent as `reasoning_effort` (chat) or `reasoning.effort` (responses), only when set."""
    store: bool = False
    """Whether the provider may store the request and response (sent on both APIs)."""

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
