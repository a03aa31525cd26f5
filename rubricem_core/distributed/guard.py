"""What guards a run's listeners: the launch secret, and stores and groups bound to the address they need.

One random secret per flow process (``RUBRICEM_LAUNCH_SECRET`` when the environment sets it, e.g. a
Kubernetes Secret mounted into every pod of a multi-node Job; else generated at first use). It reaches
the trainer ranks through their environment, never through the control store or a launch file in clear
(on several nodes without the variable it is written to ``state/launch/secret`` with mode 0600). From it:

- every control command and reply (``rl_ranks``) carries an HMAC over its key, session and body; a rank
  refuses, and fails the launch on, a command whose HMAC is missing or wrong (``ForgedCommand``);
- the vLLM servers' API key (``vllm_api_key``), which trainer rank 0 needs for its weight pushes;
- the names under which weight-transfer groups meet in their stores (``group_token``): a process
  without the secret cannot find, join or read them.

Listeners are bound to the address they need: ``bound_store`` gives a TCPStore server a socket bound to
one address (torch's own binds every interface, whatever host it is told), ``gloo_group(loopback=True)``
a gloo group whose connections listen on 127.0.0.1 only (both ends on one machine).

A TCPStore has no authentication of its own: a stranger who reaches its port can list and read every
key and write any. The HMAC makes what it writes worthless; the weight transfers' gloo groups meet through
a ``SealedStore`` (every value MAC'd), so a stranger cannot put its own address in a group's rendezvous
and be sent the weights.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
from pathlib import Path
from typing import Any

SECRET_ENV = "RUBRICEM_LAUNCH_SECRET"
SECRET_FILE = "secret"  # under state/launch/, mode 0600: only where several nodes must share a generated secret
_generated: str | None = None


class ForgedCommand(RuntimeError):
    """A control-store value that does not carry this launch's HMAC: written by a process without the secret."""


def launch_secret() -> str:
    """This process's launch secret: ``RUBRICEM_LAUNCH_SECRET`` if set, else one generated once per process."""
    global _generated
    from_env = os.environ.get(SECRET_ENV)
    if from_env:
        return from_env
    if _generated is None:
        _generated = secrets.token_hex(32)
    return _generated


def derive(secret: str, purpose: str) -> str:
    """A key for one purpose, from the secret (one-way: it does not reveal the secret)."""
    return hmac.new(secret.encode(), f"rubricem:{purpose}".encode(), hashlib.sha256).hexdigest()


def vllm_api_key(secret: str | None = None) -> str:
    """The API key of this launch's vLLM servers (their clients: the flow process and trainer rank 0)."""
    return derive(secret or launch_secret(), "vllm-api-key")


def group_token(secret: str | None = None, purpose: str = "weights") -> str:
    """A name part of a transfer group's store keys that only holders of the secret can compute."""
    return derive(secret or launch_secret(), f"group:{purpose}")[:32]


def mac(secret: str, session: str, key: str, body: str) -> str:
    return hmac.new(secret.encode(), f"{session}\n{key}\n{body}".encode(), hashlib.sha256).hexdigest()


def seal(secret: str, session: str, key: str, value: dict[str, Any]) -> str:
    """``value`` as a store value that carries its HMAC (bound to the store key and the session, so a
    value cannot be replayed under another key or into another launch)."""
    body = json.dumps(value)
    return json.dumps({"body": body, "hmac": mac(secret, session, key, body)})


def unseal(secret: str, session: str, key: str, raw: bytes | str, where: str) -> dict[str, Any]:
    """The value ``seal`` made; ForgedCommand (naming the key and ``where``) when it carries no HMAC or a wrong one."""
    try:
        outer = json.loads(raw)
        body, tag = outer["body"], outer["hmac"]
        ok = (
            isinstance(body, str) and isinstance(tag, str) and hmac.compare_digest(tag, mac(secret, session, key, body))
        )
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise ForgedCommand(
            f"refused {key!r} from the control store {where}: it does not carry this launch's HMAC "
            f"({SECRET_ENV}); a process without the launch secret wrote it. Stopping the launch."
        )
    value = json.loads(body)
    if not isinstance(value, dict):
        raise ForgedCommand(f"refused {key!r} from the control store {where}: not an object")
    return value


def write_secret_file(path: Path, secret: str) -> None:
    """The secret for the other nodes, readable by this user only (created 0600, replaced atomically)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secret.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_secret_file(path: Path) -> str:
    """The secret node 0 wrote; refused when others than its owner may read or write it."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"{path} has mode {mode:o}: the launch secret must be readable by its owner only (0600)")
    return path.read_text().strip()


def listening_socket(host: str) -> socket.socket:
    """A TCP socket listening on ``host`` (an address of this machine) at a free port, for a TCPStore
    server to adopt (``master_listen_fd``): torch's TCPStore binds every interface, whatever host it is given."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(512)
    return sock


def bound_store(host: str, timeout_s: float) -> Any:
    """A TCPStore server listening on ``host`` only (loopback on one node); ``host`` "" listens on every
    interface. The store owns the listening socket (it closes it when it goes)."""
    from datetime import timedelta

    import torch.distributed as dist

    sock = listening_socket(host) if host else _every_interface()
    port = sock.getsockname()[1]
    fd = sock.detach()  # torch's store closes the descriptor it adopts
    try:
        return dist.TCPStore(
            host or "0.0.0.0",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        os.close(fd)
        raise


def _every_interface() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    sock.listen(512)
    return sock


def node_address(name: str) -> str:
    """The address of this machine that ``name`` (node 0's master_addr) resolves to, for a listener the
    other nodes reach; "" (every interface) when it is not one this machine can bind."""
    import ipaddress

    try:
        addr = socket.gethostbyname(name)
        if ipaddress.ip_address(
            addr
        ).is_loopback:  # e.g. Debian's 127.0.1.1 for the host name: not what other nodes reach
            return ""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((addr, 0))
        return addr
    except OSError:
        return ""


def gloo_group(store: Any, rank: int, size: int, timeout_s: float, loopback: bool) -> Any:
    """A gloo process group over ``store``; with ``loopback`` its connections listen on 127.0.0.1 only
    (every member on this machine), else on the address gloo picks (this host name's)."""
    from datetime import timedelta

    import torch.distributed as dist

    if not loopback:
        return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, size, options)


def sealed_store(inner: Any, key: str, prefix: str) -> Any:
    """``inner`` (a torch.distributed Store) seen under ``prefix/``, every value carrying an HMAC under
    ``key`` over its full name: what a member reads was written there by a holder of the key, or the read
    raises ForgedCommand. For a gloo group's rendezvous (it uses set, get and wait), so a stranger on the
    store cannot announce itself as a member. Keep the returned object as long as the group: torch holds
    only its C++ half, and a call into a collected Python store fails."""
    import torch.distributed as dist

    secret = key.encode()

    class SealedStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()

        def _full(self, name: str) -> str:
            return f"{prefix}/{name}"

        def _tag(self, full: str, value: bytes) -> bytes:
            return hmac.new(secret, full.encode() + b"\0" + value, hashlib.sha256).digest()

        def set(self, name: str, value: Any) -> None:
            data = value.encode() if isinstance(value, str) else bytes(value)
            full = self._full(name)
            inner.set(full, self._tag(full, data) + data)

        def get(self, name: str) -> bytes:
            full = self._full(name)
            raw = bytes(inner.get(full))
            tag, data = raw[:32], raw[32:]
            if not hmac.compare_digest(tag, self._tag(full, data)):
                raise ForgedCommand(
                    f"refused {full!r} from a weight-transfer rendezvous: it does not carry the group's HMAC; "
                    "a process without the key wrote it"
                )
            return data

        def wait(self, names: list[str], timeout: Any = None) -> None:
            full = [self._full(n) for n in names]
            inner.wait(full) if timeout is None else inner.wait(full, timeout)

        def check(self, names: list[str]) -> bool:
            return bool(inner.check([self._full(n) for n in names]))

        def set_timeout(self, timeout: Any) -> None:
            inner.set_timeout(timeout)

        def delete_key(self, name: str) -> bool:
            return bool(inner.delete_key(self._full(name)))

    return SealedStore()
