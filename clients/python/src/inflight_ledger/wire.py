"""The wire: every route this client calls and every body it sends or reads,
as docs/api.md and ``GET /openapi.json`` describe them.

The ``TypedDict``s are also read at run time (their keys), so the test suite
compares what the client sends and reads with the server's OpenAPI document.
"""

from __future__ import annotations

from typing import Dict, List, Literal, Optional, Set, Tuple, TypedDict, Union, get_args

#: A timestamp in a request: epoch milliseconds or an RFC 3339 string.
TimestampInput = Union[int, str]

Priority = Literal["interactive", "batch", "unknown"]
#: The priorities a begin accepts (``unknown`` is the default), as a tuple;
#: the test suite compares them with the server's document.
PRIORITIES: Tuple[Priority, ...] = get_args(Priority)
#: What a label must match, as the server's OpenAPI document says it (checked
#: against it by the tests).
LABEL_PATTERN = "^[A-Za-z0-9._-]{1,64}$"
Admission = Literal["queued", "direct", "external"]
State = Literal["waiting", "executing", "succeeded", "failed", "cancelled", "reaped"]
Disposition = Literal["abandoned", "unsettled"]
ReapReason = Literal["deadline", "owner-lost"]
FailureStage = Literal["provider", "queue", "unknown"]
OwnerState = Literal["live", "lost", "released"]

#: The server's stable error codes (``{"error": {"code": ...}}``).
SERVER_ERROR_CODES: Tuple[str, ...] = (
    "invalid_request",
    "unauthorized",
    "forbidden",
    "not_found",
    "method_not_allowed",
    "request_timeout",
    "conflict",
    "payload_too_large",
    "lane_full",
    "lane_cooling",
    "budget_exhausted",
    "idempotency_conflict",
    "internal",
    "unavailable",
    # The proxy's (`/proxy/NAME/...`); the client does not call it.
    "upstream_unreachable",
    "upstream_timeout",
)

_BeginRequired = TypedDict("_BeginRequired", {"service": str, "provider": str})
_BeginOptional = TypedDict(
    "_BeginOptional",
    {
        "class": str,
        "operationStage": str,
        "model": str,
        "priority": Priority,
        "admission": Admission,
        "enqueuedAt": TimestampInput,
        "startedAt": TimestampInput,
        "deadlineMs": int,
        "ownerId": str,
        # The tokens the call is estimated to spend (prompt and answer),
        # TOKENS_MIN to TOKENS_MAX: executing, it reserves them in its lane.
        "maxTokens": int,
    },
    total=False,
)


class BeginRequest(_BeginRequired, _BeginOptional):
    """``POST /v1/activities``: ``service`` and ``provider`` name the lane."""


class StartRequest(TypedDict, total=False):
    startedAt: TimestampInput


class _SettleRequired(TypedDict):
    success: bool


#: The bounds of a settle's ``retryAfterMs`` (and of what ``retry_after_ms`` returns).
RETRY_AFTER_MS_MIN = 1
RETRY_AFTER_MS_MAX = 3_600_000


#: The bounds of each count of a settle's ``usage`` and of a begin's
#: ``maxTokens`` (whole numbers).
TOKENS_MIN = 0
TOKENS_MAX = 1_000_000_000


class SettleUsage(TypedDict, total=False):
    """A settle's ``usage``: the tokens the provider reported for the call,
    each a whole number from 0 to 1000000000, each optional."""

    inputTokens: int
    outputTokens: int


class SettleRequest(_SettleRequired, total=False):
    failureStage: FailureStage
    completedAt: TimestampInput
    #: The provider's ``Retry-After`` in milliseconds (1 to 3600000), with a
    #: failure only: the lane grants no slot until it has passed (at most the
    #: server's ``max_cooldown``). An older server ignores it.
    retryAfterMs: int
    #: The call's token usage, with a success or a failure. A late settle
    #: (the record was reaped) keeps the usage of the first late settle.
    usage: SettleUsage


class CancelRequest(TypedDict, total=False):
    reason: str


class RefineRequest(TypedDict):
    """``POST /v1/activities/{id}/refine``: the model the call was dispatched
    to, once it is known (a non-empty string, as a begin's ``model``)."""

    model: str


class _RegisterOwnerRequired(TypedDict):
    name: str


class RegisterOwnerRequest(_RegisterOwnerRequired, total=False):
    ttlMs: int


_ActivityRecordBase = TypedDict(
    "_ActivityRecordBase",
    {
        "activityId": str,
        "service": str,
        "provider": str,
        "class": str,
        "operationStage": str,
        "model": str,
        "priority": Priority,
        "admission": Admission,
        "state": State,
        "disposition": Optional[Disposition],
        "reapReason": Optional[ReapReason],
        "ownerId": Optional[str],
        "enqueuedAt": str,
        "startedAt": Optional[str],
        "completedAt": Optional[str],
        "reapedAt": Optional[str],
        "deadlineMs": int,
        "reapableAt": Optional[str],
        "queueWaitMs": Optional[int],
        "executionMs": Optional[int],
        "success": Optional[bool],
        "failureStage": Optional[FailureStage],
        "lateSettle": bool,
    },
)


class ActivityRecord(_ActivityRecordBase, total=False):
    """Every activity route answers with the record."""

    #: Settled with success without ever starting (no ``startedAt``): not a
    #: normal completion. Absent from older servers (read it as false).
    unstartedSuccess: bool
    #: Whether a refinement (``Activity.refine``) landed on the record: its
    #: ``model`` is the refined one, or ``unknown`` after two different ones.
    #: Absent from older servers (read it as false: ``record.get("refined", False)``).
    refined: bool
    cancelReason: str  # present only when a cancel gave a reason
    #: The tokens its settle reported (``None`` when it reported none).
    #: Absent from servers older than usage (read them with ``.get``).
    inputTokens: Optional[int]
    outputTokens: Optional[int]
    #: The tokens it is estimated to spend: its begin's ``maxTokens``, else
    #: its class's ``tokens``; ``None`` when neither. Absent from servers
    #: older than estimates (read it with ``.get``).
    maxTokens: Optional[int]
    ignoredFields: List[str]  # on a begin's answer only: the request's fields the server ignored
    #: The W3C ``traceparent`` its begin carried (``TRACEPARENT_HEADER``),
    #: whose span is the parent of the span the server exports when the record
    #: ends. Absent when the begin carried none, and from servers older than it.
    traceparent: str


class InFlightRecord(ActivityRecord):
    elapsedMs: int


class ReapedRecord(ActivityRecord):
    ageMs: int


class Owner(TypedDict):
    ownerId: str
    name: str
    ttlMs: int
    registeredAt: str
    renewedAt: str
    expiresAt: str
    state: OwnerState
    endedAt: Optional[str]
    reapedRecords: int
    cancelledRecords: int


class ReapCounts(TypedDict):
    abandoned: int
    unsettled: int


class PriorityCounts(TypedDict):
    executing: int
    waiting: int


class ByPriority(TypedDict):
    """A lane's records in flight by priority (all three always present)."""

    interactive: PriorityCounts
    batch: PriorityCounts
    unknown: PriorityCounts


class _LaneBase(TypedDict):
    service: str
    provider: str
    cap: Optional[int]
    executing: int
    waiting: int
    reaped: ReapCounts
    reapedOwnerLost: int
    lateSettles: int
    resurrections: int
    longestWaitMs: int


class Lane(_LaneBase, total=False):
    """A lane of the snapshot's ``nativeAdmission``. The fields below are
    absent from servers older than cooldowns, ``tokensLastMinute`` from
    servers older than usage, ``tokensReserved`` from servers older than
    estimates, and ``tokensPerMinute`` and ``providerTokensPerMinute`` from
    servers older than token budgets (read them with ``.get``)."""

    #: When the lane's cooldown ends (RFC 3339), or ``None`` when it is not cooling down.
    coolingUntil: Optional[str]
    #: The cap admissions go by: ``cap``, unless an adaptive lane lowered it;
    #: ``None`` for a lane with no cap.
    effectiveCap: Optional[int]
    #: How many cooldowns the lane ever started.
    cooldowns: int
    byPriority: ByPriority
    #: The tokens the lane's calls reported in the last minute (by the second
    #: of their settle), and the estimates (``maxTokens``) of its calls that
    #: ran and reported no usage.
    tokensLastMinute: int
    #: The estimates (``maxTokens``) of the lane's calls executing.
    tokensReserved: int
    #: The lane's own token budget (``tokens_per_minute`` in the server's
    #: configuration), or ``None`` when it has none. A start whose estimate
    #: does not fit is refused ``budget_exhausted`` (``BudgetExhaustedError``).
    tokensPerMinute: Optional[int]
    #: Its provider's token budget, shared by every lane of the provider, or
    #: ``None`` when it has none; it refuses a start as the lane's own does.
    providerTokensPerMinute: Optional[int]


_AggregateBase = TypedDict(
    "_AggregateBase",
    {
        "service": str,
        "operationStage": str,
        "class": str,
        "provider": str,
        "model": str,
        "priority": Priority,
        "admission": Admission,
        "calls": int,
        "successes": int,
        "failures": int,
        "cancelled": int,
        "reaped": ReapCounts,
        "lateSettles": int,
        "inFlight": int,
        "avgQueueWaitMs": Optional[int],
        "maxQueueWaitMs": Optional[int],
        "avgExecutionMs": Optional[int],
        "maxExecutionMs": Optional[int],
        "lastSeenAt": Optional[str],
    },
)


class Aggregate(_AggregateBase, total=False):
    #: Of ``successes``, records that never started (absent from older servers).
    successesUnstarted: int
    #: The sums of the usage its records' settles reported (absent from
    #: servers older than usage).
    inputTokens: int
    outputTokens: int


class SnapshotWarning(TypedDict):
    """Show a ``code`` this client does not know like any other."""

    code: str
    message: str


class _SnapshotBase(TypedDict):
    status: Literal["ok", "degraded"]
    at: str
    since: str
    nativeAdmission: Dict[str, Lane]
    totalActivities: int
    totalSucceeded: int
    totalFailed: int
    totalCancelled: int
    totalInFlight: int
    totalRecentCompletions: int
    totalReaped: int
    totalReapedOwnerLost: int
    totalLateSettles: int
    totalResurrections: int
    reapedThisRead: ReapCounts
    inFlight: List[InFlightRecord]
    recentCompletions: List[ActivityRecord]
    reaped: List[ReapedRecord]
    inFlightTruncated: bool
    recentCompletionsTruncated: bool
    reapedTruncated: bool
    aggregates: List[Aggregate]
    owners: List[Owner]


class Snapshot(_SnapshotBase, total=False):
    #: Of ``totalSucceeded``, records that never started (absent from older servers).
    totalSucceededUnstarted: int
    #: What the server's configuration and the window's calls do not match
    #: (absent from older servers).
    warnings: List[SnapshotWarning]


class ErrorDetail(TypedDict):
    code: str
    message: str


class ErrorBody(TypedDict):
    error: ErrorDetail


#: Each type by the name of the server's type, for the OpenAPI check.
TYPES = {
    t.__name__: t
    for t in (
        BeginRequest,
        StartRequest,
        SettleRequest,
        SettleUsage,
        CancelRequest,
        RefineRequest,
        RegisterOwnerRequest,
        ActivityRecord,
        InFlightRecord,
        ReapedRecord,
        Owner,
        ReapCounts,
        Lane,
        ByPriority,
        PriorityCounts,
        Aggregate,
        Snapshot,
        SnapshotWarning,
        ErrorDetail,
        ErrorBody,
    )
}


def field_names(t: type) -> Set[str]:
    """Every key of a ``TypedDict`` (its own and its bases')."""
    return set(t.__required_keys__) | set(t.__optional_keys__)  # type: ignore[attr-defined]


#: The header that makes a begin idempotent: the client sends a fresh random
#: UUID (v4) with each begin, and the same one when it sends that begin again
#: after a lost answer or a 5xx.
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"

#: The header of a begin's W3C trace context (Trace Context level 1,
#: ``00-<trace id>-<span id>-<flags>``): the record keeps it, and the span the
#: server exports when the record ends is a child of that span. A malformed
#: one is refused (``InvalidRequestError``, its message starting
#: ``traceparent: ``). It is not part of an idempotent begin's request: a
#: retry sent from another span is the same begin.
TRACEPARENT_HEADER = "traceparent"


class Route:
    __slots__ = ("method", "path", "query", "idempotent", "headers")

    def __init__(
        self,
        method: str,
        path: str,
        query: Tuple[str, ...] = (),
        idempotent: bool = True,
        headers: Tuple[str, ...] = (),
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.idempotent = idempotent
        #: The header parameters the client sends on this route.
        self.headers = headers


#: Every route the client calls. A begin is idempotent through the
#: ``Idempotency-Key`` the client always sends with it (a repeat is answered
#: with the record the first made). An owner registration is not: a lost
#: answer may have registered it, and a second would be a second owner.
ROUTES: Dict[str, Route] = {
    "begin": Route("POST", "/v1/activities", ("start", "wait"), headers=(IDEMPOTENCY_KEY_HEADER, TRACEPARENT_HEADER)),
    "get": Route("GET", "/v1/activities/{id}"),
    "start": Route("POST", "/v1/activities/{id}/start", ("wait",)),
    "settle": Route("POST", "/v1/activities/{id}/settle"),
    "cancel": Route("POST", "/v1/activities/{id}/cancel"),
    "refine": Route("POST", "/v1/activities/{id}/refine"),
    "snapshot": Route("GET", "/v1/snapshot", ("limit", "since")),
    "reap": Route("POST", "/v1/reap"),
    "register_owner": Route("POST", "/v1/owners", idempotent=False),
    "renew_owner": Route("POST", "/v1/owners/{id}/renew"),
    "release_owner": Route("DELETE", "/v1/owners/{id}"),
    "healthz": Route("GET", "/healthz"),
}

#: Routes the server has that this client deliberately does not call (for
#: people and scrapers). A documented route in neither list fails the check.
ROUTES_NOT_CALLED: Tuple[str, ...] = (
    "GET /",
    "GET /dashboard.js",
    "GET /dashboard.css",
    "GET /metrics",
    "GET /openapi.json",
)
