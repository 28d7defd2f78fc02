"""gNMI paths and values as fabricwatch reads them: the wire's `Path` and `TypedValue` to
canonical leaf paths (what `gnmi_profiles` rules match) and scalars.

The gNMI stubs are pygnmi's compiled gNMI 0.8.0 protos (`pygnmi.spec.v080`), imported here
once for the collector (`gnmi_switch`) and the switch-port executor; pygnmi's own
(threaded) client is not used.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

from .gnmi_profiles import escape_key_value, split_path

try:  # pygnmi bundles compiled gNMI 0.8.0 stubs; its threaded client is never imported.
    from pygnmi.spec.v080 import gnmi_pb2, gnmi_pb2_grpc
except ImportError as _exc:  # pragma: no cover - a packaging error, reported clearly
    raise ImportError("the switch collector needs the gNMI stubs from pygnmi: pip install pygnmi==0.8.15") from _exc

__all__ = ["NO_VALUE", "canonical", "decode_value", "flatten", "gnmi_pb2", "gnmi_pb2_grpc", "natural_key", "path_elems",
           "xpath_to_path"]

_MODULE_PREFIX = re.compile(r"^[a-z][a-z0-9._-]*:")


# --------------------------------------------------------------------------- gNMI paths
def xpath_to_path(xpath: str, origin: str = "", target: str = "") -> gnmi_pb2.Path:
    """``/interfaces/interface[name=*]/state`` -> `gnmi_pb2.Path` (``elem`` form)."""
    path = gnmi_pb2.Path(origin=origin, target=target)
    for name, keys in split_path(xpath):
        elem = path.elem.add(name=name)
        for k, v in keys.items():
            elem.key[k] = v
    return path


def path_elems(path: gnmi_pb2.Path) -> list[tuple[str, dict[str, str]]]:
    """The elements of a received path; the deprecated string ``element`` form
    (``"interface[name=Ethernet0]"``, as the openconfig fake target sends) is parsed."""
    if path.elem:
        return [(e.name, dict(e.key)) for e in path.elem]
    out: list[tuple[str, dict[str, str]]] = []
    for element in path.element:
        if "[" in element:
            out.extend(split_path(element))
        else:
            out.append((element, {}))
    return out


def _strip(name: str) -> str:
    return name.split(":", 1)[1] if _MODULE_PREFIX.match(name) else name


def canonical(elems, strip_module_prefixes: bool = True) -> str:
    """The canonical string of a leaf path that profile rules match (keys sorted, module
    prefixes dropped): ``interfaces/interface[name=Ethernet0]/state/counters/in-octets``."""
    parts = []
    for name, keys in elems:
        if strip_module_prefixes:
            name = _strip(name)
        if keys:
            items = sorted(((_strip(k) if strip_module_prefixes else k), v) for k, v in keys.items())
            name += "".join(f"[{k}={escape_key_value(v)}]" for k, v in items)
        parts.append(name)
    return "/".join(parts)


# --------------------------------------------------------------------------- values
NO_VALUE = object()


def decode_value(tv: gnmi_pb2.TypedValue):
    """A `TypedValue` as a Python scalar, or a JSON tree for ``json_val``/``json_ietf_val``."""
    kind = tv.WhichOneof("value")
    if kind in ("string_val", "ascii_val", "int_val", "uint_val", "bool_val", "double_val", "float_val"):
        return getattr(tv, kind)
    if kind in ("json_val", "json_ietf_val"):
        raw = getattr(tv, kind)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return NO_VALUE
    if kind == "decimal_val":
        return tv.decimal_val.digits / (10 ** tv.decimal_val.precision)
    return NO_VALUE   # leaflist, bytes, any, proto_bytes: nothing fabricwatch reads


_LIST_KEYS = ("name", "index", "interface-id", "id")


def flatten(elems: list, value) -> Iterator[tuple[list, object]]:
    """(leaf elems, scalar) pairs of a value: a JSON object becomes one leaf per member
    (``COUNTERS/Ethernet*`` + ``{"Ethernet0": {"SAI_...": "0"}}``); a JSON list of objects
    (a YANG list in JSON_IETF) is keyed by its ``name``/``index``/``interface-id``/``id``."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flatten(elems + [(k, {})], v)
    elif isinstance(value, list):
        if not value or not all(isinstance(x, dict) for x in value):
            return   # a leaf-list: nothing fabricwatch reads
        name, last_keys = elems[-1] if elems else ("", {})
        for entry in value:
            key = next((k for k in entry if _strip(k) in _LIST_KEYS), None)
            if key is None:
                continue
            keyed = elems[:-1] + [(name, {**last_keys, _strip(key): str(entry[key])})]
            rest = {k: v for k, v in entry.items() if k != key}
            yield from flatten(keyed, rest)
    elif value is not NO_VALUE and value is not None:
        yield elems, value


def natural_key(s: str):
    """``Ethernet2`` before ``Ethernet10``; ``Ethernet1/2`` before ``Ethernet1/10``."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s) if t)
