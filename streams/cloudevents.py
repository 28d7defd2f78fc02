"""CloudEvents v1.0 for our Kafka records: the Kafka protocol binding, written by hand.

Every record fabricwatch writes to the anomalies, actions and audit topics is a CloudEvent
in **binary mode**: the attributes travel as ``ce_<name>`` headers, ``datacontenttype``
as the plain ``content-type`` header, and the value stays the serialized protobuf, so
existing readers of the value are unaffected. :func:`parse` reads binary mode and, from
other producers, structured mode (``content-type: application/cloudevents+json``).

Why not the official SDK (``cloudevents`` 2.2, tried for this): its v1.0 event takes
``time`` only as a ``datetime``, so it would write microseconds where our records carry the
detection time to the nanosecond; its older ``cloudevents.v1.kafka`` API drops the
``ce_partitionkey`` header. Reading, it maps headers through a dict (a repeated header goes
unnoticed), returns protobuf data as ``str`` when the bytes happen to be UTF-8, and raises
its own errors where :class:`CloudEventError` names the header at fault. The binding here is
the spec's Kafka binary mode and no more; tests/test_cloudevents.py has the SDK read what we
write and we read what it writes, so interop is checked by the library itself.

=================  ===========================================================  ==========================
attribute          anomaly                                                      decision (action / audit)
=================  ===========================================================  ==========================
``specversion``    ``1.0``                                                      ``1.0``
``id``             ``AnomalyEvent.id``                                          ``<idempotency_key>:<outcome>:<decided_unix_ns>``
``source``         ``fabricwatch/<cluster>/worker``                             ``fabricwatch/<cluster>/actions`` or ``/audit``
``type``           ``io.fabricwatch.anomaly.v1.<kind>.<lifecycle>``             ``io.fabricwatch.action.v1.<outcome>``, ``io.fabricwatch.audit.v1.<outcome>``
``time``           detection time, RFC 3339 UTC (``Z``), ns precision           decision time
``subject``        entity path (``c1/node-0007/mlx5_3/1``)                      target entity path
``partitionkey``   entity path                                                  target entity path
``content-type``   ``application/protobuf``                                     ``application/protobuf``
=================  ===========================================================  ==========================

>>> from fabricwatch.protos.v1 import events_pb2 as ev
>>> event = ev.AnomalyEvent(id="a1", kind="pfc_storm", lifecycle=ev.LIFECYCLE_OPEN,
...                         detected_unix_ns=1764500000123456789,
...                         entity=ev.EntityPath(cluster="c1", node="node-0007", device="mlx5_3", port="1"))
>>> headers = anomaly_headers(event)
>>> [(name, value.decode()) for name, value in headers][:4]
[('ce_specversion', '1.0'), ('ce_id', 'a1'), ('ce_source', 'fabricwatch/c1/worker'), ('ce_type', 'io.fabricwatch.anomaly.v1.pfc_storm.open')]
>>> dict(headers)["ce_time"]
b'2025-11-30T10:53:20.123456789Z'
>>> parsed = parse(headers, entity_key("c1/node-0007/mlx5_3/1"), event.SerializeToString())
>>> parsed.subject, parsed.time_unix_ns == event.detected_unix_ns, parsed.message == event
('c1/node-0007/mlx5_3/1', True, True)
"""
from __future__ import annotations

import base64
import calendar
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal
from urllib.parse import quote

from google.protobuf import json_format
from google.protobuf.message import DecodeError

from fabricwatch.protos.v1 import events_pb2 as ev

from .events import LIFECYCLE_NAME, OUTCOME_NAME, entity_ref

__all__ = [
    "CONTENT_TYPE_PROTOBUF",
    "CloudEventError",
    "FeedEvent",
    "anomaly_headers",
    "decision_headers",
    "entity_key",
    "entity_path",
    "format_time",
    "parse",
    "parse_time",
]

SPECVERSION = "1.0"
CONTENT_TYPE_HEADER = "content-type"
CONTENT_TYPE_PROTOBUF = "application/protobuf"
CONTENT_TYPE_JSON = "application/json"
STRUCTURED_PREFIX = "application/cloudevents"      # receivers pick the mode by this prefix
STRUCTURED_JSON = "application/cloudevents+json"
HEADER_PREFIX = "ce_"

TYPE_ANOMALY = "io.fabricwatch.anomaly.v1."
TYPE_ACTION = "io.fabricwatch.action.v1."
TYPE_AUDIT = "io.fabricwatch.audit.v1."
TopicKind = Literal["anomaly", "action", "audit"]
_TYPE_PREFIX: dict[str, str] = {"anomaly": TYPE_ANOMALY, "action": TYPE_ACTION, "audit": TYPE_AUDIT}
_REQUIRED = ("specversion", "id", "source", "type")


_RFC3339 = re.compile(r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
                      r"(?:([Zz])|([+-])(\d{2}):(\d{2}))")


class CloudEventError(ValueError):
    """A record that is not a usable fabricwatch CloudEvent, or an event that cannot become one."""


@dataclass(frozen=True)
class FeedEvent:
    """One parsed record: its CloudEvents attributes and the decoded protobuf message."""

    attributes: dict[str, str]            # without the ce_ prefix; "datacontenttype" included
    message: ev.AnomalyEvent | ev.ActionDecision
    key: bytes | None = None

    @property
    def id(self) -> str:
        return self.attributes["id"]

    @property
    def type(self) -> str:
        return self.attributes["type"]

    @property
    def source(self) -> str:
        return self.attributes["source"]

    @property
    def subject(self) -> str:
        return self.attributes.get("subject", "")

    @property
    def topic_kind(self) -> TopicKind:
        return _topic_kind(self.type)

    @property
    def time_unix_ns(self) -> int:
        """``time`` as ns since the epoch; 0 when the event carries none."""
        return parse_time(self.attributes["time"]) if "time" in self.attributes else 0


# ---------------------------------------------------------------------- writing
def entity_path(entity: ev.EntityPath) -> str:
    """The readable path of an entity, the same as in dedup keys: ``c1/node-0007/mlx5_3/1``."""
    return entity_ref(entity).path()


def entity_key(path: str) -> bytes:
    """The Kafka key for keying records by entity: all records of one entity share a partition.

    >>> entity_key("c1/node-0007/mlx5_3/1")
    b'c1/node-0007/mlx5_3/1'
    """
    if not path:
        raise CloudEventError("entity path must not be empty")
    return path.encode()


def format_time(unix_ns: int) -> str:
    """RFC 3339 in UTC with a ``Z`` and nanoseconds.

    >>> format_time(1764500000000000001)
    '2025-11-30T10:53:20.000000001Z'
    """
    if unix_ns < 0:
        raise CloudEventError(f"time must not be before 1970, got {unix_ns} ns")
    seconds, nanos = divmod(unix_ns, 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{nanos:09d}Z"


def _source(cluster: str, producer: str) -> str:
    # A URI-reference: the cluster name is percent-encoded so any name stays one path segment.
    return f"fabricwatch/{quote(cluster, safe='')}/{producer}" if cluster else f"fabricwatch/{producer}"


def _headers(attributes: dict[str, str]) -> list[tuple[str, bytes]]:
    headers = [(HEADER_PREFIX + name, value.encode()) for name, value in attributes.items()]
    headers.append((CONTENT_TYPE_HEADER, CONTENT_TYPE_PROTOBUF.encode()))
    return headers


def anomaly_headers(event: ev.AnomalyEvent) -> list[tuple[str, bytes]]:
    """Binary-mode headers of an anomaly record (its value stays ``event.SerializeToString()``)."""
    if not event.id or not event.kind:
        raise CloudEventError(f"an anomaly needs an id and a kind to be a CloudEvent (id={event.id!r}, "
                              f"kind={event.kind!r})")
    lifecycle = LIFECYCLE_NAME.get(event.lifecycle)
    if lifecycle is None:
        raise CloudEventError(f"anomaly {event.id}: lifecycle {event.lifecycle} is not open/update/resolved")
    path = entity_path(event.entity)
    attributes = {
        "specversion": SPECVERSION,
        "id": event.id,
        "source": _source(event.entity.cluster, "worker"),
        "type": f"{TYPE_ANOMALY}{event.kind}.{lifecycle}",
        "time": format_time(event.detected_unix_ns or event.emitted_unix_ns),
    }
    if path:
        attributes |= {"subject": path, "partitionkey": path}
    return _headers(attributes)


def decision_headers(decision: ev.ActionDecision, topic_kind: Literal["action", "audit"]) -> list[tuple[str, bytes]]:
    """Binary-mode headers of a decision record on the actions or the audit topic.

    The two topics get different sources, so the same decision on both is two events.
    """
    if topic_kind not in ("action", "audit"):
        raise CloudEventError(f"topic_kind must be 'action' or 'audit', got {topic_kind!r}")
    if not decision.idempotency_key:
        raise CloudEventError("a decision needs an idempotency_key to be a CloudEvent")
    outcome = OUTCOME_NAME.get(decision.outcome)
    if outcome is None:
        raise CloudEventError(f"decision {decision.idempotency_key}: outcome {decision.outcome} is unspecified "
                              "or unknown")
    path = entity_path(decision.target)
    attributes = {
        "specversion": SPECVERSION,
        # + decision time: a key decided twice the same way (two skipped redeliveries) is two events.
        "id": f"{decision.idempotency_key}:{outcome}:{decision.decided_unix_ns}",
        "source": _source(decision.target.cluster, "actions" if topic_kind == "action" else "audit"),
        "type": f"{_TYPE_PREFIX[topic_kind]}{outcome}",
        "time": format_time(decision.decided_unix_ns),
    }
    if path:
        attributes |= {"subject": path, "partitionkey": path}
    return _headers(attributes)


# ---------------------------------------------------------------------- reading
def parse_time(text: str) -> int:
    """An RFC 3339 timestamp as ns since the epoch.

    >>> parse_time("2025-11-30T10:53:20.000000001Z"), parse_time("2025-11-30T11:53:20+01:00")
    (1764500000000000001, 1764500000000000000)
    """
    m = _RFC3339.fullmatch(text)
    if m is None:
        raise CloudEventError(f"time {text!r} is not RFC 3339 (e.g. 2025-11-30T10:53:20.5Z)")
    year, month, day, hour, minute, second = (int(g) for g in m.group(1, 2, 3, 4, 5, 6))
    try:
        # datetime() rejects day 31 of February and the like; second 60 is a leap second.
        seconds = calendar.timegm(datetime(year, month, day, hour, minute, min(second, 59)).timetuple())
    except ValueError as exc:
        raise CloudEventError(f"time {text!r} is not a valid date: {exc}") from None
    seconds += second - min(second, 59)
    if m.group(9):
        offset_s = (int(m.group(10)) * 60 + int(m.group(11))) * 60
        seconds -= offset_s if m.group(9) == "+" else -offset_s
    nanos = int((m.group(7) or "0").ljust(9, "0"))
    return seconds * 1_000_000_000 + nanos


def _topic_kind(ce_type: str) -> TopicKind:
    for kind, prefix in _TYPE_PREFIX.items():
        if ce_type.startswith(prefix) and len(ce_type) > len(prefix):
            return kind  # type: ignore[return-value]
    raise CloudEventError(f"type {ce_type!r} is not a fabricwatch event type "
                          f"({TYPE_ANOMALY}*, {TYPE_ACTION}*, {TYPE_AUDIT}*)")


def _text(name: str, value: bytes | str | None) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    try:
        return bytes(value).decode("utf-8")
    except (UnicodeDecodeError, TypeError) as exc:
        raise CloudEventError(f"header {name!r} is not UTF-8 text: {exc}") from None


def _media_type(content_type: str) -> str:
    """``application/cloudevents+json; charset=UTF-8`` -> ``application/cloudevents+json``."""
    return content_type.split(";", 1)[0].strip().lower()


def parse(headers: Iterable[tuple[str, bytes | str | None]] | None, key: bytes | None,
          value: bytes | None) -> FeedEvent:
    """A Kafka record (as aiokafka gives it) -> :class:`FeedEvent`, or :class:`CloudEventError`.

    The mode is chosen by ``content-type``: ``application/cloudevents...`` is structured
    mode (only JSON is supported), anything else binary mode.
    """
    header_map: dict[str, str] = {}
    for name, raw in headers or ():
        if not isinstance(name, str):
            raise CloudEventError(f"header name {name!r} is not a string")
        # Kafka header names are case-sensitive, but producers differ on "Content-Type".
        name = name.lower() if name.lower() == CONTENT_TYPE_HEADER else name
        if name in header_map:
            raise CloudEventError(f"header {name!r} appears twice")
        header_map[name] = _text(name, raw)
    content_type = header_map.get(CONTENT_TYPE_HEADER, "")
    if _media_type(content_type).startswith(STRUCTURED_PREFIX):
        return _parse_structured(content_type, key, value)
    attributes = {name[len(HEADER_PREFIX):]: text for name, text in header_map.items()
                  if name.startswith(HEADER_PREFIX)}
    if content_type:
        attributes["datacontenttype"] = content_type
    _check_attributes(attributes)
    if value is None:
        raise CloudEventError(f"event {attributes['id']}: the record has no value (a tombstone), no data to decode")
    if _media_type(content_type) != CONTENT_TYPE_PROTOBUF:
        raise CloudEventError(f"event {attributes['id']}: content-type {content_type or '(none)'!r} is not "
                              f"{CONTENT_TYPE_PROTOBUF!r}")
    return FeedEvent(attributes, _decode(attributes, bytes(value)), key)


def _check_attributes(attributes: dict[str, str]) -> None:
    missing = [name for name in _REQUIRED if not attributes.get(name)]
    if missing:
        raise CloudEventError(f"not a CloudEvent: missing required attribute(s) {', '.join(missing)} "
                              f"(binary mode headers ce_{', ce_'.join(missing)})")
    if attributes["specversion"] != SPECVERSION:
        raise CloudEventError(f"specversion {attributes['specversion']!r} is not supported (only {SPECVERSION})")
    if "time" in attributes:
        parse_time(attributes["time"])
    _topic_kind(attributes["type"])


def _decode(attributes: dict[str, str], data: bytes) -> ev.AnomalyEvent | ev.ActionDecision:
    cls = ev.AnomalyEvent if _topic_kind(attributes["type"]) == "anomaly" else ev.ActionDecision
    try:
        return cls.FromString(data)
    except DecodeError as exc:
        raise CloudEventError(f"event {attributes['id']}: data is not a {cls.__name__} protobuf: {exc}") from None


def _parse_structured(content_type: str, key: bytes | None, value: bytes | None) -> FeedEvent:
    if _media_type(content_type) != STRUCTURED_JSON:
        raise CloudEventError(f"structured content-type {content_type!r} is not supported (only {STRUCTURED_JSON})")
    if value is None:
        raise CloudEventError("structured-mode record has no value")
    try:
        doc = json.loads(bytes(value))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CloudEventError(f"structured-mode value is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CloudEventError("structured-mode value must be a JSON object")
    data, data_b64 = doc.pop("data", None), doc.pop("data_base64", None)
    bad = sorted(name for name, v in doc.items() if not isinstance(v, str))
    if bad:
        raise CloudEventError(f"attributes {bad} must be strings in fabricwatch events")
    attributes: dict[str, str] = doc
    _check_attributes(attributes)
    media = _media_type(attributes.get("datacontenttype", CONTENT_TYPE_JSON))
    if data_b64 is not None:
        if media != CONTENT_TYPE_PROTOBUF:
            raise CloudEventError(f"event {attributes['id']}: data_base64 needs datacontenttype "
                                  f"{CONTENT_TYPE_PROTOBUF!r}, got {media!r}")
        try:
            raw = base64.b64decode(data_b64, validate=True)
        except (ValueError, TypeError) as exc:
            raise CloudEventError(f"event {attributes['id']}: data_base64 is not base64: {exc}") from None
        return FeedEvent(attributes, _decode(attributes, raw), key)
    if data is None:
        raise CloudEventError(f"event {attributes['id']}: no data")
    if media != CONTENT_TYPE_JSON or not isinstance(data, dict):
        raise CloudEventError(f"event {attributes['id']}: JSON data must be an object with datacontenttype "
                              f"{CONTENT_TYPE_JSON!r}")
    message = ev.AnomalyEvent() if _topic_kind(attributes["type"]) == "anomaly" else ev.ActionDecision()
    try:
        json_format.ParseDict(data, message)
    except json_format.ParseError as exc:
        raise CloudEventError(f"event {attributes['id']}: data is not a {type(message).__name__}: {exc}") from None
    return FeedEvent(attributes, message, key)
