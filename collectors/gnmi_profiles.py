"""Per-NOS gNMI profiles: what to subscribe to, and how each leaf maps to fabricwatch names.

A profile is data: subscription groups (one gNMI ``Subscribe`` RPC each, because the
prefix ``target``/``origin`` is per ``SubscriptionList``) and rules that map a received
leaf path to one normalised switch-port column of ``fabricwatch.counters``
(``in-octets``, ``pfc3-rx-pkts``, ``oper_up``, ...). The code below only compiles them.

Rule templates are written in the canonical path form the collector builds from every
received leaf: elements joined by ``/``, keys as ``[k=v]`` sorted by key name, YANG module
prefixes removed (``openconfig-interfaces:interfaces`` -> ``interfaces``) where the profile
says so. Placeholders:

=============  ==========================================================================
``{port}``     the switch port (entity id), e.g. ``Ethernet8``, ``swp12``, ``Ethernet1/1``
``{prio}``     a PFC priority 0..7 (digits)
``{queue}``    an egress queue index (digits; taken as the priority, see docs)
``{*}``        any one element name or key value (ignored)
``{**}/``      zero or more whole elements (ignored); SONiC's wildcard JSON nesting
``[*=...]``    a key whose name does not matter
=============  ==========================================================================

Units are converted ONLY where the normalised name's unit differs from the source's
(each converter below says which); every other counter travels raw, as the switch counts.

>>> p = compile_profile("arista")
>>> m = p.match("interfaces/interface[name=Ethernet1/1]/ethernet/pfc/priorities/priority[index=3]"
...             "/state/pfc-on-total-rx-time")
>>> m.rule.output_name(m.binds), m.binds["port"], m.rule.convert
('pfc3-rx-pause-duration-us', 'Ethernet1/1', 'ns_to_us')
>>> compile_profile("sonic").match("COUNTERS/Ethernet*/Ethernet8/SAI_PORT_STAT_PFC_3_RX_PKTS").binds
{'port': 'Ethernet8', 'prio': '3'}
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache

COUNTER, GAUGE, PORT_NAME_MAP = "counter", "gauge", "port_name_map"
SAMPLE, ON_CHANGE = "sample", "on_change"
UINT64_MAX = 2**64 - 1


@dataclass(frozen=True)
class Rule:
    template: str
    name: str                 # normalised output name; may use {prio} / {queue}
    kind: str = COUNTER       # COUNTER | GAUGE | PORT_NAME_MAP
    convert: str = "raw"      # key of CONVERTERS
    mode: str = SAMPLE        # SAMPLE leaves drive the tick; ON_CHANGE leaves ride along
    rank: int = 0             # several sources for one name on one port: the highest rank wins

    def output_name(self, binds: dict[str, str]) -> str:
        if "{" not in self.name:
            return self.name
        return self.name.format(prio=int(binds.get("prio", 0)), queue=int(binds.get("queue", 0)))


def R(template: str, name: str, kind: str = COUNTER, convert: str = "raw", mode: str = SAMPLE,
      rank: int = 0) -> Rule:
    return Rule(template, name, kind, convert, mode, rank)


# --------------------------------------------------------------------------- converters
# Every converter takes the decoded gNMI scalar (int, float, str, bool) and returns the
# value to store: an int 0..2**64-1 for counters, a float for gauges; None = unusable.

def _to_uint(v) -> int | None:
    """A counter as the switch counts it. SONiC sends JSON strings ("0"), JSON_IETF sends
    uint64 as strings too; PROTO sends uint_val."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        n = v
    elif isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            return None
        n = int(v)
    elif isinstance(v, str):
        s = v.strip()
        if not s or not (s.isdigit() or (s[0] in "+-" and s[1:].isdigit())):
            return None
        n = int(s)
    else:
        return None
    return n if 0 <= n <= UINT64_MAX else None


def _ns_to_us(v) -> int | None:
    """Nanoseconds -> microseconds (floor): Arista ``pfc-on-total-rx-time`` is a total in ns
    ("The total time in nanoseconds that (interface, priority) was paused", EOS 4.36.1F
    arista-pfc-history-counters-augment.yang); ``pfc<p>-rx-pause-duration-us`` is in us.
    Floor division of a monotonic total stays monotonic."""
    n = _to_uint(v)
    return None if n is None else n // 1000


_SPEED = re.compile(r"SPEED_(\d+(?:\.\d+)?)(G|M)B", re.IGNORECASE)


def _speed_to_gbps(v) -> float | None:
    """OpenConfig ``port-speed`` identityref -> Gb/s: ``openconfig-if-ethernet:SPEED_400GB``
    -> 400.0, ``SPEED_2500MB`` -> 2.5, ``SPEED_UNKNOWN`` -> None. A plain number is taken as
    Mb/s (Cumulus documents port-speed as "units of 1,000,000 bits per second")."""
    if isinstance(v, str):
        m = _SPEED.search(v)
        if m:
            return float(m.group(1)) / (1 if m.group(2).upper() == "G" else 1000)
        n = _to_uint(v)
        return None if n is None else n / 1000.0
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
        return float(v) / 1000.0
    return None


def _mbps_to_gbps(v) -> float | None:
    """SONiC APPL_DB ``PORT_TABLE`` ``speed`` is in Mb/s ("400000") -> Gb/s."""
    n = _to_uint(v)
    return None if n is None else n / 1000.0


def _status_up(v) -> float | None:
    """``oper-status``/``admin-status`` (OpenConfig enum ``UP``/``DOWN``/``LOWER_LAYER_DOWN``/...,
    SONiC ``up``/``down``) -> 1.0 when UP, 0.0 otherwise, None (NaN) when ``UNKNOWN``."""
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if not isinstance(v, str):
        return None
    s = v.rsplit(":", 1)[-1].strip().upper()
    if s == "UP":
        return 1.0
    if not s or s == "UNKNOWN":
        return None
    return 0.0


def _gauge(v) -> float | None:
    """A gauge in the source's unit (e.g. bytes of queue occupancy)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _string(v) -> str | None:
    return v if isinstance(v, str) else None


CONVERTERS = {
    "raw": _to_uint,
    "ns_to_us": _ns_to_us,
    "speed_to_gbps": _speed_to_gbps,
    "mbps_to_gbps": _mbps_to_gbps,
    "status_up": _status_up,
    "gauge": _gauge,
    "string": _string,
}


# --------------------------------------------------------------------------- profile data
# OpenConfig interfaces (openconfig/public interfaces 3.8.1, if-ethernet 2.18.0).
_OC_IF = "interfaces/interface[name={port}]"
_OC_COUNTERS = [
    R(f"{_OC_IF}/state/counters/{leaf}", leaf)
    for leaf in ("in-octets", "out-octets", "in-pkts", "out-pkts", "in-errors", "out-errors",
                 "in-discards", "out-discards")
] + [
    # a flap is UP->DOWN->UP = +2 in both; carrier-transitions is deprecated since 3.8.0 and
    # interface-transitions wins on a port that reports both.
    R(f"{_OC_IF}/state/counters/interface-transitions", "interface-transitions", rank=2),
    R(f"{_OC_IF}/state/counters/carrier-transitions", "interface-transitions", rank=1),
]
_OC_STATUS = [
    R(f"{_OC_IF}/state/oper-status", "oper_up", GAUGE, "status_up", ON_CHANGE),
    R(f"{_OC_IF}/state/admin-status", "admin_up", GAUGE, "status_up", ON_CHANGE),
    R(f"{_OC_IF}/ethernet/state/port-speed", "port_speed_gbps", GAUGE, "speed_to_gbps", ON_CHANGE),
]
_OC_QUEUE = "qos/interfaces/interface[interface-id={port}]/output/queues/queue[name={queue}]/state"
_OC_QUEUES = [
    R(f"{_OC_QUEUE}/transmit-pkts", "queue{queue}-transmit-pkts"),
    R(f"{_OC_QUEUE}/transmit-octets", "queue{queue}-transmit-octets"),
    # openconfig-qos queue state: packets the queue dropped (lossless_drop reads it)
    R(f"{_OC_QUEUE}/dropped-pkts", "queue{queue}-dropped-pkts"),
]
# Cumulus Linux 5.x queue leaves beyond OpenConfig's (ecn_pfc_misorder, lossless_drop)
_CUMULUS_QUEUES = [
    R(f"{_OC_QUEUE}/ecn-marked-pkts", "queue{queue}-ecn-marked-pkts"),
    R(f"{_OC_QUEUE}/no-buffer-uc-dropped-pkts", "queue{queue}-no-buffer-dropped-pkts"),
    R(f"{_OC_QUEUE}/wred-dropped-pkts", "queue{queue}-wred-dropped-pkts"),
]
_OC_SUBS = [
    ("/interfaces/interface[name=*]/state/counters", SAMPLE),
    ("/interfaces/interface[name=*]/state/oper-status", ON_CHANGE),
    ("/interfaces/interface[name=*]/state/admin-status", ON_CHANGE),
    ("/interfaces/interface[name=*]/ethernet/state/port-speed", ON_CHANGE),
]
_OC_QUEUE_SUBS = [
    ("/qos/interfaces/interface[interface-id=*]/output/queues/queue[name=*]/state/transmit-pkts", SAMPLE),
    ("/qos/interfaces/interface[interface-id=*]/output/queues/queue[name=*]/state/transmit-octets", SAMPLE),
    ("/qos/interfaces/interface[interface-id=*]/output/queues/queue[name=*]/state/dropped-pkts", SAMPLE),
]
_CUMULUS_QUEUE_SUBS = [
    (f"/qos/interfaces/interface[interface-id=*]/output/queues/queue[name=*]/state/{leaf}", SAMPLE)
    for leaf in ("ecn-marked-pkts", "no-buffer-uc-dropped-pkts", "wred-dropped-pkts")
]
_OC_ROOTS = [_OC_IF]

# SONiC sonic-gnmi ("telemetry" container), DB paths; values are JSON strings ("0").
_SONIC_PORT = "COUNTERS/{**}/{port}"
_SONIC_QUEUE = "COUNTERS/{**}/{port}:{queue}"

PROFILES: dict[str, dict] = {
    "openconfig": {
        "description": "OpenConfig interfaces (+ optional OpenConfig QoS queues); no PFC (not modelled)",
        "auth": "metadata",
        "encoding": "json_ietf",
        "strip_module_prefixes": True,
        "groups": [
            {"name": "interfaces", "paths": _OC_SUBS},
            {"name": "queues", "optional": True, "paths": _OC_QUEUE_SUBS},
        ],
        "rules": _OC_COUNTERS + _OC_STATUS + _OC_QUEUES,
        "port_roots": _OC_ROOTS,
    },
    "sonic": {
        "description": "SONiC sonic-gnmi COUNTERS_DB virtual paths (+ APPL_DB PORT_TABLE status)",
        "auth": "metadata",
        "encoding": "json_ietf",
        "strip_module_prefixes": False,
        "groups": [
            {"name": "counters", "target": "COUNTERS_DB", "paths": [
                ("COUNTERS_PORT_NAME_MAP", ON_CHANGE),
                ("COUNTERS/Ethernet*", SAMPLE),
                ("COUNTERS/Ethernet*/Queues", SAMPLE),
            ]},
            # Wildcard keys on non-virtual DB tables are not documented by sonic-gnmi: optional.
            {"name": "port-status", "target": "APPL_DB", "optional": True, "paths": [
                ("PORT_TABLE/Ethernet*", ON_CHANGE),
            ]},
        ],
        "rules": [
            R("COUNTERS_PORT_NAME_MAP/{port}", "", PORT_NAME_MAP, "string", ON_CHANGE),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_IN_OCTETS", "in-octets"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_OUT_OCTETS", "out-octets"),
            # in-pkts / out-pkts = unicast + non-unicast (SAI has no total), see "derived"
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_IN_UCAST_PKTS", "~in-ucast-pkts"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_IN_NON_UCAST_PKTS", "~in-non-ucast-pkts"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_OUT_UCAST_PKTS", "~out-ucast-pkts"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_OUT_NON_UCAST_PKTS", "~out-non-ucast-pkts"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_IN_ERRORS", "in-errors"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_OUT_ERRORS", "out-errors"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_IN_DISCARDS", "in-discards"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_OUT_DISCARDS", "out-discards"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_PFC_{{prio}}_RX_PKTS", "pfc{prio}-rx-pkts"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_PFC_{{prio}}_TX_PKTS", "pfc{prio}-tx-pkts"),
            # SAI: "duration in micro seconds converted from quanta" -> already us, raw
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_PFC_{{prio}}_RX_PAUSE_DURATION_US", "pfc{prio}-rx-pause-duration-us"),
            # saiport.h: "TX pause duration ... converted from quanta in egress pause frame for
            # that priority (a pause frame sent by the switch)", us: raw. Where the platform
            # polls it (COUNTERS_DB holds only the stats the port's flex counter group reads)
            # it says when a port holds its peer; a tick without it says nothing.
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_PFC_{{prio}}_TX_PAUSE_DURATION_US", "pfc{prio}-tx-pause-duration-us"),
            # FEC codewords (IEEE 802.3 aFECCorrectedBlocks / aFECUncorrectableBlocks), raw
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_IN_FEC_CORRECTABLE_FRAMES", "in-fec-correctable-frames"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_IN_FEC_NOT_CORRECTABLE_FRAMES", "in-fec-uncorrectable-frames"),
            R(f"{_SONIC_PORT}/SAI_PORT_STAT_IF_IN_FEC_SYMBOL_ERRORS", "in-fec-symbol-errors"),
            R(f"{_SONIC_QUEUE}/SAI_QUEUE_STAT_PACKETS", "queue{queue}-transmit-pkts"),
            R(f"{_SONIC_QUEUE}/SAI_QUEUE_STAT_BYTES", "queue{queue}-transmit-octets"),
            R(f"{_SONIC_QUEUE}/SAI_QUEUE_STAT_CURR_OCCUPANCY_BYTES", "queue{queue}-occupancy-bytes", GAUGE, "gauge"),
            # ECN-marked and dropped packets per queue (ecn_pfc_misorder, lossless_drop), raw
            R(f"{_SONIC_QUEUE}/SAI_QUEUE_STAT_WRED_ECN_MARKED_PACKETS", "queue{queue}-ecn-marked-pkts"),
            R(f"{_SONIC_QUEUE}/SAI_QUEUE_STAT_DROPPED_PACKETS", "queue{queue}-dropped-pkts"),
            R("PORT_TABLE/{**}/{port}/oper_status", "oper_up", GAUGE, "status_up", ON_CHANGE),
            R("PORT_TABLE/{**}/{port}/admin_status", "admin_up", GAUGE, "status_up", ON_CHANGE),
            R("PORT_TABLE/{**}/{port}/speed", "port_speed_gbps", GAUGE, "mbps_to_gbps", ON_CHANGE),
        ],
        "derived": {
            "in-pkts": ("~in-ucast-pkts", "~in-non-ucast-pkts"),
            "out-pkts": ("~out-ucast-pkts", "~out-non-ucast-pkts"),
        },
        "port_roots": ["COUNTERS/{port}", "PORT_TABLE/{port}"],
    },
    "arista": {
        "description": "Arista EOS: OpenConfig interfaces + arista-intf-augments PFC counters",
        "auth": "metadata",
        "encoding": "json_ietf",
        "strip_module_prefixes": True,
        "queue_name": r"(?:UC)?(?P<queue>\d+)",
        "groups": [
            {"name": "interfaces", "paths": _OC_SUBS + [
                ("/interfaces/interface[name=*]/ethernet/pfc/priorities/priority[index={prio}]/state", SAMPLE),
            ]},
            {"name": "queues", "optional": True, "paths": _OC_QUEUE_SUBS},
        ],
        "rules": _OC_COUNTERS + _OC_STATUS + _OC_QUEUES + [
            R(f"{_OC_IF}/ethernet/pfc/priorities/priority[index={{prio}}]/state/in-frames", "pfc{prio}-rx-pkts"),
            R(f"{_OC_IF}/ethernet/pfc/priorities/priority[index={{prio}}]/state/out-frames", "pfc{prio}-tx-pkts"),
            R(f"{_OC_IF}/ethernet/pfc/priorities/priority[index={{prio}}]/state/pfc-on-total-rx-time",
              "pfc{prio}-rx-pause-duration-us", convert="ns_to_us"),
        ],
        "port_roots": _OC_ROOTS,
    },
    "cumulus": {
        "description": "NVIDIA Cumulus Linux 5.x gNMI server: OpenConfig + switch-priority pause counters",
        "auth": "basic",                 # Cumulus ignores credentials in RPC metadata
        "encoding": "proto",             # "Cumulus Linux supports the Protobuf and JSON data formats"
        "strip_module_prefixes": True,
        "groups": [
            {"name": "interfaces", "paths": [
                ("/interfaces/interface[name=*]/state/counters", SAMPLE),
                ("/interfaces/interface[name=*]/ethernet/state/counters/carrier-transitions", ON_CHANGE),
                ("/interfaces/interface[name=*]/state/oper-status", ON_CHANGE),
                ("/interfaces/interface[name=*]/state/admin-status", ON_CHANGE),
                ("/interfaces/interface[name=*]/ethernet/state/port-speed", ON_CHANGE),
                ("/qos/interfaces/interface[interface-id=*]/state/switch-priority", SAMPLE),
            ] + _OC_QUEUE_SUBS + _CUMULUS_QUEUE_SUBS},
            # nvidia-if-ethernet-ext per-priority PFC frames: documented for the NetQ agent.
            {"name": "pfc-ext", "optional": True, "paths": [
                ("/interfaces/interface[name=*]/ethernet/state/counters/in-pfc{prio}-packets", SAMPLE),
                ("/interfaces/interface[name=*]/ethernet/state/counters/out-pfc{prio}-packets", SAMPLE),
            ]},
        ],
        "rules": _OC_COUNTERS + _OC_STATUS + _OC_QUEUES + _CUMULUS_QUEUES + [
            R(f"{_OC_IF}/ethernet/state/counters/carrier-transitions", "interface-transitions", mode=ON_CHANGE,
              rank=1),
            # "Number of pause packets for the priority class in the egress queue": sent -> tx
            R("qos/interfaces/interface[interface-id={port}]/state/switch-priority[*={prio}]/counters/out-pause-pkts",
              "pfc{prio}-tx-pkts"),
            R(f"{_OC_IF}/ethernet/state/counters/in-pfc{{prio}}-packets", "pfc{prio}-rx-pkts"),
            R(f"{_OC_IF}/ethernet/state/counters/out-pfc{{prio}}-packets", "pfc{prio}-tx-pkts"),
        ],
        "port_roots": _OC_ROOTS,
    },
}


# --------------------------------------------------------------------------- compilation
_PLACEHOLDER = re.compile(r"\{(port|prio|queue|\*|\*\*)\}")


def split_path(path: str) -> list[tuple[str, dict[str, str]]]:
    """``/a/b[k=v][k2=v2]/c`` -> ``[("a", {}), ("b", {"k": "v", "k2": "v2"}), ("c", {})]``.

    ``/`` inside ``[...]`` belongs to the key value (``interface[name=Ethernet1/1]``);
    ``\\]`` and ``\\\\`` escape inside a value (gNMI path conventions).

    >>> split_path("/interfaces/interface[name=Ethernet1/1]/state")
    [('interfaces', {}), ('interface', {'name': 'Ethernet1/1'}), ('state', {})]
    """
    elems: list[tuple[str, dict[str, str]]] = []
    i, n = 0, len(path)
    name: list[str] = []
    keys: dict[str, str] = {}
    while i < n:
        c = path[i]
        if c == "/":
            if name or keys:
                elems.append(("".join(name), keys))
            name, keys = [], {}
            i += 1
        elif c == "[":
            j = path.find("=", i)
            if j < 0:
                raise ValueError(f"bad path {path!r}: key without '=' at {i}")
            key = path[i + 1:j]
            k, val = j + 1, []
            while k < n and path[k] != "]":
                if path[k] == "\\" and k + 1 < n:
                    k += 1
                val.append(path[k])
                k += 1
            if k >= n:
                raise ValueError(f"bad path {path!r}: unterminated '['")
            keys[key] = "".join(val)
            i = k + 1
        else:
            name.append(c)
            i += 1
    if name or keys:
        elems.append(("".join(name), keys))
    return elems


def escape_key_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace("]", "\\]") if ("]" in v or "\\" in v) else v


def unescape_key_value(v: str) -> str:
    return re.sub(r"\\(.)", r"\1", v) if "\\" in v else v


def _name_regex(name: str, seen: set[str], in_key: bool, queue_name: str) -> str:
    out, pos = [], 0
    for m in _PLACEHOLDER.finditer(name):
        out.append(re.escape(name[pos:m.start()]))
        ph = m.group(1)
        if ph == "*":
            out.append(r"(?:[^\]\\]|\\.)*" if in_key else r"[^/]+")
        elif ph == "**":
            raise ValueError("{**} must be a whole element")
        elif ph in seen:
            out.append(f"(?P={ph})")
        else:
            seen.add(ph)
            if ph == "port":
                # in an element name a port has no ':' (SONiC queue keys are "Ethernet68:3"),
                # except a raw SONiC object id "oid:0x1000000000002"
                out.append(r"(?P<port>(?:[^\]\\]|\\.)+)" if in_key else r"(?P<port>(?:oid:)?[^/\[\]*:]+)")
            elif ph == "queue" and in_key:
                out.append(queue_name)
            else:
                out.append(rf"(?P<{ph}>\d+)")
        pos = m.end()
    out.append(re.escape(name[pos:]))
    return "".join(out)


def template_regex(template: str, queue_name: str = r"(?P<queue>\d+)") -> re.Pattern:
    """The regex of a rule template over canonical paths (see module doc)."""
    seen: set[str] = set()
    parts = []
    for name, keys in split_path(template):
        if name == "{**}" and not keys:
            parts.append(r"(?:[^/]+/)*")
            continue
        s = _name_regex(name, seen, False, queue_name)
        for k in sorted(keys):
            kre = r"[^=\]/]+" if k == "*" else re.escape(k)
            s += rf"\[{kre}=" + _name_regex(keys[k], seen, True, queue_name) + r"\]"
        parts.append(s + "/")
    return re.compile("^" + "".join(parts)[:-1] + "$")


@dataclass(frozen=True)
class Match:
    rule: Rule
    binds: dict[str, str]


@dataclass
class SubscriptionGroup:
    name: str
    paths: tuple[tuple[str, str], ...]     # (path, SAMPLE | ON_CHANGE); may contain {prio}
    target: str = ""
    origin: str = ""
    optional: bool = False
    index: int = 0                          # position in the profile (ticks are tracked per group)


@dataclass
class CompiledProfile:
    name: str
    description: str
    auth: str
    encoding: str
    strip_module_prefixes: bool
    groups: tuple[SubscriptionGroup, ...]
    rules: tuple[tuple[Rule, re.Pattern], ...]
    roots: tuple[re.Pattern, ...]
    derived: dict[str, tuple[str, ...]]
    _cache: dict[str, Match | None] = field(default_factory=dict, repr=False)
    max_cache: int = 200_000

    def match(self, canonical: str) -> Match | None:
        """The rule for one canonical leaf path (cached: a switch sends the same leaves every tick)."""
        try:
            return self._cache[canonical]
        except KeyError:
            pass
        found = None
        for rule, rx in self.rules:
            m = rx.match(canonical)
            if m:
                binds = {k: v for k, v in m.groupdict().items() if v is not None}
                if "port" in binds:
                    binds["port"] = unescape_key_value(binds["port"])
                found = Match(rule, binds)
                break
        if len(self._cache) >= self.max_cache:
            self._cache.clear()
        self._cache[canonical] = found
        return found

    def port_root(self, canonical: str) -> str | None:
        """The port a delete of this whole subtree removes (``interfaces/interface[name=X]``)."""
        for rx in self.roots:
            m = rx.match(canonical)
            if m:
                return unescape_key_value(m.group("port"))
        return None


@lru_cache(maxsize=None)
def compile_profile(name: str) -> CompiledProfile:
    try:
        data = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown gNMI profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None
    queue_name = data.get("queue_name", r"(?P<queue>\d+)")
    rules = []
    for rule in data["rules"]:
        if rule.convert not in CONVERTERS:
            raise ValueError(f"profile {name}: unknown converter {rule.convert!r}")
        rules.append((rule, template_regex(rule.template, queue_name)))
    groups = tuple(SubscriptionGroup(g["name"], tuple(g["paths"]), g.get("target", ""), g.get("origin", ""),
                                     g.get("optional", False), i) for i, g in enumerate(data["groups"]))
    return CompiledProfile(
        name=name, description=data["description"], auth=data["auth"], encoding=data["encoding"],
        strip_module_prefixes=data["strip_module_prefixes"], groups=groups, rules=tuple(rules),
        roots=tuple(template_regex(t) for t in data.get("port_roots", ())), derived=dict(data.get("derived", {})),
    )


def expand_paths(group: SubscriptionGroup, priorities) -> list[tuple[str, str]]:
    """Subscription paths of a group, ``{prio}`` expanded to each configured priority."""
    out: list[tuple[str, str]] = []
    for path, mode in group.paths:
        if "{prio}" in path:
            out.extend((path.replace("{prio}", str(p)), mode) for p in sorted(priorities))
        else:
            out.append((path, mode))
    return out
