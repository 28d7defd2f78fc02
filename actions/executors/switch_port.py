"""Switch-port executor: admin-down (ISOLATE_PORT) and restore (RESTORE_PORT) over gNMI Set.

`SwitchPortExecutor` sets the OpenConfig leaf
``/interfaces/interface[name=<port>]/config/enabled`` to false or true with one gNMI
``Set`` (an ``update`` of that leaf, JSON_IETF ``false``/``true`` by default). Before the
Set it reads the leaf with ``Get`` and answers ALREADY when the port already is as wanted;
a target without Get (UNIMPLEMENTED) is simply set, which is idempotent anyway.

Connections are made as the switch collector makes them (`collectors.gnmi_switch`):
`grpc.aio` with pygnmi's compiled gNMI 0.8.0 stubs, TLS with the switch's CA, optional
mTLS, ``skip_verify`` pinning, plaintext to loopback only, and credentials as gNMI
``username``/``password`` metadata or HTTP Basic, per the switch's profile. Targets come
from a mapping switch name -> `SwitchSettings`, or from the collector's YAML
(`SwitchPortExecutor.from_config`), so one file describes how to reach each switch.
A channel is opened per action and closed after it: isolation is rare and must not
depend on a long-lived connection.

Cumulus Linux serves gNMI Subscribe only (no Get/Set, ecosystem 3.2): switches with the
``cumulus`` profile are refused with a clear FAILED. SONiC needs its management-framework
(translib) gNMI server for OpenConfig Set; the telemetry container's COUNTERS_DB target
cannot set anything. `execute` never raises: RPC and connection errors come back FAILED.
"""
from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Mapping

import grpc

from fabricwatch.actions.base import (
    ALREADY,
    DONE,
    FAILED,
    ISOLATE_PORT,
    RESTORE_PORT,
    ActionRequest,
    ExecutionResult,
)
from fabricwatch.collectors.gnmi_decode import gnmi_pb2, gnmi_pb2_grpc
from fabricwatch.collectors.gnmi_profiles import compile_profile
from fabricwatch.collectors.gnmi_switch import (
    SwitchSettings,
    auth_metadata,
    is_loopback,
    open_channel,
    split_target,
)

log = logging.getLogger("fabricwatch.actions.switch_port")

#: Profiles whose NOS has no gNMI Set, and why.
NO_SET = {"cumulus": "Cumulus Linux serves gNMI Subscribe only (no Get/Set)"}
VALUE_ENCODINGS = ("json_ietf", "json", "bool")


def enabled_path(port: str, origin: str = "") -> gnmi_pb2.Path:
    """``/interfaces/interface[name=<port>]/config/enabled`` built element by element, so a
    port name is only ever a key value (no xpath parsing of data)."""
    path = gnmi_pb2.Path(origin=origin)
    path.elem.add(name="interfaces")
    path.elem.add(name="interface").key["name"] = port
    path.elem.add(name="config")
    path.elem.add(name="enabled")
    return path


def typed_bool(enabled: bool, encoding: str) -> gnmi_pb2.TypedValue:
    if encoding == "bool":
        return gnmi_pb2.TypedValue(bool_val=enabled)
    raw = json.dumps(enabled).encode()
    return gnmi_pb2.TypedValue(json_ietf_val=raw) if encoding == "json_ietf" else gnmi_pb2.TypedValue(json_val=raw)


def read_bool(value: gnmi_pb2.TypedValue) -> bool | None:
    """A boolean leaf as the target sent it: bool_val, or JSON ``true``/``false``, possibly
    wrapped as ``{"openconfig-interfaces:enabled": true}``; None if it is neither."""
    kind = value.WhichOneof("value")
    if kind == "bool_val":
        return value.bool_val
    if kind in ("json_ietf_val", "json_val"):
        try:
            decoded = json.loads(getattr(value, kind))
        except ValueError:
            return None
        if isinstance(decoded, dict) and len(decoded) == 1:
            decoded = next(iter(decoded.values()))
        return decoded if isinstance(decoded, bool) else None
    if kind in ("string_val", "ascii_val"):
        text = getattr(value, kind).strip().lower()
        return {"true": True, "false": False}.get(text)
    return None


class SwitchPortExecutor:
    """ISOLATE_PORT / RESTORE_PORT by gNMI Set of OpenConfig ``config/enabled``.

    Parameters
    ----------
    switches
        Switch name (``EntityRef.switch``) -> how to reach it (`SwitchSettings`).
    value_encoding
        How the boolean travels: ``json_ietf`` (default), ``json`` or ``bool`` (``bool_val``).
    origin
        gNMI path origin; ``""`` leaves it to the target (OpenConfig on EOS and most NOSes).
    timeout_s
        Per RPC.
    check_first
        Get the leaf first and answer ALREADY without a Set when it already is as wanted.
    """

    name = "switch_port"
    handles = frozenset({ISOLATE_PORT, RESTORE_PORT})

    def __init__(self, switches: Mapping[str, SwitchSettings], *, value_encoding: str = "json_ietf",
                 origin: str = "", timeout_s: float = 10.0, check_first: bool = True, fabric: str = "default") -> None:
        if value_encoding not in VALUE_ENCODINGS:
            raise ValueError(f"value_encoding must be one of {VALUE_ENCODINGS}, got {value_encoding!r}")
        #: What the guard rails count in: the fabric these switches form (one config = one fabric).
        self.domain = f"fabric:{fabric}"
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        for name, settings in switches.items():
            if name != settings.name:
                raise ValueError(f"switch key {name!r} does not match its settings' name {settings.name!r}")
            host, _ = split_target(settings.target)   # ValueError for a bad target
            if settings.tls.plaintext and not is_loopback(host):
                raise ValueError(f"switch {name}: plaintext gNMI is only allowed to a loopback target")
        self.switches = dict(switches)
        self.value_encoding = value_encoding
        self.origin = origin
        self.timeout_s = timeout_s
        self.check_first = check_first
        self._profiles = {name: compile_profile(s.profile) for name, s in self.switches.items()}

    @classmethod
    def from_config(cls, path: str, **kwargs) -> SwitchPortExecutor:
        """The switches of a switch-collector YAML (``fabricwatch collect-switch --config``)."""
        from fabricwatch.collectors.switch import load_config

        kwargs.setdefault("fabric", path)
        return cls({s.name: s for s in load_config(path).switches}, **kwargs)

    async def execute(self, request: ActionRequest) -> ExecutionResult:
        switch, port = request.target.switch, request.target.port
        if request.action not in self.handles:
            return ExecutionResult(FAILED, f"switch_port executor does not handle {request.action!r}")
        if not switch or not port:
            return ExecutionResult(FAILED, f"{request.action}: the request must name a switch and a port")
        settings = self.switches.get(switch)
        if settings is None:
            return ExecutionResult(FAILED, f"{request.action}: no gNMI target configured for switch {switch!r}")
        if settings.profile in NO_SET:
            return ExecutionResult(FAILED, f"{request.action} {switch}:{port}: {NO_SET[settings.profile]}; "
                                           "isolate the port another way")
        enabled = request.action == RESTORE_PORT
        where = f"{switch}:{port}"
        try:
            return await self._set(settings, port, enabled, where)
        except grpc.aio.AioRpcError as exc:
            return ExecutionResult(FAILED, f"gNMI on {where} ({settings.target}) failed: "
                                           f"{exc.code().name}: {exc.details()}")
        except (OSError, ssl.SSLError, ValueError) as exc:
            return ExecutionResult(FAILED, f"gNMI on {where} ({settings.target}): {type(exc).__name__}: {exc}")
        except Exception as exc:   # never crash the responder
            return ExecutionResult(FAILED, f"gNMI on {where}: unexpected {type(exc).__name__}: {exc}")

    async def _set(self, settings: SwitchSettings, port: str, enabled: bool, where: str) -> ExecutionResult:
        metadata = auth_metadata(settings, self._profiles[settings.name])
        path = enabled_path(port, self.origin)
        word = "enabled" if enabled else "disabled (admin-down)"
        async with await open_channel(settings) as channel:
            stub = gnmi_pb2_grpc.gNMIStub(channel)
            if self.check_first:
                current = await self._get(stub, path, metadata)
                if current is enabled:
                    return ExecutionResult(ALREADY, f"{where}: config/enabled already {str(enabled).lower()}")
            update = gnmi_pb2.Update(path=path, val=typed_bool(enabled, self.value_encoding))
            response = await stub.Set(gnmi_pb2.SetRequest(update=[update]), metadata=metadata,
                                      timeout=self.timeout_s)
        return ExecutionResult(DONE, f"{where}: gNMI Set config/enabled={str(enabled).lower()} -> port {word} "
                                     f"(target timestamp {response.timestamp})")

    async def _get(self, stub, path: gnmi_pb2.Path, metadata) -> bool | None:
        """The leaf's current value; None if the target cannot say (no Get, odd encoding)."""
        request = gnmi_pb2.GetRequest(path=[path], type=gnmi_pb2.GetRequest.CONFIG,
                                      encoding=gnmi_pb2.JSON_IETF)
        try:
            response = await stub.Get(request, metadata=metadata, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND,
                              grpc.StatusCode.INVALID_ARGUMENT):
                return None   # no Get, or the leaf is unset: the Set decides
            raise
        for notification in response.notification:
            for update in notification.update:
                value = read_bool(update.val)
                if value is not None:
                    return value
        return None
