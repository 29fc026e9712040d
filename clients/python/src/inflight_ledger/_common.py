"""What the sync and the asyncio clients share: building requests, reading
answers, backoff, lifecycle hooks, the attribution context. No I/O here."""

from __future__ import annotations

import contextvars
import email.utils
import errno
import json
import logging
import math
import operator
import os
import random
import re
import socket
import ssl
import threading
import uuid
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from types import TracebackType
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Set, Tuple, Type, Union
from urllib.parse import quote, urlencode

import httpx

from .errors import (
    InflightError,
    LaneFullError,
    TLSError,
    UnavailableError,
    WaitCancelledError,
    WaitTimeoutError,
    error_for,
)
from .wire import (
    IDEMPOTENCY_KEY_HEADER,
    LABEL_PATTERN,
    PRIORITIES,
    RETRY_AFTER_MS_MAX,
    RETRY_AFTER_MS_MIN,
    ROUTES,
    SERVER_ERROR_CODES,
    TOKENS_MAX,
    TOKENS_MIN,
    TRACEPARENT_HEADER,
    ActivityRecord,
    BeginRequest,
    FailureStage,
    Priority,
    SettleRequest,
    SettleUsage,
)

#: Where the client logs what the server let pass (a begin's ignored fields).
log = logging.getLogger("inflight_ledger")

DEFAULT_URL = "http://127.0.0.1:7878"
#: The server holds a ``?wait=`` at most this long.
MAX_WAIT_STEP = 30.0

#: Keyword arguments in snake case, and the wire's camelCase names.
_SNAKE_TO_WIRE = {
    "class_": "class",
    "klass": "class",
    "operation_stage": "operationStage",
    "enqueued_at": "enqueuedAt",
    "started_at": "startedAt",
    "deadline_ms": "deadlineMs",
    "owner_id": "ownerId",
    "max_tokens": "maxTokens",
}

Hook = Callable[[ActivityRecord], None]


@dataclass(frozen=True)
class Lifecycle:
    """Called as a record moves through its life; errors raised here are ignored."""

    on_enqueued: Optional[Hook] = None
    on_started: Optional[Hook] = None
    on_settled: Optional[Hook] = None


def call_hook(hooks: Tuple[Optional[Lifecycle], ...], name: str, record: ActivityRecord) -> None:
    for lifecycle in hooks:
        hook = getattr(lifecycle, name, None) if lifecycle is not None else None
        if hook is None:
            continue
        try:
            hook(record)
        except Exception:  # noqa: BLE001 - a hook's failure is the hook's; the call goes on
            pass


class IgnoredFieldsLog:
    """Logs the fields a begin's answer says the server ignored
    (``ignoredFields``: top-level fields it does not know, e.g. a misspelled
    ``clas``), once per distinct set of names for the client that owns it,
    so a misspelling in a hot path is told once, not on every call."""

    def __init__(self) -> None:
        self._told: Set[FrozenSet[str]] = set()
        self._lock = threading.Lock()  # a sync Ledger is shared by threads

    def note(self, record: ActivityRecord) -> None:
        fields = record.get("ignoredFields") or []
        if not fields:
            return
        key = frozenset(fields)
        with self._lock:
            if key in self._told:
                return
            self._told.add(key)
        log.warning(
            "inflight: the server ignored the begin's unknown field%s %s (activity %s on %s::%s); "
            "a misspelling? (told once per set of fields)",
            "s" if len(fields) > 1 else "",
            ", ".join(json.dumps(f) for f in fields),
            record.get("activityId"),
            record.get("service"),
            record.get("provider"),
            extra={"inflight_ignored_fields": list(fields), "inflight_activity_id": record.get("activityId")},
        )


def wire_time(value: Any) -> Any:
    """A ``datetime`` as epoch milliseconds (naive means UTC); anything else as is."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return int(value.timestamp() * 1000)
    return value


def settle_body(
    success: bool,
    failure_stage: Optional[FailureStage],
    completed_at: Any,
    retry_after_ms: Optional[int],
    usage: Optional["Usage"] = None,
) -> SettleRequest:
    """A settle's body; the fields left ``None`` are not sent (nor a usage
    with neither count)."""
    body: SettleRequest = {"success": success}
    if failure_stage is not None:
        body["failureStage"] = failure_stage
    if completed_at is not None:
        body["completedAt"] = wire_time(completed_at)
    if retry_after_ms is not None:
        body["retryAfterMs"] = retry_after_ms
    if usage is not None:
        if not isinstance(usage, Usage):
            raise TypeError(
                f"settle: usage must be an inflight_ledger.Usage, not {type(usage).__name__} "
                "(Usage(input_tokens=..., output_tokens=...))"
            )
        wire = usage.wire()
        if wire:
            body["usage"] = wire
    return body


# ---- token usage -----------------------------------------------------------


def _tokens(name: str, value: Any, what: str = "usage") -> Optional[int]:
    """A count of tokens (of ``Usage``, or a begin's ``max_tokens``), checked
    as the server checks it: a whole number from 0 to 1000000000 (an ``int``,
    or anything with ``__index__`` but a ``bool``), or ``None``. The errors
    start with ``what`` and name the field."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what}: invalid {name}: must be a whole number, not a bool ({value!r})")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{what}: invalid {name}: must be a whole number (int), not {type(value).__name__} ({value!r})"
        ) from None
    if not TOKENS_MIN <= count <= TOKENS_MAX:
        raise ValueError(f"{what}: invalid {name}: must be from {TOKENS_MIN} to {TOKENS_MAX}, not {count}")
    return count


@dataclass(frozen=True)
class Usage:
    """The tokens a provider reported for one call, sent with its settle:
    ``Usage(input_tokens=12, output_tokens=40)``. Each count is optional
    (``None``: not reported) and, when given, a whole number from 0 to
    1000000000; anything else raises here, before any request, naming the
    field: ``TypeError`` for a ``bool``, a ``float``, a string, ...,
    ``ValueError`` for a number out of range."""

    input_tokens: Optional[int] = None
    output_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("input_tokens", "output_tokens"):
            object.__setattr__(self, name, _tokens(name, getattr(self, name)))

    def wire(self) -> SettleUsage:
        """The settle's ``usage``, with the counts that are set."""
        wire: SettleUsage = {}
        if self.input_tokens is not None:
            wire["inputTokens"] = self.input_tokens
        if self.output_tokens is not None:
            wire["outputTokens"] = self.output_tokens
        return wire


#: Reads a provider's answer and returns its ``Usage``, or ``None`` when it has none.
UsageExtractor = Callable[[Any], Optional[Usage]]


def _get(source: Any, name: str) -> Any:
    """``source[name]`` for a mapping (a JSON answer), else the attribute
    (an SDK's object); ``None`` when absent."""
    if isinstance(source, Mapping):
        return source.get(name)
    return getattr(source, name, None)


def _count(value: Any) -> Optional[int]:
    """A count of a provider's answer: an ``int`` (not a ``bool``) from 0 to
    1000000000, else ``None``."""
    if isinstance(value, int) and not isinstance(value, bool) and TOKENS_MIN <= value <= TOKENS_MAX:
        return int(value)
    return None


def _pair(source: Any, input_name: str, output_name: str) -> Optional[Usage]:
    if source is None:
        return None
    input_tokens, output_tokens = _count(_get(source, input_name)), _count(_get(source, output_name))
    if input_tokens is None and output_tokens is None:
        return None
    return Usage(input_tokens, output_tokens)


def usage_of(result: Any) -> Optional[Usage]:
    """The token usage a provider's answer reports, or ``None``. Recognised,
    as JSON (a mapping) and as an SDK's objects (attributes):

    - OpenAI chat completions (and completions): ``usage.prompt_tokens``,
      ``usage.completion_tokens``;
    - OpenAI's Responses API: ``usage.input_tokens``, ``usage.output_tokens``;
    - Ollama (``/api/chat``, ``/api/generate``, ``/api/embed``, the
      ``ollama`` package): ``prompt_eval_count``, ``eval_count``;
    - Gemini: ``usage_metadata.prompt_token_count``,
      ``usage_metadata.candidates_token_count`` (the ``google-genai``
      package), ``usageMetadata.promptTokenCount``,
      ``usageMetadata.candidatesTokenCount`` (the REST API's JSON).

    A count that is not a whole number from 0 to 1000000000 (a ``bool``, a
    ``float``, a negative, a string) is left out; an answer with neither
    count is ``None``. It never raises."""
    try:
        usage = _get(result, "usage")
        found = _pair(usage, "prompt_tokens", "completion_tokens") or _pair(usage, "input_tokens", "output_tokens")
        found = found or _pair(result, "prompt_eval_count", "eval_count")
        found = found or _pair(_get(result, "usage_metadata"), "prompt_token_count", "candidates_token_count")
        return found or _pair(_get(result, "usageMetadata"), "promptTokenCount", "candidatesTokenCount")
    except Exception:  # noqa: BLE001 - an answer of an unknown shape has no usage
        return None


class UsageReport:
    """The usage a handle (``Activity``, ``AsyncActivity``) sends with its
    settle: reported with ``report_usage``, or read from a provider's answer
    with ``report_usage_of``. No I/O here."""

    id: str
    record: ActivityRecord

    def _init_usage(self, extractor: Optional[UsageExtractor] = usage_of) -> None:
        self._usage: Optional[Usage] = None
        self._usage_explicit = False
        #: What ``report_usage_of`` reads an answer with (``None``: it reads nothing).
        self.usage_extractor = extractor

    @property
    def usage(self) -> Optional[Usage]:
        """The usage the settle will carry (reported or read from an answer), or ``None``."""
        return self._usage

    def _before_settle(self, what: str) -> None:
        if has_ended(self.record):
            raise RuntimeError(
                f"{what}: activity {self.id} has already ended ({self.record['state']}); "
                "report the usage before the settle, or pass usage= to it"
            )

    def report_usage(
        self,
        usage: Optional[Usage] = None,
        *,
        input_tokens: Optional[int] = None,
        output_tokens: Optional[int] = None,
    ) -> Optional[Usage]:
        """Sets the usage the record's settle carries (the block's, or
        ``succeed``/``fail``/``settle`` without ``usage=``): a ``Usage``, or
        its counts as ``input_tokens``/``output_tokens``. Checked here (see
        ``Usage``). It wins over ``report_usage_of``, called before or after;
        a second report replaces the first. Nothing given (``None``, as
        ``report_usage(usage_of(answer))`` gives for an answer with no usage)
        reports nothing. ``RuntimeError`` once the record has ended. Returns
        the usage the settle will carry."""
        if usage is None:
            if input_tokens is None and output_tokens is None:
                return self._usage
            usage = Usage(input_tokens, output_tokens)
        elif input_tokens is not None or output_tokens is not None:
            raise TypeError("report_usage: give a Usage or input_tokens/output_tokens, not both")
        elif not isinstance(usage, Usage):
            raise TypeError(
                f"report_usage: usage must be an inflight_ledger.Usage, not {type(usage).__name__}"
            )
        self._before_settle("report_usage")
        self._usage = usage
        self._usage_explicit = True
        return usage

    def report_usage_of(self, result: Any) -> Optional[Usage]:
        """Reads the usage of a provider's answer with ``usage_extractor``
        (``usage_of`` unless the block was given another; ``None`` reads
        nothing) for the settle to carry, unless ``report_usage`` reported
        one (it wins). An answer with no usage changes nothing; a second
        answer's replaces the first's. An extractor that raises, or returns
        something other than a ``Usage`` or ``None``, is warned about
        (``RuntimeWarning``) and read as no usage: the call's outcome
        stands. Returns the usage the settle will carry."""
        extractor = self.usage_extractor
        if extractor is None or self._usage_explicit:
            return self._usage
        try:
            found = extractor(result)
            if found is not None and not isinstance(found, Usage):
                raise TypeError(f"it returned {type(found).__name__}, not a Usage or None")
        except Exception as err:  # noqa: BLE001 - the call's outcome stands without its usage
            warnings.warn(
                f"inflight: the usage extractor {getattr(extractor, '__name__', extractor)!r} failed on "
                f"activity {self.id} ({err}); its settle carries no usage from the answer",
                RuntimeWarning,
                stacklevel=2,
            )
            return self._usage
        if found is not None:
            self._before_settle("report_usage_of")
            self._usage = found
        return self._usage


def now_ms() -> int:
    return int(datetime.now(timezone.utc).timestamp() * 1000)


#: The server's label rule: ``LABEL_PATTERN`` decides; the two below only word the refusal.
_LABEL = re.compile(LABEL_PATTERN)
_MAX_LABEL_LEN = 64
_LABEL_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


@dataclass(frozen=True)
class ActivityContext:
    """The attribution of a ``context()`` block: what every record the client
    begins inside it takes for the fields the begin leaves out (absent or
    ``None``). ``None`` here is "not set": a nested block inherits it."""

    service: Optional[str] = None
    operation_stage: Optional[str] = None
    priority: Optional[Priority] = None

    @classmethod
    def checked(
        cls, service: Optional[str], operation_stage: Optional[str], priority: Optional[Priority]
    ) -> "ActivityContext":
        """The context, checked as the server checks a begin's fields: each
        label 1 to 64 characters of ``A-Z a-z 0-9 . _ -``, the priority one of
        ``PRIORITIES``. Raises ``TypeError`` (not a string) or ``ValueError``
        naming the field otherwise."""
        for name, value in (("service", service), ("operation_stage", operation_stage)):
            if value is not None:
                _check_label(name, value)
        if priority is not None and priority not in PRIORITIES:
            raise ValueError(
                f"context: invalid priority: {priority!r} is not one of {', '.join(repr(p) for p in PRIORITIES)}"
            )
        return cls(service, operation_stage, priority)

    def over(self, outer: Optional["ActivityContext"]) -> "ActivityContext":
        """This context nested in ``outer``: its own fields win, the ones it leaves ``None`` are the outer's."""
        if outer is None:
            return self
        return ActivityContext(
            self.service if self.service is not None else outer.service,
            self.operation_stage if self.operation_stage is not None else outer.operation_stage,
            self.priority if self.priority is not None else outer.priority,
        )

    def fill(self, body: Dict[str, Any]) -> None:
        """Sets the context's values in a begin's body (wire names) where the body has none."""
        for key, value in (("service", self.service), ("operationStage", self.operation_stage),
                           ("priority", self.priority)):
            if value is not None and body.get(key) is None:
                body[key] = value


def _check_label(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"context: invalid {name}: must be a string, not {type(value).__name__}")
    if _LABEL.fullmatch(value):
        return
    if not value:
        problem = "must not be empty"
    elif len(value) > _MAX_LABEL_LEN:
        problem = f"must be at most {_MAX_LABEL_LEN} characters"
    else:
        bad = next((c for c in value if c not in _LABEL_CHARS), None)
        problem = (
            f"must match {LABEL_PATTERN}"
            if bad is None
            else f"character {bad!r} is not allowed (use A-Z, a-z, 0-9, '.', '_', '-')"
        )
    raise ValueError(f"context: invalid {name}: {problem}")


class ContextBlock:
    """``with client.context(...):`` (see ``Attributed.context``). Entering
    sets the client's context (this one over the enclosing one), leaving
    restores the enclosing one. The block's value is the context in force."""

    def __init__(self, var: "contextvars.ContextVar[Optional[ActivityContext]]", context: ActivityContext) -> None:
        self._var = var
        self._context = context
        # A stack, so the same block object may be entered again inside itself.
        self._tokens: List["contextvars.Token[Optional[ActivityContext]]"] = []

    def __enter__(self) -> ActivityContext:
        merged = self._context.over(self._var.get())
        self._tokens.append(self._var.set(merged))
        return merged

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self._var.reset(self._tokens.pop())


class Attributed:
    """The attribution context of a client (``Ledger``, ``AsyncLedger``): a
    ``contextvars.ContextVar`` of the client's own, so another client's
    begins never see it."""

    _attribution: "contextvars.ContextVar[Optional[ActivityContext]]"

    def _init_attribution(self) -> None:
        # One variable per client (not per call): what a Context holds of it
        # is reset when each block ends.
        self._attribution = contextvars.ContextVar(f"inflight_ledger.context.{id(self):x}", default=None)

    def context(
        self,
        *,
        service: Optional[str] = None,
        operation_stage: Optional[str] = None,
        priority: Optional[Priority] = None,
    ) -> ContextBlock:
        """``with client.context(service=..., operation_stage=..., priority=...):``
        every record this client begins inside the block (``begin``,
        ``activity``, ``observe_unqueued``), however deep in the calls it
        makes, takes these values for the fields the begin leaves out (absent
        or ``None``); a field the begin sets wins. On ``contextvars``: the
        context holds across ``await``s and in asyncio tasks created inside
        the block (each task copies it when created); a thread started
        inside does not inherit it (run it with
        ``contextvars.copy_context().run``). A nested block overrides the
        fields it sets and inherits the ones it leaves ``None``. The context
        is this client's: another client's begins do not see it.

        The values are checked here, as the server checks a begin's fields:
        a bad one raises ``ValueError`` (``TypeError`` for a non-string
        label) naming the field, before the block runs."""
        return ContextBlock(self._attribution, ActivityContext.checked(service, operation_stage, priority))

    def _current_context(self) -> Optional[ActivityContext]:
        return self._attribution.get()


def build_spec(
    spec: Optional[Mapping[str, Any]],
    fields: Mapping[str, Any],
    owner_id: Optional[str],
    context: Optional[ActivityContext] = None,
) -> BeginRequest:
    """A begin's body from a mapping (wire names) and keyword arguments (snake
    case), with ``context``'s values for the attribution fields it leaves out.
    Its ``maxTokens`` (``max_tokens``) is checked like a count of ``Usage``:
    ``TypeError`` or ``ValueError`` naming it, before any request."""
    body: Dict[str, Any] = dict(spec or {})
    for key, value in fields.items():
        body[_SNAKE_TO_WIRE.get(key, key)] = value
    if context is not None:
        context.fill(body)
    for key in ("enqueuedAt", "startedAt"):
        if key in body:
            body[key] = wire_time(body[key])
    if body.get("ownerId") is None and owner_id is not None:
        body["ownerId"] = owner_id
    if body.get("maxTokens") is not None:
        body["maxTokens"] = _tokens("max_tokens", body["maxTokens"], "begin")
    body = {k: v for k, v in body.items() if v is not None}
    return body  # type: ignore[return-value]


@dataclass
class Config:
    base_url: str
    token: Optional[str]
    timeout: float
    retries: int
    backoff: float
    max_backoff: float
    #: What httpx verifies the server's certificate with: a context trusting
    #: the given CA, else httpx's default roots.
    verify: Union[ssl.SSLContext, bool] = True

    @classmethod
    def make(
        cls,
        base_url: Optional[str],
        token: Optional[str],
        timeout: float,
        retries: int,
        backoff: float,
        max_backoff: float,
        ca_file: Optional[str] = None,
        ca: Optional[str] = None,
    ) -> "Config":
        url = base_url or os.environ.get("INFLIGHT_URL") or DEFAULT_URL
        tok = token if token is not None else (os.environ.get("INFLIGHT_TOKEN") or None)
        verify = ca_context(ca_file, ca)
        return cls(url.rstrip("/"), tok or None, timeout, retries, backoff, max_backoff, True if verify is None else verify)

    def url(self, route: str, id: Optional[str], query: Optional[Mapping[str, Any]]) -> str:
        path = ROUTES[route].path
        if id is not None:
            path = path.replace("{id}", quote(id, safe=""))
        q = {k: v for k, v in (query or {}).items() if v is not None}
        return self.base_url + path + ("?" + urlencode(q) if q else "")

    def headers(
        self, has_body: bool, idempotency_key: Optional[str] = None, traceparent: Optional[str] = None
    ) -> Dict[str, str]:
        headers = {"accept": "application/json"}
        if has_body:
            headers["content-type"] = "application/json"
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        if idempotency_key is not None:
            headers[IDEMPOTENCY_KEY_HEADER] = idempotency_key
        if traceparent is not None:
            headers[TRACEPARENT_HEADER] = traceparent
        return headers

    def delay(self, attempt: int, error: InflightError) -> float:
        """Exponential backoff with jitter (half fixed, half random), at least
        the server's ``Retry-After`` (up to ``max_backoff``)."""
        backoff = min(self.max_backoff, self.backoff * float(2**attempt))
        jittered = backoff / 2 + random.random() * backoff / 2
        return max(jittered, min(error.retry_after or 0.0, self.max_backoff))


def ca_context(ca_file: Optional[str], ca: Optional[str]) -> Optional[ssl.SSLContext]:
    """A context trusting only the CA in ``ca`` (PEM text), else in the file
    ``ca_file`` or ``INFLIGHT_CA_FILE`` names; ``None`` when none is given."""
    if ca is not None and ca_file is not None:
        raise ValueError("give ca or ca_file, not both")
    if ca is not None:
        try:
            return ssl.create_default_context(cadata=ca)
        except ssl.SSLError as err:
            raise ValueError(f"ca holds no usable PEM certificate: {err}") from err
    source = "ca_file" if ca_file is not None else "INFLIGHT_CA_FILE"
    path = ca_file if ca_file is not None else (os.environ.get("INFLIGHT_CA_FILE") or None)
    if path is None:
        return None
    try:
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"cannot read the CA file {path} ({source}): {err}") from err


def read_answer(response: httpx.Response, what: str) -> Any:
    """The answer's JSON, or the ``InflightError`` its error body names."""
    if response.is_success:
        return response.json() if response.content else None
    retry_after: Optional[float] = None
    try:
        retry_after = float(response.headers.get("retry-after", ""))
    except ValueError:
        pass
    try:
        error = json.loads(response.content)["error"]
        code, message = error["code"], error["message"]
        if code in SERVER_ERROR_CODES:
            raise error_for(
                code, f"{what}: {message}", status=response.status_code, retry_after=retry_after, from_server=True
            )
    except (ValueError, KeyError, TypeError):
        pass  # not the server's error body: a proxy or something else answered
    code = "unavailable" if response.status_code >= 500 else "invalid_request"
    raise error_for(
        code, f"{what}: HTTP {response.status_code} {response.text[:200]}", status=response.status_code, retry_after=retry_after
    )


#: getaddrinfo's failures (socket.gaierror), which errno.errorcode does not name.
_GAI_ERRORS = {
    getattr(socket, name): (name, words)
    for name, words in (
        ("EAI_NONAME", "no such host"),
        ("EAI_AGAIN", "the host name could not be resolved (DNS)"),
        ("EAI_FAIL", "the host name could not be resolved (DNS)"),
        ("EAI_NODATA", "no such host"),
    )
    if hasattr(socket, name)
}

#: OS errors of a connection, in words.
_ERRNO_WORDS = {
    "ECONNREFUSED": "connection refused",
    "ECONNRESET": "connection reset",
    "ECONNABORTED": "connection aborted",
    "EPIPE": "connection closed while sending",
    "EHOSTUNREACH": "host unreachable",
    "ENETUNREACH": "network unreachable",
    "ETIMEDOUT": "connection timed out",
}


def _why(err: BaseException, timeout: Optional[float]) -> str:
    """Why a request got no answer, in words, with the OS's code when there
    is one (``connection refused (ECONNREFUSED)``). httpx keeps the OS error
    as the cause of its own."""
    cause: Optional[BaseException] = err
    while cause is not None:
        if isinstance(cause, socket.gaierror) and cause.errno in _GAI_ERRORS:
            name, words = _GAI_ERRORS[cause.errno]
            return f"{words} ({name})"
        if isinstance(cause, OSError) and isinstance(cause.errno, int) and cause.errno in errno.errorcode:
            name = errno.errorcode[cause.errno]
            return f"{_ERRNO_WORDS.get(name) or cause.strerror or name} ({name})"
        cause = cause.__cause__ or cause.__context__
    if isinstance(err, httpx.ConnectTimeout):
        return "connection timed out"
    if isinstance(err, httpx.TimeoutException):
        return "no answer in time" if timeout is None else f"no answer within {timeout:g} s"
    if isinstance(err, httpx.RemoteProtocolError):
        return f"the connection closed without an answer ({err})"
    return f"{type(err).__name__}: {err}"


def unavailable(what: str, base: str, err: BaseException, timeout: Optional[float] = None) -> UnavailableError:
    """The error for a request that got no answer: ``TLSError`` when the TLS
    handshake failed (httpx keeps the ``ssl`` error as a cause), else
    ``UnavailableError``. Each names the server (``base``) and the cause."""
    cause: Optional[BaseException] = err
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return TLSError(
            "unavailable",
            f"{what}: the TLS certificate of {base} was refused: {cause.verify_message or cause}; "
            "trust its certificate authority with ca_file or INFLIGHT_CA_FILE",
        )
    if cause is not None:
        hint = " (does the server serve TLS? if not, its URL is http://)" if cause.reason == "WRONG_VERSION_NUMBER" else ""
        return TLSError("unavailable", f"{what}: the TLS handshake with {base} failed: {cause}{hint}")
    hint = ""
    # A TLS server answers a plain request with a TLS alert, which is no HTTP.
    if isinstance(err, httpx.RemoteProtocolError) and base.startswith("http:"):
        hint = "; does the server serve https? then its URL is https://"
    return UnavailableError("unavailable", f"{what}: cannot reach {base}: {_why(err, timeout)}{hint}")


def key_for(route: str, given: Optional[str]) -> Optional[str]:
    """The ``Idempotency-Key`` a request on ``route`` carries: ``given``, else a
    fresh random UUID (v4) for a route that takes one (a begin); made once
    per request, so each of its retries sends the same key. ``None`` for a
    route that takes none (giving one there raises ``ValueError``)."""
    r = ROUTES[route]
    if IDEMPOTENCY_KEY_HEADER not in r.headers:
        if given is not None:
            raise ValueError(f"request: {r.method} {r.path} takes no {IDEMPOTENCY_KEY_HEADER}")
        return None
    return given if given is not None else str(uuid.uuid4())


def traceparent_header(route: str, traceparent: Optional[str]) -> Optional[str]:
    """The ``traceparent`` header a request on ``route`` carries: the one
    given, sent as is with each attempt; only a begin takes one (giving one
    elsewhere raises ``ValueError``). ``request`` never looks for the
    current span: the methods that begin records do."""
    if traceparent is None:
        return None
    r = ROUTES[route]
    if TRACEPARENT_HEADER not in r.headers:
        raise ValueError(f"request: {r.method} {r.path} takes no {TRACEPARENT_HEADER}")
    return traceparent


def has_ended(record: ActivityRecord) -> bool:
    """Whether the record has ended (settled, cancelled or reaped)."""
    return record["state"] not in ("waiting", "executing")


#: What a begin does when its answer's record has ended (see ``begin_anew``):
#: given the record and the seconds since the begin was first sent, the
#: error to raise instead of beginning anew, or ``None`` to begin anew.
Instead = Callable[[ActivityRecord, float], Optional[BaseException]]


def begin_anew(
    record: ActivityRecord, elapsed: float, instead: Instead, anew: int, retries: int
) -> None:
    """After a begin answered a record that has ended: returns to begin anew
    (with a new key), or raises. A first begin answers a record in flight
    (or 429); an ended one is a repeat's, whose record ended before the
    first answer came (cancelled or reaped), so no one holds it. ``instead``
    says what to raise rather than begin anew; and at most ``retries``
    begins are made anew, then ``UnavailableError``."""
    error = instead(record, elapsed)
    if error is not None:
        raise error
    if anew >= retries:
        raise UnavailableError(
            "unavailable",
            f"POST /v1/activities: the record of each of {anew + 1} begins ended before its answer arrived "
            f"(the last: activity {record['activityId']}, {record['state']}); no record was begun",
        )


def no_wait_left(wait: Optional[float]) -> Instead:
    """``begin(start_now=True, wait=...)``: a repeat that finds its record
    ended (cancelled after its wait, or when its request was dropped) is
    ``LaneFullError`` once ``wait`` has passed, as the server's answer to a
    wait that ended; before, the begin is made anew for the wait left."""

    def instead(record: ActivityRecord, elapsed: float) -> Optional[BaseException]:
        if wait is None or elapsed < wait:
            return None
        return LaneFullError(
            "lane_full",
            f"POST /v1/activities: lane {record['service']}::{record['provider']} did not admit activity "
            f"{record['activityId']} within {wait:g} s; it is recorded {record['state']} and holds no place in "
            "line (the begin was sent again after its answer was lost, and found it so)",
        )

    return instead


def in_line(max_wait: Optional[float], cancel: Optional[threading.Event] = None) -> Instead:
    """The blocks (``activity``, ``observe_unqueued``): a begin whose record
    ended before its answer came is made anew while the call would still wait
    in line, but not once its ``cancel`` event is set (``WaitCancelledError``)
    nor past ``max_wait`` (``WaitTimeoutError``, as for a wait in line that
    ran out). The ended record needs no cancel, and the block never runs
    with it."""

    def instead(record: ActivityRecord, elapsed: float) -> Optional[BaseException]:
        if cancel is not None and cancel.is_set():
            return wait_cancelled(record)
        if max_wait is not None and elapsed >= max_wait:
            return wait_timeout(
                record,
                max_wait,
                f" (it is recorded {record['state']}: its begin was sent again after its answer was lost, "
                "and found it so)",
            )
        return None

    return instead


def retryable(route: str, err: InflightError) -> bool:
    """Whether a failed request may be sent again. An idempotent one (a begin
    is, with its ``Idempotency-Key``): when no answer came, or a 5xx. Any
    other (an owner registration): only when the server itself answered that
    it did not handle the request (503 ``unavailable`` at a limit, 408
    ``request_timeout``), since a lost answer may have registered it. Never
    after a failed TLS handshake, which would fail again."""
    if isinstance(err, TLSError):
        return False
    if err.from_server and err.code in ("unavailable", "request_timeout"):
        return True
    return ROUTES[route].idempotent and err.code in ("unavailable", "internal")


#: The refusals a wait in line keeps waiting through: the lane at its cap,
#: the lane cooling down after a provider's ``Retry-After``, and the call's
#: tokens not fitting in a token budget.
WAIT_CODES: Tuple[str, ...] = ("lane_full", "lane_cooling", "budget_exhausted")


def pause_before_asking(err: InflightError, deadline: Optional[float], now: float) -> float:
    """Seconds to wait before asking a lane again after ``err`` refused a
    wait in line: for ``lane_cooling`` with a ``Retry-After``, until then
    (the server admits nothing before), but never past ``deadline`` (a
    ``time.monotonic()`` value, ``None`` for none); else none (a
    ``?wait=`` request is held by the server, so asking again at once does
    not spin). ``budget_exhausted``'s ``Retry-After`` is no such bound, only
    when the window makes room by itself (60 s when only a settle can): a
    settle reporting less than its estimate makes room sooner, and the
    server's held ``?wait=`` wakes for it, so after it too none."""
    if err.code != "lane_cooling" or not err.retry_after or err.retry_after <= 0:
        return 0.0
    pause = float(err.retry_after)
    if deadline is not None:
        pause = min(pause, max(0.0, deadline - now))
    return pause


#: Delta-seconds (RFC 9110 allows digits only; a fraction is taken too).
_DELTA_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def _header(headers: Any, name: str) -> Optional[str]:
    """The header ``name`` (lower case) of an httpx-like ``headers``: a
    case-insensitive mapping (httpx, requests), or a plain one."""
    if headers is None:
        return None
    value: Any = None
    get = getattr(headers, "get", None)
    if callable(get):
        value = get(name)
    if value is None and callable(getattr(headers, "items", None)):
        for key, item in headers.items():
            if isinstance(key, (str, bytes)) and (key.decode("latin-1") if isinstance(key, bytes) else key).lower() == name:
                value = item
                break
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value if isinstance(value, str) else None


def retry_after_ms(response: Any) -> Optional[int]:
    """A provider's ``Retry-After`` in milliseconds, for a failure settle's
    ``retry_after_ms``: read from ``response``, an ``httpx.Response`` or any
    object with ``status_code`` and ``headers`` (a ``requests.Response``,
    ``openai.APIStatusError.response``). The header is delta-seconds
    (``"2"``; a fraction such as ``"1.5"`` is taken too) or an HTTP-date (in
    any of its three forms, counted from this machine's clock). The result
    is clamped to 1..3600000 (a date already past is 1). ``None`` when the
    status is not 429 or 503, or the header is absent or unparseable."""
    status = getattr(response, "status_code", None)
    if isinstance(status, bool) or status not in (429, 503):
        return None
    value = _header(getattr(response, "headers", None), "retry-after")
    if value is None:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        ms = float(value) * 1000
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when is None:
            return None
        if when.tzinfo is None:  # asctime and "-0000" carry no zone: HTTP-dates are GMT
            when = when.replace(tzinfo=timezone.utc)
        ms = (when - datetime.now(timezone.utc)).total_seconds() * 1000
    return max(RETRY_AFTER_MS_MIN, min(RETRY_AFTER_MS_MAX, math.ceil(ms)))


#: The clients' connections: as many as there are requests at once, since a
#: call waiting in line holds one open for up to its ``wait_step``; under
#: httpx's default cap of 100, a settle (the one that frees the slot the
#: waiters want) would queue behind them.
CONNECTIONS = httpx.Limits(max_connections=None, max_keepalive_connections=20)


def checked_wait_step(wait_step: float) -> float:
    """``wait_step``, a number of seconds above 0; a step of 0 would ask
    again and again without waiting: ``ValueError`` naming it."""
    if isinstance(wait_step, bool) or not isinstance(wait_step, (int, float)) or not wait_step > 0:
        raise ValueError(f"wait_step must be a number of seconds above 0; got {wait_step!r}")
    return float(wait_step)


def failure_stage_for(
    exc: BaseException, failure_stage: Union[FailureStage, Callable[[BaseException], FailureStage]]
) -> FailureStage:
    """The stage a block that raised ``exc`` fails with: ``failure_stage(exc)``
    when it is a function, ``"unknown"`` when that raises (the record is
    still settled, and the block's own exception is the one that goes on)."""
    if not callable(failure_stage):
        return failure_stage
    try:
        return failure_stage(exc)
    except Exception:  # noqa: BLE001 - a stage that cannot be read is unknown
        return "unknown"


def retry_after_of(exc: Optional[BaseException]) -> Optional[int]:
    """The provider's ``Retry-After`` (milliseconds, see ``retry_after_ms``)
    an exception carries, for the failure settle of a block it ended. Shapes
    recognised: an exception whose ``response`` attribute has
    ``status_code`` and ``headers`` (``httpx.HTTPStatusError``, the
    ``openai`` package's ``APIStatusError`` and its subclasses such as
    ``RateLimitError``, ``requests.HTTPError``), or one raised ``from`` such
    an exception (its ``__cause__`` chain, explicit chaining only). ``None``
    for any other."""
    seen: Set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        try:
            response = getattr(exc, "response", None)
        except Exception:  # noqa: BLE001 - a property that raises carries no answer
            response = None
        if response is not None and hasattr(response, "status_code") and hasattr(response, "headers"):
            ms = retry_after_ms(response)
            if ms is not None:
                return ms
        exc = exc.__cause__
    return None


def wait_param(seconds: Optional[float]) -> Optional[str]:
    if seconds is None:
        return None
    return f"{max(0, min(int(MAX_WAIT_STEP * 1000), int(seconds * 1000)))}ms"


def wait_timeout(record: ActivityRecord, max_wait: Optional[float], note: str = "") -> WaitTimeoutError:
    return WaitTimeoutError(
        "wait_timeout",
        f"activity {record['activityId']} was not admitted on {record['service']}::{record['provider']} "
        f"within {max_wait} s{note}",
    )


def wait_cancelled(record: ActivityRecord) -> WaitCancelledError:
    return WaitCancelledError(
        "wait_cancelled",
        f"activity {record['activityId']} on {record['service']}::{record['provider']}: "
        "its cancel event was set while it waited in line; the record is cancelled",
    )


def cancel_reason(exc: Optional[BaseException]) -> str:
    if isinstance(exc, WaitTimeoutError):
        return "wait timeout"
    if isinstance(exc, WaitCancelledError):
        return "cancelled"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return "cancelled"


def default_ledger_error(err: BaseException, record: ActivityRecord) -> None:
    warnings.warn(
        f"inflight: could not record how activity {record['activityId']} ended ({err}); "
        "the server reaps it past its bound",
        RuntimeWarning,
        stacklevel=3,
    )


def is_abort(exc: Optional[BaseException]) -> bool:
    """Whether a block ended by an abort (settled ``cancelled``) rather than an error (``failed``)."""
    return exc is not None and not isinstance(exc, Exception)


__all__ = [
    "ActivityContext",
    "Attributed",
    "Config",
    "ContextBlock",
    "IgnoredFieldsLog",
    "InflightError",
    "Instead",
    "Lifecycle",
    "Usage",
    "UsageExtractor",
    "UsageReport",
    "WAIT_CODES",
    "begin_anew",
    "build_spec",
    "call_hook",
    "cancel_reason",
    "default_ledger_error",
    "has_ended",
    "in_line",
    "is_abort",
    "key_for",
    "no_wait_left",
    "now_ms",
    "pause_before_asking",
    "read_answer",
    "retry_after_ms",
    "retry_after_of",
    "retryable",
    "settle_body",
    "unavailable",
    "usage_of",
    "wait_cancelled",
    "wait_param",
    "wait_timeout",
]
