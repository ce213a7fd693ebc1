"""Who may talk on the internal wire: CURVE keys on tcp:// endpoints, one key pair per role.

`pagedserve keys DIR` writes a folder per service, each holding only what that service needs:

    DIR/scheduler/  scheduler.key_secret, api.key, worker.key   (its pair; the keys it admits)
    DIR/api/        api.key_secret, scheduler.key                (its pair; the server it trusts)
    DIR/worker/     worker.key_secret, scheduler.key

The scheduler's two sockets are CURVE servers, each admitting only its own role's public keys
(more `api*.key` or `worker*.key` files admit more): an api key cannot reach the worker socket,
and a peer without a key completes no handshake, so it can neither send nor receive. `ipc://`
endpoints live in a private directory and need no keys. `--insecure-wire` turns CURVE off on
tcp:// with a warning.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from shared.log_limits import RateLimit

log = logging.getLogger(__name__)
zap_log = logging.getLogger("pagedserve.zap")  # the authenticator's lines and its refusals, rate-limited

KEYS_DIR_ENV = "PAGEDSERVE_KEYS_DIR"
PEERS = {"scheduler": ("api", "worker"), "api": ("scheduler",), "worker": ("scheduler",)}


class WireSecurityError(RuntimeError):
    pass


@dataclass(slots=True)
class WireKeys:
    public: bytes
    secret: bytes
    scheduler_public: bytes | None = None  # what clients check the server against
    admitted: dict[str, set[bytes]] = field(default_factory=dict)  # role -> public keys (scheduler)


def make_keys(directory: str | os.PathLike[str]) -> list[Path]:
    """One pair per role, each service's folder holding its secret and its peers' public keys.

    Every file and folder is private from its first byte (umask 077), and `directory`, when it
    exists open to others, is closed to them first: no one else can read a secret while it is written."""
    root = Path(directory)
    previous = os.umask(0o077)
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if root.stat().st_mode & 0o077:
            log.warning("%s was open to other users: closing it (0700) before writing keys into it", root)
            root.chmod(0o700)
        pairs: dict[str, tuple[Path, Path]] = {}
        for role in PEERS:
            public_file, secret_file = zmq.auth.create_certificates(str(root), role)
            pairs[role] = (Path(public_file), Path(secret_file))
        written: list[Path] = []
        for role, peers in PEERS.items():
            folder = root / role
            folder.mkdir(exist_ok=True, mode=0o700)
            secret = folder / f"{role}.key_secret"
            os.replace(pairs[role][1], secret)
            written.append(secret)
            for peer in peers:
                (folder / f"{peer}.key").write_bytes(pairs[peer][0].read_bytes())
        for public, _ in pairs.values():
            public.unlink()
    finally:
        os.umask(previous)
    return written


def load_keys(directory: str | os.PathLike[str], role: str) -> WireKeys:
    folder = Path(directory)
    secret_file = folder / f"{role}.key_secret"
    if not secret_file.exists():
        raise WireSecurityError(f"no {secret_file}: make keys with `pagedserve keys DIR` and pass DIR/{role}")
    public, secret = zmq.auth.load_certificate(str(secret_file))
    if secret is None:
        raise WireSecurityError(f"{secret_file} holds no secret key")
    keys = WireKeys(public, secret)
    if role == "scheduler":
        for peer in PEERS["scheduler"]:
            keys.admitted[peer] = {zmq.auth.load_certificate(str(f))[0] for f in sorted(folder.glob(f"{peer}*.key"))}
            if not keys.admitted[peer]:
                raise WireSecurityError(f"no {peer}*.key in {folder}: no {peer} could connect")
    else:
        server = folder / "scheduler.key"
        if not server.exists():
            raise WireSecurityError(f"no {server}: the scheduler's public key is needed to trust it")
        keys.scheduler_public = zmq.auth.load_certificate(str(server))[0]
    return keys


def keys_for(args: argparse.Namespace, role: str, endpoints: list[str]) -> WireKeys | None:
    """The keys this service uses, or None where its endpoints need none."""
    if not any(e.startswith("tcp://") for e in endpoints):
        return None
    if args.insecure_wire:
        log.warning("--insecure-wire: the %s's tcp:// sockets are open to anyone who reaches them", role)
        return None
    if args.keys_dir is None:
        raise WireSecurityError(
            "tcp:// endpoints need CURVE keys: make them with `pagedserve keys DIR` and pass "
            f"--keys-dir DIR/{role} (or ${KEYS_DIR_ENV}), or --insecure-wire"
        )
    return load_keys(args.keys_dir, role)


def serve_securely(sock: zmq.Socket[bytes], keys: WireKeys | None, domain: str) -> None:
    """Make `sock` a CURVE server whose peers the authenticator checks against `domain`'s keys."""
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = domain.encode()


def connect_securely(sock: zmq.Socket[bytes], keys: WireKeys | None) -> None:
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.scheduler_public


class _Admitted:
    def __init__(self, keys: set[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        zap_log.warning("refused a CURVE peer on the %s socket: its key %s is not admitted", domain, key[:8].decode())
        return False


def start_authenticator(context: zmq.Context[zmq.Socket[bytes]], keys: WireKeys | None) -> ThreadAuthenticator | None:
    """The ZAP handler that admits each role's keys on that role's socket (domain)."""
    if keys is None:
        return None
    if not any(isinstance(f, RateLimit) for f in zap_log.filters):  # every refused peer would cost a line
        zap_log.addFilter(RateLimit())
    authenticator = ThreadAuthenticator(context, log=zap_log)
    authenticator.start()
    for role, admitted in keys.admitted.items():
        authenticator.configure_curve_callback(role, _Admitted(admitted))
    return authenticator
