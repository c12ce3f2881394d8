"""Log output for the `dtfm-peer` command: one line per event, human-readable or JSON lines.

Modules only call `logging.getLogger(__name__)`; handlers are set here, by the CLI alone.
Fields passed as `extra={...}` (for example `peer`) appear as `key=value` in human lines and as
keys in JSON lines.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import sys
import time
from pathlib import Path
from typing import TextIO

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


def _utc_iso(created: float) -> str:
    t = time.gmtime(created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(created % 1 * 1000):03d}Z"


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS and not k.startswith("_")}


def _one_line(text: str) -> str:
    return text.replace("\n", "\\n").replace("\r", "\\r")


def _exc_summary(record: logging.LogRecord) -> str:
    if not record.exc_info or record.exc_info[1] is None:
        return ""
    exc = record.exc_info[1]
    return f"{type(exc).__name__}: {exc}"


class HumanFormatter(logging.Formatter):
    """`2026-01-01T00:00:00.000Z INFO  dtfm.peer.daemon: message key=value`"""

    def format(self, record: logging.LogRecord) -> str:
        parts = [_utc_iso(record.created), f"{record.levelname:<5}", f"{record.name}:",
                 record.getMessage()]
        parts += [f"{k}={v}" for k, v in _extras(record).items()]
        exc = _exc_summary(record)
        if exc:
            parts.append(f"({exc})")
        line = _one_line(" ".join(parts))
        if record.exc_info and record.levelno >= logging.ERROR:
            # An unexpected failure: keep the traceback, escaped onto the same line.
            line += " traceback=" + _one_line(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then any extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, object] = {
            "ts": _utc_iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in _extras(record).items():
            obj.setdefault(k, v)
        exc = _exc_summary(record)
        if exc:
            obj["error"] = exc
        if record.exc_info and record.levelno >= logging.ERROR:
            obj["traceback"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


def configure(level: str = "info", *, json_lines: bool = False, stream: TextIO | None = None,
              file: Path | None = None, max_bytes: int = 32 << 20, backups: int = 3) -> logging.Handler:
    """Send dtfm's log records to `stream` (stderr by default), or to `file`, rotated past
    `max_bytes` with `backups` older files kept (FILE.1 the newest); returns the handler.
    OSError when the file cannot be opened."""
    handler: logging.Handler
    if file is not None:
        # (appended to: a restarted daemon goes on in the same file; delay=False opens it now,
        # so a bad path is an error at start, not at the first line)
        handler = logging.handlers.RotatingFileHandler(file, maxBytes=max_bytes, backupCount=backups,
                                                       encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if json_lines else HumanFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_dtfm", False):
            root.removeHandler(h)
            h.close()
    setattr(handler, "_dtfm", True)  # (this module's own handler, replaced by the next `configure`)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    return handler
