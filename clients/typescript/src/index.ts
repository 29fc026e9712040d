// inflight-ledger: a client of the inflight server for Node.js 20+.
export { Activity, InflightClient, OwnerLease } from "./client.js";
export type { ActivityContext } from "./context.js";
export { ProviderActivityRecorder, RecorderError } from "./recorder.js";
export { retryAfterMs } from "./retry-after.js";
export { usageOf } from "./usage.js";
export type { HeadersLike, RetryAfterSource } from "./retry-after.js";
export type { ProviderActivityEntry, ProviderActivityOutcome, RecorderEvent, RecorderOperation, RecorderOptions } from "./recorder.js";
export type {
  ActivitySpec,
  AdmitOptions,
  ClientOptions,
  InflightWarning,
  LeaseOptions,
  Lifecycle,
  RequestOptions,
  RetryOptions,
  RunOptions,
  TraceOptions,
} from "./client.js";
export {
  BudgetExhaustedError,
  ConflictError,
  errorFor,
  ForbiddenError,
  IdempotencyConflictError,
  InflightError,
  InvalidRequestError,
  isInflightError,
  LaneCoolingError,
  LaneFullError,
  NotFoundError,
  RequestTimeoutError,
  TLSError,
  UnauthorizedError,
  UnavailableError,
  WaitTimeoutError,
} from "./errors.js";
export type { ErrorCode } from "./errors.js";
export * from "./wire.js";
