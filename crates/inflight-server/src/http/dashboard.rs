//! `GET /`: the live dashboard, a page and its script and stylesheet built
//! into the binary, so that it works with no request leaving the machine.
//!
//! The page itself holds no data and needs no token: its script reads
//! `/v1/snapshot` (asking for the token when the server wants one) and
//! writes every value as text. The Content-Security-Policy allows only this
//! server's own script, style and fetches: no inline script runs, and no
//! request goes elsewhere.

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/dashboard.js");
const STYLE: &str = include_str!("dashboard/dashboard.css");

/// What the dashboard's responses allow the browser to do.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

// The page, its script and its stylesheet are routes of the API's one
// list (`api_routes` in `http`), so `/openapi.json` documents them too.

/// `GET /`: the page.
#[utoipa::path(get, path = "/", tag = "dashboard", operation_id = "dashboard",
    summary = "The live dashboard: an HTML page that reads /v1/snapshot; never behind the token",
    responses((status = 200, description = "The page", body = String, content_type = "text/html")))]
pub(super) async fn page() -> impl IntoResponse {
    asset("text/html; charset=utf-8", PAGE).await
}

/// `GET /dashboard.js`: the page's script.
#[utoipa::path(get, path = "/dashboard.js", tag = "dashboard", operation_id = "dashboardScript",
    summary = "The dashboard's script",
    responses((status = 200, description = "The script", body = String, content_type = "text/javascript")))]
pub(super) async fn script() -> impl IntoResponse {
    asset("text/javascript; charset=utf-8", SCRIPT).await
}

/// `GET /dashboard.css`: the page's stylesheet.
#[utoipa::path(get, path = "/dashboard.css", tag = "dashboard", operation_id = "dashboardStyle",
    summary = "The dashboard's stylesheet",
    responses((status = 200, description = "The stylesheet", body = String, content_type = "text/css")))]
pub(super) async fn style() -> impl IntoResponse {
    asset("text/css; charset=utf-8", STYLE).await
}

async fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            // A new binary may serve a new page: revalidate rather than cache.
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_never_parses_server_values_as_markup() {
        for banned in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
        ] {
            assert!(!SCRIPT.contains(banned), "dashboard.js uses {banned}");
        }
        assert!(!PAGE.contains("<script>"), "the page has an inline script");
        assert!(!PAGE.contains("style="), "the page has an inline style");
    }

    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        for text in [PAGE, SCRIPT, STYLE] {
            // The SVG namespace is a name, never fetched.
            let text = text.replace("http://www.w3.org/2000/svg", "");
            for outside in ["http://", "https://", "//cdn"] {
                assert!(!text.contains(outside), "the dashboard refers to {outside}");
            }
        }
    }
}
