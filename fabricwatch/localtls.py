"""A self-signed certificate for the local stack, so gRPC is TLS even on loopback."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def ensure_self_signed(directory: Path, days: int = 30) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for CN=localhost / 127.0.0.1, created once per directory."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "gateway-cert.pem", directory / "gateway-key.pem"
    if cert.exists() and key.exists():
        return cert, key
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl not found: install it, or pass --tls-cert/--tls-key")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", str(days), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    key.chmod(0o600)
    return cert, key
