"""Activity options shared by the workflows: timeouts and retry policies in one place."""

from datetime import timedelta

from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityCancellationType

# A control activity is one short transaction (or a few RPCs; also run as a local activity, see replica.py): one that has not finished in 10 s is retried,
# and a worker that died after its commit is noticed that soon (the retry returns the stored result).
CONTROL = dict(
    start_to_close_timeout=timedelta(seconds=10),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10)),
)
# The reconciler's `decide`: snapshot, planner, saving the explanations. A failure (a planner bug, the
# database away) is retried for as long as it takes, each attempt with a newer snapshot, at most 5 s apart
# (the reconciler is back within 5 s of Postgres). It heartbeats while it runs, so a worker that died in a
# pass is noticed in 10 s rather than at the 120 s timeout (issue 13: a pass that placed a replica and lost
# its completion is retried at once; the retry returns what it committed).
DECIDE = dict(
    start_to_close_timeout=timedelta(seconds=120),
    heartbeat_timeout=timedelta(seconds=10),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5)),
)
# A node that never picks up its work is down: give up on it rather than wait forever.
NODE_PICKUP = timedelta(seconds=60)
FETCH = dict(
    start_to_close_timeout=timedelta(hours=6),
    heartbeat_timeout=timedelta(seconds=60),
    schedule_to_start_timeout=NODE_PICKUP,
    retry_policy=RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=2)),
)
# Fetch then launch in one node activity (`start_shard`): a fetch's timeouts. A node whose worker predates
# it fails the attempt at once ("NotFoundError": not registered) and the start takes the two-step path.
START_SHARD = dict(FETCH, retry_policy=RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=2),
                                                   non_retryable_error_types=["NotFoundError"]))
# Fetching bounded by time, not attempts (issue 38; replica starts that ask `FETCH_BY_TIME`). Each boot of a node's
# worker ends the attempt its predecessor left (node/attempts.py), and Temporal counts that as an attempt:
# five agent restarts during one long download had failed the start. So attempts are not counted: the node
# fails a fetch for good once it has made no progress for `fetch_retry_s` (a transient error, node/activities.py;
# a permanent one at once), and the planner fails a start past its budget (`start_budget_s`, a profile's
# `start_timeout`), which cancels it.
# Retries at most 10 s apart: a restarted agent's attempt is retried soon however many came before.
FETCH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_interval=timedelta(seconds=10))
FETCH_TIMED = dict(FETCH, retry_policy=FETCH_RETRY)
START_SHARD_TIMED = dict(FETCH, retry_policy=RetryPolicy(initial_interval=timedelta(seconds=2),
                                                         maximum_interval=timedelta(seconds=10),
                                                         non_retryable_error_types=["NotFoundError"]))
# A short node activity (open a rendezvous, ask about a shard): the node answers at once or is down.
NODE_QUICK = dict(
    start_to_close_timeout=timedelta(seconds=30),
    schedule_to_start_timeout=NODE_PICKUP,
    retry_policy=RetryPolicy(maximum_attempts=3),
)
LAUNCH = dict(
    start_to_close_timeout=timedelta(seconds=120),
    schedule_to_start_timeout=NODE_PICKUP,
    retry_policy=RetryPolicy(maximum_attempts=3),
)
# Waking an engine (vLLM: 0.1-6 s; weights copied back to the GPUs): a node that does not answer in minutes
# has failed it, and the replica is stopped (workflows/sleep.py).
WAKE = dict(
    start_to_close_timeout=timedelta(seconds=300),
    schedule_to_start_timeout=timedelta(seconds=30),
    retry_policy=RetryPolicy(maximum_attempts=3, initial_interval=timedelta(seconds=1)),
)
STOP = dict(
    start_to_close_timeout=timedelta(seconds=120),
    schedule_to_start_timeout=timedelta(seconds=30),
    retry_policy=RetryPolicy(maximum_attempts=3),
)


# Waiting on a node for as long as an engine takes (readiness, a drain). An attempt ends without the engine
# having done anything wrong when its agent restarts (the new boot fails its predecessor's attempts:
# node/attempts.py) or when Temporal is away longer than the heartbeat timeout; each retry resumes the
# wait from its heartbeat (`waiting_s`, `draining_s`). So attempts are not counted: the whole wait is
# bounded instead (schedule-to-close), and the activity fails for good on its own deadline or when the
# engine exits. Two such interruptions had failed a healthy loading replica (maximum_attempts=2) and one
# had cut a drain short (maximum_attempts=1). A node that never picks an attempt up still fails it at
# NODE_PICKUP (a schedule-to-start timeout is not retried).
WAIT_MARGIN = timedelta(seconds=120)
WAIT_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5))


def ready(timeout_s: float, heartbeat_s: float = 30.0) -> dict:
    """A wait on a node: its heartbeat timeout (`heartbeat_s`, LLMGW_NODE_WAIT_HEARTBEAT_TIMEOUT_S) is how long
    an agent that died mid-wait holds it before the node's next worker takes it over."""
    return dict(
        start_to_close_timeout=timedelta(seconds=timeout_s),
        schedule_to_close_timeout=timedelta(seconds=timeout_s) + WAIT_MARGIN,
        heartbeat_timeout=timedelta(seconds=heartbeat_s),
        schedule_to_start_timeout=NODE_PICKUP,
        retry_policy=WAIT_RETRY,
    )


def drain(timeout_s: float, heartbeat_s: float = 30.0) -> dict:
    """As `ready`: a drain on a node that its next worker resumes after `heartbeat_s` unheard."""
    return dict(
        start_to_close_timeout=timedelta(seconds=timeout_s + 30),
        schedule_to_close_timeout=timedelta(seconds=timeout_s + 30) + WAIT_MARGIN,
        heartbeat_timeout=timedelta(seconds=heartbeat_s),
        schedule_to_start_timeout=timedelta(seconds=30),
        retry_policy=WAIT_RETRY,
    )


def await_close(timeout_s: float) -> dict:
    """Waiting for a workflow to close (a control activity that heartbeats while it polls)."""
    return dict(
        start_to_close_timeout=timedelta(seconds=timeout_s + 30),
        heartbeat_timeout=timedelta(seconds=10),
        retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10)),
    )


# Mirror activities (on the mirror's own queue). An origin that is down for a while is waited for:
# retries back off to a minute, for about twenty minutes, before the mirror is declared failed.
MIRROR_QUICK = dict(
    start_to_close_timeout=timedelta(minutes=5),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=60),
                             maximum_attempts=20),
)
MIRROR_PUBLISH = dict(
    start_to_close_timeout=timedelta(minutes=30),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5),
)


def mirror_fetch(heartbeat_timeout_s: float) -> dict:
    """One file: longer than one attempt's deadline (LLMGW_FETCH_DEADLINE_S, 12 h); a worker that dies is
    noticed after `heartbeat_timeout_s` and the file resumes on the next. A cancel waits for the fetch to
    stop before the staging directory is removed."""
    return dict(
        start_to_close_timeout=timedelta(hours=13),
        heartbeat_timeout=timedelta(seconds=heartbeat_timeout_s),
        retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=60),
                                 maximum_attempts=20),
        cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
    )


# A batch's round of requests (control/batch_activities.py): up to `RunBatchInput.limit` requests, however
# long the engines take; it heartbeats every 2 s, so a control worker that died is noticed in 10 s and the
# round is retried, sending only the requests whose answers are not committed. Retried for as long as it
# takes (the batch's window ends it: the activity itself returns `expired`).
BATCH_ROUND = dict(
    start_to_close_timeout=timedelta(hours=6),
    heartbeat_timeout=timedelta(seconds=10),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30)),
)
# Writing a batch's output and error files: one transaction, up to a whole file's size.
BATCH_FINISH = dict(
    start_to_close_timeout=timedelta(minutes=5),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30)),
)
