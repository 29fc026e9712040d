"""The asyncio client: ``AsyncLedger``."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from types import TracebackType
from typing import Any, Awaitable, Callable, Iterable, List, Mapping, Optional, Tuple, Type, TypeVar, Union, cast

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
    wait_param,
    wait_timeout,
    wire_time,
)
from ._trace import traceparent_for
from .errors import InflightError
from .wire import ROUTES, ActivityRecord, FailureStage, Owner, ReapCounts, RefineRequest, Snapshot

LedgerErrorHook = Callable[[BaseException, ActivityRecord], None]
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


class AsyncLedger(Attributed):
    """The asyncio client of one inflight server.

    ``async with ledger.activity(service="kb", provider="ollama") as call:``
    begins a record, waits in line until admitted, starts it, and settles it
    by how the block exits: normally, success; by an exception, failure; by
    task cancellation (or ``KeyboardInterrupt``), ``cancelled``. With
    ``timeout=``, the block (waiting and executing) is cancelled after that
    many seconds, the record is settled ``cancelled`` and ``TimeoutError`` is
    raised. The block's value is the record's ``AsyncActivity``: ``await
    call.refine(model)`` names the model once the call is dispatched,
    ``call.report_usage(...)`` (or ``call.report_usage_of(answer)``, no
    ``await``: no I/O) the tokens the settle carries.
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
        transport: Optional[httpx.AsyncBaseTransport] = None,
        propagate_trace: bool = True,
    ) -> None:
        """The same options as ``Ledger``'s (``ca_file``/``ca``: the CA to
        trust for ``https://``; ``propagate_trace``: whether a begin given no
        ``traceparent`` sends the current OpenTelemetry span's)."""
        self.config = Config.make(base_url, token, timeout, retries, backoff, max_backoff, ca_file, ca)
        self.propagate_trace = propagate_trace
        self.lifecycle = lifecycle
        self.on_ledger_error = on_ledger_error or default_ledger_error
        #: The owner whose id tags the records this client begins, if any.
        self.owner_id: Optional[str] = None
        self._ignored_fields = IgnoredFieldsLog()
        self._init_attribution()
        self._http = httpx.AsyncClient(transport=transport, verify=self.config.verify, limits=CONNECTIONS)

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` was called: no request goes out after."""
        return self._http.is_closed

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncLedger":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(
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
        made here), and each retry sends the same key, body and query (see
        ``Ledger.request``). An owner registration is retried only when the
        server answered that it did not handle it (503, 408). ``traceparent``:
        a begin's header, sent as given with each attempt."""
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
                response = await self._http.request(
                    r.method, url, headers=headers, json=body, timeout=self.config.timeout + extra_timeout
                )
                return read_answer(response, what)
            except InflightError as err:
                error = err
            except httpx.TransportError as err:
                error = unavailable(what, self.config.base_url, err, self.config.timeout + extra_timeout)
            if not retryable(route, error) or attempt + 1 >= attempts:
                raise error
            await asyncio.sleep(self.config.delay(attempt, error))
            attempt += 1

    async def begin(
        self,
        spec: Optional[Mapping[str, Any]] = None,
        *,
        start_now: bool = False,
        wait: Optional[float] = None,
        traceparent: Optional[str] = None,
        **fields: Any,
    ) -> "AsyncActivity":
        """Begins a record. Inside ``with ledger.context(...)``, the
        context's values fill the ``service``, ``operation_stage`` and
        ``priority`` it leaves out.

        The begin carries a fresh ``Idempotency-Key`` and is retried with it
        after no answer or a 5xx; a record that ended before its answer came
        is begun anew with a new key (see ``Ledger.begin``).

        With ``start_now``, the server begins it started on its own clock
        (``?start=now``): a lifecycle in two requests, this and the settle. On
        a full lane that is ``LaneFullError`` (``LaneCoolingError``, its
        subclass, on a lane cooling down; ``BudgetExhaustedError``, its
        subclass too, when the call's ``maxTokens`` does not fit in a token
        budget), with nothing holding a slot or a place in line. With ``wait``
        seconds too (at most 30), the server holds the request until the lane
        admits the record or the wait ends, through a cooldown or a used-up
        budget too; then the record is cancelled and the answer is the
        error of the limit that held it last (``LaneFullError`` when a repeat
        finds it cancelled once ``wait`` has passed).

        The begin sends ``traceparent`` when given, else the current
        OpenTelemetry span's (unless ``propagate_trace`` is false; see
        ``Ledger.begin``)."""
        if wait is not None and not start_now:
            raise ValueError("begin: wait needs start_now (a begin without it does not start the record)")
        return await self._begin(
            spec, fields, start_now=start_now, wait=wait, instead=no_wait_left(wait), traceparent=traceparent
        )

    async def _begin(
        self,
        spec: Optional[Mapping[str, Any]],
        fields: Mapping[str, Any],
        *,
        start_now: bool,
        wait: Optional[float],
        instead: Instead,
        traceparent: Optional[str] = None,
    ) -> "AsyncActivity":
        """The begins of ``begin`` and the blocks (see ``Ledger._begin``)."""
        sent = traceparent_for(traceparent, self.propagate_trace, "begin")
        body = build_spec(spec, fields, self.owner_id, self._current_context())
        began = time.monotonic()
        anew = 0
        while True:
            # A begin made anew waits only for what is left of ``wait``.
            left = wait if wait is None or anew == 0 else max(0.0, wait - (time.monotonic() - began))
            query = {"start": "now", "wait": wait_param(left)} if start_now else None
            record = await self.request("begin", query=query, body=body, extra_timeout=left or 0.0, traceparent=sent)
            self._ignored_fields.note(record)
            if not has_ended(record):
                return AsyncActivity(self, record)
            begin_anew(record, time.monotonic() - began, instead, anew, self.config.retries)
            anew += 1

    async def get_activity(self, activity_id: str) -> ActivityRecord:
        return await self.request("get", id=activity_id)  # type: ignore[no-any-return]

    async def snapshot(self, *, limit: Optional[int] = None, since: Optional[str] = None) -> Snapshot:
        return await self.request("snapshot", query={"limit": limit, "since": since})  # type: ignore[no-any-return]

    async def reap(self) -> ReapCounts:
        return await self.request("reap", body={})  # type: ignore[no-any-return]

    async def healthy(self) -> bool:
        try:
            await self.request("healthz")
            return True
        except InflightError:
            return False

    async def register_owner(self, name: str, ttl: float = 30.0) -> Owner:
        return await self.request("register_owner", body={"name": name, "ttlMs": int(ttl * 1000)})  # type: ignore[no-any-return]

    async def renew_owner(self, owner_id: str) -> Owner:
        return await self.request("renew_owner", id=owner_id)  # type: ignore[no-any-return]

    async def release_owner(self, owner_id: str) -> Owner:
        return await self.request("release_owner", id=owner_id)  # type: ignore[no-any-return]

    def activity(
        self,
        spec: Optional[Mapping[str, Any]] = None,
        *,
        max_wait: Optional[float] = None,
        wait_step: float = 10.0,
        timeout: Optional[float] = None,
        failure_stage: Union[FailureStage, Callable[[BaseException], FailureStage]] = "provider",
        lifecycle: Optional[Lifecycle] = None,
        usage_extractor: Optional[UsageExtractor] = usage_of,
        traceparent: Optional[str] = None,
        **fields: Any,
    ) -> "AsyncActivityBlock":
        """A block that is one provider call (see the class's doc and
        ``Ledger.activity``): it waits in line through a full lane, a lane
        cooling down and a used-up token budget alike, up to ``max_wait``; an
        exception carrying a provider's 429 or 503 answer with ``Retry-After``
        settles the failure with it. ``usage_extractor``: what ``call.report_usage_of(answer)``
        reads the answer's token usage with (default ``usage_of``; ``None``
        reads nothing). ``traceparent``: the begin's W3C trace context,
        instead of the OpenTelemetry span current where the block is entered."""
        return AsyncActivityBlock(
            self, build_spec(spec, fields, None), max_wait, wait_step, timeout, failure_stage, lifecycle,
            usage_extractor, traceparent=traceparent,
        )

    def observe_unqueued(
        self,
        spec: Optional[Mapping[str, Any]] = None,
        *,
        timeout: Optional[float] = None,
        lifecycle: Optional[Lifecycle] = None,
        usage_extractor: Optional[UsageExtractor] = usage_of,
        traceparent: Optional[str] = None,
        **fields: Any,
    ) -> "AsyncActivityBlock":
        """A block for a call with no queue (admission ``direct``)."""
        body = build_spec(spec, fields, None)
        body["admission"] = "direct"
        return AsyncActivityBlock(
            self, body, None, 10.0, timeout, "provider", lifecycle, usage_extractor, traceparent=traceparent
        )

    def tracked(
        self,
        spec: Optional[Mapping[str, Any]] = None,
        *,
        max_wait: Optional[float] = None,
        wait_step: float = 10.0,
        timeout: Optional[float] = None,
        failure_stage: Union[FailureStage, Callable[[BaseException], FailureStage]] = "provider",
        lifecycle: Optional[Lifecycle] = None,
        usage_extractor: Optional[UsageExtractor] = usage_of,
        traceparent: Optional[str] = None,
        **fields: Any,
    ) -> Callable[[F], F]:
        """A decorator of a coroutine function: each call is one provider
        call, awaited inside ``activity(spec, ..., **fields)`` with these
        options, and the token usage of what it returns, read with
        ``usage_extractor`` (default ``usage_of``; ``None`` reads nothing),
        is sent with the success (see ``Ledger.tracked``). Each call's begin
        sends the OpenTelemetry span current when it is called;
        ``traceparent`` gives every call that one parent instead."""

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                block = self.activity(
                    spec, max_wait=max_wait, wait_step=wait_step, timeout=timeout, failure_stage=failure_stage,
                    lifecycle=lifecycle, usage_extractor=usage_extractor, traceparent=traceparent, **fields,
                )
                async with block as call:
                    result = await fn(*args, **kwargs)
                    call.report_usage_of(result)
                return result

            return cast(F, wrapper)

        return decorate

    async def join_as_owner(
        self,
        name: str,
        ttl: float = 30.0,
        *,
        tag_records: bool = True,
        release_on_signals: Union[bool, Iterable[int]] = False,
        on_lost: Optional[Callable[[InflightError], None]] = None,
    ) -> "AsyncOwnerLease":
        """Registers this process as an owner under a lease of ``ttl`` seconds,
        renewed every third of it by a background task (see
        ``Ledger.join_as_owner``). ``release_on_signals=True`` releases on
        SIGTERM (through the event loop), then lets the signal do what it
        would have done."""
        owner = await self.register_owner(name, ttl)
        lease = AsyncOwnerLease(self, owner, release_on_signals, on_lost)
        if tag_records:
            self.owner_id = owner["ownerId"]
        return lease


class AsyncActivity(UsageReport):
    """One record: ``await start()``, then ``await settle()``, or ``await
    cancel()``; ``await refine(model)`` while it is in flight (see
    ``Activity.refine``); ``report_usage(...)`` or ``report_usage_of(answer)``
    (not awaited) for the settle to carry the call's tokens. ``async with
    ledger.activity(...) as call:`` gives the block this handle."""

    def __init__(self, ledger: AsyncLedger, record: ActivityRecord) -> None:
        self.ledger = ledger
        self.record = record
        self.id: str = record["activityId"]
        self._init_usage()

    @property
    def ended(self) -> bool:
        return has_ended(self.record)

    def _update(self, record: ActivityRecord) -> ActivityRecord:
        self.record = record
        return record

    async def start(self, *, wait: Optional[float] = None, started_at: Any = None) -> ActivityRecord:
        body = {} if started_at is None else {"startedAt": wire_time(started_at)}
        return self._update(
            await self.ledger.request(
                "start", id=self.id, query={"wait": wait_param(wait)}, body=body, extra_timeout=wait or 0.0
            )
        )

    async def admit(self, *, max_wait: Optional[float] = None, wait_step: float = 10.0) -> ActivityRecord:
        """Waits in line with bounded ``?wait=`` requests until admitted,
        through a full lane, a lane cooling down and a used-up token budget
        alike (see ``Activity.admit``: after ``lane_cooling`` with a
        ``Retry-After``, the next request waits until then, never past
        ``max_wait``; after ``budget_exhausted``, at once)."""
        wait_step = checked_wait_step(wait_step)
        deadline = None if max_wait is None else time.monotonic() + max_wait
        while True:
            left = wait_step if deadline is None else min(wait_step, max(0.0, deadline - time.monotonic()))
            try:
                return await self.start(wait=left)
            except InflightError as err:
                if err.code not in WAIT_CODES:
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    raise wait_timeout(self.record, max_wait) from err
                pause = pause_before_asking(err, deadline, time.monotonic())
            if pause > 0:
                await asyncio.sleep(pause)

    async def settle(
        self,
        success: bool,
        *,
        failure_stage: Optional[FailureStage] = None,
        completed_at: Any = None,
        retry_after_ms: Optional[int] = None,
        usage: Optional[Usage] = None,
    ) -> ActivityRecord:
        """``retry_after_ms``: with a failure, the provider's ``Retry-After``
        in milliseconds; ``usage``: the call's tokens, else those reported
        with ``report_usage``/``report_usage_of`` (see ``Activity.settle``)."""
        body = settle_body(success, failure_stage, completed_at, retry_after_ms, self.usage if usage is None else usage)
        return self._update(await self.ledger.request("settle", id=self.id, body=body))

    async def succeed(self, *, usage: Optional[Usage] = None) -> ActivityRecord:
        return await self.settle(True, usage=usage)

    async def fail(
        self,
        failure_stage: FailureStage = "provider",
        *,
        retry_after_ms: Optional[int] = None,
        usage: Optional[Usage] = None,
    ) -> ActivityRecord:
        return await self.settle(False, failure_stage=failure_stage, retry_after_ms=retry_after_ms, usage=usage)

    async def cancel(self, reason: Optional[str] = None) -> ActivityRecord:
        return self._update(
            await self.ledger.request("cancel", id=self.id, body={} if reason is None else {"reason": reason})
        )

    async def refine(self, model: str) -> ActivityRecord:
        """Names the model the call went to, once it is known; as
        ``Activity.refine`` (the first refinement replaces the begin's model,
        the same again changes nothing, a different one makes it ``unknown``
        for good; ``ConflictError`` once the record has ended). Retried like
        ``settle``."""
        body: RefineRequest = {"model": model}
        return self._update(await self.ledger.request("refine", id=self.id, body=body))

    async def refresh(self) -> ActivityRecord:
        return self._update(await self.ledger.get_activity(self.id))


class AsyncActivityBlock:
    """``async with ledger.activity(...) as call:`` (see ``AsyncLedger``)."""

    def __init__(
        self,
        ledger: AsyncLedger,
        spec: Mapping[str, Any],
        max_wait: Optional[float],
        wait_step: float,
        timeout: Optional[float],
        failure_stage: Union[FailureStage, Callable[[BaseException], FailureStage]],
        lifecycle: Optional[Lifecycle],
        usage_extractor: Optional[UsageExtractor] = usage_of,
        *,
        traceparent: Optional[str] = None,
    ) -> None:
        self.ledger = ledger
        self.spec = dict(spec)
        self.traceparent = traceparent
        self.usage_extractor = usage_extractor
        self.max_wait = max_wait
        self.wait_step = checked_wait_step(wait_step)
        self.timeout = timeout
        self.failure_stage = failure_stage
        self.hooks: Tuple[Optional[Lifecycle], ...] = (ledger.lifecycle, lifecycle)
        self.activity: Optional[AsyncActivity] = None
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timed_out = False
        self._task: Optional["asyncio.Task[Any]"] = None

    def _on_timeout(self) -> None:
        self._timed_out = True
        if self._task is not None:
            self._task.cancel()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _as_timeout(self, exc: BaseException) -> BaseException:
        """Our own timeout's cancellation becomes ``TimeoutError``; any other stays."""
        if self._timed_out and isinstance(exc, asyncio.CancelledError):
            uncancel = getattr(self._task, "uncancel", None)  # 3.11+: this cancellation is handled
            if uncancel is not None:
                uncancel()
            return TimeoutError(f"the call timed out after {self.timeout} s")
        return exc

    async def __aenter__(self) -> AsyncActivity:
        direct = self.spec.get("admission") == "direct"
        spec = dict(self.spec)
        if direct:
            now = now_ms()
            spec.setdefault("enqueuedAt", now)
            spec.setdefault("startedAt", now)
        # The begin is shielded: its answer carries the id needed to cancel,
        # so a cancellation that arrives meanwhile cancels the record after.
        # A record that ended before that answer came never reaches the
        # block: the begin is made anew (a new key) unless past max_wait.
        # The task runs in a copy of this context: the begin sees the span current here.
        begin = asyncio.ensure_future(
            self.ledger._begin(
                spec, {}, start_now=False, wait=None, instead=in_line(None if direct else self.max_wait),
                traceparent=self.traceparent,
            )
        )
        try:
            activity = await asyncio.shield(begin)
        except asyncio.CancelledError:
            begin.add_done_callback(_cancel_when_begun)
            raise
        activity.usage_extractor = self.usage_extractor
        self.activity = activity
        call_hook(self.hooks, "on_enqueued", activity.record)
        if self.timeout is not None:
            self._task = asyncio.current_task()
            self._timer = asyncio.get_running_loop().call_later(self.timeout, self._on_timeout)
        if not direct:
            try:
                await activity.admit(max_wait=self.max_wait, wait_step=self.wait_step)
            except BaseException as exc:
                self._stop_timer()
                err = self._as_timeout(exc)
                await self._end(lambda: activity.cancel(cancel_reason(err)))
                if err is exc:
                    raise
                raise err from exc
        call_hook(self.hooks, "on_started", activity.record)
        return activity

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self._stop_timer()
        activity = self.activity
        if activity is None or activity.ended:
            return
        if exc is None:
            await self._end(activity.succeed)
            return
        err = self._as_timeout(exc)
        if is_abort(err) or err is not exc:
            await self._end(lambda: activity.cancel(cancel_reason(err)))
        else:
            stage = failure_stage_for(exc, self.failure_stage)
            retry_after = retry_after_of(exc)
            await self._end(lambda: activity.fail(stage, retry_after_ms=retry_after))
        if err is not exc:
            raise err from exc

    async def _end(self, end: Callable[[], Awaitable[ActivityRecord]]) -> None:
        """Runs the last transition shielded: a cancellation of the task
        while it is sent does not lose it."""
        assert self.activity is not None
        inner = asyncio.ensure_future(end())
        try:
            await asyncio.shield(inner)
        except asyncio.CancelledError:
            # Cancelled again while ending: let the transition finish, then go on cancelling.
            inner.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        except Exception as err:  # noqa: BLE001 - the block's own outcome stands
            self.ledger.on_ledger_error(err, self.activity.record)
            return
        call_hook(self.hooks, "on_settled", self.activity.record)


_background: "set[asyncio.Future[Any]]" = set()


def _cancel_when_begun(begin: "asyncio.Future[AsyncActivity]") -> None:
    if begin.cancelled() or begin.exception() is not None:
        return
    cancel = asyncio.ensure_future(begin.result().cancel("cancelled"))
    _background.add(cancel)

    def done(f: "asyncio.Future[Any]") -> None:
        _background.discard(f)
        if not f.cancelled():
            f.exception()  # retrieved: a lost cancel is reaped past its bound

    cancel.add_done_callback(done)


class AsyncOwnerLease:
    """A registered owner whose lease a background task renews."""

    def __init__(
        self,
        ledger: AsyncLedger,
        owner: Owner,
        release_on_signals: Union[bool, Iterable[int]],
        on_lost: Optional[Callable[[InflightError], None]],
    ) -> None:
        self.ledger = ledger
        self.owner = owner
        self.id: str = owner["ownerId"]
        self.on_lost = on_lost
        self.lost_error: Optional[InflightError] = None
        self._released: Optional["asyncio.Future[Owner]"] = None
        self._signals: List[int] = []
        loop = asyncio.get_running_loop()
        signals: Iterable[int] = (
            (signal.SIGTERM,) if release_on_signals is True else (release_on_signals or ())
        )
        try:
            for sig in signals:
                loop.add_signal_handler(sig, self._on_signal, sig)
                self._signals.append(sig)
        except BaseException:
            # Not on the main thread, or Windows: nothing is left renewing or set.
            self._remove_signals()
            raise
        self._task = asyncio.ensure_future(self._renew_loop())

    @property
    def lost(self) -> bool:
        return self.lost_error is not None

    async def _renew_loop(self) -> None:
        interval = self.owner["ttlMs"] / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                self.owner = await self.ledger.renew_owner(self.id)
                interval = self.owner["ttlMs"] / 3000
            except InflightError as err:
                if err.code in ("conflict", "not_found"):
                    self._mark_lost(err)
                    return
                interval = max(0.1, self.owner["ttlMs"] / 10000)
            except Exception:  # noqa: BLE001 - the task must outlive any surprise
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
        if self._task is not asyncio.current_task():
            self._task.cancel()
        self._remove_signals()
        if self.ledger.owner_id == self.id:
            self.ledger.owner_id = None

    def _remove_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self._signals = []

    def _on_signal(self, sig: int) -> None:
        self._remove_signals()

        async def release_then_resignal() -> None:
            try:
                await self.release()
            finally:
                os.kill(os.getpid(), sig)

        asyncio.ensure_future(release_then_resignal())

    async def release(self) -> Owner:
        """A clean shutdown: stops renewing and releases the owner; its
        in-flight records are cancelled. Twice is harmless."""
        failed = self._released is not None and self._released.done() and (
            self._released.cancelled() or self._released.exception() is not None
        )
        if self._released is None or failed:
            # A release that failed is tried again.
            self.stop()
            self._released = asyncio.ensure_future(self.ledger.release_owner(self.id))
        return await asyncio.shield(self._released)

    async def __aenter__(self) -> "AsyncOwnerLease":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()
