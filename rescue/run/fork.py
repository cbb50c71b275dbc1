"""The fork at q: one common prefix, a snapshot at each query point, every other arm finished from it.

The leader (the control arm) runs the prefix; each follower (each assisted arm, the sham, every
continuation) restores the leader's snapshot on a simulator of its own and goes on from there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from rescue.core.actions import checked_chunk
from rescue.core.arms import continuation, continuation_seed
from rescue.core.digest import digest_array
from rescue.core.images import VLM_VIEWS, view_digests
from rescue.core.manifest import Case
from rescue.core.records import ArmResult, Assistance
from rescue.core.triggers import fires
from rescue.env.pool import SimLease, Simulator
from rescue.policy.protocol import PolicyConnection
from rescue.run.arm import Advisor, ArmRun, ArmSpec, query_policy


@dataclass
class Follower:
    """An arm that continues from the snapshot at q: how it runs (its spec, q included: it forks at its own q),
    how it gets a simulator and its own policy connection at q, and who answers it there (None: a continuation
    of the control arm)."""

    spec: ArmSpec
    simulator: Callable[[], Awaitable[Simulator]]
    connect: Callable[[], Awaitable[PolicyConnection]]
    advisor: Advisor | None = None
    # Who answers its later calls (DESIGN §18), each a call of its own; None: `advisor`.
    again: Advisor | None = None


@dataclass
class ForkPoint:
    """The leader at one fork step: its state digest, its snapshot and its render of the VLM views there."""

    state: str | None
    snapshot: Any
    render: dict[str, str]


class Fork:
    """One forked case in progress: the leader (`ctrl`), its followers (`runs`) and those already started.

    Followers take their simulator and connection only at q, and the control arm gives its own back
    when done (`control_done`), so forked cases never wait on each other for simulators.
    """

    def __init__(self, case: Case, spec: ArmSpec, control: tuple[Simulator, PolicyConnection],
                 followers: list[Follower], control_done: Callable[[], None], replay: bool,
                 on_result: Callable[[ArmResult], None], probe: Callable[[], Awaitable[PolicyConnection]] | None = None):
        self.case, self.replay = case, replay
        self.control_done, self.on_result = control_done, on_result
        self.ctrl = ArmRun(case, spec, *control)
        self.runs = [(ArmRun(case, f.spec, None, None, f.advisor, f.again), f) for f in followers]
        self.started: dict[ArmRun, asyncio.Task] = {}
        # The triggers the followers ask by (DESIGN §18): the leader then decides at every query step which fire.
        self.triggers = {f.spec.trigger.name: f.spec.trigger for f in followers if f.spec.trigger is not None}
        self.probe = probe
        self.ctrl.keep_all_queries = bool(self.triggers)

    async def run(self) -> list[ArmResult]:
        """Run the prefix, fork at every q, finish every arm; the leader first, then the followers in order."""
        try:
            await self.run_prefix()
        except Exception as exc:
            return await self.fail_prefix(exc)
        leader = await self.heard(self.finish_control())
        return await self.results(leader)

    async def run_prefix(self) -> None:
        """Lead to each q in turn, snapshot there, and start the followers that fork at it."""
        ctrl = self.ctrl
        await ctrl.start()
        if self.triggers:
            await self.watch_prefix()
            return
        for q in sorted({run.q for run, _ in self.runs} | {ctrl.q}):
            await ctrl.run_until(q)
            await self.fork_at(q, [run for run, _ in self.runs if run.q == q])

    async def watch_prefix(self) -> None:
        """The prefix with triggers (DESIGN §18): query by query, deciding before each query which triggers fire on
        what the leader has shown so far; a trigger's followers fork at the step it first fires at, a fixed q's at
        theirs. A trigger that never fires leaves its followers equal to the leader: not asked, no call."""
        ctrl = self.ctrl
        if self.probe is not None and ctrl.spec.probe_samples:
            await ctrl.start_probe(await self.probe())
        fixed = {run.q for run, f in self.runs if f.spec.trigger is None} | {ctrl.q}
        fired: dict[str, int] = {}
        while not ctrl.done and ctrl.step < ctrl.horizon:
            step = ctrl.step
            now = await ctrl.observe_now()
            rows = [*ctrl.query_records, *([now] if now is not None else [])]
            for name, trigger in self.triggers.items():
                if name not in fired and fires(trigger, rows, step, self.case.case_id, ctrl.horizon, ctrl.interval,
                                               triggers=ctrl.spec.triggers):
                    fired[name] = step
            starting = []
            for run, follower in self.runs:
                trigger = follower.spec.trigger
                if run not in self.started and (run.q == step if trigger is None else fired.get(trigger.name) == step):
                    run.q = step
                    starting.append(run)
            if step in fixed or starting:
                await self.fork_at(step, starting)
            await ctrl.run_until(step + ctrl.interval)
        ctrl.trigger_steps = {name: fired.get(name) for name in self.triggers}
        rest = [run for run, _ in self.runs if run not in self.started]
        for run in rest:
            if run.spec.trigger is not None:
                run.assistance = Assistance(status="not_asked")
        await self.fork_at(ctrl.horizon, rest)

    async def fork_at(self, q: int, runs: list[ArmRun]) -> None:
        """Snapshot the leader at q (unless it ended before) and start the followers that fork there."""
        ctrl = self.ctrl
        point = None
        if not ctrl.done:
            point = ForkPoint(state=await ctrl._state_digest(), snapshot=await ctrl.sim.snapshot(),
                              render=view_digests(await ctrl.sim.render(list(VLM_VIEWS), ctrl.spec.image_size)))
            if q == ctrl.q:
                ctrl.q_state, ctrl.q_render = point.state, point.render
            else:
                ctrl.fork_points[q] = (point.state, point.render)
        # The followers of this q start now; one whose q the leader never reached (it ended first) ends with it.
        for run, follower in self.runs:
            if run in runs:
                self.start_at(run)
                self.started[run] = asyncio.ensure_future(self.heard(self.finish(run, follower, point)))

    async def fail_prefix(self, exc: Exception) -> list[ArmResult]:
        """The prefix is shared: its failure is the failure of every arm that had not forked yet."""
        self.control_done()
        failed: dict[ArmRun, ArmResult] = {}
        for run, _ in self.runs:
            if run not in self.started:
                self.start_at(run)
                failed[run] = run.result(exc, "fork")
                self.on_result(failed[run])
        leader = self.ctrl.result(exc, "fork")
        self.on_result(leader)
        return await self.results(leader, failed)

    async def results(self, leader: ArmResult, known: dict[ArmRun, ArmResult] | None = None) -> list[ArmResult]:
        """The leader's result, then each follower's in order, once every started follower has ended."""
        by_run = dict(known or {})
        by_run.update(zip(self.started, await asyncio.gather(*self.started.values())))
        return [leader, *(by_run[run] for run, _ in self.runs)]

    def start_at(self, run: ArmRun) -> None:
        """A follower starts where the shared prefix stands now (copied before the leader goes on)."""
        ctrl = self.ctrl
        run.fingerprint, run.fingerprint_parts = ctrl.fingerprint, ctrl.fingerprint_parts
        run.python_hash_seed, run.action_space = ctrl.python_hash_seed, ctrl.action_space
        run.trace, run.step, run.obs = list(ctrl.trace), ctrl.step, ctrl.obs
        run.query_records, run.queries = list(ctrl.query_records), list(ctrl.queries)
        run.original = run.instruction = ctrl.original
        run.success = run.done = ctrl.done and ctrl.success
        run.object_pos = ctrl.object_pos

    async def replay_prefix(self, run: ArmRun, queries: list[tuple[int, dict]]) -> None:
        """Send the prefix's queries again on the follower's connection; each must give the leader's chunk."""
        interval = run.interval
        for (step, policy_input), row in zip(queries, run.trace):
            reply = await query_policy(run.policy, policy_input, step, run.firings)
            chunk = run.spec.protocol.executed(checked_chunk(
                reply, interval=interval, due=min(interval, run.horizon - step), space=self.ctrl.action_space,
                policy=getattr(run.policy, "url", type(run.policy).__name__), step=step))
            if digest_array(chunk) != row.actions:
                raise RuntimeError(f"fork replay: the policy answered step {step} differently (not deterministic under its seed)")

    async def finish(self, run: ArmRun, follower: Follower, point: ForkPoint | None) -> ArmResult:
        """A follower from q to its end: its own connection (replayed, reseeded), the snapshot restored, run on."""
        if run.assistance.status == "not_asked":
            # Its trigger never fired: the leader's episode is its own, with no connection and no call.
            run.rng_control = self.ctrl.rng_control
            return run.result(mode="fork")
        try:
            run.attach(await follower.connect())
            await run.start_policy()
            run.prefix_replayed = self.replay
            if self.replay:
                await self.replay_prefix(run, run.queries)
            k = continuation(run.spec.arm)
            if k > 1 and run.rng_control:
                # Each continuation its own draws, the same for every arm's k-th (paired across arms).
                run.continuation_seed = continuation_seed(self.case.policy_seed, k)
                await run.policy.reset_rng(run.continuation_seed)
            if run.spec.probe_samples:
                await run.start_probe(await follower.connect())
            if point is not None:
                run.sim = await follower.simulator()
                try:
                    await self.restore(run, point)
                    await run.run_until(run.horizon)
                finally:
                    # A follower done with its simulator gives it back at once, not when its case ends:
                    # held until then, two cases' finished followers can starve each other's waiting ones.
                    if isinstance(run.sim, SimLease):
                        run.sim.release()
        except Exception as exc:
            return run.result(exc, "fork")
        await run.end_policy(run.success)
        return run.result(mode="fork")

    @staticmethod
    async def restore(run: ArmRun, point: ForkPoint) -> None:
        """Restore the leader's snapshot on the follower's simulator; its state and first render must be the leader's."""
        await run.sim.restore(point.snapshot)
        run.q_state = await run._state_digest()
        if run.q_state != point.state:
            raise RuntimeError(f"fork: the restored simulator state differs from the state at step {run.q}")
        # The renderer's side too: the follower's first render of the state at q must be the
        # leader's, pixel for pixel (a stale render state would pass the state digest).
        run.q_views = await run.sim.render(list(VLM_VIEWS), run.spec.image_size)
        run.q_render = view_digests(run.q_views)
        differ = sorted(c for c in run.q_render if run.q_render[c] != point.render.get(c))
        if differ:
            raise RuntimeError(f"fork: the restored simulator renders {', '.join(differ)} otherwise than the "
                               f"leader did at step {run.q}")

    async def heard(self, arm: Awaitable[ArmResult]) -> ArmResult:
        """Await an arm and tell `on_result` as soon as it ends."""
        result = await arm
        self.on_result(result)
        return result

    async def finish_control(self) -> ArmResult:
        """The leader from its last fork point to its end; it gives its simulator back when done."""
        ctrl = self.ctrl
        try:
            await ctrl.run_until(ctrl.horizon)
        except Exception as exc:
            return ctrl.result(exc, "fork")
        finally:
            self.control_done()
        await ctrl.end_policy(ctrl.success)
        return ctrl.result(mode="fork")


async def run_forked(
    case: Case,
    spec: ArmSpec,
    control: tuple[Simulator, PolicyConnection],
    followers: list[Follower],
    control_done: Callable[[], None] = lambda: None,
    replay: bool = True,
    on_result: Callable[[ArmResult], None] = lambda result: None,
    probe: Callable[[], Awaitable[PolicyConnection]] | None = None,
) -> list[ArmResult]:
    """Fork at q: run the common prefix once (the control arm, as `spec` says), snapshot the simulator at q, finish
    every arm from it.

    The prefix's trace is every arm's prefix. Each follower (each assisted arm, the sham, every continuation)
    restores the snapshot on a simulator of its own (its state digest and first render must equal the leader's
    at q) and queries the policy on a fresh connection. With `replay` (a server with RNG control) the connection
    first replays the prefix's queries, which must give the same action chunks: the policy then stands where the
    leader's does, its RNG included; a continuation k >= 2 then reseeds it (`continuation_seed`). Without it (a
    stateless policy whose server gives no RNG control, DESIGN §13) the follower continues at once: what the
    policy answers from q on is a fresh draw. A follower of a declared extra query point (DESIGN §14) forks at its
    own q: the leader snapshots at each of them as it passes, and the follower starts from that snapshot as soon
    as it is taken. A trigger's follower (DESIGN §18) forks where its trigger first fires on the leader's queries,
    decided before each of them; `probe` gives the leader the connection an uncertainty trigger draws from.
    Results: the leader (control) first, then the followers in order; `on_result` hears each as soon as its arm
    ends.
    """
    return await Fork(case, spec, control, followers, control_done, replay, on_result, probe).run()
