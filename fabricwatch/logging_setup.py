"""Logging for every fabricwatch process: human-readable text, or one JSON object per line.

    fabricwatch --log-format json --log-level INFO worker ...

A text line is one line: control characters in the message (a newline in a node name or
a label a collector sent) are written as escapes (``\\n``, ``\\x1b``), so no input can
forge a log line. A traceback still follows on its own lines.

A JSON line holds ``ts`` (UTC, RFC 3339 with milliseconds), ``level``, ``logger`` and
``msg`` (the formatted message), then every field the call passed with ``extra=``, e.g.
``log.info("anomaly opened", extra={"anomaly_id": eid, "kind": kind})`` adds
``"anomaly_id"`` and ``"kind"``, so a log pipeline can join logs to anomaly and action
ids. A traceback goes in ``exc``. Values that JSON cannot hold are written as ``str()``.
"""
from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import TextIO

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Every attribute a plain LogRecord has: whatever else is on a record came from `extra=`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


# C0/C1 controls, line/paragraph separators, zero-width and bidi formatting characters
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape_control(text: str) -> str:
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT with the message's control characters escaped: one record, one line.

    >>> record = logging.LogRecord("x", logging.WARNING, "", 0, "node %s", ("n1\\nFAKE ERROR x",), None)
    >>> TextFormatter("%(levelname)s %(message)s").format(record)
    'WARNING node n1\\\\nFAKE ERROR x'
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _escape_control(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = record.stack_info
        return json.dumps(out, default=str, ensure_ascii=False)


def make_handler(log_format: str = "text", stream: TextIO | None = None) -> logging.Handler:
    if log_format not in FORMATS:
        raise ValueError(f"--log-format {log_format!r}: expected one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT))
    return handler


def configure_logging(level: str | int = "WARNING", log_format: str = "text", stream: TextIO | None = None) -> None:
    """Replace the root logger's handlers with one writing `log_format` to `stream` (stderr)."""
    handler = make_handler(log_format, stream)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
