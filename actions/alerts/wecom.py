"""WeCom (企业微信) sink: a group robot webhook, `markdown` or `text` messages.

WeCom answers HTTP 200 with ``errcode`` in the body: 0 is success, 45009 (API frequency
limit) is retried like a 429, anything else (93000 bad key, 40008 bad type, ...) fails.
Markdown content is capped at 4096 bytes of UTF-8 and text at 2048, both cut on a
character boundary. A robot takes about 20 messages a minute.

The alert's title and body are attacker text: WeCom markdown has no escape syntax, so its
markup characters (``<font>``, ``<@user>``, links, ``**``, ``#``, ``@``) become full-width
look-alikes (`escape.markup_neutral`) in both message types; only the colour tag around
the title and the dashboard link are ours. Mentions come only from the policy's
``mentioned`` list, never from the text.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fabricwatch.actions.alerts.base import RESOLVED, Alert, SendResult
from fabricwatch.actions.escape import markup_neutral
from fabricwatch.actions.alerts.http import (FAIL, OK, RETRY, JsonPoster, RateLimiter, RetryPolicy, body_json,
                                            judge_http_status)
from fabricwatch.actions.alerts.message import truncate_utf8
from fabricwatch.models.vocabulary import CRITICAL, INFO, WARNING

MSG_TYPES = ("markdown", "text")
MAX_MARKDOWN_BYTES = 4096
MAX_TEXT_BYTES = 2048
RATE_LIMIT_ERRCODES = frozenset({45009})
# WeCom markdown has three colours: info (green), comment (grey), warning (orange-red).
_SEVERITY_COLOUR = {CRITICAL: "warning", WARNING: "warning", INFO: "comment"}


def wecom_message(alert: Alert, msg_type: str = "markdown", mentioned: Sequence[str] = ()) -> dict[str, Any]:
    """The webhook body; `mentioned` (user ids or "@all") only works for text messages."""
    title, body = markup_neutral(alert.title), markup_neutral(alert.body)
    if msg_type == "text":
        content = truncate_utf8(f"{title}\n{body}", MAX_TEXT_BYTES)
        text: dict[str, Any] = {"content": content}
        if mentioned:
            text["mentioned_list"] = list(mentioned)
        return {"msgtype": "text", "text": text}
    colour = "info" if alert.status == RESOLVED else _SEVERITY_COLOUR.get(alert.severity, "warning")
    lines = [f'**<font color="{colour}">{title}</font>**', body]
    lines.extend(f"[{markup_neutral(text)}]({url})" for text, url in alert.links)
    return {"msgtype": "markdown", "markdown": {"content": truncate_utf8("\n".join(lines), MAX_MARKDOWN_BYTES)}}


def judge_wecom(status: int, body: str) -> tuple[str, str]:
    verdict, why = judge_http_status(status, body)
    if verdict != OK:
        return verdict, why
    reply = body_json(body)
    errcode = None if reply is None else reply.get("errcode")
    if errcode == 0:
        return OK, "errcode 0"
    if errcode in RATE_LIMIT_ERRCODES:
        return RETRY, f"errcode {errcode} (rate limited)"
    return FAIL, "no errcode in the reply" if errcode is None else f"errcode {errcode}"


class WeComSink:
    """Posts alerts to one WeCom group robot (the webhook URL carries its key)."""

    name = "wecom"

    def __init__(self, webhook_url: str, msg_type: str = "markdown", mentioned: Sequence[str] = (),
                 policy: RetryPolicy | None = None):
        if not webhook_url.startswith(("http://", "https://")):
            raise ValueError(f"WeComSink webhook_url must be http(s), got {webhook_url!r}")
        if msg_type not in MSG_TYPES:
            raise ValueError(f"WeComSink msg_type must be one of {MSG_TYPES}, got {msg_type!r}")
        self.webhook_url = webhook_url
        self.msg_type = msg_type
        self.mentioned = tuple(mentioned)
        self._poster = JsonPoster(self.name, policy, RateLimiter.per_window((20, 60.0)))

    async def send(self, alert: Alert) -> SendResult:
        return await self._poster.post(self.webhook_url, wecom_message(alert, self.msg_type, self.mentioned),
                                       judge_wecom)

    async def tick(self, now_ns: int) -> None:
        """Nothing to do: a chat message needs no keep-alive."""

    async def close(self) -> None:
        await self._poster.close()
