"""Per-collector tokens: who may send, and for which sources.

The gateway holds only SHA-256 digests of tokens, in a YAML file::

    collectors:
      - name: rack-12
        token_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
        sources: ["node-12*"]          # fnmatch globs of node/switch names it may report
        cluster: gpu-east              # optional: the cluster its snapshots belong to

A collector sends ``authorization: Bearer <token>`` as gRPC metadata. A snapshot for a
source outside the collector's globs is refused (``source_not_allowed``), so a valid
collector cannot speak for another node; the same holds for the node of every rank step.
The cluster of an accepted snapshot is the token's ``cluster:`` (the gateway's
``--cluster`` for a token without one), whatever the snapshot says: a collector cannot
move its nodes into another cluster's guard rails. The event feed scopes its readers the
same way (sources and cluster).
"""
from __future__ import annotations

import fnmatch
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import AfterValidator, Field

from fabricwatch.config_schema import AsText, NonEmpty, Section, validate

#: A cluster name in a tokens file: what the gateway accepts as a snapshot's cluster.
CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,252}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class AuthConfigError(ValueError):
    """A tokens file that cannot be used."""


def _digest(value: str) -> str:
    if not _SHA256.match(value):
        raise ValueError("must be 64 lowercase hex digits (SHA-256 of the token)")
    return value


def _cluster(value: str) -> str:
    if value and not CLUSTER_NAME.match(value):
        raise ValueError(f"must be a cluster name ({CLUSTER_NAME.pattern}), got {value!r}")
    return value


class TokenEntry(Section):
    """One collector of the tokens file."""

    name: AsText = Field("", description="the collector's name, in logs and rejection counts")
    token_sha256: Annotated[str, AfterValidator(_digest)] = Field(
        description="SHA-256 of the bearer token, 64 lowercase hex digits (the token itself is never stored)")
    sources: Annotated[list[NonEmpty], Field(min_length=1)] = Field(
        description="non-empty list of `fnmatch` globs of the node / switch names it may report, and that its "
                    "rank steps may name; the event feed shows it only events of these")
    cluster: Annotated[str, AfterValidator(_cluster)] = Field(
        "", description="the cluster stamped on every snapshot it sends (the snapshot's own field is ignored); "
                        "the feed shows it only this cluster's events")


class TokensFile(Section):
    collectors: list[TokenEntry] = Field(description="one entry per collector")


@dataclass(frozen=True)
class Collector:
    name: str
    token_sha256: str
    sources: tuple[str, ...]
    cluster: str = ""            # "" = the serving process's default cluster

    def may_report(self, source: str) -> bool:
        return any(fnmatch.fnmatchcase(source, glob) for glob in self.sources)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(32)


class TokenAuth:
    def __init__(self, collectors: list[Collector]) -> None:
        self.collectors = collectors

    def identify(self, bearer: str | None) -> Collector | None:
        """The collector a bearer token belongs to (constant-time compare), or None."""
        if not bearer:
            return None
        digest = token_digest(bearer)
        found = None
        for c in self.collectors:
            if hmac.compare_digest(c.token_sha256, digest):
                found = c
        return found

    @classmethod
    def load(cls, path: str | Path) -> TokenAuth:
        try:
            doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise AuthConfigError(f"{path}: cannot read tokens file: {exc}") from exc
        try:
            tokens = validate(TokensFile, doc, error=AuthConfigError)
        except AuthConfigError as exc:
            raise AuthConfigError(f"{path}: {exc}") from None
        return cls([Collector(e.name or f"collector-{i}", e.token_sha256, tuple(e.sources), e.cluster)
                    for i, e in enumerate(tokens.collectors)])

    @staticmethod
    def write(path: str | Path, name: str, token: str, sources: list[str], cluster: str = "") -> None:
        entry = {"name": name, "token_sha256": token_digest(token), "sources": sources}
        if cluster:
            entry["cluster"] = cluster
        Path(path).write_text(yaml.safe_dump({"collectors": [entry]}), encoding="utf-8")
