//! The OpenAPI document, generated from the handlers' annotations, plus every error response
//! (problem+json) each operation can return, added by one rule set so no operation forgets one.

use utoipa::openapi::path::Operation;
use utoipa::openapi::schema::ObjectBuilder;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, HeaderBuilder, Ref, ResponseBuilder, Type};
use utoipa::{Modify, OpenApi};

use crate::problem::PROBLEM_CONTENT_TYPE;
use crate::routes;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Fairlane API",
        description = "Tier-aware analysis jobs: enqueue test inventories of public git repositories and behaviour specifications, follow the jobs, and read your quota. Every error is `application/problem+json` (RFC 9457) with a stable `code`.",
    ),
    paths(
        routes::analyses::create,
        routes::analyses::list,
        routes::analyses::get,
        routes::specviews::create,
        routes::specviews::list,
        routes::specviews::get,
        routes::jobs::get,
        routes::jobs::cancel,
        routes::usage::get,
        routes::admin::create_user,
        routes::admin::update_user,
        routes::admin::issue_key,
        routes::admin::revoke_key,
        routes::system::healthz,
        routes::system::readyz,
        routes::system::metrics,
        routes::system::openapi,
        routes::system::docs,
    ),
    components(schemas(crate::problem::ProblemBody)),
    modifiers(&Security, &ProblemResponses),
    tags(
        (name = "analyses", description = "Test inventories of repositories"),
        (name = "specviews", description = "Behaviour specifications generated from analyses"),
        (name = "jobs", description = "The jobs behind analyses and specviews"),
        (name = "usage", description = "Quota"),
        (name = "admin", description = "Users, tiers and API keys (admin token)"),
        (name = "system", description = "Health, metrics and documentation"),
    )
)]
pub struct ApiDoc;

struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("flk_<id>_<secret>")
                    .description(Some("An API key issued by an admin"))
                    .build(),
            ),
        );
        components.add_security_scheme(
            "admin_token",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("The server's ADMIN_TOKEN"))
                    .build(),
            ),
        );
    }
}

struct ProblemResponses;

fn problem(description: &str, retry_after: bool) -> utoipa::openapi::Response {
    let mut builder = ResponseBuilder::new().description(description).content(
        PROBLEM_CONTENT_TYPE,
        ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("Problem")))
            .build(),
    );
    if retry_after {
        builder = builder.header(
            "Retry-After",
            HeaderBuilder::new()
                .schema(Some(ObjectBuilder::new().schema_type(Type::Integer)))
                .description(Some("Seconds until a retry can succeed"))
                .build(),
        );
    }
    builder.build()
}

fn add(op: &mut Operation, status: &str, description: &str, retry_after: bool) {
    op.responses
        .responses
        .entry(status.to_owned())
        .or_insert_with(|| problem(description, retry_after).into());
}

/// Which errors an operation can produce, by what it is.
fn add_errors(path: &str, method: &str, op: &mut Operation) {
    let user = path.starts_with("/v1/");
    let admin = path.starts_with("/admin/");
    let has_body = op.request_body.is_some();
    let has_id = path.contains('{');
    if user || admin {
        add(
            op,
            "401",
            "Missing, malformed, unknown or revoked credentials (`unauthorized`)",
            false,
        );
        add(op, "500", "Unexpected server error (`internal`)", false);
        add(
            op,
            "503",
            "The request could not be finished: it took too long (`timeout`, rolled back; \
             `timeout_outcome_unknown`, it may have taken effect), the data it needs was held \
             too long (`database_busy`), the database could not be reached \
             (`database_unavailable`, nothing changed), its commit failed or the connection was \
             lost during an admin write (`commit_outcome_unknown`), or, for an analysis served \
             from the cache, the copy was saved and reading it back failed (`committed_unread`); \
             for analyses, the repository host's name could not be looked up just now \
             (`dns_unavailable`)",
            true,
        );
    }
    if user {
        add(
            op,
            "429",
            "Too many requests (`rate_limited`), or for enqueue routes the billing period's quota is used up (`quota_exceeded`)",
            true,
        );
    }
    if admin {
        add(
            op,
            "403",
            "The admin API is disabled on this server (`forbidden`)",
            false,
        );
        add(
            op,
            "429",
            "Too many requests without the right admin token from this address (`rate_limited`); \
             the right token is never limited",
            true,
        );
    }
    if has_body {
        add(
            op,
            "400",
            "The body is not well-formed JSON (`invalid_json`)",
            false,
        );
        add(
            op,
            "408",
            "The body did not arrive within the request timeout (`request_timeout`)",
            false,
        );
        add(
            op,
            "413",
            "The body is too large (`payload_too_large`)",
            false,
        );
        add(
            op,
            "415",
            "The body is not `application/json` (`unsupported_media_type`)",
            false,
        );
        add(
            op,
            "422",
            "A value is not acceptable (`validation_failed`; for analyses also `repository_not_found`, `ref_not_found`, `repository_unreachable`)",
            false,
        );
    }
    let has_query = op.parameters.iter().flatten().any(|p| {
        matches!(
            p,
            utoipa::openapi::RefOr::T(p)
                if matches!(p.parameter_in, utoipa::openapi::path::ParameterIn::Query)
        )
    });
    if has_query {
        add(
            op,
            "422",
            "A query parameter is unknown, given twice or not acceptable (`validation_failed`)",
            false,
        );
    }
    if has_id || (path == "/v1/specviews" && method == "post") {
        add(
            op,
            "404",
            "No such resource, or not the caller's (`not_found`)",
            false,
        );
    }
    if (path == "/v1/specviews" && method == "post")
        || (path == "/v1/specviews/{id}" && method == "get")
    {
        add(
            op,
            "409",
            "The analysis (or specview) is not completed (`conflict`; its `state`: `pending` or \
             `running` will be, `failed` never will)",
            false,
        );
    }
    if path == "/admin/keys/{key_id}" && method == "delete" {
        add(
            op,
            "422",
            "A whole key, secret included, was given instead of its id (`validation_failed`)",
            false,
        );
    }
    if path == "/readyz" {
        add(
            op,
            "503",
            "Not ready: database unreachable or migrations missing (`not_ready`)",
            true,
        );
    }
}

/// The headers a rate-limited route sends on every response, success or error, when a rule
/// applies to the request (`web::rate::limit_headers`, SPEC §7).
const RATE_LIMIT_HEADERS: [(&str, Type, &str); 5] = [
    (
        "X-RateLimit-Limit",
        Type::Integer,
        "Requests allowed per window by the rule that decided this request",
    ),
    (
        "X-RateLimit-Remaining",
        Type::Integer,
        "Requests left in the current window",
    ),
    (
        "X-RateLimit-Reset",
        Type::Integer,
        "Seconds until the window resets",
    ),
    (
        "RateLimit-Policy",
        Type::String,
        "The rule as a structured field: `\"<rule>\";q=<limit>;w=<window seconds>`",
    ),
    (
        "RateLimit",
        Type::String,
        "The rule's state as a structured field: `\"<rule>\";r=<remaining>;t=<seconds to reset>`",
    ),
];

/// Adds [`RATE_LIMIT_HEADERS`] to every response of `op`.
fn add_rate_limit_headers(op: &mut Operation) {
    for response in op.responses.responses.values_mut() {
        if let utoipa::openapi::RefOr::T(response) = response {
            for (name, schema_type, description) in RATE_LIMIT_HEADERS {
                response.headers.entry(name.to_owned()).or_insert_with(|| {
                    utoipa::openapi::RefOr::T(
                        HeaderBuilder::new()
                            .schema(Some(ObjectBuilder::new().schema_type(schema_type)))
                            .description(Some(format!(
                                "{description} (sent when a rate-limit rule applies)"
                            )))
                            .build(),
                    )
                });
            }
        }
    }
}

impl Modify for ProblemResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in &mut openapi.paths.paths {
            for (method, op) in [
                ("get", item.get.as_mut()),
                ("post", item.post.as_mut()),
                ("put", item.put.as_mut()),
                ("patch", item.patch.as_mut()),
                ("delete", item.delete.as_mut()),
            ] {
                if let Some(op) = op {
                    add_errors(path, method, op);
                    if path.starts_with("/v1/") {
                        add_rate_limit_headers(op);
                    }
                }
            }
        }
    }
}

/// The document as pretty JSON.
pub fn document_json() -> String {
    ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_documents_its_errors_as_problem_json() {
        let doc: serde_json::Value = serde_json::from_str(&document_json()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        assert!(paths.contains_key("/v1/analyses"));
        assert!(paths.contains_key("/v1/jobs/{id}"));
        let post = &paths["/v1/analyses"]["post"]["responses"];
        for status in [
            "200", "202", "400", "401", "413", "415", "422", "429", "500",
        ] {
            assert!(
                post.get(status).is_some(),
                "POST /v1/analyses lacks {status}"
            );
        }
        assert!(post["429"]["content"]["application/problem+json"].is_object());
        assert!(
            post["503"]["description"]
                .as_str()
                .unwrap()
                .contains("committed_unread")
        );
        // Revoking by a whole key is refused with a 422 (admin::revoke_key).
        let revoke = &paths["/admin/keys/{key_id}"]["delete"]["responses"];
        assert!(revoke["422"]["content"]["application/problem+json"].is_object());
        assert!(doc["components"]["schemas"]["Problem"].is_object());
        assert!(doc["components"]["securitySchemes"]["api_key"].is_object());
        // The headers sent besides the bodies: Retry-After on 503s (`database_busy` and kin),
        // the rate-limit headers on every response of a rate-limited route, none on admin ones.
        assert!(post["503"]["headers"]["Retry-After"].is_object());
        for status in ["202", "422", "429", "503"] {
            for header in ["X-RateLimit-Remaining", "RateLimit", "RateLimit-Policy"] {
                assert!(
                    post[status]["headers"][header].is_object(),
                    "POST /v1/analyses {status} lacks {header}"
                );
            }
        }
        assert!(revoke["422"]["headers"]["RateLimit"].is_null());
    }
}
