"""Feishu / Lark sink: a custom group bot webhook, `text` or rich-text `post` messages.

Feishu answers HTTP 200 even when it rejects a message: success is ``code == 0`` in the
JSON body (older deployments send only ``StatusCode``). Codes 11232 and 230020 are its
send-rate limits and are retried like a 429; other codes (9499 bad request, 19021 bad
signature, ...) are failures. With a signing secret, each body carries ``timestamp`` and
``sign`` = base64(HMAC-SHA256(key=f"{timestamp}\\n{secret}", msg=b"")). A bot takes
5 messages a second and 100 a minute; the body must stay under 20 KB.

The alert's title and body are attacker text: a `text` message would turn
``<at user_id="all">`` into a mention of everyone, so markup characters become full-width
look-alikes (`escape.markup_neutral`) in both message types; `post` links are ours only.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Callable
from typing import Any

from fabricwatch.actions.alerts.base import Alert, SendResult
from fabricwatch.actions.escape import markup_neutral
from fabricwatch.actions.alerts.http import (FAIL, OK, RETRY, JsonPoster, RateLimiter, RetryPolicy, body_json,
                                            judge_http_status)
from fabricwatch.actions.alerts.message import truncate_utf8

MSG_TYPES = ("text", "post")
MAX_TEXT_BYTES = 18_000          # the whole body must stay under 20 KB
RATE_LIMIT_CODES = frozenset({11232, 230020})   # tenant / per-chat send-rate limits: retry


def feishu_sign(timestamp_s: int, secret: str) -> str:
    """The custom-bot signature: the key is "timestamp\\nsecret", the message is empty."""
    digest = hmac.new(f"{timestamp_s}\n{secret}".encode(), b"", hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def feishu_message(alert: Alert, msg_type: str = "post") -> dict[str, Any]:
    """The webhook body without signature."""
    title = markup_neutral(alert.title)
    body = truncate_utf8(markup_neutral(alert.body), MAX_TEXT_BYTES)
    if msg_type == "text":
        return {"msg_type": "text", "content": {"text": f"{title}\n{body}"}}
    paragraphs: list[list[dict[str, str]]] = [[{"tag": "text", "text": line}] for line in body.splitlines()]
    paragraphs.extend([[{"tag": "a", "text": markup_neutral(text), "href": url}] for text, url in alert.links])
    return {"msg_type": "post",
            "content": {"post": {"zh_cn": {"title": truncate_utf8(title, 1000), "content": paragraphs}}}}


def judge_feishu(status: int, body: str) -> tuple[str, str]:
    verdict, why = judge_http_status(status, body)
    reply = body_json(body)
    code = None if reply is None else reply.get("code", reply.get("StatusCode"))
    if code in RATE_LIMIT_CODES:
        return RETRY, f"code {code} (rate limited)"
    if verdict != OK:
        return verdict, why if code is None else f"code {code}"
    if code == 0:
        return OK, "code 0"
    return FAIL, "no code in the reply" if code is None else f"code {code}"


class FeishuSink:
    """Posts alerts to one Feishu/Lark custom bot; `secret` turns on signing."""

    name = "feishu"

    def __init__(self, webhook_url: str, secret: str = "", msg_type: str = "post",
                 policy: RetryPolicy | None = None, clock_s: Callable[[], float] = time.time):
        if not webhook_url.startswith(("http://", "https://")):
            raise ValueError(f"FeishuSink webhook_url must be http(s), got {webhook_url!r}")
        if msg_type not in MSG_TYPES:
            raise ValueError(f"FeishuSink msg_type must be one of {MSG_TYPES}, got {msg_type!r}")
        self.webhook_url = webhook_url
        self.secret = secret
        self.msg_type = msg_type
        self.clock_s = clock_s
        self._poster = JsonPoster(self.name, policy, RateLimiter.per_window((5, 1.0), (100, 60.0)))

    async def send(self, alert: Alert) -> SendResult:
        message = feishu_message(alert, self.msg_type)
        if self.secret:
            timestamp_s = int(self.clock_s())
            message.update(timestamp=str(timestamp_s), sign=feishu_sign(timestamp_s, self.secret))
        return await self._poster.post(self.webhook_url, message, judge_feishu)

    async def tick(self, now_ns: int) -> None:
        """Nothing to do: a chat message needs no keep-alive."""

    async def close(self) -> None:
        await self._poster.close()
