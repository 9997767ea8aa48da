"""`ReconcilerWorkflow`: the singleton loop that makes what runs match the catalog.

Each pass runs the `decide` activity (snapshot, pure planner, decisions saved for `llmgw ctl explain`;
`control/decide.py`) and acts on the actions it returns by starting child workflows (replica start/stop,
abandoned on close so they outlive a continue-as-new): each `place` action's replica, already created by
`decide` in the transaction that decided it (issue 13: one step less between a request and its load),
is started (by `decide` itself once it committed, with no workflow task of this one in between; the pass
starts only those `decide` could not); `stop` and `evict` drain then stop one; `lost` and `cleanup` stop every shard
of one that cannot serve; `sleep` and `wake` start its sleep or wake workflow (issue 39), a wake only when
`decide` has not started it itself (its id in `DecideResult.started`, as for a placement: data from the
activity, so a pass recorded before `decide` started wakes replays as it ran, starting the child). A pass that
stopped short (`more`) is followed by another at once; otherwise the next waits for the `wake` signal
(catalog changed, node registered, demand, replica failed or stopped) or the timer (`interval_s`, read from
settings each pass). After every pass, back-to-back ones included, the run continues as new when Temporal
suggests it or after `MAX_PASSES` passes, to keep its history short.

Runs started before `decide` existed planned inside workflow code (`_legacy_pass`), and moved to `decide`
at their first live pass (patch `decide-in-activity/<pass>`). That branch is gone (issue 38): every run
open now asked the patch at its first pass, which `workflow.deprecate_patch` still answers on replay
(workflows/patches.py has when it may go entirely; docs/architecture.md, "Changing workflow code"). So
did the pass's issue-13 patches (`decide` records, then starts, what it places).

Every child carries a memo (model, profile) and, when the namespace has them registered (the pass says),
llmgw's search attributes (workflows/attributes.py); neither is part of what replay compares.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from llmgw.schemas.payloads import (
        DecideInput, DecideResult, PassAction, ReconcilerInput, ReplicaSleepInput, ReplicaStartInput, ReplicaStopInput,
        ReplicaWakeInput, RolloutInput,
    )
    from llmgw.workflows import activities, attributes, options
    from llmgw.workflows.queues import CONTROL_QUEUE
    from llmgw.workflows.ids import replica_sleep_id, replica_start_id, replica_stop_id, replica_wake_id, rollout_id
    from llmgw.workflows.replica import ReplicaStartWorkflow, ReplicaStopWorkflow
    from llmgw.workflows.sleep import ReplicaSleepWorkflow, ReplicaWakeWorkflow
    from llmgw.workflows.rollout import RolloutWorkflow
    # workflow.patched ids, each registered with the version that added it and when it may go (patches.py)
    from llmgw.workflows.patches import DECIDE_IN_ACTIVITY as DECIDE_PATCH
    from llmgw.workflows.patches import DECIDE_PLACES as DECIDE_PLACES_PATCH
    from llmgw.workflows.patches import DECIDE_STARTS as DECIDE_STARTS_PATCH

MAX_PASSES = 100  # patches.py counts on it: a reconciler patch may be retired one release after it came


def _abandoned(handle):
    """A child this workflow starts and never awaits (abandoned on close): its outcome is collected, so a
    failed start is not logged as "exception was never retrieved" (its failure is recorded by the child
    itself). Collecting it issues no command: replay is unchanged."""
    handle.add_done_callback(_collect)
    return handle


def _collect(task) -> None:
    if not task.cancelled():
        task.exception()


@workflow.defn(name="ReconcilerWorkflow")
class ReconcilerWorkflow:
    def __init__(self) -> None:
        self._wakes: list[str] = []
        self._last: list[str] = []
        self._search_attributes = False  # the namespace has llmgw's search attributes (from the latest pass)

    @workflow.signal
    def wake(self, reason: str) -> None:
        self._wakes.append(reason)

    @workflow.query
    def last_pass(self) -> list[str]:
        """The last pass's decisions that were not `keep`, one line each."""
        return self._last

    @workflow.run
    async def run(self, inp: ReconcilerInput) -> None:
        passes = 0
        while True:
            self._wakes.clear()
            if passes == 0:
                # Runs recorded before issue 38 asked this at their first pass (patches.py: deprecated).
                workflow.deprecate_patch(f"{DECIDE_PATCH}/0")
            res = await self._pass(inp.passes + passes, first=passes == 0)
            passes += 1
            if passes >= MAX_PASSES or workflow.info().is_continue_as_new_suggested():
                break
            if res.more:
                continue
            try:
                await workflow.wait_condition(lambda: bool(self._wakes), timeout=timedelta(seconds=res.interval_s))
            except TimeoutError:
                pass
            if workflow.info().is_continue_as_new_suggested() or passes >= MAX_PASSES:
                break
        workflow.continue_as_new(inp.model_copy(update={"passes": inp.passes + passes}))

    async def _pass(self, pass_no: int, first: bool = False) -> DecideResult:
        if first:
            # Runs recorded before issue 38 asked these at their first pass, numbered by the passes of the
            # runs before them (patches.py: deprecated); `decide` records and starts what it places.
            workflow.deprecate_patch(f"{DECIDE_PLACES_PATCH}/{pass_no}")
            workflow.deprecate_patch(f"{DECIDE_STARTS_PATCH}/{pass_no}")
        res = await workflow.execute_activity(
            activities.decide, DecideInput(passes=pass_no, record_placements=True, start_replicas=True),
            task_queue=CONTROL_QUEUE, **options.DECIDE,
        )
        self._last = res.lines
        self._search_attributes = res.search_attributes
        await asyncio.gather(*[self._carry_out(a, res) for a in res.actions])
        return res

    async def _carry_out(self, a: PassAction, res: DecideResult) -> None:
        if a.kind == "rollout":
            await self._rollout(a.model)
        elif a.kind == "sleep":
            await self._lifecycle(ReplicaSleepWorkflow.run, ReplicaSleepInput(
                replica_id=a.replica_id, model=a.model, reason=a.reason, drain_timeout_s=res.drain_timeout_s),
                replica_sleep_id(a.replica_id), "sleep", a)
        elif a.kind == "wake":
            if a.replica_id in res.started:
                return  # `decide` started it (issue 39); passes before it did not, and replay as they ran
            await self._lifecycle(ReplicaWakeWorkflow.run, ReplicaWakeInput(replica_id=a.replica_id, model=a.model,
                                                                            reason=a.reason),
                                  replica_wake_id(a.replica_id), "wake", a)
        elif a.kind == "place":
            assert a.profile_spec is not None
            if a.replica_id in res.started:
                return  # `decide` started it
            await self._start_replica(a.replica_id, a.model, a.profile or "default", a.profile_spec, a.shards,
                                      res.ready_timeout_s, a.sleep_mode, res.wait_heartbeat_timeout_s)
        else:
            await self._start_stop(a.replica_id, ReplicaStopInput(
                replica_id=a.replica_id, reason=a.reason, drain_timeout_s=res.drain_timeout_s if a.drain else 0,
                final_status=a.final_status, wait_heartbeat_timeout_s=res.wait_heartbeat_timeout_s),
                a.model, a.profile, a.nodes)

    async def _start_replica(self, replica_id: str, model: str, profile: str, spec, shards, ready_timeout_s: float,
                             sleep_mode: bool = False, wait_heartbeat_timeout_s: float = 30.0) -> None:
        try:
            await self._start_child(replica_id, model, profile, spec, shards, ready_timeout_s, sleep_mode,
                                    wait_heartbeat_timeout_s)
        except WorkflowAlreadyStartedError:
            pass  # `decide` started it, though it could not tell (its RPC failed after the server took it)

    async def _start_child(self, replica_id: str, model: str, profile: str, spec, shards, ready_timeout_s: float,
                           sleep_mode: bool = False, wait_heartbeat_timeout_s: float = 30.0) -> None:
        _abandoned(await workflow.start_child_workflow(
            ReplicaStartWorkflow.run,
            ReplicaStartInput(replica_id=replica_id, model=model, profile=spec, shards=shards,
                              ready_timeout_s=ready_timeout_s, sleep_mode=sleep_mode,
                              wait_heartbeat_timeout_s=wait_heartbeat_timeout_s),
            id=replica_start_id(replica_id), task_queue=CONTROL_QUEUE,
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            memo=attributes.memo(model, profile),
            search_attributes=attributes.lifecycle("start", model, replica_id, [s.node_id for s in shards])
            if self._search_attributes else None,
        ))

    async def _start_stop(self, replica_id: str, inp: ReplicaStopInput, model: str, profile: str | None,
                          nodes: list[str]) -> None:
        try:
            _abandoned(await workflow.start_child_workflow(
                ReplicaStopWorkflow.run, inp, id=replica_stop_id(replica_id), task_queue=CONTROL_QUEUE,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                memo=attributes.memo(model, profile),
                search_attributes=attributes.lifecycle("stop", model, replica_id, nodes or None)
                if self._search_attributes else None,
            ))
        except WorkflowAlreadyStartedError:
            pass  # already stopping

    async def _lifecycle(self, run, inp, workflow_id: str, kind: str, a: PassAction) -> None:
        """Start a replica's sleep or wake workflow, abandoned. One already running (a pass before this one
        decided the same) is left to finish; a closed one's id is reused (a replica sleeps many times)."""
        try:
            _abandoned(await workflow.start_child_workflow(
                run, inp, id=workflow_id, task_queue=CONTROL_QUEUE,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                memo=attributes.memo(a.model, a.profile),
                search_attributes=attributes.lifecycle(kind, a.model, a.replica_id, a.nodes or None)
                if self._search_attributes else None,
            ))
        except WorkflowAlreadyStartedError:
            pass

    async def _rollout(self, model: str) -> None:
        """Make sure the model's `RolloutWorkflow` runs (one per model: a second start is refused)."""
        try:
            _abandoned(await workflow.start_child_workflow(
                RolloutWorkflow.run, RolloutInput(model=model), id=rollout_id(model), task_queue=CONTROL_QUEUE,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON, memo=attributes.memo(model),
                search_attributes=attributes.lifecycle("rollout", model) if self._search_attributes else None,
            ))
        except WorkflowAlreadyStartedError:
            pass
