"""The one way a config file is checked: pydantic sections, path-aware errors, the gateway block.

Every config file (node collector, switch collector, tokens, ...) is a tree of `Section`
models: frozen, strict (``'yes'`` is not true, ``1.5`` is not an integer), unknown keys
refused, ``null`` meaning "the default". `validate` turns pydantic's errors into the one
message style of fabricwatch, the path first: ``gateway.client_key: no such file: ...``.
Each field's ``description`` is its one-line meaning in docs/configuration.md
(`fabricwatch.config_reference` walks the models), so a new key cannot go undocumented.

`GatewayConnection` is how every client reaches the ingest gateway (target, TLS, client
certificate, token): the node collector, the switch collector and the rank SDK share it,
so a gateway run with ``--client-ca`` gets a client certificate from each of them.

>>> GatewayConnection.model_validate({"target": "127.0.0.1:50051"}).ca_cert
''
>>> validate(GatewayConnection, {"target": "gw.example:50051", "token": "t"}, where="gateway")
Traceback (most recent call last):
ValueError: gateway: a gateway at gw.example needs TLS as it is not loopback: set gateway.ca_cert (only loopback may be plaintext)
>>> validate(GatewayConnection, {"target": "127.0.0.1:1", "ca": 3}, where="gateway")
Traceback (most recent call last):
ValueError: gateway.ca: expected a string, got 3
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, GetCoreSchemaHandler, \
    ValidationError, ValidationInfo, model_validator
from pydantic_core import ErrorDetails, core_schema

from fabricwatch.grpc_tls import check_client_tls
from fabricwatch.netaddr import is_loopback, split_host_port

log = logging.getLogger("fabricwatch.config")
DEFAULT_GATEWAY = "127.0.0.1:50051"
TOKEN_ENV = "FABRICWATCH_TOKEN"


class Section(BaseModel):
    """One mapping of a config file: frozen, strict, no unknown keys, ``null``/``{}`` = default."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False,
                              populate_by_name=True, validate_default=False)

    @model_validator(mode="before")
    @classmethod
    def _mapping(cls, data: Any) -> Any:
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a mapping, got {type(data).__name__}")
        for key in data:
            if not isinstance(key, str):
                raise ValueError(f"keys must be strings, got {key!r}")
        allowed = list(keys_of(cls))
        unknown = sorted(str(k) for k in data if k not in allowed)
        if unknown:
            raise ValueError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                             f"(allowed: {', '.join(k for k in allowed if k in cls.model_fields)})")
        # null and {} mean "the defaults" (an optional section left empty stays off)
        return {k: v for k, v in data.items() if v is not None and not (isinstance(v, Mapping) and not v)}


def keys_of(model: type[BaseModel]):
    """The keys a section accepts: each field's name, then any older spelling (alias)."""
    for name, f in model.model_fields.items():
        yield name
        if isinstance(f.validation_alias, AliasChoices):
            yield from (a for a in f.validation_alias.choices if isinstance(a, str) and a != name)


# -- field types ------------------------------------------------------------------------------
def _non_empty(value: str) -> str:
    if not value.strip():
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value.strip()


def _target(value: str) -> str:
    split_host_port(value, "target")
    return value


def _config_file(value: str, info: ValidationInfo) -> str:
    """Relative to the config file's folder, and must exist, when the loader asks for it
    (context ``base``); otherwise kept as written (checked where it is opened)."""
    base = (info.context or {}).get("base")
    if not value or base is None:
        return value
    path = Path(value).expanduser()
    path = path if path.is_absolute() else Path(base) / path
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    return str(path)


@dataclass(frozen=True)
class Within:
    """``Annotated[int, Within(1, 10)]``: a closed range, named in the error and in the docs."""

    low: float
    high: float

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value: float) -> float:
        if not self.low <= value <= self.high:
            word = "an integer" if isinstance(value, int) else "a number"
            raise ValueError(f"expected {word} in {self}, got {value!r}")
        return value

    def __str__(self) -> str:
        return f"{_number(self.low)}..{_number(self.high)}"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _number_as_text(value: Any) -> Any:
    """YAML reads ``name: 12`` as a number; a name is text."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


NonEmpty = Annotated[str, AfterValidator(_non_empty)]
AsText = Annotated[str, BeforeValidator(_number_as_text)]
Name = Annotated[AsText, AfterValidator(_non_empty)]      # a node, switch, port or collector name
Target = Annotated[str, AfterValidator(_target)]
ConfigFile = Annotated[str, AfterValidator(_config_file)]


def aliases(name: str, *older: str) -> AliasChoices:
    """Accept a key under its name and under older spellings (`keys_of` lists them too)."""
    return AliasChoices(name, *older)


# -- the gateway block ------------------------------------------------------------------------
class GatewayConnection(Section):
    """How a client reaches `fabricwatch gateway`: address, TLS, client certificate, token."""

    target: Target = Field(DEFAULT_GATEWAY, description="the gateway, `host:port`")
    token_file: ConfigFile = Field("", description="file holding the bearer token (preferred over `token`); "
                                                   "a non-loopback gateway needs a token")
    token: str = Field("", repr=False, description="the bearer token itself (one of `token`, `token_file`)")
    ca_cert: ConfigFile = Field("", validation_alias=aliases("ca_cert", "ca"),
                                description="PEM of the CA of the gateway's certificate; required for a "
                                            "non-loopback target")
    client_cert: ConfigFile = Field("", description="mTLS: this client's certificate (PEM), for a gateway run "
                                                    "with `--client-ca`")
    client_key: ConfigFile = Field("", description="mTLS: the private key of `client_cert` (PEM); both or "
                                                   "neither, and only with `ca_cert`")
    server_name: str = Field("", validation_alias=aliases("server_name", "server_name_override"),
                             description="TLS name to check when the certificate names another host (test "
                                         "certificates)")

    @model_validator(mode="after")
    def _secure_unless_loopback(self) -> GatewayConnection:
        if self.token and self.token_file:
            raise ValueError("give token or token_file, not both")
        host, _ = split_host_port(self.target, "target")
        if not self.ca_cert and not is_loopback(host):
            raise ValueError(f"a gateway at {host} needs TLS as it is not loopback: set gateway.ca_cert "
                             "(only loopback may be plaintext)")
        check_client_tls(self.ca_cert, self.client_cert, self.client_key)
        return self

    @property
    def loopback(self) -> bool:
        return is_loopback(split_host_port(self.target, "target")[0])

    def read_token(self, environ: Mapping[str, str] | None = None) -> str:
        """`token_file`'s content, else `token`, else ``FABRICWATCH_TOKEN`` from `environ` (if given)."""
        if self.token_file:
            with open(self.token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
            if not token:
                raise ValueError(f"gateway.token_file {self.token_file} is empty")
            if os.stat(self.token_file).st_mode & 0o004:
                log.warning("token file %s is world-readable; chmod 600 it", self.token_file)
            return token
        if self.token:
            return self.token
        return environ.get(TOKEN_ENV, "") if environ is not None else ""


# -- validation with fabricwatch's messages ---------------------------------------------------
_TYPE_WORDS = {"bool_type": "true or false", "int_type": "an integer", "float_type": "a number",
               "string_type": "a string", "list_type": "a list", "tuple_type": "a list",
               "dict_type": "a mapping", "model_type": "a mapping", "finite_number": "a number"}
MAX_MESSAGE_CHARS = 600     # a hostile file's megabyte value is not echoed back whole


def _path(loc: tuple, data: Any, where: str, name_items: bool = True) -> str:
    """``switches[0] (leaf-01).tls.ca`` from pydantic's loc, naming list items by their ``name``."""
    out, node = where, data
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            name = node.get("name") if isinstance(node, Mapping) else None
            if name_items and isinstance(name, str) and name:
                out += f" ({name})"
        else:
            out = f"{out}.{part}" if out else str(part)
            node = node.get(part) if isinstance(node, Mapping) else None
    return out


def _message(error: ErrorDetails) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "missing":
        return f"missing key {error['loc'][-1]!r}"
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind == "too_short":
        return f"expected a non-empty list, got {value!r}"
    if kind == "literal_error":
        return f"expected one of {error['ctx']['expected']}, got {value!r}"
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {value!r}"
    return f"{error['msg']}, got {value!r}"


def validate(model: type[BaseModel], data: Any, *, where: str = "", error: type[ValueError] = ValueError,
             base: Path | str | None = None, root: str = "config", name_items: bool = True):
    """`model` from a YAML document, or `error` naming the first bad key's path.

    `base`: resolve relative file paths against this folder and require the files to exist.
    `root`: what the path of the document itself is called; `name_items`: follow a list
    index with the item's ``name`` (``switches[0] (leaf-01)``).
    """
    try:
        return model.model_validate(data, context={"base": base})
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        path = _path(first["loc"][:-1] if first["type"] == "missing" else first["loc"], data, where, name_items)
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        text = f"{path or root}: {_message(first)}"
        if len(text) > MAX_MESSAGE_CHARS:
            text = text[:MAX_MESSAGE_CHARS - 3] + "..."
        raise error(text + more) from None
