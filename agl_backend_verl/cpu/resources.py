"""verl's resource pool manager for CPU ranks.

verl 0.9.1's ``ResourcePoolManager._check_resource_available`` counts only Ray's ``GPU`` (or
``NPU``) resources, so on CPU it stops with ``Total available GPUs 0 is less than total desired
GPUs 2`` although the placement groups (bundles of the platform's Ray resource) would schedule.
This subclass checks the resource verl's pools actually request. agl's trainer uses it in CPU mode
in place of the manager verl's trainer builds, and verl's standalone rollout replicas (the rollout
pool of ``separate_async``, ``RolloutReplica.init_standalone``) get it through the patch of
``verl.workers.rollout.replica.ResourcePoolManager`` (:mod:`agl_backend_verl.cpu.patches`).
"""

from __future__ import annotations

import ray
from verl.single_controller.ray import ResourcePoolManager

from agl_backend_verl.cpu.mode import RANK_RESOURCE
from agl_core import UsageError


class CpuResourcePoolManager(ResourcePoolManager):
    """``ResourcePoolManager`` whose availability check counts :data:`RANK_RESOURCE`."""

    @classmethod
    def like(cls, manager: ResourcePoolManager) -> CpuResourcePoolManager:
        """The same pools as ``manager`` (built by verl's task runner from the config)."""
        return cls(
            resource_pool_spec=manager.resource_pool_spec,
            mapping=manager.mapping,
            max_colocate_count=manager.max_colocate_count,
        )

    def _check_resource_available(self) -> None:
        nodes = ray._private.state.available_resources_per_node().values()
        available = sum(node.get(RANK_RESOURCE, 0) for node in nodes)
        needed = self.get_n_gpus()
        if available < needed:
            raise UsageError(f"Ray offers {available:g} of resource {RANK_RESOURCE!r}; verl's CPU ranks need {needed}")
