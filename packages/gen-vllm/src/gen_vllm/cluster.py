"""``RayVirtualCluster``: the resources generation may use, reserved as Ray placement groups."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gen_interface import BackendUnavailableError

from gen_vllm.logs import quiet_ray_driver

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

__all__ = ["Bundle", "RayVirtualCluster", "ray_reachable"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bundle:
    """One reserved slot: ``bundle_index`` of ``node_index``'s placement group.

    ``local_index`` and ``local_count`` place the bundle among the bundles of its node, which is
    how CPU workers on one machine pick disjoint cores.
    """

    node_index: int
    bundle_index: int
    local_index: int
    local_count: int
    num_cpus: float
    num_gpus: float


class RayVirtualCluster:
    """Describes the resources generation may use and reserves them as Ray placement groups.

    One placement group per entry of ``bundle_ct_per_node_list``, packed onto one node
    (``STRICT_PACK``), so the bundles listed for a node share a machine. A bundle holds one GPU
    (and ``num_cpus_per_bundle`` CPUs) when GPUs are used, else ``num_cpus_per_bundle`` CPUs.

    Args:
        bundle_ct_per_node_list: bundles on each node, e.g. ``[2]`` or ``[8, 8]``.
        use_gpus: True, False, or None for "GPUs if Ray sees any".
        num_gpus_per_node: GPUs per node, for checking the request (default: what Ray sees).
        max_colocated_worker_groups: how many worker groups may share each bundle (e.g. a
            trainer and generation): each gets ``1 / max_colocated_worker_groups`` of a GPU.
        num_cpus_per_bundle: CPUs per bundle; default: the node's free CPUs divided among its
            bundles (at least 1).
        name: a prefix for the placement groups' names.
        address: a Ray cluster to join (``"auto"``, ``"ray://host:port"``); default: the running
            one, or ``RAY_ADDRESS``, or a new local Ray, which the last cluster using it stops at
            its ``shutdown()``. A Ray started here listens on the loopback interface only, and
            its daemons run in process groups of their own, so a signal to this process's group
            (``kill -TERM -PGID``) stops this process, which then stops Ray in order; a joined
            Ray keeps its own addresses.
        placement_timeout_s: how long to wait for the bundles to be reserved.
        fixed_size: the cluster gets no new nodes, so a request its nodes can never hold (by
            their total resources) is refused at once instead of waiting
            ``placement_timeout_s``; False: wait, an autoscaler may add nodes. Default: True for
            a Ray started here, False for a joined one.

    Raises:
        BackendUnavailableError: Ray cannot start or join, or the resources are not there. The
            message says what was asked and what the nodes hold. A Ray started here is stopped
            again (when no other cluster uses it) before the error is raised.
    """

    # A Ray that clusters of this process started is stopped by the last of them to shut down.
    _own_ray = False
    _own_ray_users = 0

    def __init__(
        self,
        bundle_ct_per_node_list: list[int],
        use_gpus: bool | None = None,
        num_gpus_per_node: int | None = None,
        max_colocated_worker_groups: int = 1,
        num_cpus_per_bundle: float | None = None,
        name: str = "gen",
        address: str | None = None,
        placement_timeout_s: float = 180.0,
        fixed_size: bool | None = None,
    ):
        if not bundle_ct_per_node_list or any(
            not isinstance(n, int) or n < 1 for n in bundle_ct_per_node_list
        ):
            raise ValueError(
                f"bundle_ct_per_node_list must list >= 1 bundles per node, "
                f"got {bundle_ct_per_node_list!r}"
            )
        if max_colocated_worker_groups < 1:
            raise ValueError("max_colocated_worker_groups must be >= 1")
        # Under `uv run`, Ray would rebuild the driver's environment for every worker from a
        # copy of the working directory (minutes, and network access). Workers on this machine
        # already share the driver's interpreter, so keep them on it unless the user says not to.
        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        # Ray's default worker niceness (15) suits background tasks, not an inference engine.
        os.environ.setdefault("RAY_worker_niceness", "0")
        import ray

        self._uses_own_ray = False
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS")
            # Ray's own messages to the log file unless GEN_VERBOSE (logs.py)
            level = quiet_ray_driver()
            try:
                if address:
                    ray.init(address=address, log_to_driver=True, logging_level=level)
                else:
                    with _on_loopback(), _daemons_in_own_process_groups():
                        ray.init(include_dashboard=False, log_to_driver=True, logging_level=level)
                    RayVirtualCluster._own_ray = True
            except Exception as exc:  # Ray raises many types; all mean "no cluster"
                raise BackendUnavailableError(f"could not start or join Ray: {exc}") from exc
        if RayVirtualCluster._own_ray:
            RayVirtualCluster._own_ray_users += 1
            self._uses_own_ray = True
        self.bundle_ct_per_node_list = list(bundle_ct_per_node_list)
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.name = name
        self._placement_groups: list[PlacementGroup] = []
        self.bundles: list[Bundle] = []
        try:
            self._reserve(
                use_gpus,
                num_gpus_per_node,
                num_cpus_per_bundle,
                placement_timeout_s,
                self._uses_own_ray if fixed_size is None else fixed_size,
            )
        except BaseException:
            # Every message was built above, while Ray still ran: nothing here asks a Ray that
            # this shutdown may have just stopped.
            self.shutdown()
            raise

    def _reserve(
        self,
        use_gpus: bool | None,
        num_gpus_per_node: int | None,
        num_cpus_per_bundle: float | None,
        placement_timeout_s: float,
        fixed_size: bool,
    ) -> None:
        """Decide the bundles and reserve them, one placement group per node entry.

        Raises:
            BackendUnavailableError: the resources are not there (at once on a ``fixed_size``
                cluster whose nodes can never hold them).
        """
        import ray
        from ray.util.placement_group import placement_group

        resources = ray.cluster_resources()
        gpus_seen = int(resources.get("GPU", 0))
        self.use_gpus = gpus_seen > 0 if use_gpus is None else use_gpus
        if self.use_gpus and gpus_seen == 0:
            raise BackendUnavailableError("use_gpus=True but Ray sees no GPU")
        self.num_gpus_per_node = num_gpus_per_node
        counts = self.bundle_ct_per_node_list
        if self.use_gpus and num_gpus_per_node is not None:
            too_many = [n for n in counts if n > num_gpus_per_node]
            if too_many:
                raise BackendUnavailableError(
                    f"{too_many[0]} bundles asked on a node of {num_gpus_per_node} GPUs"
                )
        node_totals = [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]
        nodes = max(1, len(node_totals))
        # CPUs other work (e.g. another cluster in this Ray) already holds are not offered.
        cpus_per_node = min(
            resources.get("CPU", 1) / nodes, ray.available_resources().get("CPU", 1)
        )
        specs: list[dict[str, float]] = []
        for node_index, count in enumerate(counts):
            cpus = num_cpus_per_bundle or max(1.0, float(int(cpus_per_node // count)))
            spec: dict[str, float] = {"CPU": cpus}
            if self.use_gpus:
                spec["GPU"] = 1.0
            specs.append(spec)
            self.bundles.extend(
                Bundle(node_index, b, b, count, cpus, spec.get("GPU", 0.0)) for b in range(count)
            )
        cpus_each = " or ".join(f"{c:g}" for c in sorted({spec["CPU"] for spec in specs}))
        asked = (
            f"{counts} bundles of {cpus_each} CPUs{' and 1 GPU' if self.use_gpus else ''} "
            "each, each entry on a node of its own"
        )
        held = ", ".join(_describe(totals) for totals in node_totals) or "no live node"
        if fixed_size:
            needs = [{k: v * count for k, v in spec.items()} for spec, count in zip(specs, counts)]
            if not _fits(needs, node_totals):
                raise BackendUnavailableError(
                    f"Ray could not reserve {asked}: its {len(node_totals)} node(s) hold "
                    f"{held}, and it is a fixed-size cluster (no autoscaler adds nodes), so "
                    "this can never be placed. Ask for fewer replicas or bundles (or fewer CPUs "
                    "per bundle), or give Ray more logical resources (e.g. ray.init(num_cpus=N) "
                    "before the backend starts)"
                )

        # One entry per node: each group is reserved after the previous ones, on a node none of
        # them holds (Ray places groups independently, so two could share a node otherwise).
        nodes_taken: list[str] = []
        try:
            for node_index, (count, spec) in enumerate(zip(counts, specs)):
                group = placement_group(
                    [dict(spec) for _ in range(count)],
                    strategy="STRICT_PACK",
                    name=f"{self.name}-node{node_index}-{os.getpid()}-{id(self)}",
                    # No spaces: Ray ignores "!in(a, b)" with them.
                    bundle_label_selector=(
                        [{"ray.io/node-id": f"!in({','.join(nodes_taken)})"}] * count
                        if nodes_taken
                        else None
                    ),
                )
                self._placement_groups.append(group)
                ray.get(group.ready(), timeout=placement_timeout_s)
                nodes_taken.append(_node_of(group))
        except Exception as exc:
            raise BackendUnavailableError(
                f"Ray could not reserve {asked}, within {placement_timeout_s:g} s (its "
                f"{len(node_totals)} node(s) hold {held}): {exc}"
            ) from exc

    @property
    def world_size(self) -> int:
        """Total number of bundles."""
        return len(self.bundles)

    def engine_groups(self, tensor_parallel_size: int) -> list[list[Bundle]]:
        """The bundles of each engine: ``tensor_parallel_size`` consecutive bundles of one node.

        An engine never spans nodes (its ranks talk over NVLink / shared memory), so every
        node's bundle count must be a multiple of ``tensor_parallel_size``.

        Raises:
            BackendUnavailableError: a node's bundles do not split into whole engines; the
                message names the layouts that work.
        """
        tp = tensor_parallel_size
        counts = self.bundle_ct_per_node_list
        if any(count % tp for count in counts):
            fixed = [max(tp, count // tp * tp) for count in counts]
            raise BackendUnavailableError(
                f"bundles per node {counts} do not split into engines of "
                f"tensor_parallel_size={tp}: an engine's {tp} bundles must all be on one node, so "
                f"every node needs a multiple of {tp} bundles (e.g. {fixed}), or use "
                "tensor_parallel_size=1 for one engine per bundle"
            )
        groups: list[list[Bundle]] = []
        for node in range(len(counts)):
            on_node = [b for b in self.bundles if b.node_index == node]
            groups.extend(on_node[i : i + tp] for i in range(0, len(on_node), tp))
        return groups

    def placement_group(self, node_index: int) -> PlacementGroup:
        return self._placement_groups[node_index]

    def scheduling_strategy(self, bundle: Bundle, *, capture_child_tasks: bool = False) -> Any:
        """A Ray scheduling strategy that places an actor in ``bundle``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self._placement_groups[bundle.node_index],
            placement_group_bundle_index=bundle.bundle_index,
            placement_group_capture_child_tasks=capture_child_tasks,
        )

    def shutdown(self) -> None:
        """Remove the placement groups; stop Ray when it was started here and no other cluster
        uses it. Idempotent, and bounded: when Ray's GCS is gone (its processes were killed,
        e.g. by a signal to every process of a service), nothing is asked of it (each call
        would wait a minute for it) and only the local Ray is stopped."""
        import ray

        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        if not ray_reachable():
            logger.warning("Ray's GCS is gone: its placement groups are left to it")
            self._placement_groups = []
        for group in self._placement_groups:
            try:
                remove_placement_group(group)
            except Exception as exc:  # already removed, or Ray going down
                logger.debug("placement group removal: %s", exc)
        self._placement_groups = []
        if self._uses_own_ray:
            self._uses_own_ray = False
            RayVirtualCluster._own_ray_users -= 1
            if RayVirtualCluster._own_ray_users == 0:
                RayVirtualCluster._own_ray = False
                ray.shutdown()

    def __enter__(self) -> RayVirtualCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@contextlib.contextmanager
def _on_loopback() -> Iterator[None]:
    """Start a Ray that only this machine can reach: its GCS, raylet and workers bind to the
    node address Ray picks, which is the loopback one in Ray's single-machine mode (the mode it
    uses where multi-machine clusters are not supported). Nothing else reaches a Ray that only
    this process uses."""
    from ray._private import ray_constants

    multi_machine = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_machine


@contextlib.contextmanager
def _daemons_in_own_process_groups() -> Iterator[None]:
    """Start Ray's daemons (GCS, raylet and their helpers, and through the raylet the workers)
    each in a process group of its own. Ray starts them in the driver's group, so a signal to
    that group (``kill -TERM -PGID``, what a service manager or a shell's job control sends)
    killed Ray under the driver, whose shutdown then waited a minute for the GCS. They still
    end with the driver: Ray has each die with its parent (``PR_SET_PDEATHSIG``)."""
    from ray._private import services

    popen = services.ConsolePopen

    class _OwnGroup(popen):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = _OwnGroup  # type: ignore[misc]
    try:
        yield
    finally:
        services.ConsolePopen = popen  # type: ignore[misc]


def ray_reachable(timeout_s: float = 2.0) -> bool:
    """Whether this process's Ray can be asked anything: its GCS accepts a connection within
    ``timeout_s``. False when Ray is not initialised or its GCS process is gone; then every
    Ray call would wait about a minute before it fails."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        host, port = str(ray.get_runtime_context().gcs_address).rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError, RuntimeError):
        return False


def _describe(totals: dict[str, float]) -> str:
    """One node's CPUs and GPUs, e.g. ``2 CPUs and 0 GPUs``."""
    return f"{totals.get('CPU', 0.0):g} CPUs and {totals.get('GPU', 0.0):g} GPUs"


def _fits(needs: list[dict[str, float]], node_totals: list[dict[str, float]]) -> bool:
    """Whether every entry's needs fit on a node of its own, by the nodes' total resources.

    A bipartite matching of entries to nodes (augmenting paths; both lists are small).
    """
    holds = [
        [all(totals.get(k, 0.0) >= v for k, v in need.items()) for totals in node_totals]
        for need in needs
    ]
    node_owner: list[int | None] = [None] * len(node_totals)

    def place(entry: int, seen: set[int]) -> bool:
        for node, fits in enumerate(holds[entry]):
            if fits and node not in seen:
                seen.add(node)
                owner = node_owner[node]
                if owner is None or place(owner, seen):
                    node_owner[node] = entry
                    return True
        return False

    return all(place(entry, set()) for entry in range(len(needs)))


def _node_of(group: PlacementGroup) -> str:
    """The node a ready STRICT_PACK group's bundles sit on."""
    from ray.util.placement_group import placement_group_table

    return str(next(iter(placement_group_table(group)["bundles_to_node_id"].values())))
