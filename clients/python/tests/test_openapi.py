"""The client's wire against the server's own OpenAPI document
(``GET /openapi.json``): routes, query and header parameters, body and answer fields,
error codes, priorities. Any disagreement fails."""

from __future__ import annotations

import copy
import os
import sys
import warnings

import httpx
import pytest

from openapi_check import compare_with_document


@pytest.fixture(scope="module")
def document(plain_server):
    response = httpx.get(plain_server.url + "/openapi.json", timeout=10)
    if response.status_code == 404:
        message = (
            "THE SERVER HAS NO /openapi.json (404): the client's wire was NOT checked against the document. "
            "INFLIGHT_OPENAPI_REQUIRED=1 (which .ci/run always sets) makes this a failure."
        )
        banner = "!" * 100
        print(f"\n{banner}\n{message}\n{banner}", file=sys.stderr)
        warnings.warn(message)
        if os.environ.get("INFLIGHT_OPENAPI_REQUIRED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    assert response.status_code == 200, f"GET /openapi.json answered {response.status_code}"
    return response.json()


def test_the_clients_wire_agrees_with_the_document(document):
    problems = compare_with_document(document)
    assert problems == [], "the client and the OpenAPI document disagree:\n  " + "\n  ".join(problems)


def test_the_check_notices_what_the_client_does_not_know(document):
    changed = copy.deepcopy(document)
    for schema in (changed.get("components") or {}).get("schemas", {}).values():
        if "properties" in schema:
            schema["properties"]["brandNewField"] = {"type": "string"}
        if "lane_full" in (schema.get("enum") or []):
            schema["enum"].append("brand_new_code")
        if "interactive" in (schema.get("enum") or []):
            schema["enum"].append("brand_new_priority")
    changed["paths"]["/v1/brand-new"] = {"get": {"responses": {}}}
    problems = "\n".join(compare_with_document(changed))
    assert "ActivityRecord fields: the document has brandNewField" in problems
    assert "BeginRequest fields: the document has brandNewField" in problems
    assert "GET /v1/brand-new" in problems
    assert "brand_new_code" in problems
    assert "priorities: the document has brand_new_priority" in problems


def test_the_check_notices_an_older_servers_document_without_refinement(document):
    older = copy.deepcopy(document)
    del older["paths"]["/v1/activities/{id}/refine"]
    for schema in (older.get("components") or {}).get("schemas", {}).values():
        (schema.get("properties") or {}).pop("refined", None)
    problems = "\n".join(compare_with_document(older))
    assert "the client calls POST /v1/activities/{id}/refine, which the document lacks" in problems
    assert "ActivityRecord fields: the client has refined, the document does not" in problems


def test_the_check_notices_an_older_servers_document_without_idempotent_begins(document):
    older = copy.deepcopy(document)
    begin = older["paths"]["/v1/activities"]["post"]
    begin["parameters"] = [
        p for p in begin["parameters"] if not (p.get("in") == "header" and p["name"].lower() == "idempotency-key")
    ]
    del begin["responses"]["200"]
    for schema in (older.get("components") or {}).get("schemas", {}).values():
        if isinstance(schema.get("enum"), list):
            schema["enum"] = [code for code in schema["enum"] if code != "idempotency_conflict"]
    problems = "\n".join(compare_with_document(older))
    assert "POST /v1/activities header parameters: the client has idempotency-key, the document does not" in problems
    assert "the document has no schema where the client expects ActivityRecord" in problems
    assert "error codes: the client has idempotency_conflict, the document does not" in problems
    # And a header parameter the client does not send is noticed too.
    newer = copy.deepcopy(document)
    newer["paths"]["/v1/activities/{id}/settle"]["post"]["parameters"].append(
        {"in": "header", "name": "X-Brand-New", "schema": {"type": "string"}}
    )
    assert (
        "POST /v1/activities/{id}/settle header parameters: the document has x-brand-new, the client does not"
        in "\n".join(compare_with_document(newer))
    )


def test_the_check_notices_an_older_servers_document_without_trace_context(document):
    older = copy.deepcopy(document)
    begin = older["paths"]["/v1/activities"]["post"]
    begin["parameters"] = [
        p for p in begin["parameters"] if not (p.get("in") == "header" and p["name"].lower() == "traceparent")
    ]
    for schema in (older.get("components") or {}).get("schemas", {}).values():
        (schema.get("properties") or {}).pop("traceparent", None)
    problems = "\n".join(compare_with_document(older))
    assert "POST /v1/activities header parameters: the client has traceparent, the document does not" in problems
    assert "ActivityRecord fields: the client has traceparent, the document does not" in problems


def test_the_check_notices_an_older_servers_document_without_cooldowns(document):
    older = copy.deepcopy(document)
    for schema in (older.get("components") or {}).get("schemas", {}).values():
        for field in ("retryAfterMs", "coolingUntil", "effectiveCap", "cooldowns", "byPriority"):
            (schema.get("properties") or {}).pop(field, None)
        if isinstance(schema.get("enum"), list):
            schema["enum"] = [code for code in schema["enum"] if code != "lane_cooling"]
    problems = "\n".join(compare_with_document(older))
    assert "SettleRequest fields: the client has retryAfterMs, the document does not" in problems
    assert (
        "Lane (nativeAdmission.additionalProperties) fields: the client has byPriority, cooldowns, coolingUntil, "
        "effectiveCap, the document does not" in problems
    )
    assert "error codes: the client has lane_cooling, the document does not" in problems
    assert "expects ByPriority (nativeAdmission.additionalProperties.byPriority)" in problems


def test_the_check_notices_an_older_servers_document_without_usage(document):
    older = copy.deepcopy(document)
    for schema in (older.get("components") or {}).get("schemas", {}).values():
        for field in ("usage", "inputTokens", "outputTokens"):
            (schema.get("properties") or {}).pop(field, None)
    problems = "\n".join(compare_with_document(older))
    assert "SettleRequest fields: the client has usage, the document does not" in problems
    assert "ActivityRecord fields: the client has inputTokens, outputTokens, the document does not" in problems
    assert "Aggregate (aggregates.items) fields: the client has inputTokens, outputTokens, the document does not" in problems
    assert "the document has no schema where the client expects SettleUsage (usage)" in problems
    # And a count the client does not send is noticed too.
    newer = copy.deepcopy(document)
    newer["components"]["schemas"]["Usage"]["properties"]["cachedTokens"] = {"type": "integer"}
    assert "SettleUsage (usage) fields: the document has cachedTokens, the client does not" in "\n".join(
        compare_with_document(newer)
    )


def test_the_check_notices_an_older_servers_document_without_estimates(document):
    older = copy.deepcopy(document)
    for schema in (older.get("components") or {}).get("schemas", {}).values():
        for field in ("maxTokens", "tokensReserved"):
            (schema.get("properties") or {}).pop(field, None)
    problems = "\n".join(compare_with_document(older))
    assert "BeginRequest fields: the client has maxTokens, the document does not" in problems
    assert "ActivityRecord fields: the client has maxTokens, the document does not" in problems
    assert "Lane (nativeAdmission.additionalProperties) fields: the client has tokensReserved, the document does not" in problems
