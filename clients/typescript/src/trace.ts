// The W3C trace context a begin carries (the `traceparent` header): the one
// the caller gives, else the active OpenTelemetry span's, when the
// application has `@opentelemetry/api`.
//
// How `@opentelemetry/api` is loaded. It is an optional peer dependency: it
// may be absent, and its absence must never throw. The package ships an ESM
// and a CommonJS build of these same sources (scripts/build.mjs), which
// rules out the synchronous ways: a static import would make it required,
// `require` does not exist in the ESM build, and `createRequire(import.meta.url)`
// cannot be written in the CommonJS one (`import.meta` is ESM-only syntax).
// A dynamic `import()` works in both: tsc keeps it in the ESM build and
// turns it into a `require` inside a promise in the CommonJS one, it
// resolves from this package's own location as a static import would, and
// a missing package only rejects the promise, which is caught (then
// nothing is sent). It is started once, by the first client made with
// propagation on, so by the first begin it has usually loaded and the span
// is read synchronously, in the caller's own stack; a begin that comes
// sooner awaits it first (Node's OpenTelemetry context managers, built on
// AsyncLocalStorage, keep the caller's context across that await). The API
// keeps its state process-wide (one global per major version), so the copy
// loaded here sees the tracer provider and context manager the application
// registered, whichever of the API's builds the application imported.

/** What this module uses of `@opentelemetry/api` (its own types stay out of this package's declarations). */
interface SpanContextLike {
  traceId: string;
  spanId: string;
  traceFlags: number;
}
interface OtelApi {
  context: { active(): unknown };
  trace: {
    getSpanContext(context: unknown): SpanContextLike | undefined;
    isSpanContextValid(spanContext: SpanContextLike): boolean;
  };
}

/** The API once loaded (`null`: not installed, or not the API this module knows). */
let api: OtelApi | null | undefined;
let loading: Promise<void> | undefined;

/** Starts loading `@opentelemetry/api`, once; never rejects. */
export function loadOtel(): Promise<void> {
  loading ??= (async () => {
    try {
      const loaded = (await import("@opentelemetry/api")) as unknown as Partial<OtelApi>;
      api =
        typeof loaded.context?.active === "function" &&
        typeof loaded.trace?.getSpanContext === "function" &&
        typeof loaded.trace?.isSpanContextValid === "function"
          ? (loaded as OtelApi)
          : null;
    } catch {
      api = null;
    }
  })();
  return loading;
}

/** The active span's context as a `traceparent` (version 00), if the API is loaded and a valid span is active. */
function activeTraceparent(otel: OtelApi): string | undefined {
  try {
    const span = otel.trace.getSpanContext(otel.context.active());
    if (span === undefined || !otel.trace.isSpanContextValid(span)) return undefined;
    const flags = (span.traceFlags & 0xff).toString(16).padStart(2, "0");
    // The API accepts upper-case ids; the header's are lower case.
    return `00-${span.traceId.toLowerCase()}-${span.spanId.toLowerCase()}-${flags}`;
  } catch {
    // A broken context manager is not the ledger's concern: no trace context.
    return undefined;
  }
}

/**
 * The `traceparent` a begin sends: `explicit` when given (any string: the
 * server names a malformed one), else with `propagate` the active
 * OpenTelemetry span's, else none. Synchronous once the API has loaded (or
 * is known absent), so that the span is read where the begin was called; a
 * promise only while it is still loading. A non-string `explicit` throws a
 * `TypeError` naming `where`.
 */
export function traceparentFor(
  explicit: unknown,
  propagate: boolean,
  where: string,
): string | undefined | Promise<string | undefined> {
  if (explicit !== undefined) {
    if (typeof explicit !== "string") {
      throw new TypeError(`${where}: traceparent must be a string, not ${explicit === null ? "null" : typeof explicit}`);
    }
    return explicit;
  }
  if (!propagate) return undefined;
  if (api === undefined) return loadOtel().then(() => (api ? activeTraceparent(api) : undefined));
  return api === null ? undefined : activeTraceparent(api);
}
