//! Request extractors whose every rejection is a problem+json with a message that says what is
//! wrong: [`ApiJson`] (content type, size limit, syntax, types, unknown fields), [`ApiQuery`]
//! (the query string's parameters) and [`IdPath`].

use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use bytes::Bytes;
use http::StatusCode;
use http::request::Parts;
use serde::de::DeserializeOwned;

use crate::problem::Problem;

/// A JSON body of type `T`.
#[derive(Debug, Clone)]
pub struct ApiJson<T>(pub T);

/// Whether `content_type` is JSON this server reads: `application/json` or `application/*+json`,
/// in UTF-8 (a `charset` parameter, if any, must say so; JSON has no other encoding on the wire).
fn is_json(content_type: &str) -> bool {
    let mut parts = content_type.split(';');
    let essence = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
    let utf8 = parts.all(|parameter| {
        let Some((name, value)) = parameter.split_once('=') else {
            return true;
        };
        !name.trim().eq_ignore_ascii_case("charset") || {
            let value = value.trim().trim_matches('"');
            value.eq_ignore_ascii_case("utf-8") || value.eq_ignore_ascii_case("utf8")
        }
    });
    utf8 && (essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json")))
}

/// Decodes `bytes` as `T`, mapping errors to 400 (`invalid_json`: not JSON at all) or 422
/// (`validation_failed`: JSON of the wrong shape).
///
/// Syntax first, shape second: a truncated document is "not JSON" even when its first value
/// already has the wrong type. The shape is then decoded from the bytes straight into `T`, not
/// through a `serde_json::Value`: a map would let a key given twice through (the last one won)
/// and refuse numbers no `f64` holds as "not JSON".
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Problem> {
    serde_json::from_slice::<serde::de::IgnoredAny>(bytes).map_err(|e| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("the request body is not valid JSON: {e}"),
        )
    })?;
    // Well-formed, so its first byte past white space says what the document is.
    let first = bytes
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        .copied();
    let kind = match first {
        Some(b'{') => None,
        Some(b'n') => Some("null"),
        Some(b't' | b'f') => Some("a boolean"),
        Some(b'"') => Some("a string"),
        Some(b'[') => Some("an array"),
        _ => Some("a number"),
    };
    if let Some(kind) = kind {
        return Err(Problem::validation(format!(
            "the request body must be a JSON object, got {kind}"
        )));
    }
    serde_json::from_slice(bytes)
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
        // Every `Content-Encoding` field, and every coding in each, must be `identity`: one
        // `gzip` among them means the body is not the JSON it would be read as.
        if let Some(encoding) = req
            .headers()
            .get_all(http::header::CONTENT_ENCODING)
            .iter()
            .flat_map(|v| {
                String::from_utf8_lossy(v.as_bytes())
                    .split(',')
                    .map(|coding| coding.trim().to_owned())
                    .collect::<Vec<_>>()
            })
            .find(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case("identity"))
        {
            return Err(Problem::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("the request body must not be encoded (`Content-Encoding: {encoding}`)"),
            ));
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

/// The query string's parameters as `T` (which should deny unknown fields): a parameter that is
/// unknown, given twice or of the wrong type is a 422 `validation_failed` naming it; nothing is
/// looked up. Values are form-decoded: `+` is a space, and percent-escapes that are not UTF-8
/// become U+FFFD (a value holding a `+`, `&` or `#`, such as a URL, must be percent-encoded).
#[derive(Debug, Clone)]
pub struct ApiQuery<T>(pub T);

/// Decodes `uri`'s query string as `T`.
pub fn decode_query<T: DeserializeOwned>(uri: &http::Uri) -> Result<T, Problem> {
    match axum::extract::Query::<T>::try_from_uri(uri) {
        Ok(axum::extract::Query(value)) => Ok(value),
        Err(e) => Err(Problem::validation(format!(
            "the query string is not acceptable: {}",
            // axum's text starts with its own preamble; the cause is what says what is wrong.
            std::error::Error::source(&e).map_or_else(|| e.body_text(), |c| c.to_string())
        ))),
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        decode_query(&parts.uri).map(ApiQuery)
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
        assert!(is_json("application/json;charset=\"UTF-8\""));
        assert!(is_json("application/json; profile=x"));
        assert!(!is_json("application/json; charset=utf-16"));
        assert!(!is_json("application/json; charset=iso-8859-1"));
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
        for (body, kind) in [
            (&b" null"[..], "null"),
            (b"true", "a boolean"),
            (b"-1.5", "a number"),
            (b"\"x\"", "a string"),
            (b"[1]", "an array"),
        ] {
            let p = decode::<Body>(body).unwrap_err();
            assert_eq!(p.status(), StatusCode::UNPROCESSABLE_ENTITY);
            assert!(
                p.body()["detail"].as_str().unwrap().ends_with(kind),
                "{kind}"
            );
        }
    }

    /// A key given twice is refused, not settled by the last one (a proxy or log that reads the
    /// first would see another request than the one served); a number too large for any type is
    /// valid JSON, so a field given one is a 422 for that field, not "not JSON".
    #[test]
    fn duplicate_keys_and_huge_numbers_are_shape_errors() {
        let twice = decode::<Body>(br#"{"repository": "a", "repository": "b"}"#).unwrap_err();
        assert_eq!(twice.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert!(
            twice.body()["detail"]
                .as_str()
                .unwrap()
                .contains("duplicate field `repository`"),
            "{:?}",
            twice.body()
        );
        let huge = decode::<Body>(br#"{"repository": 1e400}"#).unwrap_err();
        assert_eq!(huge.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(huge.code(), "validation_failed");
    }
}
