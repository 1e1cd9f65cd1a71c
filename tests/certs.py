"""Certificates made at test time with the openssl CLI: a CA and leaf certificates it signs.

Every leaf is valid for 127.0.0.1 and localhost and for both server and client use, so one
certificate serves a service's listening side and the hops it dials (as the README's example does).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from services.common.security import TlsFiles

LEAF_EXTENSIONS = ("basicConstraints=critical,CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n"
                   "subjectAltName=IP:127.0.0.1,DNS:localhost\n")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str = "llmserve-test-ca") -> tuple[Path, Path]:
    """(ca.pem, ca.key) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
             "-out", str(cert), "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def make_leaf(directory: Path, name: str, ca: tuple[Path, Path]) -> TlsFiles:
    """A certificate for ``name`` signed by ``ca``; returned with ``ca``'s certificate as the CA to trust."""
    cert, key, csr, ext = (directory / f"{name}.pem", directory / f"{name}.key", directory / f"{name}.csr",
                           directory / f"{name}.ext")
    ext.write_text(LEAF_EXTENSIONS)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key),
             "-out", str(csr), "-subj", f"/CN={name}")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
             "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return TlsFiles(str(cert), str(key), str(ca[0]))
