"""Whether a VLM endpoint answered as the model the study asked for (pure).

Every answer names the model that produced it (`model` in the response, kept in the receipt as
`model_reported`). It is the requested model (`vlm.model`) when it is the same name, ignoring letter
case; or that name with a snapshot suffix, as OpenAI reports an alias by its dated version (`gpt-4.1`
answers as `gpt-4.1-2025-04-14`, `gpt-4` as `gpt-4-0613`); or that name with Ollama's default tag
(`llava` answers as `llava:latest`). Any other name is another model: another server on the port, a
proxy routing elsewhere. An answer that names no model is not compared.
"""

from __future__ import annotations

import re

_SNAPSHOT = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{4})")


def model_matches(requested: str, reported: str | None) -> bool:
    """True when `reported` names the `requested` model (or names none)."""
    if reported is None:
        return True
    want, got = requested.strip().lower(), reported.strip().lower()
    if got == want or (":" not in want and got == f"{want}:latest"):
        return True
    return got.startswith(want) and _SNAPSHOT.fullmatch(got[len(want):]) is not None


def mismatch(requested: str, reported: str | None) -> str | None:
    """One line saying that the endpoint answered as another model, or None when it did not."""
    if model_matches(requested, reported):
        return None
    return f"the endpoint answered as model {reported!r}, not the {requested!r} the study asked for"
