#!/usr/bin/env bash
# The OpenAPI document against a live server: `inflight serve` on a temp
# SQLite file and a free port; /openapi.json validated as OpenAPI 3.1; then
# short, bounded, seeded schemathesis runs that fail on any 5xx and on any
# answer the document does not describe (status, content type, headers,
# schema): one without a token, one with a token, where requests without it
# must be refused as documented.
#
# Usage: .ci/openapi.sh PATH-TO-INFLIGHT-BINARY
set -euo pipefail

binary=${1:?usage: .ci/openapi.sh PATH-TO-INFLIGHT-BINARY}
binary=$(realpath "$binary")

# Pinned, so that a new release cannot turn CI red on its own.
python3 -m pip install --quiet --disable-pip-version-check \
    "schemathesis==4.32.5" "openapi-spec-validator==0.9.0"

work=$(mktemp -d)
server_pid=""
stop_server() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
        server_pid=""
    fi
}
cleanup() {
    stop_server
    rm -rf "$work"
}
trap cleanup EXIT

# A small config: a capped lane, so that admission can answer 429 too.
printf '[lanes."schemathesis::openapi"]\ncap = 1\n' > "$work/inflight.toml"

# Starts `inflight serve` on a fresh SQLite file and a free port, with any
# further arguments; sets $base and $server_pid.
start_server() {
    local name=$1
    shift
    # A free port: bind to port 0 and read what the kernel gave.
    local port
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    base="http://127.0.0.1:$port"
    (cd "$work" && exec "$binary" serve --listen "127.0.0.1:$port" \
        --store "sqlite://$work/$name.db" --config "$work/inflight.toml" "$@") \
        > "$work/$name.log" 2>&1 &
    server_pid=$!
    for _ in $(seq 1 100); do
        if curl -fsS "$base/healthz" > /dev/null 2>&1; then
            return 0
        fi
        if ! kill -0 "$server_pid" 2>/dev/null; then
            echo "inflight serve exited early:"
            cat "$work/$name.log"
            exit 1
        fi
        sleep 0.1
    done
    curl -fsS "$base/healthz" > /dev/null
}

checks=not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance

# Runs schemathesis against $base with the remaining arguments; on a
# failure, shows the server's log and exits.
fuzz() {
    local name=$1
    shift
    local status=0
    # From the temp dir: schemathesis keeps a cache in its working directory.
    # One worker: concurrent workers crash inside hypothesis on Python 3.11.
    (cd "$work" && exec timeout 150 schemathesis --no-color run "$base/openapi.json" \
        --workers 1 --request-timeout 40 "$@") || status=$?
    if [ "$status" -ne 0 ]; then
        echo "schemathesis failed (exit $status); the server's log:"
        tail -50 "$work/$name.log"
        exit "$status"
    fi
}

start_server open

echo "-- validate /openapi.json"
curl -fsS "$base/openapi.json" > "$work/openapi.json"
python3 - "$work/openapi.json" <<'PY'
import json, sys
from openapi_spec_validator import validate
from openapi_spec_validator.validation import OpenAPIV31SpecValidator
with open(sys.argv[1]) as f:
    document = json.load(f)
assert document["openapi"].startswith("3.1"), document["openapi"]
validate(document, cls=OpenAPIV31SpecValidator)
print(f"OpenAPI {document['openapi']}: valid, {len(document['paths'])} paths")
PY

echo "-- schemathesis, no token"
fuzz open --checks "$checks" --max-examples 25 --seed 20261130
stop_server

echo "-- schemathesis, with a token (requests without it must be refused)"
start_server token --token ci-openapi-token
fuzz token --checks "$checks,ignored_auth" --max-examples 10 --seed 20261130 \
    -H "Authorization: Bearer ci-openapi-token"
