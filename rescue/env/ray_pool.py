"""Simulators as Ray actors: the pool of the `ray` backend.

Only the simulator moves to the cluster. Each actor owns one simulator (the
EnvAdapter lives in the actor's process, built with the pinned hash seed) and
is placed by resources: CPUs, GPUs and a custom resource that nodes with the
simulator installed declare. Everything that decides or records stays in the
coordinator (the `rescue` process): claims, each arm's control loop, policy
connections, VLM calls under one rate limiter, receipts, verdicts, frames.
So the engine above this pool is the local one, line for line, and fork-at-q,
release-while-waiting, the sham arm, drain, SIGTERM and `status` behave alike.

Ray's retries are off everywhere, on purpose: a simulator call is one step of
one arm's trajectory, and a retried or restarted actor would run physics the
journal never claimed (a silent re-run). `max_restarts=0` and
`max_task_retries=0` on every actor, `max_task_retries=0` and
`retry_exceptions=False` on its methods; no Ray tasks are used, so
`max_retries` has nothing to apply to. A lost actor or node surfaces as
`WorkerLost` in the arm it was serving: that case ends `unknown` (reason
`worker_lost` with the node id), and new actors take never-claimed cases.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any, Callable

import ray
import structlog
from ray.exceptions import RayActorError, RayError, RayTaskError

from rescue import __version__
from rescue.core.failfast import one_line
from rescue.core.names import resolve
from rescue.env.pool import SIM_HASH_SEED, SimPool, Simulator, SimulatorError

log = structlog.get_logger()

# Placing actors again after losing them: at most this many per simulator the study asked for.
MAX_PLACEMENTS_PER_SIMULATOR = 10
# An actor that died before it ran (its node died, and the cluster did not know yet) is placed
# again after a pause that doubles each time, up to this, so a dead node is not tried in a loop.
MAX_PLACEMENT_PAUSE_S = 30.0
_started_here = False


class ClusterUnreachable(RuntimeError):
    """No Ray cluster at the address, or Ray cannot start one here."""


def connect(options: Any, simulators: int) -> None:
    """Join the cluster at options.address (a rescue.env.backend.Backend), or start a one-machine cluster."""
    global _started_here
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = dict(log_to_driver=False, logging_level=logging.WARNING, include_dashboard=False)
    if options.address is None:
        # A cluster for this run alone: this machine's CPUs, and the simulator resource for the pool.
        if options.resource:
            kwargs["resources"] = {options.resource: simulators}
    else:
        kwargs["address"] = options.address
        kwargs.pop("include_dashboard")
        _check_reachable(options.address)
    try:
        ray.init(**kwargs)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError or ValueError for a bad address
        raise ClusterUnreachable(f"cannot join the Ray cluster at {options.address}: {one_line(str(exc))}") from None
    _started_here = options.address is None
    log.info("ray.connected", address=options.address, started_here=_started_here)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuse an address nothing listens on now (Ray itself would retry it for minutes)."""
    if address == "auto":
        return  # Ray reads this machine's cluster address file, and says at once when there is none
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as exc:
        raise ClusterUnreachable(f"cannot join the Ray cluster at {address}: {exc}") from None


def disconnect() -> None:
    """Leave the cluster; a cluster this run started stops with it."""
    if ray.is_initialized():
        ray.shutdown()


class WorkerLost(SimulatorError):
    """The actor serving an arm died, or its node did: the arm's case ends unknown (`worker_lost`)."""

    arm_error_kind = "worker_lost"


class SimulatorActor:
    """One simulator in a Ray actor process."""

    def __init__(self, adapter_spec: str, adapter_kwargs: dict):
        self.adapter = resolve(adapter_spec)(**adapter_kwargs)

    def where(self) -> dict[str, Any]:
        """Where the actor runs, and what it runs."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "rescue": __version__,
            "python_hash_seed": os.environ.get("PYTHONHASHSEED"),
        }

    @ray.method(max_task_retries=0, retry_exceptions=False)
    def call(self, method: str, args: tuple) -> Any:
        """One EnvAdapter call."""
        return getattr(self.adapter, method)(*args)


_Actor = ray.remote(SimulatorActor)


class RayActorSim(Simulator):
    """Async typed proxy of an EnvAdapter living in a Ray actor."""

    def __init__(self, handle: Any, name: str, hash_seed: str):
        self._handle = handle
        self.name = name
        self.hash_seed = hash_seed
        self.node_id: str | None = None
        self._dead = False

    async def place(self, timeout_s: float) -> dict[str, Any]:
        """Wait until the actor runs (its node id is known from then on)."""
        info = await asyncio.wait_for(_awaited(self._handle.where.remote()), timeout_s)
        self.node_id = info["node_id"]
        return info

    async def _invoke(self, method: str, *args: Any) -> Any:
        try:
            payload = await self._handle.call.remote(method, args)
        except RayTaskError as exc:  # the adapter raised: the simulator is fine, the call failed
            raise SimulatorError(f"{self.name}.{method} failed:\n{exc}") from None
        except (RayActorError, RayError) as exc:  # the actor, its process or its node is gone
            self._dead = True
            raise WorkerLost(
                f"simulator actor {self.name} on node {self.node_id} was lost during {method} ({one_line(str(exc))})"
            ) from None
        self._note(method, args)
        return payload

    async def responsive(self) -> bool:
        """True when the actor answers (an idle actor may have lost its node)."""
        if self._dead:
            return False
        try:
            await asyncio.wait_for(_awaited(self._handle.where.remote()), 30.0)
            return True
        except (RayError, asyncio.TimeoutError):
            self._dead = True
            return False

    def alive(self) -> bool:
        """False once a call found the actor gone."""
        return not self._dead

    def stop(self, timeout: float = 10.0) -> None:
        """End the actor (no restart: max_restarts is 0)."""
        try:
            ray.kill(self._handle, no_restart=True)
        except Exception:  # already gone, or the cluster is: nothing to end
            pass


async def _awaited(ref: Any) -> Any:
    return await ref


class RayPool(SimPool):
    """Simulator actors handed to arms one at a time; a lost actor is replaced by a new one."""

    def __init__(self, size: int, adapter_spec: str, adapter_kwargs: dict | None = None, *, options: Any,
                 hash_seed: str | int = SIM_HASH_SEED):
        self._init_queue(hash_seed)
        self._options = options
        self._spec, self._kwargs = adapter_spec, adapter_kwargs or {}
        self._sims: list[RayActorSim] = []  # placed actors (some may have been lost since)
        self._free: list[RayActorSim] = []
        self._placing: set[asyncio.Task] = set()
        self._unplaced: set[RayActorSim] = set()  # created, not yet running
        self._serial = 0
        self._budget = MAX_PLACEMENTS_PER_SIMULATOR * size
        self._pause = 1.0
        for _ in range(size):
            self._place_new()

    def _actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = dict(
            num_cpus=self._options.actor_cpus,
            num_gpus=self._options.actor_gpus,
            max_restarts=0,  # a restarted actor would be a new simulator under an old name
            max_task_retries=0,  # a retried call would step physics twice
            # The spawned simulator of the local backend pins the hash seed the same way (LIBERO builds
            # parts of its scene by iterating sets); the renderer follows the coordinator's choice.
            runtime_env={"env_vars": {"PYTHONHASHSEED": self._hash_seed, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}},
        )
        if self._options.resource:
            opts["resources"] = {self._options.resource: 1}
        return opts

    def _place_new(self, after_s: float = 0.0) -> None:
        if self._budget <= 0:
            self._fail(f"simulator actors were lost {MAX_PLACEMENTS_PER_SIMULATOR} times per simulator; "
                       "the cluster is not stable enough to go on")
            return
        self._budget -= 1
        task = asyncio.get_running_loop().create_task(self._place(after_s))
        self._placing.add(task)
        task.add_done_callback(self._placing.discard)

    async def _place(self, after_s: float = 0.0) -> None:
        await asyncio.sleep(after_s)
        timeout = self._options.placement_timeout_s
        self._serial += 1
        handle = _Actor.options(**self._actor_options()).remote(self._spec, self._kwargs)
        sim = RayActorSim(handle, f"actor-{self._serial}", self._hash_seed)
        self._unplaced.add(sim)
        try:
            while True:
                try:
                    info = await sim.place(timeout)
                    break
                except asyncio.TimeoutError:
                    if not any(s.alive() for s in self._sims):
                        self._fail(f"no simulator actor could be placed within {timeout:g} s on "
                                   f"{self._options.describe()}; each asks for {self._asks()}")
                        return
                    # Others run: this one is spare capacity and may wait for a node to join.
        except RayActorError as exc:
            if getattr(exc, "actor_init_failed", False):
                self._fail(f"a simulator actor failed to start: {one_line(str(exc))}")
            else:
                log.warning("ray.actor_lost_before_start", actor=sim.name, error=one_line(str(exc)), retry_in_s=self._pause)
                self._place_new(after_s=self._pause)
                self._pause = min(2 * self._pause, MAX_PLACEMENT_PAUSE_S)
            return
        except RayError as exc:
            self._fail(f"a simulator actor could not be placed: {one_line(str(exc))}")
            return
        finally:
            self._unplaced.discard(sim)
        if info["rescue"] != __version__:
            sim.stop()
            self._fail(f"node {info['node_id']} runs rescue {info['rescue']}, this coordinator {__version__}; "
                       "install the same version on every node")
            return
        log.info("ray.actor_placed", actor=sim.name, node_id=info["node_id"], pid=info["pid"])
        self._sims.append(sim)
        self._free.append(sim)
        await self._notify()

    def _asks(self) -> str:
        o = self._options
        parts = [f"{o.actor_cpus:g} CPU"] + ([f"{o.actor_gpus:g} GPU"] if o.actor_gpus else [])
        return ", ".join(parts + ([f"1 {o.resource!r}"] if o.resource else []))

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            log.error("ray.pool_failed", reason=reason)
            self._failure = reason
        asyncio.get_running_loop().create_task(self._notify())

    def _lost(self, sim: RayActorSim) -> None:
        """Drop a lost actor and place a new one in its stead."""
        log.warning("ray.actor_lost", actor=sim.name, node_id=sim.node_id)
        if sim in self._sims:
            self._sims.remove(sim)
        self._last_holder.pop(sim.name, None)
        sim.stop()
        self._place_new()

    async def take(
        self, prefer: Callable[[Any], int] | None = None, holder: object | None = None, urgent: bool = True
    ) -> tuple[RayActorSim, bool]:
        """Like SimPool.take; an actor whose node went away while it was idle is replaced, not handed out."""
        while True:
            sim = await self._next_free(prefer, urgent)
            if await sim.responsive():
                return sim, self._hand_to(sim, holder)
            self._lost(sim)

    def release(self, sim: RayActorSim) -> None:
        """Give an actor back (a lost one is replaced instead)."""
        if sim.alive():
            super().release(sim)
        else:
            self._lost(sim)

    def close(self) -> None:
        """End every actor, placed or still waiting to be."""
        for task in list(self._placing):
            task.cancel()
        for sim in [*self._sims, *self._unplaced]:
            sim.stop()
