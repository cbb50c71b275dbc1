"""structlog set-up: every event as a JSON line in the study folder, warnings on the terminal."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import structlog

_LEVELS = {"debug": 10, "info": 20, "warning": 30, "warn": 30, "error": 40, "exception": 40, "critical": 50}
_sink: Any = None


def configure(events_path: Path | None = None, verbose: bool = False) -> None:
    """Send events to `events_path` (JSON lines) and, at warning or above unless verbose, to stderr."""
    global _sink
    if _sink is not None:
        _sink.close()
        _sink = None
    if events_path is not None:
        events_path.parent.mkdir(parents=True, exist_ok=True)
        _sink = open(events_path, "a", encoding="utf-8")
    threshold = 20 if verbose else 30

    def tee(_logger: Any, method: str, event: dict) -> dict:
        global _sink
        if _sink is not None:
            try:
                _sink.write(json.dumps(event, default=str, sort_keys=True) + "\n")
                _sink.flush()
            except OSError as exc:
                # A full disk must not turn every log call into a failure of the code that logs:
                # the events file stops, once, with one line; the journal decides what is lost.
                print(f"rescue: {events_path} is no longer written ({exc.strerror or exc})", file=sys.stderr)
                _sink = None
        if _LEVELS.get(method, 20) < threshold:
            raise structlog.DropEvent
        return event

    logging.getLogger("robosuite").setLevel(logging.ERROR)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            tee,
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
