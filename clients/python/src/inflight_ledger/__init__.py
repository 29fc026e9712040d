"""inflight-ledger: a client of the inflight server, sync and asyncio.

    from inflight_ledger import Ledger

    ledger = Ledger("http://127.0.0.1:7878")
    with ledger.activity(service="knowledge-base", provider="ollama", class_="embedding") as call:
        ...  # the provider call: success, failure or cancelled by how the block exits
        call.report_usage(input_tokens=12)  # the tokens its settle carries
"""

from ._common import ActivityContext, ContextBlock, Lifecycle, Usage, UsageExtractor, retry_after_ms, usage_of
from .aio import AsyncActivity, AsyncActivityBlock, AsyncLedger, AsyncOwnerLease
from .errors import (
    BudgetExhaustedError,
    ConflictError,
    ForbiddenError,
    IdempotencyConflictError,
    InflightError,
    InvalidRequestError,
    LaneCoolingError,
    LaneFullError,
    NotFoundError,
    RequestTimeoutError,
    TLSError,
    UnauthorizedError,
    UnavailableError,
    WaitCancelledError,
    WaitTimeoutError,
    error_for,
)
from .sync import Activity, ActivityBlock, Ledger, OwnerLease
from .wire import (
    IDEMPOTENCY_KEY_HEADER,
    LABEL_PATTERN,
    PRIORITIES,
    ROUTES,
    ROUTES_NOT_CALLED,
    SERVER_ERROR_CODES,
    TRACEPARENT_HEADER,
    TYPES,
    ActivityRecord,
    BeginRequest,
    Owner,
    Snapshot,
    SnapshotWarning,
    field_names,
)

__version__ = "0.1.0"

__all__ = [
    "Activity",
    "ActivityBlock",
    "ActivityContext",
    "ActivityRecord",
    "AsyncActivity",
    "AsyncActivityBlock",
    "AsyncLedger",
    "AsyncOwnerLease",
    "BeginRequest",
    "BudgetExhaustedError",
    "ConflictError",
    "ContextBlock",
    "ForbiddenError",
    "IDEMPOTENCY_KEY_HEADER",
    "IdempotencyConflictError",
    "InflightError",
    "InvalidRequestError",
    "LaneCoolingError",
    "LaneFullError",
    "Ledger",
    "Lifecycle",
    "NotFoundError",
    "Owner",
    "OwnerLease",
    "LABEL_PATTERN",
    "PRIORITIES",
    "ROUTES",
    "RequestTimeoutError",
    "ROUTES_NOT_CALLED",
    "SERVER_ERROR_CODES",
    "Snapshot",
    "SnapshotWarning",
    "TLSError",
    "TRACEPARENT_HEADER",
    "TYPES",
    "UnauthorizedError",
    "UnavailableError",
    "Usage",
    "UsageExtractor",
    "WaitCancelledError",
    "WaitTimeoutError",
    "error_for",
    "field_names",
    "retry_after_ms",
    "usage_of",
]
