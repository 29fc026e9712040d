import type { ServerErrorCode } from "./wire.js";

/**
 * Every code an `InflightError` can carry: the server's codes, plus the
 * client's own `wait_timeout` (the call waited in line longer than its
 * `maxWaitMs`). `unavailable` is the server's (503: at a limit) and also
 * the client's when no answer came (refused, reset, timed out) or a 5xx that
 * is not the server's JSON error.
 */
export type ErrorCode = ServerErrorCode | "wait_timeout";

/**
 * Marks the errors of either build (ESM and CommonJS are two copies of each
 * class), so `isInflightError` holds across them where `instanceof` cannot.
 */
const ERROR_BRAND: unique symbol = Symbol.for("inflight-ledger.InflightError");

/** An error from the ledger, typed by its `code`. */
export class InflightError extends Error {
  override name = "InflightError";
  readonly [ERROR_BRAND] = true;
  /** The server's error code, or the client's own (`unavailable`, `wait_timeout`). */
  readonly code: ErrorCode;
  /** The HTTP status, when the server answered. */
  readonly status: number | undefined;
  /** `Retry-After`, in milliseconds, when the server sent one. */
  readonly retryAfterMs: number | undefined;
  /**
   * Whether the server itself answered with its error body (as opposed to no
   * answer, or a proxy's). A 503 `unavailable` or 408 `request_timeout` from
   * the server means that nothing was recorded.
   */
  readonly fromServer: boolean;

  constructor(
    code: ErrorCode,
    message: string,
    options: { status?: number; retryAfterMs?: number; cause?: unknown; fromServer?: boolean } = {},
  ) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.code = code;
    this.status = options.status;
    this.retryAfterMs = options.retryAfterMs;
    this.fromServer = options.fromServer ?? false;
  }
}

/** 429 `lane_full`: the lane is at its cap for this record, which keeps its place in line. */
export class LaneFullError extends InflightError {
  override name = "LaneFullError";
}
/**
 * 429 `lane_cooling`: the lane is cooling down after a provider's refusal
 * (a failure settled with `retryAfterMs`) and grants no new slot until the
 * cooldown ends; `retryAfterMs` is how long that is from the answer (the
 * server's `Retry-After`, whole seconds rounded up). The record keeps its
 * place in line, as with `lane_full`.
 */
export class LaneCoolingError extends InflightError {
  override name = "LaneCoolingError";
}
/**
 * 429 `budget_exhausted`: the call's `maxTokens` estimate does not fit in
 * its lane's token budget (`tokens_per_minute`) or its provider's, beside
 * the tokens of the last minute and of the calls executing. `retryAfterMs`
 * is the server's `Retry-After` (whole seconds): when enough of the
 * last-minute window rolls off, or 60 s when only a settle can make room;
 * a settle that reports less than its call's estimate can make room sooner.
 * The record keeps its place in line, as with `lane_full`.
 */
export class BudgetExhaustedError extends InflightError {
  override name = "BudgetExhaustedError";
}
/**
 * The call waited in line longer than it was allowed (`maxWaitMs`); the
 * record was cancelled. Its `cause` is the last refusal (`LaneFullError`,
 * `LaneCoolingError` or `BudgetExhaustedError`), and its `retryAfterMs`
 * that refusal's.
 */
export class WaitTimeoutError extends InflightError {
  override name = "WaitTimeoutError";
}
/** 404 `not_found`: no activity or owner with that id. */
export class NotFoundError extends InflightError {
  override name = "NotFoundError";
}
/** 400 `invalid_request`: a field, parameter or id is invalid; the message names it. */
export class InvalidRequestError extends InflightError {
  override name = "InvalidRequestError";
}
/** 401 `unauthorized`: the server has a token and the request lacked it. */
export class UnauthorizedError extends InflightError {
  override name = "UnauthorizedError";
}
/**
 * 403 `forbidden`: the token is known but its scope does not cover the
 * request (a read token on a write, or a write token bound to other
 * services); the message names what it lacks. Never retried.
 */
export class ForbiddenError extends InflightError {
  override name = "ForbiddenError";
}
/** 408 `request_timeout`: the body did not arrive in time; nothing was recorded. */
export class RequestTimeoutError extends InflightError {
  override name = "RequestTimeoutError";
}
/** 409 `conflict`: the request contradicts the record or the owner. */
export class ConflictError extends InflightError {
  override name = "ConflictError";
}
/**
 * 409 `idempotency_conflict`: a begin's `Idempotency-Key` was already used
 * for a different request (another body, or another `start`/`wait`). The
 * client makes a fresh key for every begin, so this means a key was reused
 * by hand (`request("begin", { idempotencyKey })`). Never retried.
 */
export class IdempotencyConflictError extends InflightError {
  override name = "IdempotencyConflictError";
}
/** 503 from the server (at a limit), or no answer (down, unreachable) or a proxy's 5xx. */
export class UnavailableError extends InflightError {
  override name = "UnavailableError";
}

/**
 * The client's own `unavailable`: the TLS handshake with the server failed
 * (its certificate is not trusted, names another host, or the server does
 * not speak TLS). Never retried: another attempt would fail the same way.
 */
export class TLSError extends UnavailableError {
  override name = "TLSError";
}

const CLASSES: Partial<Record<ErrorCode, typeof InflightError>> = {
  lane_full: LaneFullError,
  lane_cooling: LaneCoolingError,
  budget_exhausted: BudgetExhaustedError,
  wait_timeout: WaitTimeoutError,
  not_found: NotFoundError,
  invalid_request: InvalidRequestError,
  unauthorized: UnauthorizedError,
  forbidden: ForbiddenError,
  conflict: ConflictError,
  idempotency_conflict: IdempotencyConflictError,
  request_timeout: RequestTimeoutError,
  unavailable: UnavailableError,
};

/** The error for `code`, of its class when it has one. */
export function errorFor(
  code: ErrorCode,
  message: string,
  options: { status?: number; retryAfterMs?: number; cause?: unknown; fromServer?: boolean } = {},
): InflightError {
  const Class = CLASSES[code] ?? InflightError;
  return new Class(code, message, options);
}

/**
 * Whether `err` is an `InflightError`, with `code` when given. Unlike
 * `instanceof`, it holds for an error of the other build too (a program that
 * both `require`s and `import`s the package has two copies of each class).
 */
export function isInflightError(err: unknown, code?: ErrorCode): err is InflightError {
  if (typeof err !== "object" || err === null || (err as { [ERROR_BRAND]?: unknown })[ERROR_BRAND] !== true) return false;
  return code === undefined || (err as InflightError).code === code;
}
