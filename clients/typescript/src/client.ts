import { AsyncLocalStorage } from "node:async_hooks";
import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";

import { Agent, fetch as undiciFetch } from "undici";

import type { ActivityContext } from "./context.js";
import { checkContext, mergeContexts, withContextFields } from "./context.js";
import {
  errorFor,
  InflightError,
  isInflightError,
  LaneFullError,
  TLSError,
  UnavailableError,
  WaitTimeoutError,
} from "./errors.js";
import type { ErrorCode } from "./errors.js";
import type {
  ActivityRecord,
  BeginRequest,
  CancelRequest,
  ErrorBody,
  FailureStage,
  Owner,
  ReapCounts,
  RefineRequest,
  RegisterOwnerRequest,
  RouteName,
  SettleRequest,
  Snapshot,
  StartRequest,
  TimestampInput,
  Usage,
} from "./wire.js";
import { retryAfterOfError, settleRetryAfterMs } from "./retry-after.js";
import { loadOtel, traceparentFor } from "./trace.js";
import { checkMaxTokens, checkUsage, extractedUsage, usageOf } from "./usage.js";
import { IDEMPOTENCY_KEY_HEADER, ROUTES, SERVER_ERROR_CODES, TRACEPARENT_HEADER } from "./wire.js";

/**
 * What a call is: the fields of a begin. `service` and `provider` name its
 * lane. `service` may be left out inside `withContext` (whose context gives
 * it); a begin with no service from either is refused by the server
 * (`InvalidRequestError`, naming `service`).
 */
export type ActivitySpec = Omit<BeginRequest, "service"> & { service?: string };

/** Called as a record moves through its life; errors thrown here are ignored. */
export interface Lifecycle {
  onEnqueued?(record: ActivityRecord): void;
  onStarted?(record: ActivityRecord): void;
  onSettled?(record: ActivityRecord): void;
}

export interface RetryOptions {
  /**
   * Extra attempts after the first, for idempotent requests only (a begin is
   * one: it carries an `Idempotency-Key`). Default 3.
   */
  retries?: number;
  /** The first backoff; doubled each attempt, with jitter. Default 100 ms. */
  baseDelayMs?: number;
  /** The longest backoff. Default 2000 ms. */
  maxDelayMs?: number;
}

export interface ClientOptions {
  /** The server. Default: `INFLIGHT_URL`, else `http://127.0.0.1:7878`. */
  baseUrl?: string;
  /** The bearer token. Default: `INFLIGHT_TOKEN`, else none. */
  token?: string;
  /**
   * A PEM file of the certificate authorities to trust for an `https://`
   * server, instead of Node's default roots. Default: `INFLIGHT_CA_FILE`,
   * else the default roots.
   */
  caFile?: string;
  /** The same as PEM text (one or more certificates); give `ca` or `caFile`, not both. */
  ca?: string;
  /** How long one request may take (plus its `?wait=`). Default 10 s. */
  requestTimeoutMs?: number;
  retry?: RetryOptions;
  /** Called for every record this client moves (besides each call's own). */
  lifecycle?: Lifecycle;
  /**
   * Called when the ledger could not be told how a call ended (the call's
   * own result still stands; the server reaps the record past its bound).
   * Default: a process warning.
   */
  onLedgerError?(err: unknown, record: ActivityRecord): void;
  /**
   * Called with what the client noticed but the server let pass: a begin
   * whose answer lists `ignoredFields` (top-level fields the server does not
   * know, e.g. a misspelled `clas`). Once per distinct set of field names
   * for this client, not on every call. Default: `console.warn(message)`.
   */
  onWarning?(message: string, warning: InflightWarning): void;
  /**
   * A `fetch` to use instead of the global one. With a CA, it receives the
   * connection pool that trusts it as `init.dispatcher` (an undici `Agent`).
   */
  fetch?: typeof fetch;
  /**
   * Whether a begin given no `traceparent` sends the active OpenTelemetry
   * span's (when `@opentelemetry/api`, an optional peer dependency, is
   * installed and a valid span is active where the begin is called).
   * Default true; `false` sends only a `traceparent` given explicitly.
   */
  propagateTrace?: boolean;
}

/**
 * The W3C trace context of a begin (`begin`, `admit`, `run`,
 * `observeUnqueued`): the `traceparent` header it sends, which the record
 * keeps; the span the server exports when the record ends is a child of
 * that span.
 */
export interface TraceOptions {
  /**
   * A `traceparent` (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`,
   * lower case) to send instead of the active OpenTelemetry span's. Only
   * its being a string is checked here (else a `TypeError`); the server
   * refuses a malformed one with `InvalidRequestError`, its message
   * starting `traceparent: `, and nothing is recorded.
   */
  traceparent?: string;
}

/** What `onWarning` is told about, beside its message. */
export interface InflightWarning {
  kind: "ignoredFields";
  /** The begin's top-level fields the server ignored, as the server named them. */
  fields: string[];
  /** The record the begin made (the fields were dropped, the record stands). */
  record: ActivityRecord;
}

export interface RunOptions<T = unknown> extends Lifecycle, TraceOptions {
  /** Aborting it aborts the waiting and the call, and records the call `cancelled`. */
  signal?: AbortSignal;
  /** Like `signal`, after this long (waiting and executing together). */
  timeoutMs?: number;
  /** How long the call may wait in line before it gives up with `wait_timeout`. Default: no limit but `timeoutMs`. */
  maxWaitMs?: number;
  /** Where a thrown error happened. Default `provider`. */
  failureStage?: FailureStage | ((err: unknown) => FailureStage);
  /**
   * The provider's `Retry-After` in a thrown error, in milliseconds, sent
   * with the failure's settle (the lane then cools down). Default: read
   * from the error's `response` (a fetch `Response`, or any object with
   * `status` and `headers`), else from the error itself when it has
   * `status` and `headers` (the `openai` package's `APIError`); only a 429
   * or a 503 counts. Return `undefined` for none (`() => undefined` never
   * sends one); a value is rounded and kept within 1 to 3600000.
   */
  retryAfterMs?: (err: unknown) => number | undefined;
  /**
   * The tokens the call spent, read from what `fn` returns, sent with the
   * success's settle. Default: `usageOf(result)` (the usage of an OpenAI,
   * Ollama or Gemini answer). Return `undefined` for none; `false` never
   * reads any. What it returns is sent only when it is valid usage (each
   * count a whole number from 0 to 1000000000), and one that throws reads
   * nothing: the settle is never lost to it. Usage `fn` reported itself
   * (`activity.reportUsage`) wins over it.
   */
  usage?: false | ((result: T) => Usage | null | undefined);
}

export interface AdmitOptions {
  signal?: AbortSignal;
  /** Give up with `wait_timeout` after this long in line. Default: wait until admitted or aborted. */
  maxWaitMs?: number;
  /** How long each `?wait=` holds (at most 30 s). Default 10 s. */
  waitStepMs?: number;
}

export interface LeaseOptions {
  /** Tag every record this client begins with the owner (default true). */
  tagRecords?: boolean;
  /**
   * Release the lease when the process receives these signals (`true`:
   * `SIGTERM` and `SIGINT`), then let the signal do what it would have done.
   */
  releaseOnSignals?: boolean | NodeJS.Signals[];
  /** Called once if the lease is lost (it ran out, or the server forgot the owner). */
  onLost?(err: InflightError): void;
}

export interface RequestOptions {
  id?: string;
  query?: Record<string, string | number | undefined>;
  body?: object;
  signal?: AbortSignal | undefined;
  /** Extra time allowed for this request (a `?wait=`). */
  extraTimeoutMs?: number;
  /**
   * A begin's `traceparent` header, sent as given with each attempt. Only
   * the begin route takes one. `request` never reads the active span: the
   * methods that begin records do.
   */
  traceparent?: string;
  /**
   * A begin's `Idempotency-Key` (1 to 255 printable ASCII characters).
   * Default: a fresh random UUID (v4) for each call of `request("begin")`,
   * sent again unchanged with each of its retries. Only the begin route
   * takes one.
   */
  idempotencyKey?: string;
}

const IDEMPOTENT: ReadonlySet<RouteName> = new Set<RouteName>([
  "get", "start", "settle", "cancel", "refine", "snapshot", "reap", "renewOwner", "releaseOwner", "healthz",
]);
const SERVER_CODES: ReadonlySet<string> = new Set(SERVER_ERROR_CODES);
const MAX_WAIT_STEP_MS = 30_000;
/** The refusals of a start that `admit` keeps waiting through: the record keeps its place in line. */
const WAITED_THROUGH: ReadonlySet<ErrorCode> = new Set<ErrorCode>(["lane_full", "lane_cooling", "budget_exhausted"]);

/**
 * Whether a failed request may be sent again. An idempotent one (a begin is,
 * with its `Idempotency-Key`): when no answer came, or a 5xx. Any other (an
 * owner registration): only when the server itself answered that it did not
 * handle the request (503 `unavailable` at a limit, 408 `request_timeout`),
 * since a lost answer may have registered it.
 */
function retryable(error: InflightError, idempotent: boolean): boolean {
  if (error instanceof TLSError) return false;
  if (error.fromServer && (error.code === "unavailable" || error.code === "request_timeout")) return true;
  return idempotent && (error.code === "unavailable" || error.code === "internal");
}

/** The CA to trust: `ca`, else the file `caFile` or `INFLIGHT_CA_FILE` names, else none. */
function caOption(options: ClientOptions): string | undefined {
  if (options.ca !== undefined && options.caFile !== undefined) {
    throw new TypeError("InflightClient: give ca or caFile, not both");
  }
  if (options.ca !== undefined) return options.ca;
  const file = options.caFile ?? (process.env.INFLIGHT_CA_FILE || undefined);
  if (file === undefined) return undefined;
  try {
    return readFileSync(file, "utf8");
  } catch (err) {
    const source = options.caFile === undefined ? "INFLIGHT_CA_FILE" : "caFile";
    throw new Error(`InflightClient: cannot read the CA file ${file} (${source}): ${(err as Error).message}`, { cause: err });
  }
}

/** Node's codes for a certificate that could not be verified. */
const CERTIFICATE_CODES = /CERT|UNABLE_TO_|SELF_SIGNED|^ERR_TLS_/;

/** Node's and undici's codes for a connection that failed, in words. */
const TRANSPORT_CODES: Record<string, string> = {
  ECONNREFUSED: "connection refused",
  ECONNRESET: "connection reset",
  EPIPE: "connection closed while sending",
  ENOTFOUND: "no such host",
  EAI_AGAIN: "the host name could not be resolved (DNS)",
  EHOSTUNREACH: "host unreachable",
  ENETUNREACH: "network unreachable",
  ETIMEDOUT: "connection timed out",
  UND_ERR_CONNECT_TIMEOUT: "connection timed out",
  UND_ERR_SOCKET: "the connection closed without an answer",
  UND_ERR_CLOSED: "the connection closed without an answer",
};

/**
 * The error for a request that got no answer: `TLSError` when the TLS
 * handshake failed (retrying would fail again), else `UnavailableError`.
 * `fetch` says only "fetch failed"; what happened is in its `cause`, so the
 * message names the server (`base`) and that cause.
 */
function transportError(what: string, base: string, err: unknown): InflightError {
  let cause: unknown = err;
  while (cause instanceof Error && cause.message === "fetch failed" && cause.cause !== undefined) cause = cause.cause;
  // A connection to a name with several addresses fails with an AggregateError of each.
  if (cause instanceof AggregateError && cause.errors.length > 0 && (cause as { code?: unknown }).code === undefined) {
    cause = cause.errors[0];
  }
  const code = (cause as { code?: unknown } | undefined)?.code;
  const message = cause instanceof Error ? cause.message : String(cause);
  if (typeof code === "string" && CERTIFICATE_CODES.test(code)) {
    return new TLSError(
      "unavailable",
      `${what}: the TLS certificate of ${base} was refused: ${message} (${code}); ` +
        "trust its certificate authority with the caFile option or INFLIGHT_CA_FILE",
      { cause: err },
    );
  }
  if (typeof code === "string" && code.startsWith("ERR_SSL_")) {
    // OpenSSL's message is a raw error line; its `reason` is the readable part.
    const reason = (cause as { reason?: unknown }).reason ?? message;
    const hint = code === "ERR_SSL_WRONG_VERSION_NUMBER" ? " (does the server serve TLS? if not, its URL is http://)" : "";
    return new TLSError("unavailable", `${what}: the TLS handshake with ${base} failed: ${String(reason)}${hint}`, { cause: err });
  }
  // A TLS server answers a plain request with a TLS alert, which is no HTTP.
  const hint =
    typeof code === "string" && code.startsWith("HPE_") && base.startsWith("http:")
      ? "; does the server serve https? then its URL is https://"
      : "";
  const words = typeof code === "string" ? TRANSPORT_CODES[code] : undefined;
  const why = words !== undefined ? `${words} (${code})` : typeof code === "string" ? `${message} (${code})` : message;
  return new UnavailableError("unavailable", `${what}: cannot reach ${base}: ${why}${hint}`, { cause: err });
}

function toWireTime(value: TimestampInput | undefined): number | string | undefined {
  return value instanceof Date ? value.getTime() : value;
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal!.reason);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** A signal aborted when any of `signals` is; `dispose` detaches it. */
function anySignal(signals: (AbortSignal | undefined)[]): { signal: AbortSignal; dispose(): void } {
  const controller = new AbortController();
  const present = signals.filter((s): s is AbortSignal => s !== undefined);
  const listeners: [AbortSignal, () => void][] = [];
  const dispose = () => {
    for (const [s, l] of listeners) s.removeEventListener("abort", l);
  };
  for (const s of present) {
    if (s.aborted) {
      controller.abort(s.reason);
      dispose();
      return { signal: controller.signal, dispose };
    }
    const l = () => {
      controller.abort(s.reason);
      dispose();
    };
    s.addEventListener("abort", l, { once: true });
    listeners.push([s, l]);
  }
  return { signal: controller.signal, dispose };
}

/** A timeout signal whose timer never keeps the process alive, with a way to stop it. */
function timeoutSignal(ms: number): { signal: AbortSignal; clear(): void } {
  const controller = new AbortController();
  const timer = setTimeout(
    () => controller.abort(new DOMException(`timed out after ${ms} ms`, "TimeoutError")),
    ms,
  );
  timer.unref?.();
  return { signal: controller.signal, clear: () => clearTimeout(timer) };
}

function callHook<K extends keyof Lifecycle>(hooks: (Lifecycle | undefined)[], name: K, record: ActivityRecord) {
  for (const h of hooks) {
    try {
      h?.[name]?.(record);
    } catch {
      // A hook's failure is the hook's: the call goes on.
    }
  }
}

/** A client of one inflight server. */
export class InflightClient {
  readonly baseUrl: string;
  /** The owner whose id tags the records this client begins, if any. */
  ownerId: string | undefined;
  private readonly token: string | undefined;
  private readonly requestTimeoutMs: number;
  private readonly retries: number;
  private readonly baseDelayMs: number;
  private readonly maxDelayMs: number;
  private readonly fetchImpl: typeof fetch;
  /** The undici pool trusting the CA, when one is given. */
  private readonly dispatcher: Agent | undefined;
  readonly lifecycle: Lifecycle | undefined;
  private readonly onLedgerError: (err: unknown, record: ActivityRecord) => void;
  private readonly onWarning: (message: string, warning: InflightWarning) => void;
  /** Whether a begin given no `traceparent` sends the active OpenTelemetry span's. */
  readonly propagateTrace: boolean;
  /** The sets of ignored fields already warned about (sorted, joined), so each is told once. */
  private readonly warnedIgnored = new Set<string>();
  /** This client's attribution context (`withContext`); another client's is its own. */
  private readonly attribution = new AsyncLocalStorage<Readonly<ActivityContext>>();

  constructor(options: ClientOptions = {}) {
    this.baseUrl = (options.baseUrl ?? process.env.INFLIGHT_URL ?? "http://127.0.0.1:7878").replace(/\/+$/, "");
    this.token = options.token ?? process.env.INFLIGHT_TOKEN ?? undefined;
    this.requestTimeoutMs = options.requestTimeoutMs ?? 10_000;
    this.retries = options.retry?.retries ?? 3;
    this.baseDelayMs = options.retry?.baseDelayMs ?? 100;
    this.maxDelayMs = options.retry?.maxDelayMs ?? 2_000;
    const ca = caOption(options);
    this.dispatcher = ca === undefined ? undefined : new Agent({ connect: { ca } });
    // Node's global fetch takes no CA; undici's own fetch goes with its own
    // Agent (a dispatcher of another undici version may not fit the global one).
    this.fetchImpl =
      options.fetch ?? (this.dispatcher ? (undiciFetch as unknown as typeof fetch) : globalThis.fetch);
    this.lifecycle = options.lifecycle;
    this.onLedgerError =
      options.onLedgerError ??
      ((err, record) =>
        process.emitWarning(
          `inflight: could not record how activity ${record.activityId} ended (${String(err)}); ` +
            "the server reaps it past its bound",
          "InflightWarning",
        ));
    this.onWarning = options.onWarning ?? ((message) => console.warn(message));
    this.propagateTrace = options.propagateTrace ?? true;
    // Loaded once for the process, early, so that a begin reads the span where it is called.
    if (this.propagateTrace) void loadOtel();
  }

  // ---- attribution -------------------------------------------------------

  /**
   * Runs `fn` (sync or async; its result or promise is returned) with an
   * attribution context: every record this client begins inside it, however
   * deep in `fn`'s calls and across `await`s and timers (`begin`, `admit`,
   * `run`, `observeUnqueued`), takes the context's `service`,
   * `operationStage` and `priority` for the fields its spec leaves
   * `undefined`; a field the spec sets wins. A nested `withContext` merges
   * over its parent: its fields override, the ones it leaves out are
   * inherited. The context is this client's (one `AsyncLocalStorage` per
   * client): another client's begins do not see it.
   *
   * The context is checked at once, as the server checks a begin's fields:
   * a label of 1 to 64 characters of `A-Z a-z 0-9 . _ -`, a priority of
   * `PRIORITIES`; anything else (or an unknown field) throws a `TypeError`
   * naming the field, before `fn` runs.
   */
  withContext<T>(context: ActivityContext, fn: () => T): T {
    const checked = checkContext(context);
    if (typeof fn !== "function") throw new TypeError(`withContext: fn must be a function, not ${typeof fn}`);
    return this.attribution.run(mergeContexts(this.attribution.getStore(), checked), fn);
  }

  /** The attribution context in force where this is called (`withContext`), if any. */
  currentContext(): Readonly<ActivityContext> | undefined {
    return this.attribution.getStore();
  }

  // ---- one request -------------------------------------------------------

  /**
   * Sends one request on `route`. Idempotent routes are retried with
   * backoff when the server is unreachable or answers a 5xx. A begin is one:
   * it carries an `Idempotency-Key` (`options.idempotencyKey`, else a fresh
   * random UUID made here), and each retry sends the same key, body and
   * query, so a begin whose answer was lost is answered with the record it
   * made (200) rather than making a second one. An owner registration is
   * retried only when the server answered that it did not handle it (503,
   * 408), never after no answer (a lost answer may have registered it).
   */
  async request<T>(route: RouteName, options: RequestOptions = {}): Promise<T> {
    const { method, path } = ROUTES[route];
    let url = this.baseUrl + (options.id === undefined ? path : path.replace("{id}", encodeURIComponent(options.id)));
    const query = Object.entries(options.query ?? {}).filter(([, v]) => v !== undefined);
    if (query.length > 0) {
      url += "?" + new URLSearchParams(query.map(([k, v]): [string, string] => [k, String(v)])).toString();
    }
    const headers: Record<string, string> = { accept: "application/json" };
    if (options.body !== undefined) headers["content-type"] = "application/json";
    if (this.token) headers.authorization = `Bearer ${this.token}`;
    const keyed = (ROUTES[route].headers as readonly string[]).includes(IDEMPOTENCY_KEY_HEADER);
    if (options.idempotencyKey !== undefined && !keyed) {
      throw new TypeError(`request: ${method} ${path} takes no ${IDEMPOTENCY_KEY_HEADER}`);
    }
    // One key for every attempt of this request: a retry is the same begin.
    if (keyed) headers[IDEMPOTENCY_KEY_HEADER.toLowerCase()] = options.idempotencyKey ?? randomUUID();
    if (options.traceparent !== undefined) {
      if (!(ROUTES[route].headers as readonly string[]).includes(TRACEPARENT_HEADER)) {
        throw new TypeError(`request: ${method} ${path} takes no ${TRACEPARENT_HEADER}`);
      }
      headers[TRACEPARENT_HEADER] = options.traceparent;
    }
    const body = options.body === undefined ? undefined : JSON.stringify(options.body);
    const idempotent = keyed || IDEMPOTENT.has(route);
    const attempts = this.retries + 1;

    for (let attempt = 0; ; attempt++) {
      const timeout = timeoutSignal(this.requestTimeoutMs + (options.extraTimeoutMs ?? 0));
      const combined = anySignal([options.signal, timeout.signal]);
      let error: InflightError;
      try {
        const init = { method, headers, body, signal: combined.signal, ...(this.dispatcher && { dispatcher: this.dispatcher }) };
        // `dispatcher` is undici's, which the global fetch's RequestInit type does not name.
        const response = await this.fetchImpl(url, init as RequestInit);
        const text = await response.text();
        if (response.ok) return (text ? JSON.parse(text) : undefined) as T;
        error = this.errorFromAnswer(response, text, `${method} ${path}`);
      } catch (err) {
        if (options.signal?.aborted) throw options.signal.reason;
        const limitMs = this.requestTimeoutMs + (options.extraTimeoutMs ?? 0);
        error = timeout.signal.aborted
          ? new UnavailableError("unavailable", `${method} ${path}: no answer from ${this.baseUrl} within ${limitMs} ms`, { cause: err })
          : transportError(`${method} ${path}`, this.baseUrl, err);
      } finally {
        timeout.clear();
        combined.dispose();
      }
      if (!retryable(error, idempotent) || attempt + 1 >= attempts) throw error;
      const backoff = Math.min(this.maxDelayMs, this.baseDelayMs * 2 ** attempt);
      const delay = backoff / 2 + Math.random() * (backoff / 2);
      await sleep(Math.max(delay, Math.min(error.retryAfterMs ?? 0, this.maxDelayMs)), options.signal);
    }
  }

  private errorFromAnswer(response: Response, text: string, what: string): InflightError {
    const retryAfter = Number(response.headers.get("retry-after"));
    const extra = {
      status: response.status,
      ...(Number.isFinite(retryAfter) && retryAfter > 0 ? { retryAfterMs: retryAfter * 1000 } : {}),
    };
    try {
      const parsed = JSON.parse(text) as Partial<ErrorBody>;
      const code = parsed.error?.code;
      if (typeof code === "string" && SERVER_CODES.has(code)) {
        return errorFor(code, `${what}: ${parsed.error?.message ?? code}`, { ...extra, fromServer: true });
      }
    } catch {
      // Not the server's error body: a proxy or something else answered.
    }
    const code = response.status >= 500 ? "unavailable" : "invalid_request";
    return errorFor(code, `${what}: HTTP ${response.status} ${text.slice(0, 200)}`, extra);
  }

  // ---- the routes --------------------------------------------------------

  /**
   * Begins a record (`waiting`, or `executing` when `startedAt` is given).
   * Inside `withContext`, the context fills the spec's missing `service`,
   * `operationStage` and `priority`. A spec's `maxTokens` (the tokens the
   * call is estimated to spend) that is not a whole number from 0 to
   * 1000000000 rejects with a `TypeError` naming it, and nothing is sent
   * (so with `admit`, `run` and `observeUnqueued`).
   *
   * The begin carries a fresh `Idempotency-Key` (a random UUID), and is
   * retried like `settle` (after no answer, a reset, a timeout, or a 5xx)
   * with the same key, body and query: the server answers a repeat with the
   * record the first one made (200, not 201), so a lost answer never makes
   * a second record. If that record ended before its answer came (cancelled
   * or reaped), the begin is made anew with a new key (at most `retries`
   * times; then `UnavailableError`).
   *
   * With `startNow`, the server begins it started on its own clock
   * (`?start=now`): a lifecycle in two requests, this and the settle. On a
   * full lane that is `LaneFullError` (on a lane cooling down,
   * `LaneCoolingError`, whose `retryAfterMs` says for how long; when the
   * call's `maxTokens` does not fit in a token budget,
   * `BudgetExhaustedError`), with nothing holding a slot or a place in
   * line. With `waitMs` too (at most 30 s), the server holds the request
   * until the lane admits the record or the wait ends, through a cooldown
   * or a used-up budget too; then the record is cancelled and the answer is
   * `LaneFullError`, or `LaneCoolingError` if the lane was still cooling
   * down, or `BudgetExhaustedError` if the tokens still did not fit. A
   * `maxTokens` larger than a whole budget is `InvalidRequestError` (it
   * could never start), whether or not `startNow` is given. A repeat that finds its
   * record cancelled is the same `LaneFullError` once `waitMs` has passed;
   * before, the begin is made anew (a new key) for the wait that is left.
   *
   * The begin sends `traceparent` when given, else the active
   * OpenTelemetry span's (unless the client's `propagateTrace` is false):
   * the record keeps it, and its exported span is that span's child.
   */
  async begin(
    spec: ActivitySpec,
    options: { signal?: AbortSignal; startNow?: boolean; waitMs?: number } & TraceOptions = {},
  ): Promise<Activity> {
    if (options.waitMs !== undefined && !options.startNow) {
      throw new TypeError("begin: waitMs needs startNow (a begin without it does not start the record)");
    }
    const waitMs = options.waitMs === undefined ? undefined : Math.max(0, Math.min(MAX_WAIT_STEP_MS, Math.ceil(options.waitMs)));
    return this.beginActivity(spec, { ...options, waitMs }, (record, elapsedMs) =>
      waitMs !== undefined && elapsedMs >= waitMs
        ? new LaneFullError(
            "lane_full",
            `POST /v1/activities: lane ${record.service}::${record.provider} did not admit activity ` +
              `${record.activityId} within ${waitMs} ms; it is recorded ${record.state} and holds no place in line ` +
              "(the begin was sent again after its answer was lost, and found it so)",
          )
        : undefined,
    );
  }

  /**
   * The begins of `begin`, `admit`, `run` and `observeUnqueued`. `request`
   * gives each a fresh `Idempotency-Key` and retries it with that key, and
   * the `traceparent` read here, before anything else, so that the active
   * span is the caller's (every path reaches this synchronously). A
   * begin's answer whose record has ended can only be a repeat's (a first
   * begin answers a record in flight, or 429): the record it made ended
   * before its answer came, so no one holds it. Then `instead(record,
   * elapsedMs)` names what to throw, or nothing to begin anew, with a new
   * key (at most `retries` times).
   */
  private async beginActivity(
    spec: ActivitySpec,
    options: {
      signal?: AbortSignal | undefined;
      startNow?: boolean | undefined;
      waitMs?: number | undefined;
      traceparent?: string | undefined;
    },
    instead: (record: ActivityRecord, elapsedMs: number) => unknown,
  ): Promise<Activity> {
    const tracing = traceparentFor(options.traceparent, this.propagateTrace, "begin");
    checkMaxTokens(spec.maxTokens, "begin");
    const filled = withContextFields(spec, this.attribution.getStore());
    // `service` may still be missing: the server refuses that, naming the field.
    const body: ActivitySpec = {
      ...filled,
      enqueuedAt: toWireTime(spec.enqueuedAt),
      startedAt: toWireTime(spec.startedAt),
      ownerId: spec.ownerId ?? this.ownerId,
    };
    const traceparent = tracing instanceof Promise ? await tracing : tracing;
    const began = Date.now();
    for (let anew = 0; ; anew++) {
      // A begin made anew waits only for what is left of `waitMs`.
      const left =
        options.waitMs === undefined || anew === 0 ? options.waitMs : Math.max(0, options.waitMs - (Date.now() - began));
      const query = options.startNow ? { start: "now", wait: left === undefined ? undefined : `${left}ms` } : {};
      const record = await this.request<ActivityRecord>("begin", {
        body,
        query,
        signal: options.signal,
        extraTimeoutMs: left ?? 0,
        ...(traceparent === undefined ? {} : { traceparent }),
      });
      this.warnIgnoredFields(record);
      if (!hasEnded(record)) return new Activity(this, record);
      const error = instead(record, Date.now() - began);
      if (error !== undefined) throw error;
      if (anew >= this.retries) {
        throw new UnavailableError(
          "unavailable",
          `POST /v1/activities: the record of each of ${anew + 1} begins ended before its answer arrived ` +
            `(the last: activity ${record.activityId}, ${record.state}); no record was begun`,
        );
      }
    }
  }

  /**
   * What `admit`, `run` and `observeUnqueued` do when their begin's record
   * ended before its answer came: begin anew while they would still wait in
   * line, but not once aborted, nor past `maxWaitMs` (`WaitTimeoutError`,
   * as for a wait in line that ran out; the record needs no cancel).
   */
  private static lineInstead(options: { signal?: AbortSignal | undefined; maxWaitMs?: number | undefined }) {
    return (record: ActivityRecord, elapsedMs: number): unknown => {
      if (options.signal?.aborted) return options.signal.reason;
      if (options.maxWaitMs !== undefined && elapsedMs >= options.maxWaitMs) {
        return new WaitTimeoutError(
          "wait_timeout",
          `activity ${record.activityId} was not admitted on ${record.service}::${record.provider} within ` +
            `${options.maxWaitMs} ms (it is recorded ${record.state}: its begin was sent again after its answer ` +
            "was lost, and found it so)",
        );
      }
      return undefined;
    };
  }

  /** Tells `onWarning` once per distinct set of fields a begin's answer says the server ignored. */
  private warnIgnoredFields(record: ActivityRecord): void {
    const fields = record.ignoredFields;
    if (!fields || fields.length === 0) return;
    const key = [...fields].sort().join("\n");
    if (this.warnedIgnored.has(key)) return;
    this.warnedIgnored.add(key);
    const message =
      `inflight: the server ignored the begin's unknown field${fields.length > 1 ? "s" : ""} ` +
      `${fields.map((f) => JSON.stringify(f)).join(", ")} (activity ${record.activityId} on ` +
      `${record.service}::${record.provider}); a misspelling? (told once per set of fields)`;
    try {
      this.onWarning(message, { kind: "ignoredFields", fields: [...fields], record });
    } catch {
      // The hook's failure is the hook's: the call goes on.
    }
  }

  /** The record with this id (reaped first if it is past its bound). */
  getActivity(id: string, options: { signal?: AbortSignal } = {}): Promise<ActivityRecord> {
    return this.request<ActivityRecord>("get", { id, signal: options.signal });
  }

  /** The ledger as operators read it. */
  snapshot(query: { limit?: number; since?: string } = {}, options: { signal?: AbortSignal } = {}): Promise<Snapshot> {
    return this.request<Snapshot>("snapshot", { query, signal: options.signal });
  }

  /** Reaps every record past its bound now. */
  reap(): Promise<ReapCounts> {
    return this.request<ReapCounts>("reap", { body: {} });
  }

  /** Whether the server answers `/healthz`. */
  async healthy(): Promise<boolean> {
    try {
      await this.request("healthz");
      return true;
    } catch {
      return false;
    }
  }

  /** Registers an owner without renewing it; `joinAsOwner` is the usual way. */
  registerOwner(request: RegisterOwnerRequest): Promise<Owner> {
    return this.request<Owner>("registerOwner", { body: request });
  }

  renewOwner(ownerId: string): Promise<Owner> {
    return this.request<Owner>("renewOwner", { id: ownerId });
  }

  releaseOwner(ownerId: string): Promise<Owner> {
    return this.request<Owner>("releaseOwner", { id: ownerId });
  }

  // ---- the lifecycle -----------------------------------------------------

  /**
   * Begins a record and waits in line until it is admitted (`executing`).
   * Its begin sends `traceparent` as `begin`'s does.
   */
  async admit(spec: ActivitySpec, options: AdmitOptions & Lifecycle & TraceOptions = {}): Promise<Activity> {
    waitStepOf(options); // refused before anything is recorded
    const activity = await this.beginActivity(spec, { traceparent: options.traceparent }, InflightClient.lineInstead(options));
    callHook([this.lifecycle, options], "onEnqueued", activity.record);
    try {
      await activity.admit(options);
    } catch (err) {
      await activity.cancelQuietly(reasonOf(err));
      throw err;
    }
    callHook([this.lifecycle, options], "onStarted", activity.record);
    return activity;
  }

  /**
   * Runs `fn` as one provider call: begins a record, waits for admission,
   * starts it, calls `fn(signal, activity)`, then settles it by how `fn`
   * ends (resolved: success; thrown: failure). `activity` is the record's
   * handle: `activity.id`, `activity.record`, and `activity.refine(model)`
   * to name the model once `fn` has dispatched the call (a spec's `model`
   * is often a guess, or left out). When `options.signal` aborts or
   * `options.timeoutMs` passes, the waiting or the call is aborted (the
   * signal given to `fn` aborts), the record is settled `cancelled`, and
   * `run` rejects with the abort's reason at once.
   *
   * The begin sends `options.traceparent` when given, else the active
   * OpenTelemetry span's (unless the client's `propagateTrace` is false).
   *
   * Errors of the ledger before `fn` runs (a refused begin, `wait_timeout`,
   * the server unreachable) reject `run` and `fn` is not called. Once `fn`
   * has run, its own result or error is what `run` gives; a ledger error
   * then goes to `onLedgerError`.
   */
  async run<T>(
    spec: ActivitySpec,
    fn: (signal: AbortSignal, activity: Activity) => Promise<T>,
    options: RunOptions<T> = {},
  ): Promise<T> {
    const hooks = [this.lifecycle, options];
    const timeout = options.timeoutMs === undefined ? undefined : timeoutSignal(options.timeoutMs);
    const aborted = anySignal([options.signal, timeout?.signal]);
    const signal = aborted.signal;
    try {
      if (signal.aborted) throw signal.reason;
      // The begin is not aborted: its answer carries the id needed to cancel.
      // A record that ended before that answer came is never given to `fn`:
      // the begin is made anew (a new key) unless aborted or past `maxWaitMs`.
      const direct = spec.admission === "direct";
      const now = new Date();
      const activity = await this.beginActivity(
        direct ? { ...spec, enqueuedAt: spec.enqueuedAt ?? now, startedAt: spec.startedAt ?? now } : spec,
        { traceparent: options.traceparent },
        InflightClient.lineInstead({ signal, maxWaitMs: direct ? undefined : options.maxWaitMs }),
      );
      callHook(hooks, "onEnqueued", activity.record);
      if (!direct) {
        try {
          await activity.admit({ signal, ...(options.maxWaitMs === undefined ? {} : { maxWaitMs: options.maxWaitMs }) });
        } catch (err) {
          await this.endQuietly(activity, () => activity.cancel(reasonOf(signal.aborted ? signal.reason : err)), hooks);
          throw signal.aborted ? signal.reason : err;
        }
      }
      if (signal.aborted) {
        await this.endQuietly(activity, () => activity.cancel(reasonOf(signal.reason)), hooks);
        throw signal.reason;
      }
      callHook(hooks, "onStarted", activity.record);

      let onAbort!: () => void;
      const abortedWhileRunning = new Promise<never>((_, reject) => {
        onAbort = () => reject(signal.reason);
        signal.addEventListener("abort", onAbort, { once: true });
      });
      const call = Promise.resolve().then(() => fn(signal, activity));
      call.catch(() => {}); // after an abort its ending is no one's concern
      abortedWhileRunning.catch(() => {});
      let result: T;
      try {
        result = await Promise.race([call, abortedWhileRunning]);
      } catch (err) {
        signal.removeEventListener("abort", onAbort);
        if (signal.aborted) {
          await this.endQuietly(activity, () => activity.cancel(reasonOf(signal.reason)), hooks);
          throw signal.reason;
        }
        const stage = failureStageOf(err, options.failureStage);
        const retryAfterMs = retryAfterOf(err, options.retryAfterMs);
        await this.endQuietly(activity, () => activity.fail(stage ?? "provider", { retryAfterMs }), hooks);
        throw err;
      }
      signal.removeEventListener("abort", onAbort);
      const usage = activity.reportedUsage ?? usageOfResult(result, options.usage);
      await this.endQuietly(activity, () => activity.succeed({ usage }), hooks);
      return result;
    } finally {
      timeout?.clear();
      aborted.dispose();
    }
  }

  /**
   * Runs `fn` as a call with no queue (admission `direct`: observed, never
   * counted in a lane nor refused), settled like `run`; `fn` gets the same
   * `(signal, activity)`, and may `activity.refine(model)` too.
   */
  observeUnqueued<T>(
    spec: ActivitySpec,
    fn: (signal: AbortSignal, activity: Activity) => Promise<T>,
    options: RunOptions<T> = {},
  ): Promise<T> {
    return this.run({ ...spec, admission: "direct" }, fn, options);
  }

  private async endQuietly(activity: Activity, end: () => Promise<ActivityRecord>, hooks: (Lifecycle | undefined)[]) {
    try {
      await end();
      callHook(hooks, "onSettled", activity.record);
    } catch (err) {
      this.onLedgerError(err, activity.record);
    }
  }

  /**
   * Registers this process as an owner under a lease of `ttlMs`, renewed in
   * the background every third of it (the timers never keep the process
   * alive). Records this client begins carry the owner's id unless
   * `tagRecords` is false. If the process dies, the server reaps its
   * in-flight records once the lease runs out; `release()` is the clean
   * shutdown (its in-flight records are cancelled).
   */
  async joinAsOwner(name: string, ttlMs = 30_000, options: LeaseOptions = {}): Promise<OwnerLease> {
    const owner = await this.registerOwner({ name, ttlMs });
    const lease = new OwnerLease(this, owner, options);
    if (options.tagRecords ?? true) this.ownerId = owner.ownerId;
    return lease;
  }
}

/** Whether the record has ended (settled, cancelled or reaped). */
function hasEnded(record: ActivityRecord): boolean {
  return record.state !== "waiting" && record.state !== "executing";
}

/**
 * How long each `?wait=` of `admit` holds: `waitStepMs` (10 s when not
 * given, at most 30 s). A step of 0 or less, or not a number, would ask
 * again and again without waiting: a `TypeError` naming it.
 */
function waitStepOf(options: AdmitOptions): number {
  const step = options.waitStepMs ?? 10_000;
  if (typeof step !== "number" || !(step > 0)) {
    throw new TypeError(`waitStepMs must be a number of milliseconds above 0; got ${String(step)}`);
  }
  return Math.min(MAX_WAIT_STEP_MS, step);
}

/**
 * The stage to settle a failure of `run` with: `stage(err)` when it is a
 * function; `unknown` when that throws (the failure is still settled, and
 * the call's own error is the one thrown).
 */
function failureStageOf(
  err: unknown,
  stage: FailureStage | ((err: unknown) => FailureStage) | undefined,
): FailureStage | undefined {
  if (typeof stage !== "function") return stage;
  try {
    return stage(err);
  } catch {
    return "unknown";
  }
}

/**
 * The `retryAfterMs` to settle a failure of `run` with: `read(err)`, or
 * what `retryAfterOfError` recognises; `undefined` when not a number, and
 * else rounded and kept within what the server takes.
 */
function retryAfterOf(err: unknown, read: ((err: unknown) => number | undefined) | undefined): number | undefined {
  let ms: unknown;
  try {
    ms = (read ?? retryAfterOfError)(err);
  } catch {
    // A reader that throws reads nothing: the failure is still settled.
    return undefined;
  }
  return settleRetryAfterMs(ms);
}

/**
 * The usage to settle a success of `run` with: `read(result)` (`usageOf`
 * when not given, nothing when `false`), kept only when it is valid usage.
 */
function usageOfResult<T>(
  result: T,
  read: false | ((result: T) => Usage | null | undefined) | undefined,
): Usage | undefined {
  if (read === false) return undefined;
  try {
    return extractedUsage((read ?? usageOf)(result));
  } catch {
    // An extractor that throws reads nothing: the success is still settled.
    return undefined;
  }
}

function reasonOf(reason: unknown): string {
  if (reason instanceof WaitTimeoutError) return "wait timeout";
  if (reason instanceof Error || reason instanceof DOMException) {
    if (reason.name === "TimeoutError") return "timeout";
    if (reason.name === "AbortError") return "aborted";
    return reason.name;
  }
  return "aborted";
}

/**
 * One record, for code that has its own queue: `start()`, then `settle()`,
 * or `cancel()`; `refine(model)` while it is in flight. Every transition is
 * idempotent, so each is retried. `run` and `observeUnqueued` give their
 * function this handle as its second argument.
 */
export class Activity {
  readonly id: string;
  /** The record as the server last answered it. */
  record: ActivityRecord;
  private readonly client: InflightClient;
  private reported: Usage | undefined;

  constructor(client: InflightClient, record: ActivityRecord) {
    this.client = client;
    this.record = record;
    this.id = record.activityId;
  }

  private async update(p: Promise<ActivityRecord>): Promise<ActivityRecord> {
    this.record = await p;
    return this.record;
  }

  /** Whether the record has ended (settled, cancelled or reaped). */
  get ended(): boolean {
    return hasEnded(this.record);
  }

  /**
   * Starts it: admitted at once, or `LaneFullError` (or `LaneCoolingError`
   * on a lane cooling down, or `BudgetExhaustedError` when its `maxTokens`
   * does not fit in a token budget; the record keeps its place in line
   * each way). With `waitMs` (at most 30 s), the server holds the
   * request until its turn comes or the wait ends.
   */
  start(options: { waitMs?: number; startedAt?: TimestampInput; signal?: AbortSignal } = {}): Promise<ActivityRecord> {
    const body: StartRequest = options.startedAt === undefined ? {} : { startedAt: toWireTime(options.startedAt) };
    const waitMs = options.waitMs === undefined ? undefined : Math.max(0, Math.min(MAX_WAIT_STEP_MS, Math.ceil(options.waitMs)));
    return this.update(
      this.client.request<ActivityRecord>("start", {
        id: this.id,
        body,
        query: { wait: waitMs === undefined ? undefined : `${waitMs}ms` },
        signal: options.signal,
        extraTimeoutMs: waitMs ?? 0,
      }),
    );
  }

  /**
   * Waits in line with bounded `?wait=` requests until admitted, through a
   * full lane (`lane_full`), a lane cooling down (`lane_cooling`) and a
   * token budget used up (`budget_exhausted`) alike. After a
   * `lane_cooling` with `Retry-After`, it asks again no sooner than that;
   * when that is past `maxWaitMs`, it gives up at once (`WaitTimeoutError`,
   * with the refusal's `retryAfterMs`). A `budget_exhausted`'s
   * `Retry-After` is only the latest the window makes room by itself: a
   * settle that reports less than its call's estimate makes room sooner, and
   * the server's held `?wait=` wakes for it. So after one it asks again at
   * once, as after a `lane_full`, and waits until `maxWaitMs` whatever the
   * `Retry-After` (which its `WaitTimeoutError` carries).
   */
  async admit(options: AdmitOptions = {}): Promise<ActivityRecord> {
    const step = waitStepOf(options);
    const deadline = options.maxWaitMs === undefined ? Infinity : Date.now() + options.maxWaitMs;
    for (;;) {
      const left = deadline - Date.now();
      try {
        return await this.start({ waitMs: Math.max(0, Math.min(step, left)), ...(options.signal ? { signal: options.signal } : {}) });
      } catch (err) {
        if (!isInflightError(err) || !WAITED_THROUGH.has(err.code)) throw err;
        const cooling = err.code === "lane_cooling";
        const now = Date.now();
        // A cooling lane grants nothing before its Retry-After: asking sooner is a wasted request.
        const notBefore = cooling && err.retryAfterMs !== undefined ? now + err.retryAfterMs : now;
        if (now >= deadline || notBefore > deadline) {
          const why =
            cooling ? " (the lane is cooling down after a provider's refusal)"
            : err.code === "budget_exhausted" ? " (its tokens did not fit in the token budget)"
            : "";
          throw new WaitTimeoutError(
            "wait_timeout",
            `activity ${this.id} was not admitted on ${this.record.service}::${this.record.provider} within ${options.maxWaitMs} ms${why}`,
            { cause: err, ...(err.retryAfterMs === undefined ? {} : { retryAfterMs: err.retryAfterMs }) },
          );
        }
        if (options.signal?.aborted) throw options.signal.reason;
        if (notBefore > now) await sleep(notBefore - now, options.signal);
      }
    }
  }

  /**
   * Tells the tokens the call spent (`inputTokens`, `outputTokens`: each a
   * whole number from 0 to 1000000000), for its settle to carry: the
   * handle's own `settle`, `succeed` and `fail` send it unless given a
   * `usage` of their own, and `run` sends it, with a success or a failure,
   * instead of what it would read from `fn`'s result. A count given again
   * replaces the earlier one; a count left out keeps it. Throws a
   * `TypeError` naming the field (`usage.outputTokens`) for anything else;
   * nothing is sent until the settle.
   */
  reportUsage(usage: Usage): void {
    const checked = checkUsage(usage, "reportUsage");
    if (checked !== undefined) this.reported = { ...this.reported, ...checked };
  }

  /** The usage `reportUsage` was told so far, if any. */
  get reportedUsage(): Usage | undefined {
    return this.reported === undefined ? undefined : { ...this.reported };
  }

  /**
   * Settles it: success, or a failure (at `failureStage`), with the tokens
   * it spent (`usage`, else what `reportUsage` was told). Repeating the
   * same settle is harmless. A `usage` that is not an object of whole
   * numbers from 0 to 1000000000 rejects with a `TypeError` naming the
   * field, and nothing is sent.
   */
  async settle(outcome: boolean | SettleRequest): Promise<ActivityRecord> {
    const { usage: given, ...rest }: SettleRequest = typeof outcome === "boolean" ? { success: outcome } : outcome;
    const usage = checkUsage(given, "settle") ?? this.reported;
    const body: SettleRequest = { ...rest, completedAt: toWireTime(rest.completedAt), ...(usage === undefined ? {} : { usage }) };
    return this.update(this.client.request<ActivityRecord>("settle", { id: this.id, body }));
  }

  /** Settles it succeeded, with the tokens it spent (`usage`, else what `reportUsage` was told). */
  succeed(options: { usage?: Usage | null | undefined } = {}): Promise<ActivityRecord> {
    return this.settle({ success: true, ...(options.usage === undefined ? {} : { usage: options.usage }) });
  }

  /**
   * Settles it failed at `failureStage`. `retryAfterMs` is the provider's
   * `Retry-After` (an integer of milliseconds, 1 to 3600000; `retryAfterMs(response)`
   * reads it from an answer): the lane then cools down, granting no new
   * slot until that long after the settle (at most its `max_cooldown`).
   * `undefined` sends none. `usage` is the tokens the failed call spent
   * (else what `reportUsage` was told), as for `succeed`.
   */
  fail(
    failureStage: FailureStage = "provider",
    options: { retryAfterMs?: number | undefined; usage?: Usage | null | undefined } = {},
  ): Promise<ActivityRecord> {
    return this.settle({
      success: false,
      failureStage,
      ...(options.retryAfterMs === undefined ? {} : { retryAfterMs: options.retryAfterMs }),
      ...(options.usage === undefined ? {} : { usage: options.usage }),
    });
  }

  /** Records an abort the caller observed: `cancelled`. Repeating it is harmless. */
  cancel(reason?: string): Promise<ActivityRecord> {
    const body: CancelRequest = reason === undefined ? {} : { reason };
    return this.update(this.client.request<ActivityRecord>("cancel", { id: this.id, body }));
  }

  /**
   * Names the model the call went to, once it is known (at dispatch, after
   * the begin): allowed while the record is in flight (waiting or
   * executing). The first refinement replaces the begin's model; the same
   * model again changes nothing; a different one makes it `unknown`, for
   * good. The model is kept as a begin's is (an endpoint or a key where
   * the model belongs is `redacted`). The call counts in its aggregate
   * under its final model. Repeating the same refinement is harmless, so it
   * is retried like `settle`.
   *
   * Rejects with `ConflictError` once the record has ended (settled,
   * cancelled or reaped), `NotFoundError` for an unknown id, and
   * `InvalidRequestError` for an empty model.
   */
  refine(model: string, options: { signal?: AbortSignal } = {}): Promise<ActivityRecord> {
    const body: RefineRequest = { model };
    return this.update(this.client.request<ActivityRecord>("refine", { id: this.id, body, signal: options.signal }));
  }

  /** `cancel`, ignoring failures: for error paths that are already throwing. */
  async cancelQuietly(reason?: string): Promise<void> {
    try {
      await this.cancel(reason);
    } catch {
      // The record is reaped past its bound if this cancel was lost.
    }
  }

  /** Reads the record again. */
  refresh(): Promise<ActivityRecord> {
    return this.update(this.client.getActivity(this.id));
  }
}

/** A registered owner whose lease this process renews in the background. */
export class OwnerLease {
  readonly id: string;
  /** The owner as the server last answered it. */
  owner: Owner;
  private readonly client: InflightClient;
  private readonly options: LeaseOptions;
  private timer: NodeJS.Timeout | undefined;
  private stopped = false;
  private lostError: InflightError | undefined;
  private releasing: Promise<Owner> | undefined;
  private readonly signalHandlers: [NodeJS.Signals, () => void][] = [];

  constructor(client: InflightClient, owner: Owner, options: LeaseOptions) {
    this.client = client;
    this.owner = owner;
    this.id = owner.ownerId;
    this.options = options;
    this.schedule(owner.ttlMs / 3);
    const signals =
      options.releaseOnSignals === true ? (["SIGTERM", "SIGINT"] as NodeJS.Signals[]) : options.releaseOnSignals || [];
    for (const sig of signals) {
      const handler = () => {
        this.removeSignalHandlers();
        const done = () => {
          // Do what the signal would have done had no one listened.
          if (process.listenerCount(sig) === 0) process.kill(process.pid, sig);
        };
        this.release().then(done, done);
      };
      process.once(sig, handler);
      this.signalHandlers.push([sig, handler]);
    }
  }

  /** Whether the lease was lost (it ran out, or the server no longer knows the owner). */
  get lost(): boolean {
    return this.lostError !== undefined;
  }

  private schedule(ms: number) {
    if (this.stopped) return;
    // One timer at a time: a renewNow() by hand replaces it, never adds one.
    if (this.timer) clearTimeout(this.timer);
    this.timer = setTimeout(() => void this.renewNow(), ms);
    this.timer.unref();
  }

  /** Renews now (the background timer does this every third of the TTL). */
  async renewNow(): Promise<void> {
    if (this.stopped) return;
    try {
      this.owner = await this.client.renewOwner(this.id);
      this.schedule(this.owner.ttlMs / 3);
    } catch (err) {
      // Stopped meanwhile (a release answered first): not lost, and not renewed.
      if (this.stopped) return;
      if (isInflightError(err, "conflict") || isInflightError(err, "not_found")) {
        this.markLost(err);
      } else {
        // Unreachable for now: try again soon, while the lease may still hold.
        this.schedule(Math.max(100, this.owner.ttlMs / 10));
      }
    }
  }

  private markLost(err: InflightError) {
    this.stop();
    this.lostError = err;
    try {
      this.options.onLost?.(err);
    } catch {
      // The hook's failure is the hook's.
    }
  }

  /** Stops renewing without telling the server (as a crash would). */
  stop(): void {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
    this.removeSignalHandlers();
    if (this.client.ownerId === this.id) this.client.ownerId = undefined;
  }

  private removeSignalHandlers() {
    for (const [sig, handler] of this.signalHandlers.splice(0)) process.removeListener(sig, handler);
  }

  /** A clean shutdown: stops renewing and releases the owner; its in-flight records are cancelled. */
  release(): Promise<Owner> {
    this.releasing ??= (async () => {
      this.stop();
      try {
        this.owner = await this.client.releaseOwner(this.id);
      } catch (err) {
        // Not released: a later call tries again.
        this.releasing = undefined;
        throw err;
      }
      return this.owner;
    })();
    return this.releasing;
  }
}
