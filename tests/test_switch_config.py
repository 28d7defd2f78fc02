"""The gNMI switch collector's configuration: defaults, credentials, `--check`, clear errors.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from fabricwatch.collectors.gnmi_profiles import PROFILES
from fabricwatch.collectors.switch import describe, load_config, parse_config

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- helpers


# ----------------------------------------------------------------------------- configuration
def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_config_defaults_credentials_and_check_output(tmp_path, capsys):
    write(tmp_path / "ca.pem", "x")
    write(tmp_path / "creds.yaml", "username: telemetry\npassword: s3cret\n")
    cfg = tmp_path / "switches.yaml"
    cfg.write_text("""
cluster: c1
gateway: {target: "127.0.0.1:50051", token: t0k}
defaults:
  profile: arista
  credentials: creds.yaml
  priorities: [4, 3]
  tls: {ca: ca.pem}
switches:
  - {name: spine-01, target: "10.0.0.1:6030"}
  - {name: leaf-01, target: "10.0.0.2:9339", profile: cumulus, sample_interval_ms: 500,
     tls: {server_name: leaf-01.mgmt}}
""")
    config = load_config(cfg)
    spine, leaf = config.switches
    assert (spine.profile, spine.priorities, spine.username, spine.password) == \
        ("arista", (3, 4), "telemetry", "s3cret")
    assert spine.tls.ca == str(tmp_path / "ca.pem")
    assert (leaf.tls.ca, leaf.tls.server_name, leaf.sample_interval_ms) == \
        (str(tmp_path / "ca.pem"), "leaf-01.mgmt", 500)
    assert "s3cret" not in repr(leaf) and "t0k" not in repr(config.gateway)
    text = describe(config)
    assert "switch leaf-01 10.0.0.2:9339 profile=cumulus TLS auth=basic" in text
    assert "group pfc-ext (optional): 4 paths" in text   # {prio} x priorities [3, 4]


@pytest.mark.parametrize("switch, error", [
    ({"name": "a", "target": "h:1", "skipverify": True}, r"switches\[0\] \(a\): unknown key 'skipverify'"),
    ({"name": "a", "target": "h:1", "tls": {"skip_verfy": True}}, r"\.tls: unknown key 'skip_verfy'"),
    ({"name": "a", "target": "h"}, r"\.target: target 'h' is not host:port"),
    ({"name": "a", "target": "h:1", "profile": "junos"}, r"unknown profile 'junos'"),
    ({"name": "a", "target": "10.0.0.1:1", "tls": {"plaintext": True}}, r"only allowed to a loopback"),
    ({"name": "a", "target": "h:1", "priorities": [3, 9]}, r"priorities\[1\]: expected an integer in 0..7, got 9"),
    ({"name": "a", "target": "h:1", "sample_interval_ms": 0}, r"sample_interval_ms: expected an integer"),
    ({"name": "a", "target": "h:1", "credentials": "nope.yaml"}, r"credentials: no such file"),
    ({"target": "h:1"}, r"missing key 'name'"),
])
def test_config_errors_are_clear(tmp_path, switch, error):
    with pytest.raises(ValueError, match=error):
        parse_config({"switches": [switch]}, tmp_path)


def test_config_refuses_contradictions_and_plaintext_gateway(tmp_path):
    write(tmp_path / "ca.pem", "x")
    with pytest.raises(ValueError, match="skip_verify and ca contradict"):
        parse_config({"switches": [{"name": "a", "target": "h:1", "tls": {"ca": "ca.pem", "skip_verify": True}}]},
                     tmp_path)
    with pytest.raises(ValueError, match="duplicate switch name 'a'"):
        parse_config({"switches": [{"name": "a", "target": "h:1"}, {"name": "a", "target": "h:2"}]}, tmp_path)
    with pytest.raises(ValueError, match="gateway at gw.example needs TLS"):
        parse_config({"gateway": {"target": "gw.example:50051"}, "switches": [{"name": "a", "target": "h:1"}]},
                     tmp_path)
    with pytest.raises(ValueError, match="gateway: the client certificate and its key go together"):
        parse_config({"gateway": {"target": "127.0.0.1:1", "ca": "ca.pem", "client_cert": "ca.pem"},
                      "switches": [{"name": "a", "target": "h:1"}]}, tmp_path)
    with pytest.raises(ValueError, match=r"config: unknown key 'switch'"):
        parse_config({"switch": []}, tmp_path)
    write(tmp_path / "bad.yaml", "username: u\npasswd: p\n")
    with pytest.raises(ValueError, match="unknown key 'passwd'"):
        parse_config({"switches": [{"name": "a", "target": "h:1", "credentials": "bad.yaml"}]}, tmp_path)


def test_example_config_in_deploy_is_valid(tmp_path, monkeypatch):
    text = (REPO / "deploy" / "switch-collector.example.yaml").read_text()
    data = __import__("yaml").safe_load(text)
    # the example points at /etc paths; validate it with those files stubbed under tmp_path
    for section in [data.get("gateway", {}), data.get("defaults", {}), *data["switches"]]:
        for key in ("ca", "ca_cert", "token_file", "credentials"):
            if section.get(key):
                section[key] = str(write(tmp_path / Path(section[key]).name, "u" if key == "token_file" else
                                         "username: u\npassword: p\n" if key == "credentials" else "x"))
        for key in ("ca", "client_cert", "client_key"):
            if section.get("tls", {}).get(key):
                section["tls"][key] = str(write(tmp_path / Path(section["tls"][key]).name, "x"))
    config = parse_config(data, tmp_path)
    assert {s.profile for s in config.switches} == set(PROFILES)


