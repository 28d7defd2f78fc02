"""Issue #13: every output format escapes attacker text.

Attacker text reached WeCom markdown unescaped (a clickable link, a red URGENT and an
``@all``). Everything in an alert comes from telemetry, so each field of the anomaly below
carries hostile strings: mentions for each chat (``<!channel>``, ``@all``, ``<@user>``,
``<at user_id="all">``), links in each syntax, colour tags, markdown, newlines that would
forge lines, ANSI escapes, bidi overrides and NULs. Each output is checked for what would
make it act: a mention, a link (other than our dashboard's), markup, an extra line.
"""
from __future__ import annotations

import io
import json
import logging
import re

import pytest

from fabricwatch.actions.alerts.alertmanager import am_alert
from fabricwatch.actions.alerts.feishu import feishu_message
from fabricwatch.actions.alerts.message import alert_from_anomaly
from fabricwatch.actions.alerts.pagerduty import pd_event
from fabricwatch.actions.alerts.slack import slack_message
from fabricwatch.actions.alerts.wecom import wecom_message
from fabricwatch.actions.base import EXCLUDE_AND_RESTART, ActionRequest
from fabricwatch.actions.executors.command import CommandExecutor
from fabricwatch.logging_setup import make_handler
from fabricwatch.models.findings import EntityRef
from fabricwatch.protos.v1 import events_pb2 as pb

HOSTILE = ("<!channel> <!here|here> @all @here <@U0123> <at user_id=\"all\">所有人</at> "
           "<font color=\"warning\">URGENT</font> [click](http://evil.example/a) <http://evil.example/b|go> "
           "https://evil.example/c www.evil.example **bold** *b* _i_ ~s~ `code` | pipe "
           "\n# Heading\n> quote\r\nInjected: line\x1b[31mRED\x1b[0m \u202eRLO\u200bZWSP\x00NUL\x07")
DASHBOARD = "https://dash.example/"
OUR_LINK = re.compile(r"https://dash\.example/anomalies/[A-Za-z0-9%._~-]+")
LINK = re.compile(r"(?i)(?:https?|ftp)://|www\.")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\u200b\u202a-\u202e]")


def hostile_event() -> pb.AnomalyEvent:
    return pb.AnomalyEvent(
        id="ev-h", dedup_key="pfc_storm:c1/x@all/mlx5_0/1", kind="pfc_storm", severity=pb.SEVERITY_CRITICAL,
        lifecycle=pb.LIFECYCLE_OPEN, onset_unix_ns=1_764_504_005_123_000_000,
        detected_unix_ns=1_764_504_008_123_000_000,
        entity=pb.EntityPath(cluster="c1", node="http://evil.example", device="mlx5_0", port="1", job="x@all"),
        evidence=[pb.Evidence(name="rate", value=1.0, threshold=2.0, unit="Gb/s", detail=HOSTILE)],
        summary=HOSTILE, probable_cause=HOSTILE, suggested_action=HOSTILE, detector=HOSTILE,
        related=[pb.EntityPath(cluster="c1", switch="<!channel>", port="[x](http://evil.example)")])


@pytest.fixture
def alert():
    return alert_from_anomaly(hostile_event(), [f"drain_node c1/{HOSTILE}: would have executed"], DASHBOARD)


def test_the_alert_itself_has_one_line_per_field_and_no_live_link_or_control_character(alert):
    assert "\n" not in alert.title and not CONTROL.search(alert.title + alert.body)
    assert not LINK.search(alert.title + alert.body)
    lines = alert.body.splitlines()
    assert not any(line.startswith(("Injected", "#", ">")) for line in lines)
    # summary, since, severity, evidence (2), cause, action, actions (2), related, detector
    assert len(lines) == 11, lines


def test_slack_shows_attacker_text_as_plain_text_only(alert):
    message = slack_message(alert)
    for block in message["blocks"]:
        if block["type"] == "section":
            assert block["text"]["type"] == "plain_text" and block["text"]["emoji"] is False
    [context] = [b for b in message["blocks"] if b["type"] == "context"]
    assert OUR_LINK.fullmatch(context["elements"][0]["text"][1:].split("|")[0])        # our link, mrkdwn
    fallback = message["text"]
    assert message["mrkdwn"] is False and "<" not in fallback and ">" not in fallback
    assert not LINK.search(fallback) and message["unfurl_links"] is False


@pytest.mark.parametrize("msg_type", ["markdown", "text"])
def test_wecom_has_no_mention_link_colour_or_markup_from_the_alert(alert, msg_type):
    message = wecom_message(alert, msg_type)
    content = message[msg_type]["content"]
    ours = {"markdown": 2, "text": 0}[msg_type]      # "**<font ...>" and "</font>**" around the title
    assert content.count("<") == ours and content.count(">") == ours and content.count("**") == ours
    assert "@" not in content and not CONTROL.search(content)
    links = re.findall(r"\[([^\]]*)\]\(([^)]*)\)", content)
    assert links == ([("dashboard", OUR_LINK.search(content).group(0))] if msg_type == "markdown" else [])
    assert len(LINK.findall(content)) == len(links)
    assert "mentioned_list" not in message.get("text", {})
    assert not any(line.lstrip().startswith(("#", ">", "Injected")) for line in content.splitlines())


@pytest.mark.parametrize("msg_type", ["post", "text"])
def test_feishu_has_no_at_tag_or_link_from_the_alert(alert, msg_type):
    message = feishu_message(alert, msg_type)
    dumped = json.dumps(message, ensure_ascii=False)
    assert "<" not in dumped and "@" not in dumped and not CONTROL.search(dumped)
    hrefs = re.findall(r'"href": "([^"]*)"', dumped)
    assert all(OUR_LINK.fullmatch(h) for h in hrefs) and len(LINK.findall(dumped)) == len(hrefs)


def test_pagerduty_and_alertmanager_carry_no_control_character_or_live_link(alert):
    pd = pd_event(alert, "routing-key")
    am = am_alert(alert)
    for text in (pd["payload"]["summary"], pd["payload"]["custom_details"]["description"],
                 am["annotations"]["summary"], am["annotations"]["description"], *am["labels"].values()):
        assert not CONTROL.search(text) and not LINK.search(text), text
    assert [link["href"] for link in pd["links"]] == [am["generatorURL"]] and OUR_LINK.fullmatch(am["generatorURL"])


def test_the_restart_webhook_body_carries_no_control_character():
    ex = CommandExecutor(webhook_url="http://127.0.0.1:1/hook", webhook_secret="s")
    body = json.loads(ex.body(ActionRequest(EXCLUDE_AND_RESTART, EntityRef(cluster="c1", node="n1", job="7"),
                                            reason=HOSTILE, idempotency_key="k"), ("7",)))
    assert not CONTROL.search(body["reason"]) and "\n" not in body["reason"]


def test_a_text_log_line_cannot_be_forged():
    stream = io.StringIO()
    logger = logging.getLogger("fabricwatch.test.hostile")
    logger.propagate = False
    logger.addHandler(make_handler("text", stream))
    try:
        logger.warning("decision %s", HOSTILE)
    finally:
        logger.handlers.clear()
    out = stream.getvalue()
    assert out.count("\n") == 1 and not CONTROL.search(out) and "\\x1b[31m" in out and "\\nInjected" in out
