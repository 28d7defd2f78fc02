"""The shared config schema: one gateway block for every collector, errors that name the path."""
from __future__ import annotations

import pytest

from fabricwatch.collectors.node_config import ConfigError, NodeConfig
from fabricwatch.collectors.switch_config import parse_config
from fabricwatch.config_schema import GatewayConnection, validate

SWITCH = {"name": "leaf-01", "target": "127.0.0.1:9339"}


def test_node_and_switch_collectors_read_the_same_gateway_block(tmp_path):
    for name in ("ca.pem", "client.pem", "client.key", "token"):
        (tmp_path / name).write_text("x\n")
    block = {"target": "gw.example:50051", "ca_cert": str(tmp_path / "ca.pem"), "server_name": "gw",
             "client_cert": str(tmp_path / "client.pem"), "client_key": str(tmp_path / "client.key"),
             "token_file": str(tmp_path / "token")}
    node = NodeConfig.from_dict({"gateway": block}).sender_config()
    switch = parse_config({"gateway": block, "switches": [SWITCH]}, tmp_path).gateway
    assert (node.root_cert_path, node.client_cert_path, node.client_key_path, node.server_name_override,
            node.token) == (switch.ca_cert, switch.client_cert, switch.client_key, switch.server_name,
                            switch.token) == (block["ca_cert"], block["client_cert"], block["client_key"], "gw", "x")


def test_older_spellings_of_the_gateway_keys_still_load(tmp_path):
    (tmp_path / "ca.pem").write_text("x")
    node = NodeConfig.from_dict({"gateway": {"target": "127.0.0.1:1", "ca": "/ca.pem",
                                             "server_name_override": "gw"}})
    assert (node.gateway.ca_cert, node.gateway.server_name) == ("/ca.pem", "gw")
    switch = parse_config({"gateway": {"target": "127.0.0.1:1", "ca": "ca.pem"}, "switches": [SWITCH]}, tmp_path)
    assert switch.gateway.ca_cert == str(tmp_path / "ca.pem")


@pytest.mark.parametrize("gateway, error", [
    ({"target": "127.0.0.1:1", "ca_cert": "/ca", "client_key": "/k"},
     r"^gateway: the client certificate and its key go together \(mTLS\)$"),
    ({"target": "127.0.0.1:1", "client_cert": "/c", "client_key": "/k"}, r"^gateway: a client certificate needs TLS"),
    ({"target": "127.0.0.1:1", "token": "a", "token_file": "/t"}, r"^gateway: give token or token_file, not both"),
    ({"target": "127.0.0.1"}, r"^gateway.target: target '127.0.0.1' is not host:port"),
    ({"target": "127.0.0.1:1", "client_cert": 7}, r"^gateway.client_cert: expected a string, got 7"),
    ({"target": "127.0.0.1:1", "max_batch": 0}, r"^gateway.max_batch: expected an integer in 1..10000, got 0"),
    ({"target": "127.0.0.1:1", "linger_s": float("nan")}, r"^gateway.linger_s: expected a number, got nan"),
    ({"target": "127.0.0.1:1", "max_batch": True}, r"^gateway.max_batch: expected an integer, got True"),
    ({"target": "127.0.0.1:1", "ca_crt": "/ca"}, r"^gateway: unknown key 'ca_crt' \(allowed: target, token_file"),
])
def test_node_gateway_errors_name_the_path(gateway, error):
    with pytest.raises(ConfigError, match=error):
        NodeConfig.from_dict({"gateway": gateway})


def test_switch_files_are_resolved_and_must_exist(tmp_path):
    with pytest.raises(ValueError, match=r"^gateway.client_cert: no such file: .*client.pem"):
        parse_config({"gateway": {"target": "127.0.0.1:1", "client_cert": "client.pem"}, "switches": [SWITCH]},
                     tmp_path)
    with pytest.raises(ValueError, match=r"^switches\[0\] \(leaf-01\).tls.ca: no such file"):
        parse_config({"switches": [{**SWITCH, "tls": {"ca": "nope.pem"}}]}, tmp_path)
    with pytest.raises(ValueError, match=r"^defaults.tls: unknown key 'cA'"):
        parse_config({"defaults": {"tls": {"cA": "x"}}, "switches": [SWITCH]}, tmp_path)


def test_the_switch_token_comes_from_the_environment_only_without_token_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("FABRICWATCH_TOKEN", "from-env")
    assert parse_config({"gateway": {"target": "127.0.0.1:50051"}, "switches": [SWITCH]}, tmp_path).gateway.token == "from-env"
    assert parse_config({"gateway": {}, "switches": [SWITCH]}, tmp_path).gateway is None    # empty: off
    assert parse_config({"gateway": {"token": "t"}, "switches": [SWITCH]}, tmp_path).gateway.token == "t"
    # the node collector reads no environment: its token is in its config
    assert NodeConfig.from_dict({}).sender_config().token == ""


def test_hostile_shapes_fail_cleanly():
    deep: dict = {}
    for _ in range(200):
        deep = {"x": deep}
    for data, error in (([1, 2], r"^config: expected a mapping, got list"),
                        ({"intervals": "fast"}, r"^intervals: expected a mapping, got str"),
                        ({"ethtool": {"allow": ["ok", ""]}}, r"^ethtool.allow\[1\]: expected a non-empty string"),
                        ({"nvml": deep}, r"^nvml: unknown key 'x'"),
                        ({1: 2}, r"^config: keys must be strings, got 1")):
        with pytest.raises(ConfigError, match=error):
            NodeConfig.from_dict(data)
    with pytest.raises(ValueError, match=r"^gateway: expected a mapping, got int"):
        validate(GatewayConnection, 5, where="gateway")


@pytest.mark.parametrize("text, error", [
    ("collectors: [{token_sha256: abc, sources: [x]}]", r"collectors\[0\].token_sha256: must be 64 lowercase hex"),
    (f"collectors: [{{token_sha256: {'a' * 64}, sources: []}}]", r"collectors\[0\].sources: expected a non-empty"),
    (f"collectors: [{{name: r1, token_sha256: {'a' * 64}, sources: [x], srcs: [y]}}]",
     r"collectors\[0\] \(r1\): unknown key 'srcs'"),
    ("collectors: 3", r"collectors: expected a list, got 3"),
])
def test_tokens_file_errors_name_the_entry(tmp_path, text, error):
    from fabricwatch.streams.auth import AuthConfigError, TokenAuth

    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    with pytest.raises(AuthConfigError, match=error):
        TokenAuth.load(path)


def test_the_rank_sdk_applies_the_same_gateway_rules():
    from fabricwatch.rank import RankIdentity, RankReporter

    ident = RankIdentity("job", 0, 1, "node-1", 0, "test")
    with pytest.raises(ValueError, match=r"^gateway: a gateway at gw.example needs TLS"):
        RankReporter(ident, "gw.example:50051", token="t")
    with pytest.raises(ValueError, match=r"^gateway.target: target 'gw' is not host:port"):
        RankReporter(ident, "gw")
    assert not RankReporter.from_env({"RANK": "0", "WORLD_SIZE": "1", "FABRICWATCH_GATEWAY": "gw.example:1"}).enabled


def test_importing_the_rank_sdk_does_not_import_pydantic():
    import subprocess
    import sys

    code = "import sys, fabricwatch.rank; print('pydantic' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_topology_files_round_trip_and_name_the_bad_entry(tmp_path):
    import yaml

    from fabricwatch.models.topology import TopologyError, rail_optimised
    from fabricwatch.topology_file import load_topology, topology_from_dict

    topo = rail_optimised("t", n_nodes=4, nodes_per_unit=2, n_spines=2)
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(topo.to_dict()))
    assert load_topology(path).to_dict() == topo.to_dict()
    doc = topo.to_dict()
    for change, error in ((lambda d: d["nic_ports"][3].update(port="one"),
                           r"nic_ports\[3\].port: expected an integer, got 'one'"),
                          (lambda d: d["links"][0].update(speed=1), r"links\[0\]: unknown key 'speed'"),
                          (lambda d: d["switches"][1].update(name=""), r"switches\[1\].name: expected a non-empty"),
                          (lambda d: d["nic_ports"][0].update(switch="nowhere"), r"cabled to unknown switch 'nowhere'"),
                          (lambda d: d.pop("switches"), r"config: missing key 'switches'")):
        broken = yaml.safe_load(yaml.safe_dump(doc))
        change(broken)
        with pytest.raises(TopologyError, match=error):
            topology_from_dict(broken)
    with pytest.raises(TopologyError, match="cannot read the topology"):
        load_topology(tmp_path / "missing.yaml")


def test_policy_errors_name_the_path_without_item_labels():
    from fabricwatch.actions.policy import PolicyError, parse_policy

    for text, error in (("[1]", r"^policy: expected a mapping, got list"),
                        ("rules: [{name: a, match: {kind: [pfc_storm, pfc_storm2]}, actions: [alert]}]",
                         r"^rules\[0\].match.kind: unknown anomaly kind 'pfc_storm2'"),
                        ("rules: [{name: a, match: {}, actions: [alert, alert]}]",
                         r"^rules\[0\].actions: an action is listed twice"),
                        ("guards: {breaker: {min_count: 1.5}}", r"^guards.breaker.min_count: expected an integer")):
        with pytest.raises(PolicyError, match=error):
            parse_policy(text)
    guards = parse_policy("guards: {breaker: {fleet_size: 1000, max_fraction: 0.05}}").guards
    assert guards.breaker.limit == 50 and guards.cooldown_s == 1800.0


def test_a_huge_value_is_not_echoed_back_whole():
    with pytest.raises(ConfigError) as err:
        NodeConfig.from_dict({"sources": {"nvml": "x" * 1_000_000}, "intervals": {"nvml": ["y"] * 100_000}})
    message = str(err.value)
    assert message.startswith("intervals.nvml: expected a number, got ['y'") and len(message) < 700
    assert message.endswith("(and 1 more)")


@pytest.mark.parametrize("text, error", [
    ("executors: {scheduler: slurm, slurm: {scontrl: x}}", r"^executors.slurm: unknown key 'scontrl'"),
    ("executors: {restart: {argv: [/bin/true, 3]}}", r"^executors.restart.argv\[1\]: expected a string, got 3"),
    ("executors: {restart: {webhook_url: 'https://x'}}", r"^executors.restart.webhook_secret_env: required"),
    ("alerts: {pagerduty: {routing_key_env: FABRICWATCH_TEST_UNSET}}",
     r"^alerts.pagerduty.routing_key_env: environment variable FABRICWATCH_TEST_UNSET is not set"),
    ("alerts: {alertmanager: {urls: []}}", r"^alerts.alertmanager.urls: expected a non-empty list"),
    ("alerts: {wecom: {webhook_url_env: X, mentioned: ['bad id']}}", r"^alerts.wecom.mentioned: 'bad id' is not"),
])
def test_policy_backend_sections_are_on_the_schema(text, error, monkeypatch):
    from fabricwatch.actions.policy import PolicyError, parse_policy
    from fabricwatch.actions.wiring import build

    monkeypatch.delenv("FABRICWATCH_TEST_UNSET", raising=False)
    with pytest.raises(PolicyError, match=error):
        build(parse_policy(text))


def test_an_empty_backend_section_is_off_and_a_backlog_is_kept():
    from fabricwatch.actions.policy import parse_policy
    from fabricwatch.actions.wiring import build

    assert build(parse_policy("executors: {restart: {}}\nalerts: {slack: {}}")).sinks == []
    backends = build(parse_policy("alerts: {alertmanager: {urls: ['http://127.0.0.1:9093'], max_backlog: 5}}"))
    assert backends.alert_backlog == {"alertmanager": 5}
