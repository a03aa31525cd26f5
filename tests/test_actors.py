"""RankGroup (rubricem_core/distributed/actors.py) on the session's local Ray, with tiny plain-Python rank
objects (tests/rank_cases.py): calls and their arguments, a collective, failures (a rank SIGKILLed from
outside, an exception), the rendezvous store's doors, placement that cannot be met."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

import rank_cases
from rubricem_core.distributed.actors import RankFailure, RankGroup


def fresh(tmp_path: Path, kind: str, **kw) -> RankGroup:
    g = RankGroup(kind, 2, tmp_path / "ranks", timeout_s=120, **kw)
    g.build(rank_cases.Ranked, kind)
    return g


def assert_gone(actors: list) -> None:
    """Every actor of a failed group was killed: a call on it fails as a dead actor's."""
    import ray
    from ray.exceptions import RayActorError

    assert actors
    for actor in actors:
        with pytest.raises(RayActorError):
            ray.get(actor.where.remote(), timeout=60)


def _listening(pid: int) -> dict[int, set[str]]:
    found: dict[int, set[str]] = {}
    for conn in psutil.Process(pid).net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN:
            found.setdefault(conn.laddr.port, set()).add(conn.laddr.ip)
    return found


@pytest.fixture(scope="class")
def group(ray_cluster, tmp_path_factory):
    """Two live ranks shared by the tests that leave them alive (closed after the class: the machine may
    have CPUs for one group only)."""
    g = RankGroup("unit", 2, tmp_path_factory.mktemp("ranks"), timeout_s=120)
    g.build(rank_cases.Ranked, "built-once")
    yield g
    g.close()


class TestLiveGroup:
    # ---- (a) calls -----------------------------------------------------------------------------------
    def test_each_rank_gets_only_its_own_arguments_in_rank_order(self, group):
        got = group.call_each("echo", [("zero", [0, 0]), ("one", {"k": 1})])
        assert [g["rank"] for g in got] == [0, 1]
        assert [g["args"] for g in got] == [("zero", [0, 0]), ("one", {"k": 1})]
        assert [g["pid"] for g in got] == [w["pid"] for w in group.where]  # one process per rank
        same = group.call("echo", 7)
        assert [(g["rank"], g["tag"], g["args"]) for g in same] == [(0, "built-once", (7,)), (1, "built-once", (7,))]
        assert group.run(rank_cases.rank_and_world) == [(0, 2), (1, 2)]
        with pytest.raises(ValueError, match="1 argument tuples for 2 ranks"):
            group.call_each("echo", [(1,)])

    @pytest.mark.parametrize("values, total", [((1.0, 2.0), 3.0), ((-0.5, 0.25), -0.25)])
    def test_an_all_reduce_across_the_ranks(self, group, values, total):
        assert group.call_each("all_reduce", [(v,) for v in values]) == [total, total]

    # ---- (d) the rendezvous --------------------------------------------------------------------------
    def test_the_rendezvous_store_and_gloo_listen_on_loopback_only(self, group):
        host, port = group.call("rendezvous")[0]
        assert host == "127.0.0.1"
        rank0 = _listening(group.where[0]["pid"])
        assert rank0[port] == {"127.0.0.1"}  # torch's own TCPStore would listen on every interface
        # gloo's pair listeners too; what else a rank listens on is Ray's worker (its token auth guards it)
        for w in group.where:
            loopback = {p for p, ips in _listening(w["pid"]).items() if ips == {"127.0.0.1"}}
            assert loopback - {port}, f"rank pid {w['pid']} has no loopback listener for gloo"


@pytest.mark.slow
def test_a_stranger_on_the_rendezvous_cannot_join_a_new_group(ray_cluster, tmp_path):
    """A process that reaches rank 0's store writes the address of "rank 1" for the next group (as
    DeepSpeed makes them) before rank 1 does: rank 0 refuses it, and the call fails naming the forgery."""
    g = fresh(tmp_path, "door")
    actors = list(g.actors)
    try:
        host, port = g.call("rendezvous")[0]
        stranger = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
        member = [k for k in stranger.list_keys() if k.endswith("/1") and k.startswith("pg/")]
        assert member, stranger.list_keys()  # the names are no secret
        forged = member[0].replace("//cpu//", "//1//cpu//")  # the first new group's key for rank 1
        stranger.set(forged, stranger.get(member[0]))  # a real, sealed address replayed under another name
        with pytest.raises(
            RankFailure, match=r"rank 0 of 2 .* raised ForgedCommand: .*does not carry the group's HMAC"
        ):
            g.run(rank_cases.new_group_sum, 1, 20.0)
        assert_gone(actors)
    finally:
        g.kill()


# ---- (b), (c) failures ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_rank_killed_from_outside_fails_the_call_naming_it(ray_cluster, tmp_path):
    g = fresh(tmp_path, "killed")
    actors, where = list(g.actors), list(g.where)
    victim = where[1]["pid"]
    killed_at: list[float] = []

    def kill_when_waiting() -> None:  # once rank 1 has printed (so its log has a tail), while rank 0 blocks
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if g.log_files[1].exists() and "last words of rank 1" in g.log_files[1].read_text():
                killed_at.append(time.monotonic())
                os.kill(victim, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_when_waiting)
    killer.start()
    try:
        with pytest.raises(RankFailure) as err:
            g.call("wait_in_collective", 1, 300.0)
        detected = time.monotonic() - killed_at[0]
    finally:
        killer.join()
        g.kill()
    print(f"rank 1 SIGKILLed: RankFailure after {detected:.2f}s")
    message = str(err.value)
    assert detected < 30
    assert "rank 1 of 2" in message and "died" in message and "'wait_in_collective'" in message
    assert f"node {where[1]['ip']} (pid {victim})" in message
    assert str(g.log_files[1]) in message and "the last words of rank 1" in message.split("last lines of")[1]
    assert_gone(actors)


@pytest.mark.slow
def test_an_exception_in_one_rank_fails_the_call_with_its_traceback(ray_cluster, tmp_path):
    g = fresh(tmp_path, "raised")
    actors = list(g.actors)
    try:
        with pytest.raises(RankFailure) as err:
            g.call("fail", 1)
    finally:
        g.kill()
    message = str(err.value)
    assert "rank 1 of 2" in message and "raised ValueError: rank one broke: bad shard 17" in message
    tail = message.split("last lines of")[1]
    assert "rank 1 reading shard 17" in tail  # its output
    traceback = tail.split("--- traceback ---")[1]
    assert "rank_cases.py" in traceback and ", in fail" in traceback  # the frames Ray carried back
    assert 'raise ValueError("rank one broke: bad shard 17")' in traceback
    assert_gone(actors)


# ---- (e) placement -------------------------------------------------------------------------------
def test_a_placement_the_cluster_cannot_meet_fails_naming_bundles_and_resources(ray_cluster, tmp_path):
    import ray
    from ray.util import placement_group_table

    cpus = int(ray.cluster_resources()["CPU"])
    with pytest.raises(RankFailure) as err:
        RankGroup("huge", cpus + 1, tmp_path, timeout_s=3)
    message = str(err.value)
    assert f"could not place {cpus + 1} huge ranks within 3s" in message
    assert "{'CPU': 1.0}" in message and "cluster has" in message and f"'CPU': {float(cpus)}" in message
    left = [pg for pg in placement_group_table().values() if pg["name"] == "rubricem-huge"]
    assert left and all(pg["state"] == "REMOVED" for pg in left)  # the unmet reservation was withdrawn
