"""Failures an activity expects (a weight that is not there, a source that is not a model, an engine that
exited at start): one log line each, not a traceback.

Temporal's worker logs every failed activity as a warning with its traceback. For a failure our own code
raised on purpose, with a message that already says what is wrong (`HTTP 404 (no such file)`), that
traceback only buries the line in frames of our code. An `ApplicationError` of category BENIGN is logged
by the worker at DEBUG instead (and counts in no failure metric of the SDK); this logs the one line an
operator reads, once per attempt, in the node's or the mirror's log. The workflow sees the same failure
(type, message, retryable or not) as before: only its logging differs.
"""

from __future__ import annotations

import logging

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

log = logging.getLogger(__name__)


def expected_failure(message: str, type: str, retryable: bool) -> ApplicationError:
    """The `ApplicationError` to raise for an expected failure, logged here as one warning line."""
    info = activity.info() if activity.in_activity() else None
    where = f"{info.activity_type} of {info.workflow_id} (attempt {info.attempt})" if info else "activity"
    first = message.strip().splitlines()[0] if message.strip() else message  # the rest is in `llmgw ctl logs`
    log.warning("%s failed%s: %s", where, "" if retryable else ", not retried", first)
    return ApplicationError(message, type=type, non_retryable=not retryable, category=ApplicationErrorCategory.BENIGN)
