"""CloudEvents Kafka binding (streams/cloudevents.py): headers, round trips, clear errors on bad input."""
import base64
import json
import time
from datetime import datetime, timezone

import pytest
from cloudevents.core.bindings import kafka as sdk_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent as SdkCloudEvent
from google.protobuf import json_format
from helpers import nic_snapshot, telemetry_value

from fabricwatch.protos.v1 import events_pb2 as ev
from fabricwatch.streams.cloudevents import (CloudEventError, anomaly_headers, decision_headers, entity_key,
                                             format_time, parse, parse_time)
from fabricwatch.streams.handlers import ANOMALIES, StageHandlers
from fabricwatch.streams.pipeline import DetectionPipeline

S = 10**9
T_NS = 1_764_500_000_123_456_789     # 2025-11-30T10:53:20.123456789Z


def anomaly(**overrides) -> ev.AnomalyEvent:
    fields = dict(id="3f2a", dedup_key="pfc_storm:c1/node-0007/mlx5_3/1", kind="pfc_storm",
                  severity=ev.SEVERITY_CRITICAL, lifecycle=ev.LIFECYCLE_OPEN, detected_unix_ns=T_NS,
                  emitted_unix_ns=T_NS + S, summary="PFC storm from node-0007 mlx5_3",
                  entity=ev.EntityPath(cluster="c1", node="node-0007", device="mlx5_3", port="1"))
    return ev.AnomalyEvent(**(fields | overrides))


def decision(**overrides) -> ev.ActionDecision:
    fields = dict(idempotency_key="k-1", anomaly_id="3f2a", anomaly_kind="pfc_storm", rule="drain-storming-nic",
                  action="drain_node", outcome=ev.OUTCOME_REFUSED_KILL_SWITCH, decided_unix_ns=T_NS,
                  target=ev.EntityPath(cluster="c1", node="node-0007"))
    return ev.ActionDecision(**(fields | overrides))


def test_anomaly_headers_follow_the_binary_mode_binding():
    headers = anomaly_headers(anomaly())
    assert headers == [
        ("ce_specversion", b"1.0"),
        ("ce_id", b"3f2a"),
        ("ce_source", b"fabricwatch/c1/worker"),
        ("ce_type", b"io.fabricwatch.anomaly.v1.pfc_storm.open"),
        ("ce_time", b"2025-11-30T10:53:20.123456789Z"),
        ("ce_subject", b"c1/node-0007/mlx5_3/1"),
        ("ce_partitionkey", b"c1/node-0007/mlx5_3/1"),
        ("content-type", b"application/protobuf"),
    ]


def test_lifecycle_and_job_entities_shape_type_and_subject():
    resolved = anomaly(kind="straggler", lifecycle=ev.LIFECYCLE_RESOLVED,
                       entity=ev.EntityPath(cluster="c 1/x", job="j42", rank="7"))
    headers = dict(anomaly_headers(resolved))
    assert headers["ce_type"] == b"io.fabricwatch.anomaly.v1.straggler.resolved"
    assert headers["ce_subject"] == b"c 1/x/job=j42/rank=7"
    assert headers["ce_source"] == b"fabricwatch/c%201%2Fx/worker"      # the cluster stays one path segment


def test_decision_headers_differ_between_the_actions_and_the_audit_topic():
    action = dict(decision_headers(decision(), "action"))
    audit = dict(decision_headers(decision(), "audit"))
    assert action["ce_type"] == b"io.fabricwatch.action.v1.refused_kill_switch"
    assert audit["ce_type"] == b"io.fabricwatch.audit.v1.refused_kill_switch"
    assert action["ce_id"] == audit["ce_id"] == f"k-1:refused_kill_switch:{T_NS}".encode()
    assert (action["ce_source"], audit["ce_source"]) == (b"fabricwatch/c1/actions", b"fabricwatch/c1/audit")
    assert action["ce_subject"] == action["ce_partitionkey"] == b"c1/node-0007"
    assert action["content-type"] == b"application/protobuf"
    # Every outcome of one key is its own event.
    started = dict(decision_headers(decision(outcome=ev.OUTCOME_STARTED), "action"))
    assert started["ce_id"] != action["ce_id"]


@pytest.mark.parametrize("make,headers_of,topic_kind", [
    (anomaly, anomaly_headers, "anomaly"),
    (decision, lambda d: decision_headers(d, "action"), "action"),
    (decision, lambda d: decision_headers(d, "audit"), "audit"),
])
def test_binary_round_trip(make, headers_of, topic_kind):
    message = make()
    key = entity_key("c1/node-0007")
    parsed = parse(headers_of(message), key, message.SerializeToString())
    assert parsed.message == message and type(parsed.message) is type(message)
    assert parsed.key == key
    assert parsed.time_unix_ns == T_NS
    assert parsed.attributes["datacontenttype"] == "application/protobuf"
    assert parsed.topic_kind == topic_kind


def test_structured_mode_is_read_with_base64_or_json_data():
    message = anomaly()
    attributes = {name[3:]: value.decode() for name, value in anomaly_headers(message) if name.startswith("ce_")}
    as_base64 = json.dumps(attributes | {"datacontenttype": "application/protobuf",
                                         "data_base64": base64.b64encode(message.SerializeToString()).decode()})
    as_json = json.dumps(attributes | {"datacontenttype": "application/json",
                                       "data": json_format.MessageToDict(message)})
    for value in (as_base64, as_json):
        parsed = parse([("content-type", b"application/cloudevents+json; charset=UTF-8")], b"k", value.encode())
        assert parsed.message == message
        assert parsed.subject == "c1/node-0007/mlx5_3/1" and parsed.id == "3f2a"


def test_time_is_rfc3339_utc_with_nanoseconds():
    assert format_time(0) == "1970-01-01T00:00:00.000000000Z"
    assert parse_time(format_time(T_NS)) == T_NS
    assert parse_time("2025-11-30T10:53:20Z") == 1_764_500_000 * S
    assert parse_time("2025-11-30T05:53:20.5-05:00") == 1_764_500_000 * S + S // 2
    now = time.time_ns()
    assert parse_time(format_time(now)) == now


def bad(headers_change=None, value=None, drop=()):
    message = anomaly()
    headers = [(n, v) for n, v in anomaly_headers(message) if n not in drop]
    headers = [(n, (headers_change or {}).get(n, v)) for n, v in headers]
    return headers, message.SerializeToString() if value is None else value


@pytest.mark.parametrize("headers,value,error", [
    (*bad(drop=("ce_id",)), "missing required attribute(s) id"),
    (*bad(drop=("ce_specversion", "ce_type")), "missing required attribute(s) specversion, type"),
    (*bad({"ce_specversion": b"0.3"}), "specversion '0.3' is not supported"),
    (*bad({"ce_type": b"com.example.thing"}), "not a fabricwatch event type"),
    (*bad({"ce_time": b"yesterday"}), "is not RFC 3339"),
    (*bad({"ce_time": b"2025-02-31T00:00:00Z"}), "is not a valid date"),
    (*bad({"content-type": b"application/json"}), "content-type 'application/json' is not 'application/protobuf'"),
    (*bad(drop=("content-type",)), "content-type '(none)'"),
    (*bad({"ce_subject": b"\xff\xfe"}), "header 'ce_subject' is not UTF-8"),
    (*bad(value=b"\xff\xff\xff"), "data is not a AnomalyEvent protobuf"),
    ([("content-type", b"application/cloudevents-batch+json")], b"[]", "only application/cloudevents+json"),
    ([("content-type", b"application/cloudevents+json")], b"{not json", "structured-mode value is not JSON"),
    ([("content-type", b"application/cloudevents+json")], b'{"specversion": "1.0"}', "missing required"),
    ([], b"", "missing required attribute(s) specversion, id, source, type"),
])
def test_bad_records_raise_a_clear_error(headers, value, error):
    with pytest.raises(CloudEventError) as caught:
        parse(headers, b"k", value)
    assert error in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_tombstones_and_repeated_headers_are_refused():
    headers = anomaly_headers(anomaly())
    with pytest.raises(CloudEventError, match="no value"):
        parse(headers, b"k", None)
    with pytest.raises(CloudEventError, match="'ce_id' appears twice"):
        parse([*headers, ("ce_id", b"again")], b"k", anomaly().SerializeToString())


def test_events_that_cannot_become_cloudevents_are_refused():
    with pytest.raises(CloudEventError, match="needs an id and a kind"):
        anomaly_headers(anomaly(kind=""))
    with pytest.raises(CloudEventError, match="lifecycle 0"):
        anomaly_headers(anomaly(lifecycle=ev.LIFECYCLE_UNSPECIFIED))
    with pytest.raises(CloudEventError, match="outcome 0 is unspecified"):
        decision_headers(decision(outcome=ev.OUTCOME_UNSPECIFIED), "audit")
    with pytest.raises(CloudEventError, match="topic_kind must be"):
        decision_headers(decision(), "anomaly")
    with pytest.raises(CloudEventError, match="before 1970"):
        format_time(-1)
    with pytest.raises(CloudEventError, match="must not be empty"):
        entity_key("")


def test_worker_handlers_attach_the_headers_to_every_anomaly():
    """The stage the Faust agent calls: its anomaly records carry headers that parse back to the value."""
    stages, stage = StageHandlers(), DetectionPipeline().sources
    t0 = time.time_ns()
    records = []
    for i in range(6):
        rates = {5: "200 Gb/sec (4X HDR)"} if 2 <= i <= 3 else {}
        out = stages.on_telemetry(
            telemetry_value(nic_snapshot(source="node-0042", t_ns=t0 + i * S, seq=i, rates=rates)), stage, 0)
        records += [r for r in out if r.topic == ANOMALIES]
        assert all(r.headers == () for r in out if r.topic != ANOMALIES)
    assert [dict(r.headers)["ce_type"] for r in records] == [b"io.fabricwatch.anomaly.v1.link_downgrade.open",
                                                            b"io.fabricwatch.anomaly.v1.link_downgrade.resolved"]
    for record in records:
        parsed = parse(record.headers, record.key, record.value)
        assert parsed.message == ev.AnomalyEvent.FromString(record.value)
        assert parsed.subject == "c1/node-0042/mlx5_5/1"
        assert record.key == parsed.message.dedup_key.encode()
    assert parse(records[0].headers, None, records[0].value).time_unix_ns == t0 + 2 * S


# ---------------------------------------------------------------------- interop, checked by the official SDK
# The SDK (cloudevents 2.x, its `core` API) is the independent reader and writer here: what
# we write it must read back as our event, and what it writes we must read. Its `time` is a
# datetime, so it carries microseconds where we carry nanoseconds.
def _sdk_time(unix_ns: int) -> datetime:
    return datetime.fromtimestamp(unix_ns // S, timezone.utc).replace(microsecond=unix_ns % S // 1000)


@pytest.mark.parametrize("message,headers_of", [
    (anomaly(), anomaly_headers),
    (decision(), lambda d: decision_headers(d, "action")),
    (decision(outcome=ev.OUTCOME_STARTED), lambda d: decision_headers(d, "audit")),
])
def test_the_cloudevents_sdk_reads_our_binary_records(message, headers_of):
    headers = headers_of(message)
    ours = {name[3:]: value.decode() for name, value in headers if name.startswith("ce_")}
    key = entity_key(ours["partitionkey"])
    event = sdk_kafka.from_binary(sdk_kafka.KafkaMessage(dict(headers), key, message.SerializeToString()),
                                  JSONFormat())
    assert event.get_specversion() == "1.0"
    assert event.get_attributes() == ours | {"time": _sdk_time(T_NS), "datacontenttype": "application/protobuf"}
    data = event.get_data()
    # The SDK hands non-JSON data back as text when it happens to decode as UTF-8.
    assert type(message).FromString(data if isinstance(data, bytes) else data.encode()) == message


@pytest.mark.parametrize("mode", ["binary", "structured"])
def test_we_read_what_the_cloudevents_sdk_writes(mode):
    message = anomaly()
    attributes = {name[3:]: value.decode() for name, value in anomaly_headers(message) if name.startswith("ce_")}
    event = SdkCloudEvent(attributes | {"time": _sdk_time(T_NS), "datacontenttype": "application/protobuf"},
                          message.SerializeToString())
    write = sdk_kafka.to_binary if mode == "binary" else sdk_kafka.to_structured
    record = write(event, JSONFormat())
    parsed = parse(list(record.headers.items()), record.key, record.value)
    assert parsed.message == message
    assert (parsed.id, parsed.type, parsed.subject) == ("3f2a", "io.fabricwatch.anomaly.v1.pfc_storm.open",
                                                        "c1/node-0007/mlx5_3/1")
    assert parsed.time_unix_ns == T_NS // 1000 * 1000
    assert record.key == entity_key("c1/node-0007/mlx5_3/1").decode()     # the SDK keys by partitionkey
