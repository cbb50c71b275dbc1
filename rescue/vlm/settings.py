"""How the VLM is asked: one pydantic model, part of a study's configuration (no SDK import)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, SecretStr


class VLMConfig(BaseModel):
    """Everything that decides how the VLM is asked (the key is never serialised in clear)."""

    base_url: str
    api_key: SecretStr | None = None
    api_key_env: str = "OPENAI_API_KEY"
    model: str = "rescue-advisor-v0"
    api: Literal["chat", "responses"] = "chat"
    structured: bool = True
    deadline_s: float = 1200.0
    request_timeout_s: float = 120.0
    max_attempts: int = 5
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    backoff_jitter_s: float = 1.0
    max_subgoal_chars: int = 1500
    prompt_template: str = "subgoal_v1"
    prompt_root: str | None = None  # None: the repository's prompts/ folder
    batch_size: int = 1  # 1 = every case gets its own call
    batch_window_s: float = 60.0
    image_format: Literal["png"] = "png"
    image_detail: Literal["auto", "low", "high"] = "auto"

    def resolved_api_key(self) -> str:
        """The key to send: explicit, else from `api_key_env`, else a placeholder for local servers."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(self.api_key_env) or "none"
