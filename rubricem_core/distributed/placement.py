"""One placement group of identical actors, one per bundle: how trainer ranks (``actors.RankGroup``) and
rollout replicas (``rollout.ray_replicas.start_ray_fleet``) are both placed, waited for and torn down.

    placed = ActorPlacement("rubricem-rl", bundles, strategy="PACK")
    placed.wait(timeout_s, lambda: RankFailure("could not place ..."))   # the caller's own error
    actors = placed.start(RankWorker, options, [args_of_0, args_of_1])   # each on its own bundle
    placed.kill()                                                         # every actor, then the group

Strategy PACK everywhere: the actors share as few nodes as they fit on (loopback between them and the
driver where they fit beside it); PACK is soft, so a group larger than one node still spreads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

STRATEGY = "PACK"


def actor_bundle(gpus: float) -> dict[str, float]:
    """One actor's resources: ``gpus`` GPUs and a CPU on a cluster with GPUs, else one CPU."""
    return {"GPU": float(gpus), "CPU": 1.0} if gpus else {"CPU": 1.0}


class ActorPlacement:
    """A placement group of ``bundles`` and the actors started on it, one per bundle."""

    def __init__(self, name: str, bundles: Sequence[dict[str, float]], strategy: str = STRATEGY) -> None:
        from ray.util.placement_group import placement_group

        self.bundles = [dict(b) for b in bundles]
        self._pg: Any = placement_group(self.bundles, strategy=strategy, name=name)
        self.actors: list[Any] = []

    def wait(self, timeout_s: float, error: Callable[[], BaseException]) -> None:
        """Until every bundle is reserved; ``error()`` raised (the group removed) after ``timeout_s``."""
        import ray

        deadline = time.monotonic() + timeout_s
        while not ray.wait([self._pg.ready()], timeout=1.0)[0]:
            if time.monotonic() > deadline:
                failure = error()
                self.kill()
                raise failure

    def start(self, cls: type, options: dict[str, Any], args_per_actor: Sequence[tuple[Any, ...]]) -> list[Any]:
        """One ``cls`` actor on each bundle, in order (``ray.remote(cls).options(**options)``, pinned to its
        bundle), built with its own arguments."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if len(args_per_actor) != len(self.bundles):
            raise ValueError(f"{len(args_per_actor)} argument tuples for {len(self.bundles)} bundles")
        remote: Any = ray.remote(cls)
        for index, args in enumerate(args_per_actor):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=index)
            self.actors.append(remote.options(scheduling_strategy=strategy, **options).remote(*args))
        return list(self.actors)

    def kill(self) -> None:
        """Kill every actor and remove the placement group (idempotent; what is gone already is skipped)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # already removed
                pass
            self._pg = None
