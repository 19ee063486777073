"""HTTPS for ``core serve``: SGLang's ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs`` and
``--ssl-keyfile-password``, checked before the model loads and handed to hypercorn.

As in SGLang (whose uvicorn keeps ``ssl_cert_reqs`` at CERT_NONE), ``--ssl-ca-certs`` is loaded
into the server's context but clients are never asked for a certificate: it is not mutual TLS.
SGLang uses the file to verify its own requests to itself; core makes none (warm-up and health
checks run in-process), so a client of the server is what needs the CA.
"""

from __future__ import annotations

import argparse
import os
import ssl
from typing import Any

from core.errors import CoreError


def check_ssl_args(ns: argparse.Namespace) -> None:
    """SGLang's pairing rules (a key needs its certificate and the other way round; a CA file or a
    password needs both), the files present, then the certificate, key and CA really loaded, so a
    wrong password or a key of another certificate stops start-up, not the first handshake."""
    cert, key = getattr(ns, "ssl_certfile", None), getattr(ns, "ssl_keyfile", None)
    ca, password = getattr(ns, "ssl_ca_certs", None), getattr(ns, "ssl_keyfile_password", None)
    if key and not cert:
        raise CoreError("--ssl-keyfile needs --ssl-certfile too (the certificate the key belongs to)")
    if cert and not key:
        raise CoreError("--ssl-certfile needs --ssl-keyfile too (the certificate's private key)")
    if not cert:
        for flag, value in (("--ssl-ca-certs", ca), ("--ssl-keyfile-password", password)):
            if value:
                raise CoreError(f"{flag} has no effect without --ssl-certfile and --ssl-keyfile; pass them, or drop it")
        return
    for flag, path in (("--ssl-certfile", cert), ("--ssl-keyfile", key), ("--ssl-ca-certs", ca)):
        if path and not os.path.isfile(path):
            raise CoreError(f"{flag} {path}: no such file; pass the path of a PEM file")
    server_context(cert, key, ca, password)


def server_context(certfile: str, keyfile: str, ca_certs: str | None, password: str | None) -> ssl.SSLContext:
    """A server context over the files (what hypercorn builds from the same settings), or a
    CoreError naming the flag whose file does not load. An encrypted key without a password is
    refused, not prompted for on the terminal (OpenSSL's default)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(certfile, keyfile, password=password if password is not None else (lambda: b""))
    except (ssl.SSLError, OSError, ValueError) as e:
        if not _encrypted(keyfile):
            hint = "check that both are PEM files and the key is the certificate's"
        elif password is None:
            hint = "the key is encrypted: pass its password with --ssl-keyfile-password"
        else:
            hint = "the key is encrypted and --ssl-keyfile-password does not decrypt it"
        raise CoreError(f"cannot load --ssl-certfile {certfile} with --ssl-keyfile {keyfile} ({e}); {hint}") from None
    if ca_certs:
        try:
            ctx.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError, ValueError) as e:
            raise CoreError(f"cannot load --ssl-ca-certs {ca_certs} ({e}); pass a PEM file of CA certificates") from None
    return ctx


def _encrypted(keyfile: str) -> bool:
    try:
        with open(keyfile, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b"ENCRYPTED" in head


def apply_ssl(config: Any, args: Any) -> None:
    """Set a hypercorn ``Config`` to serve HTTPS when ``args`` (ServerArgs) name a certificate."""
    if args.ssl_certfile:
        config.certfile, config.keyfile = args.ssl_certfile, args.ssl_keyfile
        config.ca_certs, config.keyfile_password = args.ssl_ca_certs, args.ssl_keyfile_password


def url_scheme(args: Any) -> str:
    """``https`` when the server serves TLS, else ``http``."""
    return "https" if getattr(args, "ssl_certfile", None) else "http"
