"""Slack sink: an incoming webhook message with a plain-text fallback and Block Kit sections.

Slack answers 200 "ok"; a section text over 3000 characters is a 400, so every section
is capped below that. Incoming webhooks allow about one message a second with short
bursts: the sink's rate limiter holds 3 and refills 1 per second.
"""
from __future__ import annotations

from typing import Any

from fabricwatch.actions.alerts.base import RESOLVED, Alert, SendResult
from fabricwatch.actions.alerts.http import JsonPoster, RateLimiter, RetryPolicy, TokenBucket
from fabricwatch.actions.alerts.message import truncate_chars

MAX_SECTION_CHARS = 2900     # Slack rejects a section text over 3000
MAX_FALLBACK_CHARS = 3000
_SEVERITY_EMOJI = {"critical": ":red_circle:", "warning": ":large_orange_circle:", "info": ":large_blue_circle:"}


def mrkdwn_escape(text: str) -> str:
    """Slack's three control characters, escaped as its docs ask."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_message(alert: Alert) -> dict[str, Any]:
    """The webhook body: `text` (notifications, fallback) and `blocks` (what the channel shows)."""
    emoji = ":white_check_mark:" if alert.status == RESOLVED else _SEVERITY_EMOJI.get(alert.severity, ":warning:")
    headline = truncate_chars(f"{emoji} *{mrkdwn_escape(alert.title)}*", MAX_SECTION_CHARS)
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": headline}},
        {"type": "section", "text": {"type": "mrkdwn",
                                     "text": truncate_chars(mrkdwn_escape(alert.body), MAX_SECTION_CHARS)}},
    ]
    if alert.links:
        links = " | ".join(f"<{url}|{mrkdwn_escape(text)}>" for text, url in alert.links)
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn",
                                                        "text": truncate_chars(links, MAX_SECTION_CHARS)}]})
    return {"text": truncate_chars(alert.title, MAX_FALLBACK_CHARS), "blocks": blocks}


class SlackSink:
    """Posts alerts to one Slack incoming webhook URL."""

    name = "slack"

    def __init__(self, webhook_url: str, policy: RetryPolicy | None = None, burst: int = 3,
                 per_second: float = 1.0):
        if not webhook_url.startswith(("http://", "https://")):
            raise ValueError(f"SlackSink webhook_url must be http(s), got {webhook_url!r}")
        self.webhook_url = webhook_url
        self.burst = burst
        self.per_second = per_second
        self._poster = JsonPoster(self.name, policy, RateLimiter(TokenBucket(burst, per_second)))

    async def send(self, alert: Alert) -> SendResult:
        return await self._poster.post(self.webhook_url, slack_message(alert))

    async def tick(self, now_ns: int) -> None:
        """Nothing to do: a chat message needs no keep-alive."""

    async def close(self) -> None:
        await self._poster.close()
