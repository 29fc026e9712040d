"""Errors typed by the server's error ``code``."""

from __future__ import annotations

from typing import Dict, Optional, Type


class InflightError(Exception):
    """An error from the ledger.

    ``code`` is the server's code (``lane_full``, ``lane_cooling``,
    ``budget_exhausted``, ``not_found``,
    ``invalid_request``, ``conflict``, ``unauthorized``, ``unavailable``,
    ...) or the client's own ``wait_timeout`` (the call waited in line longer
    than its ``max_wait``) and ``wait_cancelled`` (its ``cancel`` event was
    set while it waited). ``unavailable`` is also the client's when no
    answer came, or a 5xx that is not the server's error body.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: Optional[int] = None,
        retry_after: Optional[float] = None,
        from_server: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        #: The HTTP status, when the server answered.
        self.status = status
        #: ``Retry-After`` in seconds, when the server sent one.
        self.retry_after = retry_after
        #: Whether the server itself answered with its error body. A 503
        #: ``unavailable`` or 408 ``request_timeout`` from it means nothing was recorded.
        self.from_server = from_server

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class LaneFullError(InflightError):
    """429 ``lane_full``: the lane is at its cap (or its ``batch_cap`` for
    batch work); the record keeps its place in line."""


class LaneCoolingError(LaneFullError):
    """429 ``lane_cooling``: the lane is cooling down after a provider's
    ``Retry-After`` (a failure settled with ``retry_after_ms``) and grants no
    slot until it ends; ``retry_after`` is the seconds left (rounded up). The
    record keeps its place in line. A subclass of ``LaneFullError``, so code
    that already takes a full lane as "not now" takes a cooling one so too;
    its class (or ``code``) tells them apart."""


class BudgetExhaustedError(LaneFullError):
    """429 ``budget_exhausted``: the call's ``maxTokens`` estimate does not
    fit in its lane's token budget (``tokens_per_minute``) or its
    provider's, beside the tokens of the last minute and of the calls
    executing. ``retry_after`` is the server's ``Retry-After`` in seconds:
    when enough of the last-minute window rolls off, or 60 when only a
    settle can make room (a settle reporting less than its call's estimate
    can make room sooner). The record keeps its place in line. A subclass
    of ``LaneFullError``, as ``LaneCoolingError`` is, so code that takes a
    full lane as "not now" takes a used-up budget so too."""


class WaitTimeoutError(InflightError):
    """The call waited in line longer than ``max_wait``; its record was cancelled."""


class WaitCancelledError(InflightError):
    """The client's own ``wait_cancelled``: the call's ``cancel`` event was
    set while it waited in line (or before); its record was cancelled."""


class NotFoundError(InflightError):
    """404 ``not_found``: no activity or owner with that id."""


class InvalidRequestError(InflightError):
    """400 ``invalid_request``: a field, parameter or id is invalid; the message names it."""


class UnauthorizedError(InflightError):
    """401 ``unauthorized``: the server has a token and the request lacked it."""


class ForbiddenError(InflightError):
    """403 ``forbidden``: the token is known but its scope does not cover the
    request (a read token on a write, or a write token bound to other
    services); the message names what it lacks. Never retried."""


class RequestTimeoutError(InflightError):
    """408 ``request_timeout``: the body did not arrive in time; nothing was recorded."""


class ConflictError(InflightError):
    """409 ``conflict``: the request contradicts the record or the owner."""


class IdempotencyConflictError(InflightError):
    """409 ``idempotency_conflict``: a begin's ``Idempotency-Key`` was already
    used for a different request (another body, or another ``start``/``wait``).
    The client makes a fresh key for every begin, so this means a key was
    reused by hand (``request("begin", idempotency_key=...)``). Never retried."""


class UnavailableError(InflightError):
    """503 from the server (at a limit), or no answer (refused, reset, timed out), or a proxy's 5xx."""


class TLSError(UnavailableError):
    """The client's own ``unavailable``: the TLS handshake with the server
    failed (its certificate is not trusted, names another host, or the server
    does not speak TLS). Never retried: another attempt would fail the same way."""


_CLASSES: Dict[str, Type[InflightError]] = {
    "lane_full": LaneFullError,
    "lane_cooling": LaneCoolingError,
    "budget_exhausted": BudgetExhaustedError,
    "wait_timeout": WaitTimeoutError,
    "wait_cancelled": WaitCancelledError,
    "not_found": NotFoundError,
    "invalid_request": InvalidRequestError,
    "unauthorized": UnauthorizedError,
    "forbidden": ForbiddenError,
    "conflict": ConflictError,
    "idempotency_conflict": IdempotencyConflictError,
    "request_timeout": RequestTimeoutError,
    "unavailable": UnavailableError,
}


def error_for(
    code: str,
    message: str,
    *,
    status: Optional[int] = None,
    retry_after: Optional[float] = None,
    from_server: bool = False,
) -> InflightError:
    """The error for ``code``, of its class when it has one."""
    return _CLASSES.get(code, InflightError)(
        code, message, status=status, retry_after=retry_after, from_server=from_server
    )
