#!/usr/bin/env python3
"""A stand-in OpenTelemetry collector for trying `[otel]`: it takes OTLP over
HTTP (protobuf) on /v1/traces and /v1/metrics, prints each span and metric it
receives, one line each, and keeps nothing.

    pip install opentelemetry-proto
    python3 tools/otlp_print.py [--listen 127.0.0.1:4318]

Not a collector to run in production: use the OpenTelemetry Collector, Jaeger
or your vendor's endpoint there.
"""

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

try:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
except ImportError:
    sys.exit("otlp_print.py needs the OpenTelemetry protobuf definitions: pip install opentelemetry-proto")

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
# A body larger than this is refused: nothing sends spans that large.
MAX_BODY = 16 << 20


def value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def attributes(pairs):
    return {pair.key: value(pair.value) for pair in pairs}


def print_spans(request):
    for resource in request.resource_spans:
        service = attributes(resource.resource.attributes).get("service.name")
        for scope in resource.scope_spans:
            for span in scope.spans:
                print(json.dumps({
                    "span": span.name,
                    "service": service,
                    "kind": KINDS.get(span.kind, span.kind),
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex() or None,
                    "ms": round((span.end_time_unix_nano - span.start_time_unix_nano) / 1e6, 3),
                    "status": STATUS.get(span.status.code, span.status.code),
                    "attributes": attributes(span.attributes),
                    "events": [event.name for event in span.events],
                }), flush=True)


def print_metrics(request):
    for resource in request.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                kind = metric.WhichOneof("data")
                points = getattr(metric, kind).data_points if kind else []
                print(json.dumps({
                    "metric": metric.name,
                    "unit": metric.unit,
                    "points": [
                        {"attributes": attributes(p.attributes), "count": getattr(p, "count", None),
                         "sum": getattr(p, "sum", None)}
                        for p in points
                    ],
                }), flush=True)


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        readers = {"/v1/traces": (ExportTraceServiceRequest, print_spans),
                   "/v1/metrics": (ExportMetricsServiceRequest, print_metrics)}
        if self.path not in readers:
            self.send_error(404, "only /v1/traces and /v1/metrics")
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.send_error(413)
            return
        message, show = readers[self.path]
        request = message()
        try:
            request.ParseFromString(self.rfile.read(length))
        except Exception as err:  # a body that is not OTLP protobuf
            self.send_error(400, f"not OTLP protobuf: {err}")
            return
        show(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *args):  # the requests themselves are noise
        pass


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:4318", help="host:port (default 127.0.0.1:4318)")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    server = ThreadingHTTPServer((host, int(port)), Handler)
    print(f"otlp_print: listening on http://{args.listen}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
