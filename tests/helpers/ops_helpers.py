"""Helpers of the ops tests: the shipped configs made runnable on loopback, keys, certificates.

Nothing here fakes a server: the NATS configs under ``scripts/nats/`` are copied (with only
host names, ports and file paths rewritten) and run by real nats-server processes; keys,
certificates and JWTs are minted for each test.

* ``copy_nats_configs(dest)``: the shipped ``*.conf`` files, side by side as in /etc/nats.
* ``role_passwords()`` / ``role_nkeys(dir)``: the server-side environment of
  ``auth-users.conf`` / ``auth-nkeys.conf`` and the client-side secrets that match.
* ``make_tls(dir)``: a CA, a server certificate for 127.0.0.1, a client certificate, and an
  unrelated CA (for "wrong CA" checks), with ``cryptography``.
* ``make_operator(dir, ...)``: an operator -> account -> user JWT chain and ``.creds`` files,
  signed with ``nkeys`` (what ``nsc`` would produce), for ``scripts/nats/operator.conf``.
* ``cluster_configs(dest, ...)``: the 3-node cluster files with routes on loopback ports.
* ``start_together(servers)``: clustered servers only become ready once a quorum is up.
* ``script_env(...)`` / ``dry_run(...)``: run the systemd/Slurm entry scripts with a clean
  environment and read back the command line they would execute.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import nkeys
import pytest

from bus import EmbeddedServer
from bus.role_permissions import SHIPPED_USERS

REPO = Path(__file__).resolve().parents[2]
NATS_DIR = REPO / "scripts" / "nats"
SYSTEMD_DIR = REPO / "scripts" / "systemd"
SLURM_DIR = REPO / "scripts" / "slurm"
WORKER_EXEC = SYSTEMD_DIR / "areal-worker-exec"

ROLES = ("controller", "generation", "reward", "trainer", "weight-sync", "agent")
"""The worker roles that have a user in ``scripts/nats/permissions.conf``."""


def free_port() -> int:
    """A TCP port nothing listens on right now (for cluster routes, which need fixed ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_name(role: str) -> str:
    """``weight-sync`` -> ``WEIGHT_SYNC``: the suffix of per-role environment variables."""
    return role.upper().replace("-", "_")


# ---------------------------------------------------------------------------------------------
# NATS configs


STORE_DIR_LINE = "store_dir: /var/lib/nats/jetstream"


def copy_nats_configs(dest: Path) -> Path:
    """Copy every shipped ``scripts/nats/*.conf`` into ``dest`` (their includes are relative).

    The one rewrite: common.conf's JetStream ``store_dir`` is dropped, because EmbeddedServer
    always passes ``-sd <store_dir>`` and nats-server refuses a store_dir set twice.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for conf in NATS_DIR.glob("*.conf"):
        shutil.copy(conf, dest / conf.name)
    common = (dest / "common.conf").read_text()
    assert STORE_DIR_LINE in common, "common.conf changed shape; update copy_nats_configs"
    (dest / "common.conf").write_text(common.replace(STORE_DIR_LINE, "# store_dir: given by -sd"))
    return dest


def write_main_config(dest: Path, name: str, *includes: str, extra: str = "") -> Path:
    """A top-level config in ``dest`` made of ``include`` lines (as single.conf is) plus ``extra``."""
    lines = [f"server_name: {name}"] + [f"include ./{inc}" for inc in includes] + [extra]
    path = dest / f"main-{name}.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def role_passwords() -> dict[str, str]:
    """Fresh passwords for every user of auth-users.conf, keyed by user name."""
    return {user: secrets.token_hex(12) for user in (*SHIPPED_USERS, "sys")}


def password_env(passwords: Mapping[str, str]) -> dict[str, str]:
    """The server environment auth-users.conf reads (``AREAL_NATS_PASS_<USER>``)."""
    return {f"AREAL_NATS_PASS_{env_name(user)}": pw for user, pw in passwords.items()}


@dataclass(frozen=True)
class NkeyUser:
    public: str
    seed_file: Path


def role_nkeys(directory: Path) -> dict[str, NkeyUser]:
    """A user nkey per auth-nkeys.conf entry; seeds written as files (mode 0600) like a worker's."""
    directory.mkdir(parents=True, exist_ok=True)
    users = {}
    for user in (*SHIPPED_USERS, "sys"):
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        path = directory / f"{user}.nk"
        path.write_bytes(seed + b"\n")
        path.chmod(0o600)
        users[user] = NkeyUser(public=nkeys.from_seed(bytearray(seed)).public_key.decode(), seed_file=path)
    return users


def nkey_env(users: Mapping[str, NkeyUser]) -> dict[str, str]:
    """The server environment auth-nkeys.conf reads (``AREAL_NKEY_<USER>``)."""
    return {f"AREAL_NKEY_{env_name(user)}": u.public for user, u in users.items()}


def check_config(path: Path, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """``nats-server -t -c path``: parse and validate a config without starting a server."""
    from bus.embedded import find_nats_server

    return subprocess.run(
        [find_nats_server(), "-t", "-c", str(path)],
        env={"PATH": os.environ.get("PATH", ""), **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def cluster_configs(dest: Path, route_ports: Sequence[int]) -> list[Path]:
    """The shipped nats-{1,2,3}.conf, one directory per node, with the cluster on loopback.

    Only addresses change: ``nats-K:6222`` in the routes becomes ``127.0.0.1:<route_ports[K-1]>``
    and each node's cluster ``listen`` its own port. Client and monitoring ports are set on
    the command line by EmbeddedServer (``-p -1``, ``-m -1``), which wins over the file.
    """
    mains = []
    for k, port in enumerate(route_ports, start=1):
        node = copy_nats_configs(dest / f"nats-{k}")
        cluster = (node / "cluster.conf").read_text()
        for j, other in enumerate(route_ports, start=1):
            cluster = cluster.replace(f"nats-route://nats-{j}:6222", f"nats-route://127.0.0.1:{other}")
        cluster = cluster.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{port}")
        settings = "\n".join(line for line in cluster.splitlines() if not line.lstrip().startswith("#"))
        assert "//nats-" not in settings and ":6222" not in settings, (
            "cluster.conf changed shape; update this helper"
        )
        (node / "cluster.conf").write_text(cluster)
        mains.append(node / f"nats-{k}.conf")
    return mains


def monitor(server: EmbeddedServer, path: str) -> dict[str, object]:
    """GET a JSON page of the server's monitoring port (``/varz``, ``/jsz``)."""
    assert server.monitor_url is not None
    with urllib.request.urlopen(server.monitor_url + path, timeout=5) as response:
        return json.load(response)


async def start_together(servers: Sequence[EmbeddedServer]) -> None:
    """Start clustered servers at once: each waits for a JetStream quorum before it is ready."""
    async with anyio.create_task_group() as tg:
        for server in servers:
            tg.start_soon(server.astart)


# ---------------------------------------------------------------------------------------------
# TLS


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A CA that signed nothing here: trusting only it must fail."""


def make_tls(directory: Path) -> TlsFiles:
    """A throwaway PKI: CA, server cert (127.0.0.1, localhost), client cert, and a second CA.

    Skips the calling test when ``cryptography`` is not installed (it is a test extra).
    """
    pytest.importorskip("cryptography", reason="TLS tests make certificates with `pip install cryptography`")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)

    def cert(subject: str, key: Any, issuer: Any, issuer_key: Any, *, ca: bool, server: bool = False) -> Any:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(
                issuer.subject
                if issuer is not None
                else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
            )
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(
                    digital_signature=True, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                    encipher_only=False, decipher_only=False,
                ),
                critical=True,
            ).add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)  # fmt: skip
        else:
            usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False).add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
            )
        if server:
            names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(issuer_key if issuer_key is not None else key, hashes.SHA256())

    def write_cert(path: Path, certificate: Any) -> None:
        path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))

    def write_key(path: Path, key: Any) -> None:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        path.chmod(0o600)

    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client-key.pem",
        other_ca=directory / "other-ca.pem",
    )
    ca_key, server_key, client_key, other_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(4))
    ca = cert("areal-test-ca", ca_key, None, None, ca=True)
    write_cert(files.ca, ca)
    write_cert(files.other_ca, cert("someone-elses-ca", other_key, None, None, ca=True))
    write_cert(files.server_cert, cert("nats-0", server_key, ca, ca_key, ca=False, server=True))
    write_cert(files.client_cert, cert("areal-worker", client_key, ca, ca_key, ca=False))
    write_key(files.server_key, server_key)
    write_key(files.client_key, client_key)
    return files


# ---------------------------------------------------------------------------------------------
# JWT / .creds (what `nsc` makes; nsc is not available here)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def _public(kp: nkeys.KeyPair) -> str:
    return kp.public_key.decode()


def _jwt(nats: dict[str, object], *, subject: str, name: str, issuer: nkeys.KeyPair) -> str:
    """A NATS JWT (v2): ed25519-nkey signature over ``header.claims``; jti = sha512/256 of the claims."""
    claims: dict[str, object] = {
        "jti": "",
        "iat": int(time.time()),
        "iss": _public(issuer),
        "name": name,
        "sub": subject,
        "nats": nats,
    }
    digest = hashlib.new("sha512_256", json.dumps(claims, separators=(",", ":")).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    return f"{header}.{body}.{_b64(issuer.sign(f'{header}.{body}'.encode()))}"


def _creds(user_jwt: str, seed: str) -> str:
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


_UNLIMITED = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}
_JETSTREAM = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


@dataclass(frozen=True)
class OperatorSetup:
    operator_jwt: Path
    system_account: str
    """Public key (A...) of the system account: AREAL_NATS_SYSTEM_ACCOUNT."""
    resolver_dir: Path
    """Account JWTs as ``<public key>.jwt``, as the full resolver stores them after ``nsc push``."""
    creds: dict[str, Path]
    """User name -> .creds file, signed by the AREAL account."""
    rogue_creds: Path
    """A user of an account the server was never told about."""


def make_operator(directory: Path, users: Mapping[str, dict[str, object]]) -> OperatorSetup:
    """Operator, SYS and AREAL (JetStream) accounts, and one user per ``users`` entry.

    ``users`` maps a user name to its permissions in JWT form, e.g.
    ``{"pub": {"allow": [...], "deny": [...]}, "sub": {"allow": [...]}}``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    resolver = directory / "jwt"
    resolver.mkdir(exist_ok=True)
    operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    op_jwt = _jwt({"type": "operator", "version": 2, "system_account": _public(system)},
                  subject=_public(operator), name="areal", issuer=operator)  # fmt: skip
    sys_jwt = _jwt({"limits": _UNLIMITED, "type": "account", "version": 2},
                   subject=_public(system), name="SYS", issuer=operator)  # fmt: skip
    acct_jwt = _jwt({"limits": {**_UNLIMITED, **_JETSTREAM}, "type": "account", "version": 2},
                    subject=_public(account), name="AREAL", issuer=operator)  # fmt: skip
    (directory / "operator.jwt").write_text(op_jwt)
    (resolver / f"{_public(system)}.jwt").write_text(sys_jwt)
    (resolver / f"{_public(account)}.jwt").write_text(acct_jwt)

    def user_creds(name: str, permissions: Mapping[str, object], issuer: nkeys.KeyPair, path: Path) -> Path:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        user = nkeys.from_seed(bytearray(seed))
        claims = {**permissions, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}
        path.write_text(_creds(_jwt(claims, subject=_public(user), name=name, issuer=issuer), seed.decode()))
        path.chmod(0o600)
        return path

    creds = {
        name: user_creds(name, perms, account, directory / f"{name}.creds") for name, perms in users.items()
    }
    rogue = user_creds("rogue", {}, _keypair(nkeys.PREFIX_BYTE_ACCOUNT), directory / "rogue.creds")
    return OperatorSetup(
        operator_jwt=directory / "operator.jwt",
        system_account=_public(system),
        resolver_dir=resolver,
        creds=creds,
        rogue_creds=rogue,
    )


# ---------------------------------------------------------------------------------------------
# entry scripts


def read_env_file(path: Path) -> dict[str, str]:
    """``KEY=value`` lines of a systemd EnvironmentFile (the subset the shipped examples use:
    comments, blank lines, no quotes or continuations)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"{path}: not KEY=value: {line!r}"
        env[key] = value
    return env


def script_env(**variables: str) -> dict[str, str]:
    """A clean environment for the entry scripts: PATH, HOME, HOSTNAME and ``variables`` only,
    so nothing from the test process (AREAL_*, SLURM_*) leaks in."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "HOSTNAME": "node7.cluster.example",
        **variables,
    }


def dry_run(command: Sequence[str | Path], env: Mapping[str, str], cwd: Path = REPO) -> list[str]:
    """The argv an entry script would exec (``AREAL_DRY_RUN=1``); fails on a non-zero exit."""
    result = subprocess.run(
        [str(c) for c in command],
        env={**env, "AREAL_DRY_RUN": "1"},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, f"{command} exited {result.returncode}: {result.stderr}"
    return shlex.split(result.stdout)


def run_script(
    command: Sequence[str | Path], env: Mapping[str, str], cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """Run an entry script for real (no dry run) and return its result."""
    return subprocess.run(
        [str(c) for c in command], env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=30
    )
