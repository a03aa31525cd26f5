"""The rollout fleet's replicas placed by Ray (``rollout.placement: ray``), against real CPU `vllm serve`.

A ReplicaHost actor owns each server; the driver's fleet must sample exactly what a fleet of local
processes samples (a call is a pure function of its ids, seed and the weights), and a replica whose actor
is killed mid-batch (``ray.kill``: its server dies with it) is lost and its calls re-sent, the batch's
trajectories unchanged; with every replica gone the error names each one's node and log tail.
The servers run in the CPU build's Python (``.venv-vllm``: skipped where it is absent); this process and the
actors run this environment's Ray (a local Ray on 127.0.0.1, started once for the module).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from rubricem_core.config import DistributedConfig, RolloutConfig
from rubricem_core.rollout import RolloutError, RolloutRequest, SamplingParams
from rubricem_core.rollout.server_guard import group_members
from rubricem_core.rollout.vllm_fleet import start_fleet
from rubricem_core.rollout.vllm_server_engine import VLLMServerEngine
from rubricem_core.tools import LocalSearchTool, ToolEnv
from tests.rollout_fixtures import assert_same_trajectory, flat_groups, model_dir, prompt_ids, tok, world  # noqa: F401  (module fixtures)
from tests.vllm_cpu import CPU_SERVER_ENV, NO_VLLM_VENV, VLLM_PYTHON

pytest.importorskip("ray")
SERVER_ENV = {**CPU_SERVER_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=NO_VLLM_VENV)


def test_placement_ray_is_refused_with_what_it_cannot_take():
    for bad in ({"devices": [0, 1]}, {"colocate": True}):
        with pytest.raises(ValueError, match=f"placement: ray .* {next(iter(bad))}"):
            RolloutConfig(engine="vllm_server", placement="ray", **bad)
    with pytest.raises(ValueError, match="placement: ray .* engine: hf"):
        RolloutConfig(placement="ray")
    assert RolloutConfig().placement == "local"


def test_the_transfer_master_is_loopback_only_for_a_fleet_on_loopback():
    """Replicas on another node need trainer rank 0's node address as the transfer group's master: the
    default (127.0.0.1) with such a replica is refused before anything listens."""
    from torch import nn

    from rubricem_core.rollout.weight_transfer import WeightPusher, WeightTransferError, master_address_for

    assert master_address_for("http://127.0.0.1:8000") == "127.0.0.1"
    assert master_address_for(["http://127.0.0.1:8000", "http://localhost:8001"]) == "127.0.0.1"
    assert master_address_for(["http://127.0.0.1:8000", "http://10.1.2.3:8001"]) not in ("127.0.0.1", "localhost")
    pusher = WeightPusher(nn.Linear(2, 2), "gloo", timeout_s=5)
    assert pusher.master_address == "127.0.0.1"
    with pytest.raises(WeightTransferError, match=r"\['http://10.1.2.3:8001'\] are on another node.*127.0.0.1"):
        pusher.push(["http://127.0.0.1:8000", "http://10.1.2.3:8001"], 1, is_sender=True)


# ---- real servers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env(world):
    return ToolEnv({"search": LocalSearchTool(world.corpus_table())}, max_calls=4)


@pytest.fixture(scope="module")
def requests(tok, world) -> list[RolloutRequest]:
    params = SamplingParams(temperature=1.0, max_new_tokens=40, max_total_tokens=500, seed=1)
    return [
        RolloutRequest(f"q{i}", prompt_ids(tok, world.queries[i].question), n=4, sampling=params, max_tool_calls=2)
        for i in range(3)
    ]


SERVER = dict(dtype="float32", max_model_len=2048, python=str(VLLM_PYTHON), env=SERVER_ENV)


def _engine(fleet, tok) -> VLLMServerEngine:
    return VLLMServerEngine(fleet, tok, ("search",), max_model_len=2048)


@pytest.fixture(scope="module")
def local_rows(model_dir, tok, env, requests, tmp_path_factory):
    """What two local `vllm serve` replicas (placement: local) sample for the requests; stopped after."""
    fleet = start_fleet(model_dir, 2, log_path=tmp_path_factory.mktemp("local") / "server.log", **SERVER)
    try:
        engine = _engine(fleet, tok)
        rows = flat_groups(engine.generate(requests, env))
        assert all(n > 0 for n in fleet.calls)
    finally:
        fleet.close()
    return rows


@pytest.fixture(scope="module")
def ray_fleet(model_dir, local_rows, tmp_path_factory):
    """Two replicas placed by a local Ray (started here, shut down after)."""
    from rubricem_core.distributed.cluster import connect, disconnect
    from rubricem_core.rollout.ray_replicas import start_ray_fleet

    connect(DistributedConfig())
    fleet = start_ray_fleet(model_dir, 2, log_path=tmp_path_factory.mktemp("ray") / "server.log", **SERVER)
    yield fleet
    fleet.close()
    disconnect()


@needs_vllm
@pytest.mark.slow
def test_two_ray_placed_replicas_sample_what_two_local_replicas_sample(ray_fleet, tok, env, requests, local_rows):
    import ray

    rows = flat_groups(_engine(ray_fleet, tok).generate(requests, env))
    assert len(rows) == len(local_rows) == 12
    for a, b in zip(rows, local_rows):
        assert_same_trajectory(a, b)
    assert sum(t.n_tool_calls for t in rows) > 0
    assert all(n > 0 for n in ray_fleet.calls)  # both replicas served calls
    me = ray.get_runtime_context().get_node_id()
    for replica in ray_fleet.servers:  # on the driver's node: loopback, a process of the actor's own
        assert replica.info["node_id"] == me and replica.base_url.startswith("http://127.0.0.1:")
        assert replica.info["server_pid"] != replica.info["pid"] != os.getpid()
    assert len({replica.info["pid"] for replica in ray_fleet.servers}) == 2


def _group_gone(pgid: int, within_s: float) -> bool:
    """Whether process group ``pgid`` (a server's guard leads one) has no live member within ``within_s``."""
    deadline = time.monotonic() + within_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not group_members(pgid)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie (reaped by init later) is gone too
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


@needs_vllm
@pytest.mark.slow
def test_a_replica_whose_actor_is_killed_mid_batch_is_lost_and_its_calls_resent(
    ray_fleet, tok, env, requests, local_rows
):
    import ray

    engine = _engine(ray_fleet, tok)
    victim = ray_fleet.servers[1]
    answer = victim.sample_one
    killed = threading.Event()
    lock = threading.Lock()

    def answer_then_kill(call):  # replica 1's first answer of the batch, then its actor is killed
        sample = answer(call)
        with lock:
            if not killed.is_set():
                ray.kill(victim.actor, no_restart=True)
                assert _gone(victim.info["server_pid"], 30)  # the server dies with its actor (PR_SET_PDEATHSIG)
                killed.set()
        return sample

    victim.sample_one = answer_then_kill
    rows = flat_groups(engine.generate(requests, env))
    assert killed.is_set()
    # and its EngineCore with it: Ray SIGKILLs the actor's child (the server's guard), whose server gets
    # SIGTERM (rollout/server_guard.py) and stops its engine once its requests in flight are answered;
    # before the guard the engine lived on as an orphan
    assert _group_gone(victim.info["server_pid"], 120)
    for a, b in zip(rows, local_rows):
        assert_same_trajectory(a, b)
    assert ray_fleet.live == [0] and engine.stats["replicas_live"] == 1 and engine.stats["resent_calls"] >= 1
    why = ray_fleet.lost[1]
    assert (
        f"on node {victim.info['ip']} " in why
        and "lost its Ray actor" in why
        and f"server pid {victim.info['server_pid']}" in why
    )
    assert '"POST /v1/completions HTTP/1.1" 200' in why, why  # its log's tail, read though the actor is gone
    print(f"\nkilled replica 1's actor: {engine.stats['resent_calls']} calls re-sent to replica 0")

    # the last replica goes too: the batch fails naming each replica's node and tail
    ray.kill(ray_fleet.servers[0].actor, no_restart=True)
    node = re.escape(ray_fleet.servers[0].info["ip"])
    with pytest.raises(RolloutError, match=rf"every vLLM replica[\s\S]*replica 0 ---\non node {node} [\s\S]*replica 1"):
        engine.generate(requests, env)
