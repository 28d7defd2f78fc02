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

import yaml

#: A cluster name in a tokens file: what the gateway accepts as a snapshot's cluster.
CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+=-]{0,252}$")


class AuthConfigError(ValueError):
    """A tokens file that cannot be used."""


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
        if not isinstance(doc, dict) or not isinstance(doc.get("collectors"), list):
            raise AuthConfigError(f"{path}: expected a mapping with a 'collectors' list")
        collectors = []
        for i, entry in enumerate(doc["collectors"]):
            if not isinstance(entry, dict):
                raise AuthConfigError(f"{path}: collectors[{i}] is not a mapping")
            unknown = set(entry) - {"name", "token_sha256", "sources", "cluster"}
            if unknown:
                raise AuthConfigError(f"{path}: collectors[{i}] has unknown keys {sorted(unknown)}")
            digest = str(entry.get("token_sha256", ""))
            if len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest):
                raise AuthConfigError(f"{path}: collectors[{i}].token_sha256 must be 64 lowercase hex digits")
            sources = entry.get("sources")
            if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s for s in sources):
                raise AuthConfigError(f"{path}: collectors[{i}].sources must be a non-empty list of globs")
            cluster = entry.get("cluster", "")
            if cluster and not (isinstance(cluster, str) and CLUSTER_NAME.match(cluster)):
                raise AuthConfigError(f"{path}: collectors[{i}].cluster must be a cluster name "
                                      f"({CLUSTER_NAME.pattern}), got {cluster!r}")
            collectors.append(Collector(str(entry.get("name", f"collector-{i}")), digest, tuple(sources),
                                        cluster or ""))
        return cls(collectors)

    @staticmethod
    def write(path: str | Path, name: str, token: str, sources: list[str], cluster: str = "") -> None:
        entry = {"name": name, "token_sha256": token_digest(token), "sources": sources}
        if cluster:
            entry["cluster"] = cluster
        Path(path).write_text(yaml.safe_dump({"collectors": [entry]}), encoding="utf-8")
