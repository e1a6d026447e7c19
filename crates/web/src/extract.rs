//! Request extractors whose every rejection is a problem+json with a message that says what is
//! wrong: [`ApiJson`] (content type, size limit, syntax, types, unknown fields) and [`IdPath`].

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use bytes::Bytes;
use http::StatusCode;
use http::request::Parts;
use serde::de::DeserializeOwned;

use crate::problem::Problem;

/// A JSON body of type `T`.
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Decodes `bytes` as `T`, mapping errors to 400 (`invalid_json`: not JSON at all) or 422
/// (`validation_failed`: JSON of the wrong shape).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Problem> {
    // Syntax first, shape second: a truncated document is "not JSON" even when its first
    // value already has the wrong type.
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    if !value.is_object() {
        let kind = match value {
            serde_json::Value::Null => "null",
            serde_json::Value::Bool(_) => "a boolean",
            serde_json::Value::Number(_) => "a number",
            serde_json::Value::String(_) => "a string",
            serde_json::Value::Array(_) => "an array",
            serde_json::Value::Object(_) => "an object",
        };
        return Err(Problem::validation(format!(
            "the request body must be a JSON object, got {kind}"
        )));
    }
    serde_json::from_value(value)
        .map_err(|e| Problem::validation(format!("the request body is not acceptable: {e}")))
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let content_type = req
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        match content_type.as_deref() {
            Some(ct) if is_json(ct) => {}
            Some(ct) => {
                return Err(Problem::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    format!("the request body must be application/json, not `{ct}`"),
                ));
            }
            None => {
                return Err(Problem::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "unsupported_media_type",
                    "the request needs `Content-Type: application/json` and a JSON body",
                ));
            }
        }
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                Problem::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    "the request body is larger than this server accepts",
                )
            } else {
                Problem::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_json",
                    format!("the request body could not be read: {e}"),
                )
            }
        })?;
        decode(&bytes).map(ApiJson)
    }
}

/// The single `{id}` path segment, as text (handlers parse it; an unparseable id names nothing
/// and is a 404).
#[derive(Debug, Clone)]
pub struct IdPath(pub String);

impl<S: Send + Sync> FromRequestParts<S> for IdPath {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(id)) => Ok(IdPath(id)),
            Err(e) => Err(Problem::not_found(format!("no such resource: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        repository: String,
    }

    #[test]
    fn content_types() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(is_json("application/merge-patch+json"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/x-www-form-urlencoded"));
    }

    #[test]
    fn syntax_errors_are_400_shape_errors_422() {
        assert_eq!(
            decode::<Body>(b"{").unwrap_err().status(),
            StatusCode::BAD_REQUEST
        );
        assert_eq!(decode::<Body>(b"nope").unwrap_err().code(), "invalid_json");
        let wrong_type = decode::<Body>(br#"{"repository": 5}"#).unwrap_err();
        assert_eq!(wrong_type.status(), StatusCode::UNPROCESSABLE_ENTITY);
        let unknown = decode::<Body>(br#"{"repository": "x", "extra": 1}"#).unwrap_err();
        assert!(
            unknown.body()["detail"]
                .as_str()
                .unwrap()
                .contains("unknown field `extra`")
        );
        let missing = decode::<Body>(b"{}").unwrap_err();
        assert!(
            missing.body()["detail"]
                .as_str()
                .unwrap()
                .contains("missing field `repository`")
        );
    }
}
