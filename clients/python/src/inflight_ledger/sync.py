"""The synchronous client: ``Ledger``."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from types import TracebackType
from typing import Any, Callable, Iterable, List, Mapping, Optional, Tuple, Type, TypeVar, Union, cast

import httpx

from ._common import (
    CONNECTIONS,
    WAIT_CODES,
    Attributed,
    Config,
    IgnoredFieldsLog,
    Instead,
    Lifecycle,
    Usage,
    UsageExtractor,
    UsageReport,
    begin_anew,
    build_spec,
    call_hook,
    cancel_reason,
    checked_wait_step,
    default_ledger_error,
    failure_stage_for,
    has_ended,
    in_line,
    is_abort,
    key_for,
    no_wait_left,
    now_ms,
    pause_before_asking,
    read_answer,
    retry_after_of,
    retryable,
    settle_body,
    traceparent_header,
    unavailable,
    usage_of,
    wait_cancelled,
    wait_param,
    wait_timeout,
    wire_time,
)
from ._trace import traceparent_for
from .errors import InflightError, WaitCancelledError
from .wire import ROUTES, ActivityRecord, FailureStage, Owner, ReapCounts, RefineRequest, Snapshot

LedgerErrorHook = Callable[[BaseException, ActivityRecord], None]
F = TypeVar("F", bound=Callable[..., Any])


class Ledger(Attributed):
    """A client of one inflight server.

    ``with ledger.activity(service="kb", provider="ollama") as call:`` begins
    a record, waits in line until admitted, starts it, and settles it by how
    the block exits: normally, success; by an exception, failure; by
    ``KeyboardInterrupt`` (or any other ``BaseException``), ``cancelled``.
    The block's value is the record's ``Activity``: ``call.refine(model)``
    names the model once the call is dispatched, ``call.report_usage(...)``
    (or ``call.report_usage_of(answer)``) the tokens the settle carries.
    """

    def __init__(
        self,
        base_url: Optional[str] = None,
        *,
        token: Optional[str] = None,
        ca_file: Optional[str] = None,
        ca: Optional[str] = None,
        timeout: float = 10.0,
        retries: int = 3,
        backoff: float = 0.1,
        max_backoff: float = 2.0,
        lifecycle: Optional[Lifecycle] = None,
        on_ledger_error: Optional[LedgerErrorHook] = None,
        transport: Optional[httpx.BaseTransport] = None,
        propagate_trace: bool = True,
    ) -> None:
        """``base_url`` defaults to ``INFLIGHT_URL``, else ``http://127.0.0.1:7878``;
        ``token`` to ``INFLIGHT_TOKEN``. ``ca_file``: a PEM file of the
        certificate authorities to trust for an ``https://`` server, instead of
        the default roots (default ``INFLIGHT_CA_FILE``); ``ca``: the same as
        PEM text. ``timeout`` is per request (plus its ``?wait=``); ``retries``
        apply to idempotent requests only (a begin is one: it carries an
        ``Idempotency-Key``). ``propagate_trace``: whether a begin given no
        ``traceparent`` sends the current OpenTelemetry span's (when
        ``opentelemetry-api`` is installed and a valid span is current);
        ``False`` sends only one given explicitly."""
        self.config = Config.make(base_url, token, timeout, retries, backoff, max_backoff, ca_file, ca)
        self.propagate_trace = propagate_trace
        self.lifecycle = lifecycle
        self.on_ledger_error = on_ledger_error or default_ledger_error
        #: The owner whose id tags the records this client begins, if any.
        self.owner_id: Optional[str] = None
        self._ignored_fields = IgnoredFieldsLog()
        self._init_attribution()
        self._http = httpx.Client(transport=transport, verify=self.config.verify, limits=CONNECTIONS)

    def close(self) -> None:
        self._http.close()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called: no request goes out after."""
        return self._http.is_closed

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- one request ---------------------------------------------------

    def request(
        self,
        route: str,
        *,
        id: Optional[str] = None,
        query: Optional[Mapping[str, Any]] = None,
        body: Optional[Mapping[str, Any]] = None,
        extra_timeout: float = 0.0,
        idempotency_key: Optional[str] = None,
        traceparent: Optional[str] = None,
    ) -> Any:
        """Sends one request; idempotent routes are retried with backoff when
        the server is unreachable or answers a 5xx. A begin is one: it carries
        an ``Idempotency-Key`` (``idempotency_key``, else a fresh random UUID
        made here), and each retry sends the same key, body and query, so a
        begin whose answer was lost is answered with the record it made (200)
        rather than making a second one. An owner registration is retried
        only when the server answered that it did not handle it (503, 408).
        ``traceparent``: a begin's header, sent as given with each attempt."""
        r = ROUTES[route]
        what = f"{r.method} {r.path}"
        url = self.config.url(route, id, query)
        headers = self.config.headers(
            body is not None, key_for(route, idempotency_key), traceparent_header(route, traceparent)
        )
        attempts = self.config.retries + 1
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    r.method, url, headers=headers, json=body, timeout=self.config.timeout + extra_timeout
                )
                return read_answer(response, what)
            except InflightError as err:
                error = err
            except httpx.TransportError as err:
                error = unavailable(what, self.config.base_url, err, self.config.timeout + extra_timeout)
            if not retryable(route, error) or attempt + 1 >= attempts:
                raise error
            time.sleep(self.config.delay(attempt, error))
            attempt += 1

    # ---- the routes ----------------------------------------------------

    def begin(
        self,
        spec: Optional[Mapping[str, Any]] = None,
        *,
        start_now: bool = False,
        wait: Optional[float] = None,
        traceparent: Optional[str] = None,
        **fields: Any,
    ) -> "Activity":
        """Begins a record (``waiting``, or ``executing`` with ``started_at``).
        Inside ``with ledger.context(...)``, the context's values fill the
        ``service``, ``operation_stage`` and ``priority`` it leaves out.

        The begin carries a fresh ``Idempotency-Key`` (a random UUID), and is
        retried like ``settle`` (after no answer, a reset, a timeout, or a
        5xx) with the same key, body and query: the server answers a repeat
        with the record the first one made (200, not 201), so a lost answer
        never makes a second record. If that record ended before its answer
        came (cancelled or reaped), the begin is made anew with a new key (at
        most ``retries`` times; then ``UnavailableError``).

        With ``start_now``, the server begins it started on its own clock
        (``?start=now``): a lifecycle in two requests, this and the settle. On
        a full lane that is ``LaneFullError`` (``LaneCoolingError``, its
        subclass, on a lane cooling down, with ``retry_after``;
        ``BudgetExhaustedError``, its subclass too, when the call's
        ``maxTokens`` does not fit in a token budget), with nothing holding a
        slot or a place in line. With ``wait`` seconds too (at most 30), the
        server holds the request until the lane admits the record or the wait
        ends, through a cooldown or a used-up budget too; then the record is
        cancelled and the answer is the error of the limit that held it last.
        A ``maxTokens`` larger than a whole budget is ``InvalidRequestError``
        (it could never start), with or without ``start_now``. A repeat that
        finds its record cancelled is the same ``LaneFullError`` once ``wait``
        has passed; before, the begin is made anew (a new key) for the wait
        that is left.

        The begin sends ``traceparent`` (a W3C trace context) when given,
        else the current OpenTelemetry span's (unless ``propagate_trace`` is
        false): the record keeps it, and the span the server exports when it
        ends is that span's child. Only its being a string is checked here
        (else ``TypeError``); the server refuses a malformed one
        (``InvalidRequestError``, its message starting ``traceparent: ``)."""
        if wait is not None and not start_now:
            raise ValueError("begin: wait needs start_now (a begin without it does not start the record)")
        return self._begin(
            spec, fields, start_now=start_now, wait=wait, instead=no_wait_left(wait), traceparent=traceparent
        )

    def _begin(
        self,
        spec: Optional[Mapping[str, Any]],
        fields: Mapping[str, Any],
        *,
        start_now: bool,
        wait: Optional[float],
        instead: Instead,
        traceparent: Optional[str] = None,
    ) -> "Activity":
        """The begins of ``begin`` and the blocks. ``request`` gives each a
        fresh ``Idempotency-Key`` and retries it with that key, and the
        ``traceparent`` found here (given, else the current span's); a
        repeat's answer whose record has ended is handled by ``begin_anew``."""
        sent = traceparent_for(traceparent, self.propagate_trace, "begin")
        body = build_spec(spec, fields, self.owner_id, self._current_context())
        began = time.monotonic()
        anew = 0
        while True:
            # A begin made anew waits only for what is left of ``wait``.
            left = wait if wait is None or anew == 0 else max(0.0, wait - (time.monotonic() - began))
            query = {"start": "now", "wait": wait_param(left)} if start_now else None
            record = self.request("begin", query=query, body=body, extra_timeout=left or 0.0, traceparent=sent)
            self._ignored_fields.note(record)
            if not has_ended(record):
                return Activity(self, record)
            begin_anew(record, time.monotonic() - began, instead, anew, self.config.retries)
            anew += 1

    def get_activity(self, activity_id: str) -> ActivityRecord:
        return self.request("get", id=activity_id)  # type: ignore[no-any-return]

    def snapshot(self, *, limit: Optional[int] = None, since: Optional[str] = None) -> Snapshot:
        return self.request("snapshot", query={"limit": limit, "since": since})  # type: ignore[no-any-return]

    def reap(self) -> ReapCounts:
        return self.request("reap", body={})  # type: ignore[no-any-return]

    def healthy(self) -> bool:
        try:
            self.request("healthz")
            return True
        except InflightError:
            return False

    def register_owner(self, name: str, ttl: float = 30.0) -> Owner:
        return self.request("register_owner", body={"name": name, "ttlMs": int(ttl * 1000)})  # type: ignore[no-any-return]

    def renew_owner(self, owner_id: str) -> Owner:
        return self.request("renew_owner", id=owner_id)  # type: ignore[no-any-return]

    def release_owner(self, owner_id: str) -> Owner:
        return self.request("release_owner", id=owner_id)  # type: ignore[no-any-return]

    # ---- the lifecycle -------------------------------------------------

    def activity(
        self,
        spec: Optional[Mapping[str, Any]] = None,
        *,
        max_wait: Optional[float] = None,
        wait_step: float = 10.0,
        failure_stage: Union[FailureStage, Callable[[BaseException], FailureStage]] = "provider",
        lifecycle: Optional[Lifecycle] = None,
        cancel: Optional[threading.Event] = None,
        usage_extractor: Optional[UsageExtractor] = usage_of,
        traceparent: Optional[str] = None,
        **fields: Any,
    ) -> "ActivityBlock":
        """A block that is one provider call (see the class's doc).

        ``max_wait``: give up waiting in line after this many seconds with
        ``WaitTimeoutError`` (the record is cancelled); the wait goes on
        through a full lane, a lane cooling down and a used-up token budget
        alike. ``failure_stage``:
        where an exception happened (or a function of it). An exception that
        carries a provider's 429 or 503 answer with ``Retry-After`` (one whose
        ``response`` has ``status_code`` and ``headers``, as
        ``httpx.HTTPStatusError`` and ``openai.APIStatusError``, or one raised
        ``from`` such) settles the failure with it (``retry_after_ms``), so
        the lane cools down. ``cancel``: an
        event another thread may set to abort the call: while it waits in
        line (or before), ``WaitCancelledError`` is raised at once and the
        record is cancelled; once the block runs, an exception leaving it
        while the event is set records ``cancelled`` rather than ``failed``
        (the block itself watches the event for its own work).
        ``usage_extractor``: what ``call.report_usage_of(answer)`` reads the
        answer's token usage with (default ``usage_of``; ``None`` reads
        nothing). ``traceparent``: the begin's W3C trace context, instead of
        the OpenTelemetry span current where the block is entered (see
        ``begin``)."""
        return ActivityBlock(
            self, build_spec(spec, fields, None), max_wait, wait_step, failure_stage, lifecycle, cancel,
            usage_extractor, traceparent=traceparent,
        )

    def observe_unqueued(
        self,
        spec: Optional[Mapping[str, Any]] = None,
        *,
        lifecycle: Optional[Lifecycle] = None,
        usage_extractor: Optional[UsageExtractor] = usage_of,
        traceparent: Optional[str] = None,
        **fields: Any,
    ) -> "ActivityBlock":
        """A block for a call with no queue (admission ``direct``: observed,
        never counted in a lane nor refused), settled like ``activity``."""
        body = build_spec(spec, fields, None)
        body["admission"] = "direct"
        return ActivityBlock(
            self, body, None, 10.0, "provider", lifecycle, None, usage_extractor, traceparent=traceparent
        )

    def tracked(
        self,
        spec: Optional[Mapping[str, Any]] = None,
        *,
        max_wait: Optional[float] = None,
        wait_step: float = 10.0,
        failure_stage: Union[FailureStage, Callable[[BaseException], FailureStage]] = "provider",
        lifecycle: Optional[Lifecycle] = None,
        cancel: Optional[threading.Event] = None,
        usage_extractor: Optional[UsageExtractor] = usage_of,
        traceparent: Optional[str] = None,
        **fields: Any,
    ) -> Callable[[F], F]:
        """A decorator: each call of the function is one provider call, run
        inside ``activity(spec, ..., **fields)`` with these options (settled
        by how it returns or raises), and its return value's token usage,
        read with ``usage_extractor`` (default ``usage_of``; ``None`` reads
        nothing), is sent with the success::

            @ledger.tracked(service="assistant", provider="openai", class_="chat")
            def answer(messages):
                return client.chat.completions.create(model="gpt-4o-mini", messages=messages)

        Each call's begin sends the OpenTelemetry span current when it is
        called; ``traceparent`` gives every call that one parent instead.
        """

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                block = self.activity(
                    spec, max_wait=max_wait, wait_step=wait_step, failure_stage=failure_stage,
                    lifecycle=lifecycle, cancel=cancel, usage_extractor=usage_extractor,
                    traceparent=traceparent, **fields,
                )
                with block as call:
                    result = fn(*args, **kwargs)
                    call.report_usage_of(result)
                return result

            return cast(F, wrapper)

        return decorate

    def join_as_owner(
        self,
        name: str,
        ttl: float = 30.0,
        *,
        tag_records: bool = True,
        release_on_signals: Union[bool, Iterable[int]] = False,
        on_lost: Optional[Callable[[InflightError], None]] = None,
    ) -> "OwnerLease":
        """Registers this process as an owner under a lease of ``ttl`` seconds,
        renewed every third of it by a daemon thread. Records this client
        begins carry the owner's id unless ``tag_records`` is false. If the
        process dies, the server reaps its in-flight records once the lease
        runs out; ``release()`` (or leaving ``with lease:``) is the clean
        shutdown. ``release_on_signals=True`` releases on SIGTERM first (from
        the main thread), then lets the signal do what it would have done."""
        owner = self.register_owner(name, ttl)
        lease = OwnerLease(self, owner, release_on_signals, on_lost)
        if tag_records:
            self.owner_id = owner["ownerId"]
        return lease


class Activity(UsageReport):
    """One record, for code that has its own queue: ``start()``, then
    ``settle()``, or ``cancel()``; ``refine(model)`` while it is in flight;
    ``report_usage(...)`` or ``report_usage_of(answer)`` for the settle to
    carry the call's tokens. Every transition is idempotent, so each is
    retried. ``with ledger.activity(...) as call:`` gives the block this
    handle."""

    def __init__(self, ledger: Ledger, record: ActivityRecord) -> None:
        self.ledger = ledger
        #: The record as the server last answered it.
        self.record = record
        self.id: str = record["activityId"]
        self._init_usage()

    @property
    def ended(self) -> bool:
        return has_ended(self.record)

    def _update(self, record: ActivityRecord) -> ActivityRecord:
        self.record = record
        return record

    def start(self, *, wait: Optional[float] = None, started_at: Any = None) -> ActivityRecord:
        """Admitted at once, or ``LaneFullError`` (``LaneCoolingError`` while
        the lane cools down, ``BudgetExhaustedError`` when its ``maxTokens``
        does not fit in a token budget); the record keeps its place. With
        ``wait`` seconds (at most 30), the server holds the request until its
        turn comes or the wait ends."""
        body = {} if started_at is None else {"startedAt": wire_time(started_at)}
        param = wait_param(wait)
        return self._update(
            self.ledger.request("start", id=self.id, query={"wait": param}, body=body, extra_timeout=wait or 0.0)
        )

    def admit(
        self, *, max_wait: Optional[float] = None, wait_step: float = 10.0, cancel: Optional[threading.Event] = None
    ) -> ActivityRecord:
        """Waits in line with bounded ``?wait=`` requests until admitted,
        through a full lane, a lane cooling down and a used-up token budget
        (``budget_exhausted``) alike. After ``lane_cooling`` with a
        ``Retry-After``, the next request waits until then (never past
        ``max_wait``). After ``budget_exhausted`` it asks again at once, as
        after ``lane_full``: its ``Retry-After`` is only when the window makes
        room by itself, and a settle that reports less than its call's
        estimate makes room sooner, which the server's held ``?wait=`` wakes
        for. Past ``max_wait``, ``WaitTimeoutError`` is raised from the last
        refusal (its ``__cause__``, with its ``retry_after``).

        ``cancel``: when another thread sets it, the record is cancelled and
        ``WaitCancelledError`` raised, at once (not at the end of a
        ``?wait=``: cancelling the record ends the request the server holds)."""
        wait_step = checked_wait_step(wait_step)
        if cancel is None:
            return self._admit(max_wait, wait_step, None)
        if cancel.is_set():
            self._cancel_quietly()
            raise wait_cancelled(self.record)
        watch = _CancelWatch(self, cancel)
        try:
            record = self._admit(max_wait, wait_step, cancel)
        except InflightError as err:
            if watch.finish():
                self._cancel_quietly()
                raise wait_cancelled(self.record) from err
            raise
        except BaseException:
            watch.finish()
            raise
        if watch.finish():  # set as the turn came: the watch may have cancelled it
            self._cancel_quietly()
            raise wait_cancelled(self.record)
        return record

    def _admit(self, max_wait: Optional[float], wait_step: float, cancel: Optional[threading.Event]) -> ActivityRecord:
        deadline = None if max_wait is None else time.monotonic() + max_wait
        while True:
            left = wait_step if deadline is None else min(wait_step, max(0.0, deadline - time.monotonic()))
            try:
                return self.start(wait=left)
            except InflightError as err:
                if err.code not in WAIT_CODES or (cancel is not None and cancel.is_set()):
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise wait_timeout(self.record, max_wait) from err
                pause = pause_before_asking(err, deadline, time.monotonic())
                if pause > 0:
                    if cancel is None:
                        time.sleep(pause)
                    elif cancel.wait(pause):
                        raise  # ``admit`` sees the event set: wait_cancelled

    def _cancel_quietly(self) -> None:
        try:
            self.cancel("cancelled")
        except InflightError:
            pass  # reaped past its bound if this cancel was lost

    def settle(
        self,
        success: bool,
        *,
        failure_stage: Optional[FailureStage] = None,
        completed_at: Any = None,
        retry_after_ms: Optional[int] = None,
        usage: Optional[Usage] = None,
    ) -> ActivityRecord:
        """``retry_after_ms``: with a failure, the provider's ``Retry-After``
        in milliseconds (1 to 3600000; ``inflight_ledger.retry_after_ms(response)``
        reads it from an answer): the lane admits nothing new until it has
        passed (at most the server's ``max_cooldown``). The server refuses it
        with a success (``InvalidRequestError`` naming ``retryAfterMs``).

        ``usage``: the call's tokens, ``Usage(input_tokens=..., output_tokens=...)``,
        with a success or a failure; when left ``None``, the usage reported
        with ``report_usage``/``report_usage_of``, if any. ``TypeError`` for
        anything but a ``Usage``, before any request."""
        body = settle_body(success, failure_stage, completed_at, retry_after_ms, self.usage if usage is None else usage)
        return self._update(self.ledger.request("settle", id=self.id, body=body))

    def succeed(self, *, usage: Optional[Usage] = None) -> ActivityRecord:
        """A success; ``usage``: its tokens (see ``settle``)."""
        return self.settle(True, usage=usage)

    def fail(
        self,
        failure_stage: FailureStage = "provider",
        *,
        retry_after_ms: Optional[int] = None,
        usage: Optional[Usage] = None,
    ) -> ActivityRecord:
        """A failure at ``failure_stage``; ``retry_after_ms``: the provider's
        ``Retry-After``; ``usage``: its tokens (see ``settle``)."""
        return self.settle(False, failure_stage=failure_stage, retry_after_ms=retry_after_ms, usage=usage)

    def cancel(self, reason: Optional[str] = None) -> ActivityRecord:
        """Records an abort the caller observed: ``cancelled``. Repeating it is harmless."""
        return self._update(self.ledger.request("cancel", id=self.id, body={} if reason is None else {"reason": reason}))

    def refine(self, model: str) -> ActivityRecord:
        """Names the model the call went to, once it is known (at dispatch,
        after the begin): allowed while the record is in flight (waiting or
        executing). The first refinement replaces the begin's model; the same
        model again changes nothing; a different one makes it ``unknown``, for
        good. The model is kept as a begin's is (an endpoint or a key where
        the model belongs is ``redacted``). The call counts in its aggregate
        under its final model. Repeating the same refinement is harmless, so
        it is retried like ``settle``.

        Raises ``ConflictError`` once the record has ended (settled, cancelled
        or reaped), ``NotFoundError`` for an unknown id, and
        ``InvalidRequestError`` for an empty model."""
        body: RefineRequest = {"model": model}
        return self._update(self.ledger.request("refine", id=self.id, body=body))

    def refresh(self) -> ActivityRecord:
        return self._update(self.ledger.get_activity(self.id))


class _CancelWatch:
    """While a call waits in line, a daemon thread waits for its cancel
    event; when it is set, the thread cancels the record, which makes the
    server answer the held ``?wait=`` start at once (409) instead of at the
    end of its wait. ``finish()`` ends the watch and says whether it fired;
    once it has returned, the watch never cancels (the lock orders the two)."""

    def __init__(self, activity: "Activity", event: threading.Event) -> None:
        self._activity = activity
        self._event = event
        self._lock = threading.Lock()
        self._finished = False
        self._fired = False
        threading.Thread(target=self._run, name=f"inflight-cancel-{activity.id}", daemon=True).start()

    def _run(self) -> None:
        # Event.wait returns as soon as it is set; the timeout only bounds
        # how long the thread outlives an admission.
        while not self._event.wait(0.05):
            if self._finished:
                return
        with self._lock:
            if self._finished:
                return
            self._fired = True
        try:
            # Not through Activity.cancel: the waiting thread owns .record.
            self._activity.ledger.request("cancel", id=self._activity.id, body={"reason": "cancelled"})
        except InflightError:
            pass  # the waiting thread cancels too, once its request ends

    def finish(self) -> bool:
        with self._lock:
            self._finished = True
            return self._fired or self._event.is_set()


class ActivityBlock:
    """``with ledger.activity(...) as call:`` (see ``Ledger``)."""

    def __init__(
        self,
        ledger: Ledger,
        spec: Mapping[str, Any],
        max_wait: Optional[float],
        wait_step: float,
        failure_stage: Union[FailureStage, Callable[[BaseException], FailureStage]],
        lifecycle: Optional[Lifecycle],
        cancel: Optional[threading.Event],
        usage_extractor: Optional[UsageExtractor] = usage_of,
        *,
        traceparent: Optional[str] = None,
    ) -> None:
        self.ledger = ledger
        self.cancel = cancel
        self.traceparent = traceparent
        self.usage_extractor = usage_extractor
        self.spec = dict(spec)
        self.max_wait = max_wait
        self.wait_step = checked_wait_step(wait_step)
        self.failure_stage = failure_stage
        self.hooks: Tuple[Optional[Lifecycle], ...] = (ledger.lifecycle, lifecycle)
        self.activity: Optional[Activity] = None

    def __enter__(self) -> Activity:
        if self.cancel is not None and self.cancel.is_set():
            raise WaitCancelledError(
                "wait_cancelled", "the cancel event was set before the call began; nothing was recorded"
            )
        direct = self.spec.get("admission") == "direct"
        spec = dict(self.spec)
        if direct:
            now = now_ms()
            spec.setdefault("enqueuedAt", now)
            spec.setdefault("startedAt", now)
        # A record that ended before its begin's answer came never reaches the
        # block: the begin is made anew (a new key) unless the cancel event is
        # set or max_wait has passed.
        activity = self.ledger._begin(
            spec, {}, start_now=False, wait=None,
            instead=in_line(None if direct else self.max_wait, self.cancel), traceparent=self.traceparent,
        )
        activity.usage_extractor = self.usage_extractor
        self.activity = activity
        call_hook(self.hooks, "on_enqueued", activity.record)
        if not direct:
            try:
                activity.admit(max_wait=self.max_wait, wait_step=self.wait_step, cancel=self.cancel)
            except BaseException as exc:
                self._end(lambda: activity.cancel(cancel_reason(exc)))
                raise
        call_hook(self.hooks, "on_started", activity.record)
        return activity

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        activity = self.activity
        if activity is None or activity.ended:
            return  # settled by hand inside the block
        if exc is None:
            self._end(activity.succeed)
        elif is_abort(exc):
            self._end(lambda: activity.cancel(cancel_reason(exc)))
        elif self.cancel is not None and self.cancel.is_set():
            self._end(lambda: activity.cancel("cancelled"))  # the caller aborted the work
        else:
            stage = failure_stage_for(exc, self.failure_stage)
            retry_after = retry_after_of(exc)
            self._end(lambda: activity.fail(stage, retry_after_ms=retry_after))

    def _end(self, end: Callable[[], ActivityRecord]) -> None:
        assert self.activity is not None
        try:
            end()
            call_hook(self.hooks, "on_settled", self.activity.record)
        except Exception as err:  # noqa: BLE001 - the block's own outcome stands
            self.ledger.on_ledger_error(err, self.activity.record)


class OwnerLease:
    """A registered owner whose lease a daemon thread renews."""

    def __init__(
        self,
        ledger: Ledger,
        owner: Owner,
        release_on_signals: Union[bool, Iterable[int]],
        on_lost: Optional[Callable[[InflightError], None]],
    ) -> None:
        self.ledger = ledger
        self.owner = owner
        self.id: str = owner["ownerId"]
        self.on_lost = on_lost
        self.lost_error: Optional[InflightError] = None
        self._stop = threading.Event()
        # Reentrant: a signal may arrive, on the main thread, inside release().
        self._lock = threading.RLock()
        self._released: Optional[Owner] = None
        self._previous: List[Tuple[int, Any]] = []
        signals: Iterable[int] = (
            (signal.SIGTERM,) if release_on_signals is True else (release_on_signals or ())
        )
        try:
            for sig in signals:
                self._previous.append((sig, signal.signal(sig, self._on_signal)))
        except BaseException:
            # Not on the main thread, say: nothing is left renewing or set.
            self._restore_signals()
            raise
        self._thread = threading.Thread(target=self._renew_loop, name=f"inflight-lease-{self.id}", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> bool:
        return self.lost_error is not None

    def _renew_loop(self) -> None:
        interval = self.owner["ttlMs"] / 3000
        while not self._stop.wait(interval):
            try:
                self.owner = self.ledger.renew_owner(self.id)
                interval = self.owner["ttlMs"] / 3000
            except InflightError as err:
                if self._stop.is_set():
                    return  # released meanwhile: refused since, and not lost
                if err.code in ("conflict", "not_found"):
                    self._mark_lost(err)
                    return
                interval = max(0.1, self.owner["ttlMs"] / 10000)  # unreachable: try again soon
            except Exception:  # noqa: BLE001 - the thread must outlive any surprise
                if self.ledger.closed:
                    return  # its client is closed: no renewal can go out
                interval = max(0.1, self.owner["ttlMs"] / 10000)

    def _mark_lost(self, err: InflightError) -> None:
        self.lost_error = err
        self.stop()
        if self.on_lost is not None:
            try:
                self.on_lost(err)
            except Exception:  # noqa: BLE001
                pass

    def stop(self) -> None:
        """Stops renewing without telling the server (as a crash would)."""
        self._stop.set()
        self._restore_signals()
        if self.ledger.owner_id == self.id:
            self.ledger.owner_id = None

    def release(self) -> Owner:
        """A clean shutdown: stops renewing and releases the owner; its
        in-flight records are cancelled. Twice is harmless."""
        with self._lock:
            if self._released is None:
                self.stop()
                self._restore_signals()
                self._released = self.ledger.release_owner(self.id)
            return self._released

    def _restore_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; ours stays, harmless once released
        for sig, previous in self._previous:
            signal.signal(sig, previous)
        self._previous = []

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._restore_signals()  # handlers run on the main thread
        try:
            self.release()
        except Exception:  # noqa: BLE001 - the signal still does what it would have
            pass
        os.kill(os.getpid(), signum)

    def __enter__(self) -> "OwnerLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
