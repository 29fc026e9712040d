//! `GET /openapi.json`: the OpenAPI 3.1 document of the HTTP API.
//!
//! It is generated, never written by hand: the routes and their operations
//! come from the handlers' `#[utoipa::path]` annotations, through the same
//! list that builds the router (`api_routes` in `http`), and the schemas from
//! the `inflight-api` types. What every route shares (the bearer token, the
//! answers to an oversized body or a failed store) is added here, from the
//! same rule the token middleware applies.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::IntoResponse;
use utoipa::openapi::path::Operation;
use utoipa::openapi::request_body::RequestBody;
use utoipa::openapi::schema::{Schema, SchemaType, Type};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityRequirement, SecurityScheme};
use utoipa::openapi::Required;
use utoipa::openapi::{ContentBuilder, HeaderBuilder, OpenApi, Ref, RefOr, Response, ResponseBuilder};

use super::error::ApiError;

/// The name of the bearer-token security scheme in the document.
const BEARER: &str = "bearerToken";

/// The document's title, description and tags; the paths are added by the
/// router (`api_routes` in `http`).
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "inflight",
        description = "A ledger of AI provider calls: records are begun, started and settled; counts of \
            executing and waiting records per `service::provider` lane derive from them; records past \
            their bound are reaped and kept as evidence. Field names are camelCase; timestamps in \
            answers are RFC 3339 UTC with milliseconds. Every error is `{\"error\": {\"code\", \
            \"message\"}}`. See docs/api.md.",
        license(name = "MIT OR Apache-2.0", identifier = "MIT OR Apache-2.0"),
    ),
    tags(
        (name = "activities", description = "Records of provider calls: begin, read, start, settle, cancel"),
        (name = "owners", description = "Owner leases: a dead process's work is reclaimed"),
        (name = "ledger", description = "The snapshot, reaping and metrics"),
        (name = "meta", description = "Health and this document; never behind the token"),
        (name = "dashboard", description = "The live dashboard's page and assets; never behind the token"),
    )
)]
pub(super) struct ApiDoc;

/// The whole document: every route of the router (`api_routes` in `http`),
/// with what they share.
pub fn document() -> OpenApi {
    let (_, mut doc) = super::api_routes().split_for_parts();
    doc.components
        .get_or_insert_with(Default::default)
        .add_security_scheme(BEARER, bearer_scheme());
    for (path, item) in &mut doc.paths.paths {
        let guarded = super::needs_token(path);
        let limited = super::is_limited(path);
        // A read token opens GET and HEAD; every other method is a write.
        let operations = [
            (&mut item.get, false),
            (&mut item.put, true),
            (&mut item.post, true),
            (&mut item.delete, true),
            (&mut item.options, true),
            (&mut item.head, false),
            (&mut item.patch, true),
            (&mut item.trace, true),
        ];
        for (operation, writes) in operations {
            if let Some(operation) = operation {
                add_shared_answers(operation, guarded, limited);
                if guarded && writes {
                    add_forbidden(operation);
                }
            }
        }
    }
    doc
}

fn bearer_scheme() -> SecurityScheme {
    let mut http = Http::new(HttpAuthScheme::Bearer);
    http.description = Some(
        "Required on every /v1 route and /metrics when the server has tokens (`--token`, \
         `INFLIGHT_TOKEN`, or `[[tokens]]` in its file); not required when it has none. A read token \
         opens the GET routes and /metrics; a write token every route, or only its services' records \
         when it is bound to services."
            .to_owned(),
    );
    SecurityScheme::Http(http)
}

/// A write behind the token may be refused for the token's scope.
fn add_forbidden(operation: &mut Operation) {
    operation
        .responses
        .responses
        .entry("403".to_owned())
        .or_insert(RefOr::T(
            error_answer(
                "The token's scope does not cover the request: a read token on a write, or a write token \
             bound to other services than the record's",
            )
            .build(),
        ));
}

/// What every route behind the token, every route under the server's
/// request limit, and every route that reads a body may answer besides its
/// own.
fn add_shared_answers(operation: &mut Operation, guarded: bool, limited: bool) {
    if let Some(body) = &mut operation.request_body {
        optional_body_is_left_out(body);
    }
    let responses = &mut operation.responses.responses;
    let mut add = |status: &str, response: Response| {
        responses.entry(status.to_owned()).or_insert(RefOr::T(response));
    };
    if guarded {
        // Optional: a server without a token requires none.
        operation.security = Some(vec![
            SecurityRequirement::default(),
            SecurityRequirement::new(BEARER, Vec::<String>::new()),
        ]);
        add(
            "401",
            error_answer("A token is configured and the request carries no known one")
                .header("WWW-Authenticate", string_header("`Bearer`"))
                .build(),
        );
        // Every guarded route reads the store; its failure is the one 5xx.
        add(
            "500",
            error_answer("The store failed; the details are in the server's log").build(),
        );
    }
    if limited {
        add(
            "503",
            error_answer("The server is at its limit of requests at once, or its store cannot be reached")
                .header("Retry-After", string_header("Seconds: a hint, it may be sooner"))
                .build(),
        );
    }
    if operation.request_body.is_some() {
        add(
            "400",
            error_answer("The body is not a JSON object, or a field is invalid").build(),
        );
        add(
            "408",
            error_answer("The body did not arrive within the server's body timeout").build(),
        );
        add("413", error_answer("A body over 64 KiB").build());
    }
}

/// A response header whose value is a string.
fn string_header(description: &str) -> utoipa::openapi::Header {
    HeaderBuilder::new()
        .schema(utoipa::openapi::ObjectBuilder::new().schema_type(Type::String))
        .description(Some(description))
        .build()
}

/// A handler's `Option<T>` body means that the body may be left out (an
/// empty body is `{}`), not that it may be JSON `null`, which is refused:
/// the document says `required: false` with `T`'s schema.
fn optional_body_is_left_out(body: &mut RequestBody) {
    for content in body.content.values_mut() {
        let Some(RefOr::T(Schema::OneOf(one_of))) = &content.schema else {
            continue;
        };
        let is_null = |item: &RefOr<Schema>| {
            matches!(item, RefOr::T(Schema::Object(object))
                if object.schema_type == SchemaType::Type(Type::Null))
        };
        let mut rest = one_of.items.iter().filter(|item| !is_null(item));
        if let (Some(schema), None, true) = (rest.next(), rest.next(), one_of.items.iter().any(is_null)) {
            content.schema = Some(schema.clone());
            body.required = Some(Required::False);
        }
    }
}

/// An answer with the error body.
fn error_answer(description: &str) -> ResponseBuilder {
    ResponseBuilder::new().description(description).content(
        "application/json",
        ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("ErrorBody")))
            .build(),
    )
}

/// The document as JSON: what `GET /openapi.json` answers.
///
/// # Errors
/// The document could not be written as JSON (which would be a bug).
pub fn document_json() -> Result<serde_json::Value, serde_json::Error> {
    let mut json = serde_json::to_value(document())?;
    camel_case_links(&mut json);
    Ok(json)
}

/// utoipa 5 writes a link's fields in snake case (`operation_id`), which
/// OpenAPI does not know: they are renamed to the spec's names.
fn camel_case_links(json: &mut serde_json::Value) {
    let Some(paths) = json.get_mut("paths").and_then(|paths| paths.as_object_mut()) else {
        return;
    };
    let operations = paths
        .values_mut()
        .filter_map(|item| item.as_object_mut())
        .flat_map(|item| item.values_mut());
    let responses = operations
        .filter_map(|operation| operation.get_mut("responses").and_then(|r| r.as_object_mut()))
        .flat_map(|responses| responses.values_mut());
    let links = responses
        .filter_map(|response| response.get_mut("links").and_then(|links| links.as_object_mut()))
        .flat_map(|links| links.values_mut())
        .filter_map(|link| link.as_object_mut());
    for link in links {
        for (snake, camel) in [
            ("operation_id", "operationId"),
            ("operation_ref", "operationRef"),
            ("request_body", "requestBody"),
        ] {
            if let Some(value) = link.remove(snake) {
                link.insert(camel.to_owned(), value);
            }
        }
    }
}

/// The document's text, made once.
fn document_text() -> &'static Result<String, String> {
    static TEXT: OnceLock<Result<String, String>> = OnceLock::new();
    TEXT.get_or_init(|| {
        document_json()
            .and_then(|json| serde_json::to_string_pretty(&json))
            .map_err(|err| err.to_string())
    })
}

/// `GET /openapi.json`.
#[utoipa::path(get, path = "/openapi.json", tag = "meta", operation_id = "openapi",
    summary = "This document: the OpenAPI 3.1 description of the API",
    responses((status = 200, description = "The OpenAPI document", body = Object,
        content_type = "application/json")))]
pub(super) async fn openapi_json() -> Result<impl IntoResponse, ApiError> {
    match document_text() {
        Ok(text) => Ok(([(header::CONTENT_TYPE, "application/json")], text.as_str())),
        Err(err) => {
            tracing::error!(error = %err, "the OpenAPI document could not be written");
            Err(ApiError::internal())
        }
    }
}
