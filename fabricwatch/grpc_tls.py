"""How every client of the gateway builds its TLS credentials: one function, three clients.

The node collector, the switch collector and the rank SDK all reach the ingest gateway;
a gateway started with ``--client-ca`` needs each of them to present a client
certificate in the handshake (mTLS). Written once here so that none of them drifts.

>>> check_client_tls("", "c.pem", "k.pem")
Traceback (most recent call last):
ValueError: a client certificate needs TLS: set the CA certificate too
>>> check_client_tls("ca.pem", "c.pem", "")
Traceback (most recent call last):
ValueError: the client certificate and its key go together (mTLS)
"""
from __future__ import annotations


def check_client_tls(ca_cert: str, client_cert: str, client_key: str) -> None:
    """A clear error for settings that cannot work, before any file is read."""
    if bool(client_cert) != bool(client_key):
        raise ValueError("the client certificate and its key go together (mTLS)")
    if client_cert and not ca_cert:
        raise ValueError("a client certificate needs TLS: set the CA certificate too")


def channel_credentials(ca_cert: str, client_cert: str = "", client_key: str = ""):
    """`grpc.ssl_channel_credentials` from PEM files (for `grpc` and `grpc.aio` channels alike)."""
    import grpc

    check_client_tls(ca_cert, client_cert, client_key)
    with open(ca_cert, "rb") as fh:
        root = fh.read()
    key = chain = None
    if client_cert:
        with open(client_key, "rb") as fh:
            key = fh.read()
        with open(client_cert, "rb") as fh:
            chain = fh.read()
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
