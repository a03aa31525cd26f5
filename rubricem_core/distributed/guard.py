"""What guards a run's listeners: the run's secret, and stores and groups bound to the address they need.

One random secret per flow process (``RUBRICEM_LAUNCH_SECRET`` when the environment sets it, e.g. a
Kubernetes Secret; else generated at first use). It never travels in clear: from it come

- the vLLM servers' API key (``vllm_api_key``), which the process pushing weights needs too;
- the names under which weight-transfer groups meet in their stores (``group_token``): a process
  without the secret cannot find, join or read them.

The trainer ranks are Ray actors: their commands are Ray's remote calls (the cluster's own token
authentication guards them) and their process group meets at a store rank 0 binds to the address it
needs (``bound_store``: loopback when every rank is on one machine), every value sealed with a key the
driver hands the ranks through Ray (``sealed_store``), so a stranger who reaches the port cannot join.

Listeners are bound to the address they need: ``bound_store`` gives a TCPStore server a socket bound to
one address (torch's own binds every interface, whatever host it is told), ``gloo_group(loopback=True)``
a gloo group whose connections listen on 127.0.0.1 only (both ends on one machine).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
from typing import Any

SECRET_ENV = "RUBRICEM_LAUNCH_SECRET"
_generated: str | None = None


class ForgedCommand(RuntimeError):
    """A rendezvous value that does not carry its group's HMAC: written by a process without the key."""


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
