"""RL trainer ranks that live as long as the RL session, driven through a torch.distributed TCPStore.

The flow process (where the Prefect tasks, the judge and the rollout engine run) hosts a TCPStore and
starts ``distributed.nproc_per_node`` ranks with torchrun. Every rank builds the same ``LocalPolicy``
(trainer + frozen reference; the trainer's process group is the ranks' own) and then waits for
commands; the channel is two kinds of keys:

    cmd/<n>    {"op": "update" | "save" | "load" | "weights" | "push" | "stop", ...}  set by the flow process, read by every rank
    reply/<n>  {...}                                                      set by rank 0 once every rank is done

Every value carries an HMAC with the launch secret (rubricem_core.distributed.guard; the ranks get the
secret through their environment, never through the store): a rank refuses a command without it and the
launch fails with ``ForgedCommand``. A command's paths must lie inside the run directory; a push goes
only to a loopback URL (the servers run beside rank 0); the update payload is read with
``torch.load(weights_only=True)`` (tensors and plain containers only: nothing in it can run code).

``update`` names a payload file (the step's trajectories and token advantages, written by the flow
process under ``state/launch/``), which every rank reads and trains on its shard of; ``save`` is the
collective resumable checkpoint (every ``rl.checkpoint_every`` steps) whose HF weights rank 0 writes
gathered; ``weights`` sends the current weights to the flow process's own engine over a gloo group of
rank 0 and the flow process (every rank gathers each ZeRO-3 parameter in turn, rank 0 broadcasts it);
``push`` sends them the same way into a vLLM server's workers through vLLM's weight-transfer API
(rubricem_core.rollout.weight_transfer); ``load`` resumes optimizer and weights. A rank that fails ends torchrun, and the waiting call
raises RankFailure with the traceback. Checkpoints and payloads must sit on a file system every node sees.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from rubricem_core.config import RunConfig
from rubricem_core.distributed.guard import (
    SECRET_ENV,
    bound_store,
    derive,
    gloo_group,
    group_token,
    launch_secret,
    node_address,
    seal,
    sealed_store,
    unseal,
    write_secret_file,
)
from rubricem_core.distributed.launch import RankFailure, RankGroup, end_launch_file
from rubricem_core.distributed.nodes import with_launch_id
from rubricem_core.distributed.ranks import is_main, shutdown
from rubricem_core.distributed.spec import launch_path, launch_spec, resolve_master, start_rank
from rubricem_core.policy.loading import load_tokenizer
from rubricem_core.rollout.weight_transfer import (
    ModelWeights,
    broadcast_weights,
    meta_from_rows,
    meta_rows,
    receive_weights,
)
from rubricem_core.store import atomic_write_text
from rubricem_core.trajectory import TokenTrajectory

MODULE = "rubricem_core.distributed.rl_ranks"
CONTROL_ENV = "RUBRICEM_CONTROL"  # host:port of the flow process's TCPStore
SESSION_ENV = "RUBRICEM_CONTROL_SESSION"  # this launch's id in every HMAC: no value replays into another launch
TOKEN_ARRAYS = ("token_ids", "loss_mask", "stage_ids", "logprobs")  # all an update reads of a trajectory
ARRAY_DTYPES = {"token_ids": torch.int64, "loss_mask": torch.int64, "stage_ids": torch.int64, "logprobs": torch.float64}
WEIGHTS_PREFIX = "weights/"  # the control store's keys of the weights transfer to the flow process
log = logging.getLogger(__name__)


class RankPolicy:
    """The Policy interface of rubricem_core.rl.session, with the trainer in torchrun ranks."""

    def __init__(self, run_dir: str, cfg: RunConfig, base: Path) -> None:
        cfg = resolve_master(cfg)  # the other nodes read the address from the launch file
        d = cfg.distributed
        self.timeout_s, self._nnodes = d.timeout_s, d.nnodes
        self.tokenizer = load_tokenizer(base)
        self.on_line: Callable[[str], None] = log.info
        self._lock = threading.Lock()
        self._seq = 0
        self._run_dir = run_dir
        self._weights_group: Any = None  # gloo, this process and trainer rank 0: weights() receives over it
        self._weights_rendezvous: Any = None  # its sealed store (kept as long as the group)
        self._secret, self._session = launch_secret(), secrets.token_hex(8)
        # the ranks of every node connect to this store: on one node it listens on loopback only, on
        # several on node 0's address (every interface when that is not one of this machine's)
        host = node_address(d.master_addr or "") if d.nnodes > 1 else "127.0.0.1"
        self._control = bound_store(host, d.timeout_s)
        control_host = d.master_addr if d.nnodes > 1 else "127.0.0.1"
        self._where = f"{control_host}:{self._control.port}"
        spec_file = self._spec_file = launch_path(run_dir, "rl.json")
        control = {CONTROL_ENV: self._where, SESSION_ENV: self._session}
        if d.nnodes > 1 and not os.environ.get(SECRET_ENV):  # the other nodes read it there (0600)
            write_secret_file(launch_path(run_dir, "secret"), self._secret)
        atomic_write_text(
            spec_file,
            json.dumps(
                with_launch_id(
                    {
                        "config": cfg.model_dump(mode="json"),
                        "base": str(Path(base).resolve()),
                        "run_dir": str(Path(run_dir).resolve()),
                        "env": control,
                    }
                )
            ),
        )
        self._ranks = RankGroup(
            launch_spec(cfg),
            MODULE,
            ["--spec", str(spec_file.resolve())],
            env={**control, SECRET_ENV: self._secret},
        )
        try:
            self._call("ready")
        except BaseException:
            self._ranks.stop()
            end_launch_file(spec_file)
            raise

    # ---- the channel --------------------------------------------------------------------------
    def _call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one command to every rank and wait for rank 0's reply, streaming the ranks' output."""
        with self._lock:
            seq = self._send(op, **args)
            return self._reply(f"reply/{seq}", op)

    def _send(self, op: str, **args: Any) -> int:
        seq = self._seq
        self._seq += 1
        key = f"cmd/{seq}"
        self._control.set(key, seal(self._secret, self._session, key, {"op": op, **args}))
        return seq

    def _reply(self, key: str, op: str) -> dict[str, Any]:
        """Rank 0's sealed answer under ``key`` (ForgedCommand when a stranger wrote it)."""
        return unseal(self._secret, self._session, key, self._await(key, op), f"at {self._where}")

    def _await(self, key: str, op: str) -> bytes:
        """The value of ``key`` once a rank sets it, streaming the ranks' output meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        while not self._control.check([key]):
            self._check_alive(op, deadline)
            time.sleep(0.02)
        self._ranks.drain(self.on_line)
        return self._control.get(key)

    def _check_alive(self, op: str, deadline: float) -> None:
        self._ranks.drain(self.on_line)
        rc = self._ranks.poll()
        if rc is not None:
            raise self._ranks.failure(rc)
        if time.monotonic() > deadline:
            self._ranks.stop()
            raise RankFailure(
                f"the trainer ranks did not answer {op!r} within distributed.timeout_s={self.timeout_s:.0f}s; "
                "stopped them"
            )

    def _wait_work(self, work: Any, deadline: float) -> None:
        while not work.is_completed():
            self._check_alive("weights", deadline)
            time.sleep(0.0005)
        work.wait()

    # ---- Policy --------------------------------------------------------------------------------
    def log_to(self, on_line: Callable[[str], None]) -> None:
        self.on_line = on_line

    def update(
        self, trajectories: list[TokenTrajectory], token_advs: list[list[float]], settings: Any
    ) -> dict[str, float]:
        payload = launch_path(self._run_dir, "rl-update.pt")
        tmp = payload.with_suffix(".tmp")
        # tensors (float64 keeps every logprob and advantage exact): the ranks load it weights_only
        arrays = [{k: torch.tensor(getattr(t, k), dtype=ARRAY_DTYPES[k]) for k in TOKEN_ARRAYS} for t in trajectories]
        advs = [torch.tensor(a, dtype=torch.float64) for a in token_advs]
        torch.save({"trajectories": arrays, "token_advs": advs}, tmp)
        os.replace(tmp, payload)
        return self._call("update", payload=str(payload.resolve()), settings=asdict(settings))["metrics"]

    def save(self, directory: Path, extra: dict[str, Any]) -> None:
        self._call("save", directory=str(Path(directory).resolve()), extra=extra)

    def load(self, directory: Path) -> dict[str, Any]:
        return self._call("load", directory=str(Path(directory).resolve()))["extra"]

    def weights(self) -> dict[str, torch.Tensor]:
        """The ranks' current weights in this process (for its rollout engine), by transfer: a gloo group
        of trainer rank 0 and this process (opened on the first call, over the control store), rank 0
        broadcasting each whole parameter as every rank gathers it in turn (ZeRO-3: one at a time)."""
        with self._lock:
            seq = self._send("weights")
            if self._weights_group is None:
                self._weights_rendezvous = weights_store(self._secret, self._session, self._control)
                # rank 0 runs on this node: the group listens on loopback when every rank does too
                self._weights_group = gloo_group(
                    self._weights_rendezvous,
                    1,
                    2,
                    self.timeout_s,
                    loopback=self._nnodes == 1,
                )
            meta = meta_from_rows(self._reply(f"{WEIGHTS_PREFIX}meta/{seq}", "weights")["meta"])
            deadline = time.monotonic() + self.timeout_s
            weights = receive_weights(self._weights_group, meta, lambda work: self._wait_work(work, deadline))
            self._reply(f"reply/{seq}", "weights")
        return weights

    def push_weights(self, server_url: str | Sequence[str], backend: str, n_workers: int) -> float:
        # rank 0 must reach the server at server_url: it runs on node 0, beside this process
        return self._call("push", url=server_url, backend=backend, workers=n_workers)["seconds"]

    def close(self) -> None:
        if self._ranks.poll() is None:
            try:
                self._call("stop")
                self._ranks.wait(self.on_line, timeout=60)
            except (RankFailure, TimeoutError) as exc:
                log.warning("trainer ranks did not stop cleanly: %s", exc)
            finally:
                self._ranks.stop()
        self._weights_group = self._weights_rendezvous = None
        end_launch_file(self._spec_file)


def weights_prefix(secret: str) -> str:
    """Where the flow process and rank 0 meet for ``weights`` in the control store."""
    return f"{WEIGHTS_PREFIX}{group_token(secret)}/"


def weights_store(secret: str, session: str, control: Any) -> Any:
    """The ``weights`` group's rendezvous: every value sealed (over its full key) with a key from the secret
    and this launch's session, so no stranger on the control store can announce itself as rank 1 and be
    sent the weights, nor replay a past launch's address."""
    return sealed_store(control, derive(secret, f"weights-group:{session}"), weights_prefix(secret).rstrip("/"))


# ---- the ranks ----------------------------------------------------------------------------------
def _trajectory(d: dict[str, Any]) -> TokenTrajectory:
    return TokenTrajectory(**{k: d[k].tolist() for k in TOKEN_ARRAYS})


class RefusedCommand(RuntimeError):
    """A sealed command that names something outside what the launch allows."""


def inside(run_dir: Path, path: str, what: str) -> Path:
    """``path`` resolved, refused (RefusedCommand) unless it lies inside the run directory."""
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(run_dir):
        raise RefusedCommand(f"refused {what} {path!r}: it is not inside the run directory {run_dir}")
    return resolved


def loopback_urls(urls: Any) -> Any:
    """A push's server URL(s), refused (RefusedCommand) unless each is http on loopback: every vLLM
    server this launch starts listens on 127.0.0.1 beside rank 0."""
    from urllib.parse import urlsplit

    for url in [urls] if isinstance(urls, str) else list(urls):
        parts = urlsplit(str(url))
        if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise RefusedCommand(f"refused push to {url!r}: the launch's vLLM servers listen on http://127.0.0.1 only")
    return urls


def load_payload(path: Path) -> dict[str, Any]:
    """An update payload: tensors and plain containers only (``weights_only``: nothing in it can run code)."""
    payload = torch.load(path, weights_only=True)
    if not isinstance(payload, dict) or not {"trajectories", "token_advs"} <= payload.keys():
        raise RefusedCommand(f"refused update payload {path}: not a trajectories/token_advs mapping")
    return payload


@record
def main(argv: list[str] | None = None) -> None:
    from rubricem_core.rl.session import LocalPolicy
    from rubricem_core.rl.update import UpdateConfig

    spec, cfg = start_rank("One RL trainer rank (started by the rl flow with torchrun).", argv)
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise RuntimeError(
            f"this rank has no launch secret ({SECRET_ENV}): it cannot tell the flow's commands from a stranger's; "
            f"set {SECRET_ENV} to the same value on every node, or on none (node 0 then writes state/launch/secret)"
        )
    session, run_dir = os.environ[SESSION_ENV], Path(spec["run_dir"]).resolve()
    policy = LocalPolicy(Path(spec["base"]), cfg)
    where = spec["env"][CONTROL_ENV]
    host, port = where.rsplit(":", 1)
    # between two commands the flow runs rollouts and the judge: wait as long as a run may take
    control = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(days=7))
    to_flow: Any = None  # rank 0's gloo group with the flow process (the `weights` command)
    to_flow_rendezvous: Any = None  # its sealed store, kept as long as the group
    seq = 0
    while True:
        key = f"cmd/{seq}"
        cmd = unseal(secret, session, key, control.get(key), f"at {where}")
        op = cmd["op"]
        reply: dict[str, Any] = {}
        if op == "update":
            payload = load_payload(inside(run_dir, cmd["payload"], "update payload"))
            trajs = [_trajectory(t) for t in payload["trajectories"]]
            advs = [a.tolist() for a in payload["token_advs"]]
            reply["metrics"] = policy.update(trajs, advs, UpdateConfig(**cmd["settings"]))
        elif op == "save":
            policy.save(inside(run_dir, cmd["directory"], "checkpoint directory"), cmd["extra"])
        elif op == "load":
            reply["extra"] = policy.load(inside(run_dir, cmd["directory"], "checkpoint directory"))
        elif op == "push":
            url = loopback_urls(cmd["url"])
            reply["seconds"] = policy.push_weights(url, cmd["backend"], cmd["workers"], is_sender=is_main())
        elif op == "weights":  # to the flow process's engine (RankPolicy.weights)
            source = ModelWeights(policy.trainer.model)
            meta = source.metadata()
            if is_main():
                if to_flow is None:
                    to_flow_rendezvous = weights_store(secret, session, control)
                    to_flow = gloo_group(
                        to_flow_rendezvous,
                        0,
                        2,
                        cfg.distributed.timeout_s,
                        loopback=cfg.distributed.nnodes == 1,
                    )
                meta_key = f"{WEIGHTS_PREFIX}meta/{seq}"
                control.set(meta_key, seal(secret, session, meta_key, {"meta": meta_rows(meta)}))
            broadcast_weights(source, meta, to_flow if is_main() else None)
        elif op not in ("ready", "stop"):
            raise RefusedCommand(f"unknown trainer-rank command {op!r}")
        dist.barrier()  # every rank is done before rank 0 says so
        if is_main():
            control.set(f"reply/{seq}", seal(secret, session, f"reply/{seq}", reply))
        if op == "stop":
            break
        seq += 1
    policy.close()
    shutdown()


if __name__ == "__main__":
    main()
