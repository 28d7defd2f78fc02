"""The switch-port executor: gNMI Get/Set of OpenConfig config/enabled.

The openconfig/gnmi fake target that the switch-collector tests stream from implements
Subscribe only (its server embeds ``UnimplementedGNMIServer``), so it cannot show a Set
being applied; one test runs against it anyway, over mTLS, and checks the executor reports
its UNIMPLEMENTED cleanly. The Set itself is tested against `PortTarget`, a small
in-process `grpc.aio` gNMI server implementing Get and Set on a port table, over TLS with
client certificates, recording each request and its metadata.
"""
from __future__ import annotations

import grpc
import pytest
import pytest_asyncio
from test_switch_collector import FIXTURES, fake_server_bin, fake_target, free_port, pki  # noqa: F401 (fixtures)

from fabricwatch.actions.base import ALREADY, DONE, DRAIN_NODE, FAILED, ISOLATE_PORT, RESTORE_PORT, ActionRequest
from fabricwatch.actions.executors.switch_port import SwitchPortExecutor, read_bool
from fabricwatch.collectors.gnmi_decode import gnmi_pb2, gnmi_pb2_grpc
from fabricwatch.collectors.gnmi_switch import SwitchSettings, TlsSettings
from fabricwatch.models.findings import EntityRef


class PortTarget(gnmi_pb2_grpc.gNMIServicer):
    """A switch with ports Ethernet0..: Get/Set ``interfaces/interface[name]/config/enabled``."""

    def __init__(self, ports=("Ethernet0", "Ethernet12", "Ethernet1/1"), *, get_supported=True,
                 set_error: grpc.StatusCode | None = None):
        self.enabled = {p: True for p in ports}
        self.get_supported = get_supported
        self.set_error = set_error
        self.gets: list[gnmi_pb2.GetRequest] = []
        self.sets: list[gnmi_pb2.SetRequest] = []
        self.metadata: list[dict] = []

    @staticmethod
    def _port(path: gnmi_pb2.Path) -> str:
        names = [e.name for e in path.elem]
        if names != ["interfaces", "interface", "config", "enabled"] or list(path.elem[1].key) != ["name"]:
            raise KeyError(f"unsupported path {names}")
        return path.elem[1].key["name"]

    async def Get(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        self.gets.append(request)
        if not self.get_supported:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Get is not implemented")
        port = self._port(request.path[0])
        if port not in self.enabled:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no interface {port}")
        value = b'{"openconfig-interfaces:enabled": %s}' % (b"true" if self.enabled[port] else b"false")
        note = gnmi_pb2.Notification(timestamp=1)
        note.update.add(path=request.path[0], val=gnmi_pb2.TypedValue(json_ietf_val=value))
        return gnmi_pb2.GetResponse(notification=[note])

    async def Set(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        self.sets.append(request)
        if self.set_error is not None:
            await context.abort(self.set_error, "user telemetry may not write config")
        results = []
        for update in request.update:
            port = self._port(update.path)
            if port not in self.enabled:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no interface {port}")
            value = read_bool(update.val)
            if value is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a boolean: {update.val}")
            self.enabled[port] = value
            results.append(gnmi_pb2.UpdateResult(path=update.path, op=gnmi_pb2.UpdateResult.UPDATE))
        return gnmi_pb2.SetResponse(response=results, timestamp=1_800_000_000_000_000_000)


@pytest_asyncio.fixture(loop_scope="function")
async def serve(pki):  # noqa: F811 (the fixture imported above)
    servers = []

    async def start(target: PortTarget, *, mtls: bool = True) -> str:
        port = free_port()
        server = grpc.aio.server()
        gnmi_pb2_grpc.add_gNMIServicer_to_server(target, server)
        if mtls:
            with open(pki["server.key"], "rb") as k, open(pki["server.pem"], "rb") as c, open(pki["ca.pem"], "rb") as ca:
                creds = grpc.ssl_server_credentials([(k.read(), c.read())], root_certificates=ca.read(),
                                                    require_client_auth=True)
            server.add_secure_port(f"127.0.0.1:{port}", creds)
        else:
            server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)


def mtls_settings(pki, address: str, name="leaf-01", **kwargs) -> SwitchSettings:  # noqa: F811
    return SwitchSettings(name=name, target=address, username="netops", password="pw",
                          tls=TlsSettings(ca=pki["ca.pem"], client_cert=pki["client.pem"], client_key=pki["client.key"]),
                          **kwargs)


def request(action=ISOLATE_PORT, switch="leaf-01", port="Ethernet12") -> ActionRequest:
    return ActionRequest(action=action, target=EntityRef(cluster="c1", switch=switch, port=port),
                         reason="pfc storm source", idempotency_key=f"{action}-{switch}-{port}")


def elems(path: gnmi_pb2.Path) -> list[tuple[str, dict]]:
    return [(e.name, dict(e.key)) for e in path.elem]


async def test_isolate_sets_enabled_false_over_mtls_then_is_already(pki, serve):  # noqa: F811
    target = PortTarget()
    address = await serve(target)
    ex = SwitchPortExecutor({"leaf-01": mtls_settings(pki, address)})

    result = await ex.execute(request())

    assert result.status == DONE, result.detail
    [get] = target.gets
    [set_request] = target.sets
    [update] = set_request.update
    assert elems(update.path) == [("interfaces", {}), ("interface", {"name": "Ethernet12"}), ("config", {}),
                                  ("enabled", {})]
    assert elems(get.path[0]) == elems(update.path) and get.type == gnmi_pb2.GetRequest.CONFIG
    assert update.val.json_ietf_val == b"false"
    assert not set_request.replace and not set_request.delete
    assert target.enabled == {"Ethernet0": True, "Ethernet12": False, "Ethernet1/1": True}
    assert all(md["username"] == "netops" and md["password"] == "pw" for md in target.metadata)

    again = await ex.execute(request())
    assert again.status == ALREADY and len(target.sets) == 1

    restored = await ex.execute(request(RESTORE_PORT))
    assert restored.status == DONE
    assert target.sets[-1].update[0].val.json_ietf_val == b"true"
    assert target.enabled["Ethernet12"] is True


async def test_bool_encoding_basic_auth_and_a_port_name_with_a_slash(pki, serve):  # noqa: F811
    target = PortTarget()
    address = await serve(target)
    ex = SwitchPortExecutor({"leaf-01": mtls_settings(pki, address, auth="basic")}, value_encoding="bool")
    result = await ex.execute(request(port="Ethernet1/1"))
    assert result.status == DONE, result.detail
    assert target.sets[0].update[0].val.bool_val is False
    assert target.sets[0].update[0].val.WhichOneof("value") == "bool_val"
    assert target.enabled["Ethernet1/1"] is False
    assert target.metadata[0]["authorization"] == "Basic bmV0b3BzOnB3"   # netops:pw


async def test_a_target_without_get_is_set_directly(pki, serve):  # noqa: F811
    target = PortTarget(get_supported=False)
    address = await serve(target, mtls=False)
    ex = SwitchPortExecutor({"leaf-01": SwitchSettings(name="leaf-01", target=address,
                                                       tls=TlsSettings(plaintext=True))})
    result = await ex.execute(request())
    assert result.status == DONE and len(target.gets) == 1 and len(target.sets) == 1
    assert target.metadata[0].get("username") is None   # no credentials configured, none sent


async def test_rpc_errors_and_bad_requests_are_failed(pki, serve):  # noqa: F811
    denied = PortTarget(set_error=grpc.StatusCode.PERMISSION_DENIED)
    address = await serve(denied)
    ex = SwitchPortExecutor({"leaf-01": mtls_settings(pki, address)})
    result = await ex.execute(request())
    assert result.status == FAILED
    assert "PERMISSION_DENIED" in result.detail and "leaf-01:Ethernet12" in result.detail

    healthy = PortTarget()
    ex_healthy = SwitchPortExecutor({"leaf-01": mtls_settings(pki, await serve(healthy))})
    missing = await ex_healthy.execute(request(port="Ethernet99"))   # Get's NOT_FOUND is tolerated, Set's is not
    assert missing.status == FAILED and "NOT_FOUND" in missing.detail and "no interface Ethernet99" in missing.detail
    assert len(healthy.sets) == 1

    assert "no gNMI target" in (await ex.execute(request(switch="spine-09"))).detail
    assert "must name a switch and a port" in (await ex.execute(request(port=""))).detail
    assert (await ex.execute(request(DRAIN_NODE))).status == FAILED


async def test_an_unreachable_switch_and_a_cumulus_switch_are_failed():
    ex = SwitchPortExecutor({
        "leaf-01": SwitchSettings(name="leaf-01", target=f"127.0.0.1:{free_port()}", tls=TlsSettings(plaintext=True)),
        "leaf-02": SwitchSettings(name="leaf-02", target="10.0.0.12:9339", profile="cumulus"),
    }, timeout_s=2)
    down = await ex.execute(request())
    assert down.status == FAILED and "UNAVAILABLE" in down.detail
    cumulus = await ex.execute(request(switch="leaf-02"))
    assert cumulus.status == FAILED and "Subscribe only" in cumulus.detail


def test_construction_errors_are_clear():
    with pytest.raises(ValueError, match="loopback"):
        SwitchPortExecutor({"s": SwitchSettings(name="s", target="10.0.0.1:57400", tls=TlsSettings(plaintext=True))})
    with pytest.raises(ValueError, match="value_encoding"):
        SwitchPortExecutor({}, value_encoding="yaml")
    with pytest.raises(ValueError, match="does not match"):
        SwitchPortExecutor({"a": SwitchSettings(name="b", target="127.0.0.1:1")})
    with pytest.raises(ValueError, match="host:port"):
        SwitchPortExecutor({"a": SwitchSettings(name="a", target="no-port")})


async def test_targets_from_the_switch_collector_yaml(tmp_path, serve):
    target = PortTarget()
    address = await serve(target, mtls=False)
    config = tmp_path / "switches.yaml"
    config.write_text(f"switches:\n  - name: leaf-07\n    target: {address}\n    tls:\n      plaintext: true\n")
    ex = SwitchPortExecutor.from_config(str(config))
    assert (await ex.execute(request(switch="leaf-07", port="Ethernet0"))).status == DONE
    assert target.enabled["Ethernet0"] is False


async def test_the_openconfig_fake_target_has_no_set_and_that_is_reported(fake_server_bin, pki, tmp_path):  # noqa: F811
    with fake_target(fake_server_bin, FIXTURES / "openconfig.textproto", pki, tmp_path, mtls=True) as fake:
        ex = SwitchPortExecutor({"leaf-01": mtls_settings(pki, f"127.0.0.1:{fake.port}")})
        result = await ex.execute(request())
    assert result.status == FAILED
    assert "UNIMPLEMENTED" in result.detail and "Set" in result.detail
