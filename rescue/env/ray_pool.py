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

A cluster that can never hold an actor (no node offers what it asks) stops the
study at once, saying what is missing; one that is only busy is waited for.
A terminal's Ctrl-C is the coordinator's: neither the one-machine cluster a run
starts nor the actors die of it, so the arms in flight can finish.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from typing import Any, Callable

import ray
import structlog
from ray.exceptions import RayActorError, RayError, RayTaskError

from rescue import __version__
from rescue.core.failfast import one_line
from rescue.core.configuration.names import resolve
from rescue.env.pool import SIM_HASH_SEED, SimPool, Simulator, SimulatorError

log = structlog.get_logger()

# Placing actors again after losing them: at most this many per simulator the study asked for.
MAX_PLACEMENTS_PER_SIMULATOR = 10
# An actor that died before it ran (its node died, and the cluster did not know yet) is placed
# again after a pause that doubles each time, up to this, so a dead node is not tried in a loop.
MAX_PLACEMENT_PAUSE_S = 30.0
# An actor not yet placed after this long, with no room free for it, is what the run waits for (said once).
WAITING_NOTICE_S = 5.0
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
        # A cluster for this run alone: this machine's CPUs, and the simulator resource for the pool. "local":
        # a new one even when another runs on this machine or RAY_ADDRESS names one (ray.init() would join it).
        kwargs["address"] = "local"
        if options.resource:
            kwargs["resources"] = {options.resource: simulators}
    else:
        kwargs["address"] = options.address
        kwargs.pop("include_dashboard")
        _check_reachable(options.address)
    try:
        if options.address is None:
            _start_here(kwargs)
        else:
            ray.init(**kwargs)
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError or ValueError for a bad address
        where = "start a one-machine Ray cluster" if options.address is None else f"join the Ray cluster at {options.address}"
        raise ClusterUnreachable(f"cannot {where}: {one_line(str(exc))}") from None
    _started_here = options.address is None
    log.info("ray.connected", address=options.address, started_here=_started_here)


def _start_here(kwargs: dict[str, Any]) -> None:
    """ray.init starting a one-machine cluster whose processes do not die of a terminal's Ctrl-C.

    Ctrl-C sends SIGINT to the whole foreground process group, and the GCS, the raylet and
    their agents start in the run's group. Each inherits this thread's signal mask, so they
    start with SIGINT blocked and outlive it while the arms in flight finish; the run stops
    them itself (ray.shutdown). Ray blocks it in the processes it spawns too; this does not
    rely on that. A Ctrl-C meanwhile waits until ray.init returns, then interrupts the run.
    """
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        ray.init(**kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


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


def asks(options: Any) -> dict[str, float]:
    """What each simulator actor asks of its node, by Ray resource name (options: a Backend)."""
    wanted = {"CPU": options.actor_cpus, "GPU": options.actor_gpus, **({options.resource: 1.0} if options.resource else {})}
    return {name: float(amount) for name, amount in wanted.items() if amount > 0}


def amounts(resources: dict[str, float], names: Any = None) -> str:
    """A resource dict as `1 CPU, 1 'simulator'` (only `names`, in their order, when given)."""
    names = list(resources) if names is None else list(names)
    return ", ".join(f"{resources.get(n, 0.0):g} {n if n in ('CPU', 'GPU') else repr(n)}" for n in names)


def never_fits(wanted: dict[str, float], nodes: list[dict[str, float]]) -> str | None:
    """Why no node can ever hold a simulator actor asking `wanted`, in one line; None when some node can.

    `nodes`: the total resources of each live node. What is free does not matter here: a busy
    node frees its resources, a node without them never has them."""
    if any(all(node.get(name, 0.0) >= amount for name, amount in wanted.items()) for node in nodes):
        return None
    if not nodes:
        return "the cluster has no live node"
    short = []
    for name, amount in wanted.items():
        most = max(node.get(name, 0.0) for node in nodes)
        if most >= amount:
            continue
        if name in ("CPU", "GPU"):
            flag = f"--ray-actor-{name.lower()}s"
            has = f"no node has a {name}" if most == 0 else f"the largest node has {most:g}"
            short.append(f"each simulator actor asks {amount:g} {name} and {has} ({flag})")
        elif most == 0:
            short.append(f"no node offers the custom resource {name!r}: start the simulator nodes with "
                         f"`ray start --resources '{{\"{name}\": N}}'` (N simulators each), "
                         "or ask for none with --ray-resource ''")
        else:
            short.append(f"each simulator actor asks {amount:g} {name!r} and no node has more than {most:g}")
    if not short:  # each resource is somewhere, never all on one node
        short.append(f"no node offers all that each simulator actor asks ({amounts(wanted)}) at once; the nodes have "
                     + "; ".join(amounts(node, wanted) for node in nodes[:4]) + ("; ..." if len(nodes) > 4 else ""))
    return "; ".join(short)


def _node_totals() -> list[dict[str, float]]:
    return [dict(node.get("Resources") or {}) for node in ray.nodes() if node.get("Alive")]


class SimulatorActor:
    """One simulator in a Ray actor process; it answers `where` before it builds (`build`) its simulator,
    so that the coordinator tells waiting for a node from building a scene."""

    def __init__(self, adapter_spec: str, adapter_kwargs: dict):
        # The run's Ctrl-C is the coordinator's (it drains, then ends the actors itself). Ray starts
        # workers in process groups of their own with SIGINT blocked; an actor that shares a
        # terminal's group all the same, or is sent SIGINT, must not die of it either.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        self._spec, self._kwargs = adapter_spec, adapter_kwargs
        self.adapter: Any = None

    @ray.method(max_task_retries=0, retry_exceptions=False)
    def build(self) -> None:
        """Build the simulator (the adapter), once."""
        if self.adapter is None:
            self.adapter = resolve(self._spec)(**self._kwargs)

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

    def placed(self) -> asyncio.Future:
        """The actor's `where` (a dict), once a node runs it: the actor holds its resources from then on."""
        return asyncio.ensure_future(_awaited(self._handle.where.remote()))

    def at(self, info: dict[str, Any]) -> None:
        """Note where the placed actor runs."""
        self.node_id = info["node_id"]

    async def build(self) -> None:
        """Build the simulator in the placed actor (SimulatorError when the adapter cannot be built)."""
        await self._remote("build", self._handle.build.remote())

    async def _remote(self, method: str, ref: Any) -> Any:
        try:
            return await ref
        except RayTaskError as exc:  # the adapter raised: the simulator is fine, the call failed
            raise SimulatorError(f"{self.name}.{method} failed:\n{exc}") from None
        except (RayActorError, RayError) as exc:  # the actor, its process or its node is gone
            self._dead = True
            raise WorkerLost(
                f"simulator actor {self.name} on node {self.node_id} was lost during {method} ({one_line(str(exc))})"
            ) from None

    async def _invoke(self, method: str, *args: Any) -> Any:
        payload = await self._remote(method, self._handle.call.remote(method, args))
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
        self._unplaced: dict[RayActorSim, float] = {}  # created, not yet running: since when (monotonic)
        self._watching: asyncio.Task | None = None
        self._ever_placed = False  # until then, a cluster that cannot hold an actor stops the study at once
        self._asks = asks(options)
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
        self._unplaced[sim] = time.monotonic()
        self._watch()
        try:
            while True:
                placed = sim.placed()
                try:
                    info = await asyncio.wait_for(placed, timeout)
                    break
                except asyncio.TimeoutError:
                    if not any(s.alive() for s in self._sims):
                        self._fail(f"no simulator actor could be placed within {timeout:g} s on "
                                   f"{self._options.describe()}; each asks for {amounts(self._asks)}")
                        return
                    # Others run: this one is spare capacity and may wait for a node to join.
        except RayActorError as exc:
            if getattr(exc, "actor_init_failed", False):
                self._fail(f"a simulator actor failed to start: {one_line(str(exc))}")
            else:
                self._lost_before_start(sim, exc)
            return
        except RayError as exc:
            self._fail(f"a simulator actor could not be placed: {one_line(str(exc))}")
            return
        finally:
            self._unplaced.pop(sim, None)
        sim.at(info)
        if info["rescue"] != __version__:
            sim.stop()
            self._fail(f"node {info['node_id']} runs rescue {info['rescue']}, this coordinator {__version__}; "
                       "install the same version on every node")
            return
        try:
            await sim.build()
        except WorkerLost as exc:
            self._lost_before_start(sim, exc)
            return
        except SimulatorError as exc:
            sim.stop()
            self._fail(f"a simulator actor failed to start on node {info['node_id']}: {one_line(str(exc))}")
            return
        log.info("ray.actor_placed", actor=sim.name, node_id=info["node_id"], pid=info["pid"])
        self._ever_placed = True
        self._sims.append(sim)
        self._free.append(sim)
        await self._notify()

    def _lost_before_start(self, sim: RayActorSim, exc: Exception) -> None:
        log.warning("ray.actor_lost_before_start", actor=sim.name, error=one_line(str(exc)), retry_in_s=self._pause)
        sim.stop()
        self._place_new(after_s=self._pause)
        self._pause = min(2 * self._pause, MAX_PLACEMENT_PAUSE_S)

    def _watch(self) -> None:
        if self._watching is None or self._watching.done():
            self._watching = asyncio.get_running_loop().create_task(self._watch_room())

    async def _watch_room(self) -> None:
        """While actors wait for a node: stop the study at once when no node can ever hold one (before
        the first is placed), and say once what they wait for when the nodes that could are busy.

        Once an actor has run, a cluster that lost every node able to hold one is waited for (the
        nodes may come back) up to the placement timeout."""
        told = False
        while self._unplaced and self._failure is None:
            if not self._ever_placed:
                missing = never_fits(self._asks, _node_totals())
                if missing is not None:
                    self._fail(f"no simulator actor can be placed on {self._options.describe()}: {missing}")
                    return
            waited = time.monotonic() - min(self._unplaced.values(), default=time.monotonic())
            if not told and waited >= WAITING_NOTICE_S:
                free = ray.available_resources()
                if not all(free.get(name, 0.0) >= amount for name, amount in self._asks.items()):
                    told = True
                    log.warning("ray.waiting_for_room", actors=len(self._unplaced), each_asks=amounts(self._asks),
                                free=amounts(free, self._asks), of=amounts(ray.cluster_resources(), self._asks),
                                gives_up_after_s=self._options.placement_timeout_s)
            await asyncio.sleep(1.0)

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            log.info("ray.pool_failed", reason=reason)  # the engine stops the study with it, and says so
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
        self, prefer: Callable[[Any], Any] | None = None, holder: object | None = None, urgent: bool = True
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
        for task in [*self._placing, *([self._watching] if self._watching else [])]:
            task.cancel()
        for sim in [*self._sims, *self._unplaced]:
            sim.stop()
