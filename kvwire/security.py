"""Who may read KV events: CURVE encryption and an allow-list of client keys, on every socket.

KV events carry users' prompt token ids. Without keys kvwire binds loopback and
warns for anything wider; with keys every socket it binds (PUB, replay ROUTER,
the reference engine's control socket) is a CURVE server that admits only
clients whose public key is in an allow-list directory, and every socket it
connects (SUB, replay DEALER, control client) is a CURVE client of a known
server key. Keys are ZeroMQ certificate files (``zmq.auth`` format), made by
``kvwire keygen NAME``.

The allow-list is read through ZAP, ZeroMQ's authentication protocol, on the
binding side's context. It is re-read whenever the directory's key files
change, so keys are rotated by adding and removing files, without a restart;
a removed key keeps the connections it already has until they drop.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = [
    "AllowList",
    "ClientKeys",
    "SecurityError",
    "ServerKeys",
    "generate_keypair",
    "is_loopback",
    "load_public_key",
    "load_secret_key",
    "release_context",
    "secure_client",
    "secure_server",
    "warn_if_exposed",
]

log = logging.getLogger("kvwire.security")

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
_ZAP_DOMAIN = "kvwire"


class SecurityError(ValueError):
    """Keys that cannot be used as configured (missing, unreadable, wrong kind)."""


def generate_keypair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` into ``directory``.

    Give the public file to the other side (a client's goes into the server's
    allow-list directory); keep the secret file private (mode 0600).
    """
    if not name or os.sep in name or name.startswith("."):
        raise SecurityError(f"key name {name!r} must be a plain file name")
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(target), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """The z85 public key in a certificate file (public or secret)."""
    public, _ = _load(path)
    return public


def load_secret_key(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """``(public, secret)`` z85 keys from a ``.key_secret`` file."""
    public, secret = _load(path)
    if secret is None:
        raise SecurityError(f"{path} holds no secret key (pass the .key_secret file)")
    return public, secret


def _load(path: str | os.PathLike[str]) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot read key file {path}: {exc}") from None
    if public is None or len(public) != 40:
        raise SecurityError(f"{path} holds no CURVE public key")
    return public, secret


@dataclass(frozen=True)
class ServerKeys:
    """A binding socket's identity and who may connect to it.

    ``secret_key_file``: this server's ``.key_secret``. ``allow_dir``: a
    directory of clients' public ``.key`` files; only those clients get in.
    """

    secret_key_file: Path
    allow_dir: Path

    def __post_init__(self) -> None:
        load_secret_key(self.secret_key_file)
        if not Path(self.allow_dir).is_dir():
            raise SecurityError(f"allow-list directory {self.allow_dir} does not exist")


@dataclass(frozen=True)
class ClientKeys:
    """A connecting socket's identity and the server it expects.

    ``server_key_file``: the server's public ``.key``. ``secret_key_file``:
    this client's ``.key_secret`` (its public half must be in the server's
    allow-list).
    """

    server_key_file: Path
    secret_key_file: Path

    def __post_init__(self) -> None:
        load_public_key(self.server_key_file)
        load_secret_key(self.secret_key_file)


class AllowList:
    """The client public keys in a directory, re-read when its ``.key`` files change."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._lock = threading.Lock()
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._keys: frozenset[bytes] = frozenset()

    def _scan(self) -> tuple[tuple[str, int, int], ...]:
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return ()
        out = []
        for entry in entries:
            if entry.name.endswith(".key") and entry.is_file():
                st = entry.stat()
                out.append((entry.name, st.st_mtime_ns, st.st_size))
        return tuple(sorted(out))

    def keys(self) -> frozenset[bytes]:
        """The allowed z85 public keys now (re-read if the directory changed)."""
        signature = self._scan()
        with self._lock:
            if signature != self._signature:
                keys = set()
                for name, _, _ in signature:
                    try:
                        keys.add(load_public_key(self.directory / name))
                    except SecurityError as exc:
                        log.warning("allow-list: skipping %s: %s", name, exc)
                self._keys = frozenset(keys)
                self._signature = signature
            return self._keys

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question: may the client with z85 public key ``key`` connect?"""
        allowed = key in self.keys()
        if not allowed:
            log.warning("refused a CURVE client whose key is not in %s", self.directory)
        return allowed


class _ContextAuth:
    """One ZAP handler per context, shared by every secured socket bound in it."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("kvwire.security.zap"))
        self.auth.start()
        self.domains: dict[Path, str] = {}


_auths: dict[int, _ContextAuth] = {}
_auths_lock = threading.Lock()


def _domain(ctx: zmq.Context[Any], allow_dir: Path) -> str:
    """The ZAP domain that checks ``allow_dir`` on ``ctx`` (its handler started on first use)."""
    with _auths_lock:
        state = _auths.get(id(ctx))
        if state is None or state.auth.context is not ctx:
            state = _auths[id(ctx)] = _ContextAuth(ctx)
        key = allow_dir.resolve()
        domain = state.domains.get(key)
        if domain is None:
            domain = f"{_ZAP_DOMAIN}-{len(state.domains)}"
            allow = AllowList(key)
            state.auth.configure_curve_callback(domain, credentials_provider=allow)
            state.domains[key] = domain
        return domain


def release_context(ctx: zmq.Context[Any]) -> None:
    """Stop the ZAP handler of ``ctx`` (call before terminating a context that used keys)."""
    with _auths_lock:
        state = _auths.pop(id(ctx), None)
    if state is not None:
        state.auth.stop()


def secure_server(sock: zmq.Socket[Any], keys: ServerKeys) -> None:
    """Make ``sock`` a CURVE server admitting only the allow-list; before ``bind``.

    Starts (once per context) the ZAP handler that checks the allow-list, so a
    client with no key, or a key not listed, never completes its handshake.
    """
    public, secret = load_secret_key(keys.secret_key_file)
    domain = _domain(sock.context, Path(keys.allow_dir))
    sock.setsockopt_string(zmq.ZAP_DOMAIN, domain)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def secure_client(sock: zmq.Socket[Any], keys: ClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server in ``keys``; before ``connect``."""
    public, secret = load_secret_key(keys.secret_key_file)
    sock.setsockopt(zmq.CURVE_SERVERKEY, load_public_key(keys.server_key_file))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


def is_loopback(endpoint: str) -> bool:
    """Whether binding ``endpoint`` keeps it on this host (ipc and inproc always do)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return True
    host = rest.rpartition(":")[0]
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def warn_if_exposed(
    logger: logging.Logger, endpoint: str, what: str, *, secured: bool
) -> bool:
    """Log a warning when ``endpoint`` is reachable beyond this host; returns whether it is.

    Every socket kvwire binds calls this: a wider bind is an explicit choice,
    and the log says what it exposes and whether keys protect it.
    """
    if is_loopback(endpoint):
        return False
    risk = "(CURVE keys required to connect)"
    if not secured:
        risk = (
            "WITHOUT authentication or encryption: anyone who reaches it reads users' prompt "
            "token ids (give it CURVE keys, see kvwire.security, or bind 127.0.0.1)"
        )
    logger.warning("%s bound on %s, reachable beyond this host %s", what, endpoint, risk)
    return True
