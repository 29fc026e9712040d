// A recorder with the four calls of a hand-written provider-activity ledger
// (begin, start, refine, complete), so that code written against that
// lifecycle can point at an inflight server without changing its call
// sites. Each call returns at once and never throws; the requests go out in
// the background, in order for each activity, and failures go to `onError`.
import { randomUUID } from "node:crypto";

import type { InflightClient } from "./client.js";
import { withContextFields } from "./context.js";
import { traceparentFor } from "./trace.js";
import { isInflightError, TLSError } from "./errors.js";
import { settleRetryAfterMs } from "./retry-after.js";
import type { ActivityRecord, Admission, BeginRequest, FailureStage, Priority, SettleRequest, TimestampInput } from "./wire.js";
import { PRIORITIES } from "./wire.js";

/**
 * What `beginProviderActivity` takes: the fields of a hand-written ledger's
 * entry. Values are taken as they come (such code passes whatever it has);
 * see `ProviderActivityRecorder` for how each maps to a begin.
 */
export interface ProviderActivityEntry {
  service?: string;
  operationStage?: string;
  /** The deadline class (`chat`, `embedding`, ...): a begin's `class`. */
  role?: string;
  provider?: string;
  model?: string;
  priority?: Priority | string;
  enqueuedAt?: TimestampInput;
  /** Set when the call is begun already running (`not-applicable` calls usually are). */
  startedAt?: TimestampInput | null;
  /** `neo-queued` (the caller's own limiter admits it) or `not-applicable` (no queue). */
  queueDisposition?: "neo-queued" | "not-applicable" | string;
  /**
   * The begin's W3C `traceparent`, instead of the OpenTelemetry span
   * active where `beginProviderActivity` is called (which it sends unless
   * the client's `propagateTrace` is false). A string, sent as given: a
   * malformed one is refused by the server, and reported to `onError`.
   */
  traceparent?: string;
}

/** What `completeProviderActivity` takes. */
export interface ProviderActivityOutcome {
  completedAt?: TimestampInput;
  /** `true` is a success; anything else a failure. */
  success?: boolean;
  /** Where a failure happened: `provider`, `queue` or `unknown` (anything else is `unknown`). */
  failureStage?: FailureStage | string | null;
  /**
   * A failure's provider `Retry-After`, in milliseconds (`retryAfterMs(response)`
   * reads it): the lane cools down that long. Rounded and kept within 1 to
   * 3600000; anything but a finite number, or with a success, is not sent.
   */
  retryAfterMs?: number | null;
}

export type RecorderOperation = "begin" | "start" | "refine" | "complete";

/** Which call a failure (or an answer) belongs to. */
export interface RecorderEvent {
  operation: RecorderOperation;
  /** The id `beginProviderActivity` returned (also the begin's `Idempotency-Key`). */
  id: string;
  /** The server's id of the record, once its begin has answered. */
  activityId: string | undefined;
}

export interface RecorderOptions {
  /**
   * Called with every failure, instead of throwing into the caller: a
   * request the server refused (`InflightError`), one that found no server
   * after the client's retries, or a call the recorder could not send
   * (`RecorderError`: an id it does not know, or an activity whose begin
   * failed). Errors thrown here are ignored. Default: a process warning
   * (pass `() => {}` to drop failures silently).
   */
  onError?(err: unknown, event: RecorderEvent): void;
  /** Called with the record each request answered (for logs and tests). Errors thrown here are ignored. */
  onRecorded?(record: ActivityRecord, event: RecorderEvent): void;
  /**
   * How long, in ms, an activity never completed stays in this recorder
   * once the server has reaped it (its `reapedAt`) or may (its
   * `reapableAt`), as the record last answered says: a complete that comes
   * by then is still sent, and the server absorbs it as the late settle it
   * is. After that it is forgotten, so that completes the caller lost do
   * not grow this process's memory without bound; the server keeps the
   * evidence (the record, reaped). A later call for its id is `unknown-id`.
   * An activity whose begin never got an answer is forgotten a day after
   * it was begun. Default 10 minutes; 0 forgets at the first chance.
   */
  forgetAfterMs?: number;
}

/** `RecorderOptions.forgetAfterMs`'s default. */
const FORGET_AFTER_MS = 10 * 60_000;
/** How long an activity whose begin never got an answer is kept. */
const UNANSWERED_FOR_MS = 24 * 60 * 60_000;
/** How often, at most, the activities are looked over for those to forget. */
const SWEEP_EVERY_MS = 10_000;

/** A call the recorder could not send (it never reached the server). */
export class RecorderError extends Error {
  override name = "RecorderError";
  /** `unknown-id`: not an id of this recorder's, or its activity was completed or forgotten (`forgetAfterMs`); `not-begun`: its begin failed. */
  readonly reason: "unknown-id" | "not-begun";

  constructor(reason: "unknown-id" | "not-begun", message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.reason = reason;
  }
}

/** One activity the recorder has begun and not yet seen completed. */
interface Tracked {
  /** The recorder's id: the begin's `Idempotency-Key`. */
  readonly id: string;
  /** The begin's body, made once, so that every attempt is the same request. */
  readonly body: BeginRequest;
  /**
   * The begin's `traceparent`, read when `beginProviderActivity` was
   * called (a promise only while `@opentelemetry/api` was still loading).
   */
  traceparent: string | undefined | Promise<string | undefined>;
  /** The server's id, once the begin answered. */
  activityId: string | undefined;
  /** The begin's failure that another attempt would not mend (a 4xx), if any. */
  refused: unknown;
  /** The last request queued for this activity: the next one goes out after it. */
  tail: Promise<void>;
  /** When the recorder forgets it, if it is not completed by then (ms since the epoch). */
  forgetAt: number;
}

/** The errors after which the same begin, sent again, may yet be answered: no answer, a 5xx, a 408. */
function mendable(err: unknown): boolean {
  if (!isInflightError(err) || err instanceof TLSError) return false;
  return err.code === "unavailable" || err.code === "internal" || err.code === "request_timeout";
}

/** A timestamp as the wire takes it; `fallback` (now, at the call) when none was given. */
function stamp(value: TimestampInput | null | undefined, fallback: number): number | string {
  if (value === undefined || value === null) return fallback;
  return value instanceof Date ? value.getTime() : value;
}

const FAILURE_STAGES: readonly string[] = ["provider", "queue", "unknown"] satisfies FailureStage[];

/**
 * The four calls of a hand-written provider-activity ledger, sent to an
 * inflight server through `client` (its base URL, token, TLS options,
 * retries and errors):
 *
 * - `beginProviderActivity(entry)` returns an id at once (a random UUID,
 *   made here). The begin goes out with that id as its `Idempotency-Key`,
 *   so a begin whose answer was lost is sent again and answered with the
 *   record the first made, never a second record. Once it answers, the id
 *   maps to the server's record.
 * - `startProviderActivity(id, startedAt)`, `refineProviderActivity(id,
 *   {model})` and `completeProviderActivity(id, {completedAt, success,
 *   failureStage})` are the record's start, refine and settle.
 *
 * The requests of one id go out in order, each after the previous one has
 * answered (or failed): begin, then start, refine, complete, however slow
 * each is. A call returns before its request is sent and never throws;
 * every failure goes to `onError`. `flush()` waits for everything still
 * being sent (call it before the process exits).
 *
 * The entry's fields, as a begin's:
 * - `role` is the `class`; `service`, `operationStage`, `provider` and
 *   `model` are themselves (inside `client.withContext`, the context fills
 *   a missing `service`, `operationStage` or `priority`; a `service` or
 *   `provider` still missing is `unknown`, as the hand-written ledger
 *   recorded it). The records carry `client.ownerId` when the client holds
 *   an owner lease.
 * - `priority`: `interactive`, `batch` or `unknown`; any other value is `unknown`.
 * - `queueDisposition`: `not-applicable` is admission `direct` (observed
 *   only); `neo-queued` (and anything else, or none) is `external`: the
 *   caller's own limiter admitted the call, and its start is a fact, not a
 *   request. An `external` record that executes takes a slot of its lane's
 *   cap (so the ledger's own queued callers see it taken), one that waits
 *   holds no place in line, and it is never refused `lane_full`.
 * - Times missing from a call (`enqueuedAt`, a start's `startedAt`, a
 *   complete's `completedAt`) are stamped with this process's clock when the
 *   call is made, not when its request goes out.
 */
export class ProviderActivityRecorder {
  readonly client: InflightClient;
  private readonly onError: (err: unknown, event: RecorderEvent) => void;
  private readonly onRecorded: ((record: ActivityRecord, event: RecorderEvent) => void) | undefined;
  /** The activities begun and not yet completed, by the recorder's id. */
  private readonly activities = new Map<string, Tracked>();
  /** Every request queued and not yet settled, for `flush`. */
  private readonly pending = new Set<Promise<void>>();
  private readonly forgetAfterMs: number;
  /** When the activities are next looked over (ms since the epoch). */
  private nextSweep = 0;

  constructor(client: InflightClient, options: RecorderOptions = {}) {
    this.client = client;
    this.onError =
      options.onError ??
      ((err, event) =>
        process.emitWarning(
          `inflight recorder: the ${event.operation} of activity ${event.id} was not recorded: ${String(err)}`,
          "InflightWarning",
        ));
    this.onRecorded = options.onRecorded;
    const forgetAfterMs = options.forgetAfterMs ?? FORGET_AFTER_MS;
    if (typeof forgetAfterMs !== "number" || !Number.isFinite(forgetAfterMs) || forgetAfterMs < 0) {
      throw new TypeError(`forgetAfterMs must be a number of milliseconds, 0 or more; got ${String(forgetAfterMs)}`);
    }
    this.forgetAfterMs = forgetAfterMs;
    // Callable detached (`const { beginProviderActivity } = recorder`), as plain functions are.
    this.beginProviderActivity = this.beginProviderActivity.bind(this);
    this.startProviderActivity = this.startProviderActivity.bind(this);
    this.refineProviderActivity = this.refineProviderActivity.bind(this);
    this.completeProviderActivity = this.completeProviderActivity.bind(this);
    this.flush = this.flush.bind(this);
  }

  /** How many activities were begun and not yet completed through this recorder. */
  get inFlight(): number {
    return this.activities.size;
  }

  /**
   * Begins a record for a provider call and returns its id at once (never
   * throws): the id the other three calls take.
   */
  beginProviderActivity(entry: ProviderActivityEntry = {}): string {
    const id = randomUUID();
    try {
      this.sweep();
      const tracked: Tracked = {
        id,
        body: this.beginBody(entry ?? {}),
        traceparent: traceparentFor(entry?.traceparent, this.client.propagateTrace, "beginProviderActivity"),
        activityId: undefined,
        refused: undefined,
        tail: Promise.resolve(),
        forgetAt: Date.now() + UNANSWERED_FOR_MS,
      };
      this.activities.set(id, tracked);
      this.enqueue(tracked, async () => {
        try {
          await this.ensureBegun(tracked);
        } catch (err) {
          this.report(err, { operation: "begin", id, activityId: undefined });
        }
      });
    } catch (err) {
      this.report(err, { operation: "begin", id, activityId: undefined });
    }
    return id;
  }

  /** Reports that the call started (at `startedAt`, default now): a fact the server records, never refuses for capacity. */
  startProviderActivity(id: string, startedAt?: TimestampInput | null): void {
    const at = stamp(startedAt, Date.now());
    this.transition(id, "start", (activityId) =>
      this.client.request<ActivityRecord>("start", { id: activityId, body: { startedAt: at } }),
    );
  }

  /**
   * Names the model the call was dispatched to. The server keeps the first
   * refinement, and folds a different later one to `unknown`. A call without
   * `model` sends nothing; a `model` that is not a non-empty string is `unknown`.
   */
  refineProviderActivity(id: string, activity: { model?: unknown } = {}): void {
    if (activity === null || typeof activity !== "object" || !Object.hasOwn(activity, "model")) return;
    const model = typeof activity.model === "string" && activity.model.trim() !== "" ? activity.model : "unknown";
    this.transition(id, "refine", (activityId) =>
      this.client.request<ActivityRecord>("refine", { id: activityId, body: { model } }),
    );
  }

  /**
   * Settles the record: `success: true` succeeded, anything else failed at
   * `failureStage` (with the provider's `retryAfterMs`, if given). The id is forgotten once this is called. A success of a
   * record that never started is recorded by the server with a flag
   * (`unstartedSuccess`), never as a normal completion.
   */
  completeProviderActivity(id: string, outcome: ProviderActivityOutcome = {}): void {
    const completedAt = stamp(outcome?.completedAt, Date.now());
    let body: SettleRequest;
    if (outcome?.success === true) {
      body = { success: true, completedAt };
    } else {
      body = { success: false, completedAt };
      const stage = outcome?.failureStage;
      if (stage !== undefined && stage !== null) {
        body.failureStage = (FAILURE_STAGES.includes(stage) ? stage : "unknown") as FailureStage;
      }
      const retryAfterMs = settleRetryAfterMs(outcome?.retryAfterMs);
      if (retryAfterMs !== undefined) body.retryAfterMs = retryAfterMs;
    }
    this.transition(id, "complete", (activityId) =>
      this.client.request<ActivityRecord>("settle", { id: activityId, body }),
    );
    this.activities.delete(id);
  }

  /**
   * Resolves once every request queued so far, and any queued while it
   * waits, has been answered or given up (never rejects): call it before
   * the process exits so that no settle is lost.
   */
  async flush(): Promise<void> {
    while (this.pending.size > 0) await Promise.allSettled([...this.pending]);
  }

  // ---- inside ------------------------------------------------------------

  private beginBody(entry: ProviderActivityEntry): BeginRequest {
    const enqueuedAt = stamp(entry.enqueuedAt, Date.now());
    const admission: Admission = entry.queueDisposition === "not-applicable" ? "direct" : "external";
    const priority =
      entry.priority === undefined || entry.priority === null
        ? undefined
        : (PRIORITIES as readonly string[]).includes(entry.priority)
          ? (entry.priority as Priority)
          : "unknown";
    const spec = withContextFields(
      {
        service: entry.service ?? undefined,
        operationStage: entry.operationStage ?? undefined,
        priority,
      },
      this.client.currentContext(),
    );
    const body: BeginRequest = {
      service: spec.service ?? "unknown",
      provider: entry.provider ?? "unknown",
      admission,
      enqueuedAt,
    };
    if (entry.role !== undefined && entry.role !== null) body.class = entry.role;
    if (spec.operationStage !== undefined) body.operationStage = spec.operationStage;
    if (entry.model !== undefined && entry.model !== null) body.model = entry.model;
    if (spec.priority !== undefined) body.priority = spec.priority;
    if (entry.startedAt !== undefined && entry.startedAt !== null) body.startedAt = stamp(entry.startedAt, Date.now());
    if (this.client.ownerId !== undefined) body.ownerId = this.client.ownerId;
    return body;
  }

  /**
   * The server's id of the activity, beginning it first if that has not
   * answered yet: the same begin (the same key and body), so that a begin
   * whose answer was lost is answered with the record it made. Rejects with
   * the begin's error; once a begin was refused (a 4xx), at once.
   */
  private async ensureBegun(tracked: Tracked): Promise<string> {
    if (tracked.activityId !== undefined) return tracked.activityId;
    if (tracked.refused !== undefined) throw tracked.refused;
    try {
      if (tracked.traceparent instanceof Promise) tracked.traceparent = await tracked.traceparent;
      const traceparent = tracked.traceparent;
      const record = await this.client.request<ActivityRecord>("begin", {
        body: tracked.body,
        idempotencyKey: tracked.id,
        ...(traceparent === undefined ? {} : { traceparent }),
      });
      tracked.activityId = record.activityId;
      tracked.forgetAt = this.forgetAt(record);
      this.recorded(record, { operation: "begin", id: tracked.id, activityId: record.activityId });
      return record.activityId;
    } catch (err) {
      if (!mendable(err)) tracked.refused = err;
      throw err;
    }
  }

  /** Queues a start, refine or complete of `id` behind its earlier requests. */
  private transition(
    id: string,
    operation: Exclude<RecorderOperation, "begin">,
    send: (activityId: string) => Promise<ActivityRecord>,
  ): void {
    try {
      const tracked = typeof id === "string" ? this.activities.get(id) : undefined;
      if (tracked === undefined) {
        const known = typeof id === "string" ? `activity ${id}` : `an id that is ${id === null ? "null" : typeof id}`;
        this.report(
          new RecorderError(
            "unknown-id",
            `inflight recorder: ${operation} of ${known}, which this recorder did not begin, has completed or has forgotten (forgetAfterMs); nothing was sent`,
          ),
          { operation, id: String(id), activityId: undefined },
        );
        return;
      }
      this.enqueue(tracked, async () => {
        let activityId: string;
        try {
          activityId = await this.ensureBegun(tracked);
        } catch (err) {
          this.report(
            new RecorderError(
              "not-begun",
              `inflight recorder: the ${operation} of activity ${id} was not sent: its begin failed (${String(err)})`,
              { cause: err },
            ),
            { operation, id, activityId: undefined },
          );
          return;
        }
        const event: RecorderEvent = { operation, id, activityId };
        try {
          const record = await send(activityId);
          tracked.forgetAt = this.forgetAt(record);
          this.recorded(record, event);
        } catch (err) {
          this.report(err, event);
        }
      });
    } catch (err) {
      this.report(err, { operation, id: String(id), activityId: undefined });
    }
  }

  /** When an activity whose record last answered `record` is forgotten. */
  private forgetAt(record: ActivityRecord): number {
    const bound = Date.parse(record.reapedAt ?? record.reapableAt ?? "");
    return (Number.isFinite(bound) ? bound : Date.now()) + this.forgetAfterMs;
  }

  /** Forgets the activities past their time (`RecorderOptions.forgetAfterMs`), at most every 10 s. */
  private sweep(): void {
    const now = Date.now();
    if (now < this.nextSweep) return;
    this.nextSweep = now + Math.min(this.forgetAfterMs, SWEEP_EVERY_MS);
    for (const [id, tracked] of this.activities) {
      if (tracked.forgetAt <= now) this.activities.delete(id);
    }
  }

  /** Runs `request` once every earlier request of the activity has settled. */
  private enqueue(tracked: Tracked, request: () => Promise<void>): void {
    const next = tracked.tail.then(request).catch(() => {});
    tracked.tail = next;
    this.pending.add(next);
    void next.then(() => this.pending.delete(next));
  }

  private report(err: unknown, event: RecorderEvent): void {
    try {
      this.onError(err, event);
    } catch {
      // The hook's failure is the hook's: the caller never sees it.
    }
  }

  private recorded(record: ActivityRecord, event: RecorderEvent): void {
    try {
      this.onRecorded?.(record, event);
    } catch {
      // As above.
    }
  }
}
