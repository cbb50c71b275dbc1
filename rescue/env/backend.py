"""Where a study's simulators run: local processes (default) or Ray actors on a cluster.

The backend is a property of one run, not of the study: a study created on one
machine may be resumed on a cluster and the other way round (its identity, the
journal and every record are the same). Nothing here imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rescue.env.pool import SimPool


class BackendError(RuntimeError):
    """The backend cannot be used (Ray missing, no cluster at the address), named in one line."""


@dataclass(frozen=True)
class Backend:
    """How this run gets its simulators."""

    kind: Literal["local", "ray"] = "local"
    # Ray: "auto" (the cluster `ray start` made on this machine), "ray://host:10001", "host:6379";
    # None starts a one-machine cluster for this run alone.
    address: str | None = None
    # Ray: what each simulator actor asks of its node. `resource` is the custom resource that
    # nodes with the simulator installed declare (`ray start --resources '{"simulator": N}'`).
    actor_cpus: float = 1.0
    actor_gpus: float = 0.0
    resource: str | None = "simulator"
    # Ray: how long simulator actors may wait for room, none of them running, before the study stops.
    # Before the first runs, a cluster where no node can ever hold one stops it at once, saying what is missing.
    placement_timeout_s: float = 600.0
    # Local: the folder of a warm pool (`rescue serve-simulators`) whose free simulators the run leases
    # before it starts its own (rescue.env.warm); None: only its own.
    warm: str | None = None

    def describe(self) -> str:
        """One line for logs and errors."""
        if self.kind == "local":
            return f"local simulator processes (leased first from the warm pool in {self.warm})" if self.warm \
                else "local simulator processes"
        return f"the Ray cluster at {self.address}" if self.address else "a one-machine Ray cluster started for this run"

    def _ray(self):
        try:
            from rescue.env import ray_pool
        except ModuleNotFoundError as exc:
            raise BackendError(f"--backend ray needs Ray ({exc}): pip install 'vlm-rescue[ray]'") from None
        return ray_pool

    def connect(self, simulators: int) -> None:
        """Make sure the backend can be used before a study is created or resumed (BackendError if not)."""
        if self.kind == "ray":
            ray_pool = self._ray()
            try:
                ray_pool.connect(self, simulators)
            except ray_pool.ClusterUnreachable as exc:
                raise BackendError(str(exc)) from None

    def disconnect(self) -> None:
        """Leave the cluster (and stop it when this run started it)."""
        if self.kind == "ray":
            self._ray().disconnect()

    def pool(self, size: int, adapter: str, log_path: str | None, max_rss_gb: float | None = None) -> "SimPool":
        """The simulator pool of one run; `max_rss_gb` is each simulator's memory budget (`[env]
        max_simulator_rss_gb`; None: the adapter's default), enforced inside the simulator alike on both backends."""
        kwargs = {} if max_rss_gb is None else {"max_rss_gb": max_rss_gb}
        if self.kind == "ray":
            self.connect(size)
            return self._ray().RayPool(size, adapter, kwargs, options=self)
        from rescue.env.pool import SimPool

        lease = None
        if self.warm is not None:
            from functools import partial

            from rescue.env.warm import lease as warm_lease

            lease = partial(warm_lease, self.warm)
        return SimPool(size, adapter, kwargs, log_path=log_path, lease=lease)


LOCAL = Backend()
