"""Compares what the client sends and reads (the TypedDicts, ROUTES and
PRIORITIES in inflight_ledger.wire) with the server's OpenAPI document;
returns every disagreement."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Set

from inflight_ledger import LABEL_PATTERN, PRIORITIES, ROUTES, ROUTES_NOT_CALLED, SERVER_ERROR_CODES, TYPES, field_names

METHODS = ("get", "put", "post", "delete", "patch", "options", "head")


def deref(doc: Dict[str, Any], schema: Any) -> Any:
    seen: Set[str] = set()
    while isinstance(schema, dict) and "$ref" in schema:
        ref = schema["$ref"]
        if ref in seen:
            raise ValueError(f"a $ref cycle at {ref}")
        seen.add(ref)
        node: Any = doc
        for part in ref.lstrip("#/").split("/"):
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        schema = node
    return schema


def variants(doc: Dict[str, Any], schema: Any) -> List[Dict[str, Any]]:
    """The schema's variants that are not null (a nullable $ref is oneOf [null, $ref])."""
    schema = deref(doc, schema)
    if not isinstance(schema, dict):
        return []
    alternatives = schema.get("oneOf") or schema.get("anyOf")
    if alternatives:
        return [s for a in alternatives for s in variants(doc, a) if s.get("type") != "null"]
    return [schema]


def property_names(doc: Dict[str, Any], schema: Any) -> Set[str]:
    names: Set[str] = set()
    for s in variants(doc, schema):
        names.update((s.get("properties") or {}).keys())
        for part in s.get("allOf") or []:
            names.update(property_names(doc, part))
    return names


def child(doc: Dict[str, Any], schema: Any, step: str) -> Any:
    for s in variants(doc, schema):
        if step in ("items", "additionalProperties"):
            if isinstance(s.get(step), dict):
                return s[step]
            continue
        if step in (s.get("properties") or {}):
            return s["properties"][step]
        for part in s.get("allOf") or []:
            found = child(doc, part, step)
            if found is not None:
                return found
    return None


def enum_values(doc: Dict[str, Any], schema: Any) -> Set[str]:
    values: Set[str] = set()
    for s in variants(doc, schema):
        values.update(s.get("enum") or [])
        if "const" in s:
            values.add(s["const"])
    return values


def compare(problems: List[str], what: str, client: Iterable[str], documented: Iterable[str]) -> None:
    c, d = set(client), set(documented)
    if c - d:
        problems.append(f"{what}: the client has {', '.join(sorted(c - d))}, the document does not")
    if d - c:
        problems.append(f"{what}: the document has {', '.join(sorted(d - c))}, the client does not")


def compare_with_document(doc: Dict[str, Any]) -> List[str]:
    problems: List[str] = []
    paths = doc.get("paths") or {}

    def operation(route: str) -> Optional[Dict[str, Any]]:
        r = ROUTES[route]
        return (paths.get(r.path) or {}).get(r.method.lower())

    def json_schema(content: Any) -> Any:
        return ((content or {}).get("application/json") or {}).get("schema")

    def request_body(route: str) -> Any:
        return json_schema(((operation(route) or {}).get("requestBody") or {}).get("content"))

    def response(route: str, status: str) -> Any:
        return json_schema((((operation(route) or {}).get("responses") or {}).get(status) or {}).get("content"))

    documented = {f"{m.upper()} {p}" for p, item in paths.items() for m in METHODS if m in item}
    called = {f"{r.method} {r.path}" for r in ROUTES.values()}
    for r in sorted(called - documented):
        problems.append(f"the client calls {r}, which the document lacks")
    for r in sorted(documented - called - set(ROUTES_NOT_CALLED)):
        problems.append(f"the document has {r}, which the client neither calls nor lists in ROUTES_NOT_CALLED")

    # Query and header parameters (a header's name in lower case: HTTP does not tell case apart).
    for name, r in ROUTES.items():
        op = operation(name)
        if op is None:
            continue
        params = [deref(doc, p) for p in op.get("parameters") or []]
        compare(problems, f"{r.method} {r.path} query parameters", r.query,
                [p["name"] for p in params if p.get("in") == "query"])
        compare(problems, f"{r.method} {r.path} header parameters", [h.lower() for h in r.headers],
                [p["name"].lower() for p in params if p.get("in") == "header"])

    snapshot = response("snapshot", "200")
    error = response("begin", "400")
    targets = [
        ("BeginRequest", request_body("begin")),
        ("StartRequest", request_body("start")),
        ("SettleRequest", request_body("settle")),
        ("SettleUsage", (request_body("settle"), "usage")),
        ("CancelRequest", request_body("cancel")),
        ("RefineRequest", request_body("refine")),
        ("RegisterOwnerRequest", request_body("register_owner")),
        ("ActivityRecord", response("begin", "201")),
        ("ActivityRecord", response("begin", "200")),
        ("ActivityRecord", response("get", "200")),
        ("ActivityRecord", response("start", "200")),
        ("ActivityRecord", response("settle", "200")),
        ("ActivityRecord", response("cancel", "200")),
        ("ActivityRecord", response("refine", "200")),
        ("Owner", response("register_owner", "201")),
        ("Owner", response("renew_owner", "200")),
        ("Owner", response("release_owner", "200")),
        ("ReapCounts", response("reap", "200")),
        ("Snapshot", snapshot),
        ("Lane", (snapshot, "nativeAdmission", "additionalProperties")),
        ("ReapCounts", (snapshot, "nativeAdmission", "additionalProperties", "reaped")),
        ("ByPriority", (snapshot, "nativeAdmission", "additionalProperties", "byPriority")),
        *[("PriorityCounts", (snapshot, "nativeAdmission", "additionalProperties", "byPriority", priority))
          for priority in PRIORITIES],
        ("InFlightRecord", (snapshot, "inFlight", "items")),
        ("ActivityRecord", (snapshot, "recentCompletions", "items")),
        ("ReapedRecord", (snapshot, "reaped", "items")),
        ("Aggregate", (snapshot, "aggregates", "items")),
        ("Owner", (snapshot, "owners", "items")),
        ("SnapshotWarning", (snapshot, "warnings", "items")),
        ("ErrorBody", error),
        ("ErrorDetail", (error, "error")),
    ]
    for type_name, where in targets:
        label = type_name
        schema = where
        if isinstance(where, tuple):
            schema = where[0]
            for step in where[1:]:
                schema = child(doc, schema, step) if schema is not None else None
            label = f"{type_name} ({'.'.join(where[1:])})"
        if schema is None:
            problems.append(f"the document has no schema where the client expects {label}")
            continue
        compare(problems, f"{label} fields", field_names(TYPES[type_name]), property_names(doc, schema))

    code = child(doc, child(doc, error, "error") or {}, "code") if error is not None else None
    if code is None:
        problems.append("the document has no schema for the error code")
    else:
        compare(problems, "error codes", SERVER_ERROR_CODES, enum_values(doc, code))

    # The priorities (client.context() checks a context's against the client's list).
    priority = child(doc, request_body("begin") or {}, "priority")
    if priority is None:
        problems.append("the document has no schema for a begin's priority")
    else:
        compare(problems, "priorities", PRIORITIES, enum_values(doc, priority))

    # The label rule (client.context() checks a context's labels with it).
    for field in ("service", "operationStage"):
        schema = child(doc, request_body("begin") or {}, field)
        patterns = [s.get("pattern") for s in variants(doc, schema)] if schema is not None else []
        if LABEL_PATTERN not in patterns:
            problems.append(f"a begin's {field}: the document's pattern {patterns}, the client's {LABEL_PATTERN}")
    return problems
