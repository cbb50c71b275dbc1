"""Prompt templates: files under `prompts/`, identified by name and sha256.

A template is plain text rendered with `str.format`; its sha256 (of the file's
bytes) goes into every receipt, so a changed template is a different prompt.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from rescue.core.inputs import MAX_PROMPT_BYTES, read_input

# Package data (a link to the top-level prompts/ in a checkout), so any install finds it.
DEFAULT_ROOT = Path(str(resources.files("rescue") / "assets" / "prompts"))


class Template(BaseModel):
    """A prompt template as loaded from disk."""

    model_config = ConfigDict(frozen=True)

    name: str
    text: str
    sha256: str


def load_template(name: str, root: Path | str | None = None) -> Template:
    """Read `<root>/<name>.txt` (default root: the repository's `prompts/`); InputFileError names a file
    that cannot be one."""
    folder = Path(root) if root is not None else DEFAULT_ROOT
    path = folder / f"{name}.txt"
    data = read_input(path, MAX_PROMPT_BYTES, "prompt template")  # InputFileError: not a regular file, or too long
    return Template(name=name, text=data.decode("utf-8"), sha256=hashlib.sha256(data).hexdigest())


def render(template: Template, **fields: object) -> str:
    """Fill the template's placeholders; a missing field raises KeyError."""
    return template.text.format(**fields)


def prompt_sha256(text: str) -> str:
    """Digest of a rendered prompt, as stored in receipts."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
