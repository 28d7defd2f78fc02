"""Slack sink: an incoming webhook message with a plain-text fallback and Block Kit sections.

Slack answers 200 "ok"; a section text over 3000 characters is a 400, so every section
is capped below that. Incoming webhooks allow about one message a second with short
bursts: the sink's rate limiter holds 3 and refills 1 per second.

The alert's title and body are attacker text (`escape`): they travel as ``plain_text``
(no formatting, no mentions, no links) and the notification fallback is escaped and sent
with ``mrkdwn: false``; only the dashboard link, which is ours, is mrkdwn (``verbatim``).
Unfurling is off, so no URL is fetched by Slack either.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fabricwatch.actions.alerts.base import RESOLVED, Alert, SendResult
from fabricwatch.actions.escape import slack_escape
from fabricwatch.actions.alerts.http import JsonPoster, RateLimiter, RetryPolicy, TokenBucket
from fabricwatch.actions.alerts.message import truncate_chars
from fabricwatch.models.vocabulary import CRITICAL, INFO, WARNING

MAX_SECTION_CHARS = 2900     # Slack rejects a section text over 3000
MAX_FALLBACK_CHARS = 3000
_SEVERITY_EMOJI = {CRITICAL: "\U0001f534", WARNING: "\U0001f7e0", INFO: "\U0001f535"}
_RESOLVED_EMOJI = "\u2705"

mrkdwn_escape = slack_escape     # the name callers used before `escape` existed


def _plain(text: str) -> dict[str, Any]:
    # plain_text: Slack shows it as it is (emoji off, so ":shortcodes:" stay text too)
    return {"type": "plain_text", "text": truncate_chars(text, MAX_SECTION_CHARS), "emoji": False}


def slack_message(alert: Alert) -> dict[str, Any]:
    """The webhook body: `text` (notifications, fallback) and `blocks` (what the channel shows)."""
    emoji = _RESOLVED_EMOJI if alert.status == RESOLVED else _SEVERITY_EMOJI.get(alert.severity, "\u26a0")
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": _plain(f"{emoji} {alert.title}")},
        {"type": "section", "text": _plain(alert.body)},
    ]
    if alert.links:
        links = " | ".join(f"<{url}|{slack_escape(text)}>" for text, url in alert.links)
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "verbatim": True,
                                                        "text": truncate_chars(links, MAX_SECTION_CHARS)}]})
    return {"text": truncate_chars(slack_escape(alert.title), MAX_FALLBACK_CHARS), "mrkdwn": False,
            "unfurl_links": False, "unfurl_media": False, "blocks": blocks}


class SlackSink:
    """Posts alerts to one Slack incoming webhook URL."""

    name = "slack"

    def __init__(self, webhook_url: str, policy: RetryPolicy | None = None, burst: int = 3,
                 per_second: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Any] = asyncio.sleep):
        if not webhook_url.startswith(("http://", "https://")):
            raise ValueError(f"SlackSink webhook_url must be http(s), got {webhook_url!r}")
        self.webhook_url = webhook_url
        self.burst = burst
        self.per_second = per_second
        self._poster = JsonPoster(self.name, policy, RateLimiter(TokenBucket(burst, per_second, clock=clock), sleep=sleep),
                                  clock=clock, sleep=sleep)

    async def send(self, alert: Alert) -> SendResult:
        return await self._poster.post(self.webhook_url, slack_message(alert))

    async def tick(self, now_ns: int) -> None:
        """Nothing to do: a chat message needs no keep-alive."""

    async def close(self) -> None:
        await self._poster.close()
