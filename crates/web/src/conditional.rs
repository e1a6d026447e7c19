//! Conditional reads of records (RFC 9110 §8.8.3, §13.1.2): an analysis or specview answers
//! with an entity tag made from its row's version, and a `GET` whose `If-None-Match` names the
//! current tag is answered `304 Not Modified` before its result is read. A client polling a
//! large result (tens of megabytes) for a change then costs one small statement, not a read and
//! a transfer of the whole result each time.

use axum::response::{IntoResponse as _, Response};
use http::{HeaderMap, HeaderValue, StatusCode};

/// The SQL expression of a record's version, for its `SELECT` list (as `row_version`): the
/// transaction that last wrote the row (`xmin`) and the `updated_at` every writer sets. Any
/// write of the row changes it.
pub const ROW_VERSION_COLUMN: &str = "xmin::text || '.' || \
     (extract(epoch FROM updated_at) * 1000000)::bigint::text AS row_version";

/// The form of the answers the tags stand for: bump it when what a record's answer holds
/// changes (a field added to a view), or clients holding a tag would be told "not modified" of
/// an answer that now reads differently.
const ANSWER_FORM: &str = "1";

/// The strong entity tag of `representation` (`""` for JSON, `".md"` for Markdown) of the row
/// at `version` (from [`ROW_VERSION_COLUMN`]).
pub fn entity_tag(version: &str, representation: &str) -> String {
    format!("\"{ANSWER_FORM}.{version}{representation}\"")
}

/// The entity tags of a request's `If-None-Match` fields. `*` is not taken as a condition: a
/// `GET` answered 200 instead of 304 loses nothing, and a record without the representation
/// asked for (Markdown not written yet) has no current one to match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IfNoneMatch(Vec<String>);

impl IfNoneMatch {
    /// The condition `headers` state, if any. A field that does not parse (or is not ASCII)
    /// makes the whole condition void, so the request is answered as if it had none.
    pub fn parse(headers: &HeaderMap) -> Option<IfNoneMatch> {
        let mut tags = Vec::new();
        for field in headers.get_all(http::header::IF_NONE_MATCH) {
            let text = field.to_str().ok()?;
            for member in text.split(',').map(str::trim).filter(|m| !m.is_empty()) {
                if member == "*" {
                    continue;
                }
                tags.push(opaque_tag(member)?.to_owned());
            }
        }
        (!tags.is_empty()).then_some(IfNoneMatch(tags))
    }

    /// Whether `tag` (as [`entity_tag`] makes them) is among the condition's, compared weakly
    /// (a `W/` prefix is ignored), as `If-None-Match` asks.
    pub fn matches(&self, tag: &str) -> bool {
        opaque_tag(tag).is_some_and(|own| self.0.iter().any(|t| t == own))
    }
}

/// The quoted part of an entity tag, quotes included, without a `W/` prefix; `None` if `member`
/// is not one (RFC 9110: `[W/] DQUOTE *etagc DQUOTE`, no quote or control inside).
fn opaque_tag(member: &str) -> Option<&str> {
    let quoted = member.strip_prefix("W/").unwrap_or(member);
    let inner = quoted.strip_prefix('"')?.strip_suffix('"')?;
    inner
        .bytes()
        .all(|b| b == 0x21 || (0x23..=0x7e).contains(&b) || b >= 0x80)
        .then_some(quoted)
}

/// `response` with `tag` as its `ETag`, to be revalidated before reuse (`no-cache`) and by the
/// client only (`private`: it is one user's). An error (serialising the body failed) is left
/// untagged: the tag stands for the record, not for the error.
pub fn tagged(mut response: Response, tag: &str) -> Response {
    let status = response.status();
    if !(status.is_success() || status == StatusCode::NOT_MODIFIED) {
        return response;
    }
    if let Ok(value) = HeaderValue::from_str(tag) {
        response.headers_mut().insert(http::header::ETAG, value);
    }
    response.headers_mut().insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("private, no-cache"),
    );
    response
}

/// `304 Not Modified` for the representation tagged `tag`.
pub fn not_modified(tag: &str) -> Response {
    tagged(StatusCode::NOT_MODIFIED.into_response(), tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn condition(fields: &[&str]) -> Option<IfNoneMatch> {
        let mut headers = HeaderMap::new();
        for f in fields {
            headers.append(
                http::header::IF_NONE_MATCH,
                HeaderValue::from_str(f).unwrap(),
            );
        }
        IfNoneMatch::parse(&headers)
    }

    #[test]
    fn tags_are_compared_weakly_across_fields_and_lists() {
        let tag = entity_tag("1234.1795000000000000", "");
        assert_eq!(tag, "\"1.1234.1795000000000000\"");
        let c = condition(&["\"a\", W/\"1.1234.1795000000000000\"", "\"b\""]).unwrap();
        assert!(c.matches(&tag));
        assert!(!c.matches(&entity_tag("1234.1795000000000000", ".md")));
        assert!(!c.matches("\"1.1235.1795000000000000\""));
        assert!(condition(&[&tag]).unwrap().matches(&tag));
        // A tag of another answer form (before a deploy that changed a view) is not current.
        assert!(
            !condition(&["\"1234.1795000000000000\""])
                .unwrap()
                .matches(&tag)
        );
    }

    #[test]
    fn no_condition_malformed_or_star_is_none() {
        assert_eq!(condition(&[]), None);
        assert_eq!(condition(&["*"]), None);
        assert_eq!(condition(&[""]), None);
        for bad in ["abc", "\"unterminated", "W/abc", "\"a\"b\"", "\"a\", nope"] {
            assert_eq!(condition(&[bad]), None, "{bad}");
        }
        // One bad field voids the condition: answered as if there were none.
        assert_eq!(condition(&["\"a\"", "bad"]), None);
    }

    #[test]
    fn answers_carry_the_tag_and_must_be_revalidated() {
        let r = not_modified("\"v\"");
        assert_eq!(r.status(), StatusCode::NOT_MODIFIED);
        assert_eq!(r.headers()[http::header::ETAG], "\"v\"");
        assert_eq!(
            r.headers()[http::header::CACHE_CONTROL],
            "private, no-cache"
        );
    }
}
