#!/usr/bin/env bash
# The OpenAPI document against a live server: `inflight serve` on a temp
# SQLite file and a free port; /openapi.json validated as OpenAPI 3.1; then a
# short, bounded schemathesis run that fails on any 5xx and on any answer
# the document does not describe (status, content type, headers, schema).
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
cleanup() {
    if [ -n "$server_pid" ]; then
        kill "$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# A free port: bind to port 0 and read what the kernel gave.
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
base="http://127.0.0.1:$port"

# A small config: a capped lane, so that admission answers 429 too.
cat > "$work/inflight.toml" <<EOF
[lanes."schemathesis::openapi"]
cap = 1
EOF

(cd "$work" && exec "$binary" serve --listen "127.0.0.1:$port" \
    --store "sqlite://$work/inflight.db" --config "$work/inflight.toml") \
    > "$work/server.log" 2>&1 &
server_pid=$!

for _ in $(seq 1 100); do
    if curl -fsS "$base/healthz" > /dev/null 2>&1; then
        break
    fi
    if ! kill -0 "$server_pid" 2>/dev/null; then
        echo "inflight serve exited early:"
        cat "$work/server.log"
        exit 1
    fi
    sleep 0.1
done
curl -fsS "$base/healthz" > /dev/null

echo "-- validate /openapi.json"
curl -fsS "$base/openapi.json" > "$work/openapi.json"
python3 - "$work/openapi.json" <<'EOF'
import json, sys
from openapi_spec_validator import validate
from openapi_spec_validator.validation import OpenAPIV31SpecValidator
with open(sys.argv[1]) as f:
    document = json.load(f)
assert document["openapi"].startswith("3.1"), document["openapi"]
validate(document, cls=OpenAPIV31SpecValidator)
print(f"OpenAPI {document['openapi']}: valid, {len(document['paths'])} paths")
EOF

echo "-- schemathesis"
status=0
# From the temp dir: schemathesis keeps a cache in its working directory.
(cd "$work" && exec timeout 240 schemathesis --no-color run "$base/openapi.json" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance \
    --max-examples 25 --seed 20261130 --workers 1 \
    --request-timeout 40 \
    --report junit --report-dir "$work/report") || status=$?
if [ "$status" -ne 0 ]; then
    echo "schemathesis failed (exit $status); the server's log:"
    tail -50 "$work/server.log"
    exit "$status"
fi
