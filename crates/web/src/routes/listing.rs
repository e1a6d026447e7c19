//! Lists of a user's records (`GET /v1/analyses`, `GET /v1/specviews`): newest first, a page at
//! a time, by keyset on `(created_at, id)` with an opaque cursor naming the last item of the
//! page before. A page reads about a page of rows however deep the list is (one repository's:
//! that repository's records; [`page_statement`]), where an offset would read and drop every row
//! before it; and records created while a client pages do not shift or repeat the rows it has
//! still to read.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::{DateTime, Utc};
use sqlx::postgres::{PgRow, Postgres};
use sqlx::{PgPool, QueryBuilder};
use uuid::Uuid;

use super::{AnalysisSummary, SpecviewSummary, WorkState};
use crate::problem::Problem;

/// Items in a page when the request does not say.
pub const DEFAULT_PAGE_SIZE: u32 = 20;
/// The most items a page may ask for.
pub const MAX_PAGE_SIZE: u32 = 100;

/// Where a page ends: its last item's creation time and id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub created_at: DateTime<Utc>,
    pub id: Uuid,
}

/// The cursor text's version prefix, so its form can change without misreading old cursors.
const CURSOR_VERSION: &str = "1";

/// The latest time a cursor may name: 9999-12-31T23:59:59.999999Z, in microseconds since the
/// epoch. The earliest is the epoch.
const MAX_CURSOR_MICROS: i64 = 253_402_300_799_999_999;

impl Cursor {
    /// The cursor as the API gives it out: URL-safe base64 of `1.<microseconds>.<id>`.
    pub fn encode(&self) -> String {
        URL_SAFE_NO_PAD.encode(format!(
            "{CURSOR_VERSION}.{}.{}",
            self.created_at.timestamp_micros(),
            self.id.simple()
        ))
    }

    /// A cursor this API gave out; anything else is a 422 naming the `cursor` parameter.
    pub fn decode(text: &str) -> Result<Cursor, Problem> {
        let refused = || {
            Problem::validation("cursor: not a cursor this API gave out (use `next_cursor` as is)")
                .with("field", "cursor")
        };
        let bytes = URL_SAFE_NO_PAD.decode(text).map_err(|_| refused())?;
        let text = std::str::from_utf8(&bytes).map_err(|_| refused())?;
        let mut parts = text.split('.');
        let (Some(CURSOR_VERSION), Some(micros), Some(id), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(refused());
        };
        let micros: i64 = micros.parse().map_err(|_| refused())?;
        // Within what a record's `created_at` can be: a time PostgreSQL cannot hold would be
        // refused by the database, a 500 for a made-up cursor.
        if !(0..=MAX_CURSOR_MICROS).contains(&micros) {
            return Err(refused());
        }
        let created_at = DateTime::from_timestamp_micros(micros).ok_or_else(refused)?;
        let id = Uuid::try_parse(id).map_err(|_| refused())?;
        let cursor = Cursor { created_at, id };
        // Only as `encode` writes it (no `+5`, `005`, hyphens or upper case): one cursor, one
        // spelling.
        if cursor.encode() != URL_SAFE_NO_PAD.encode(text) {
            return Err(refused());
        }
        Ok(cursor)
    }
}

/// The page size a request asked for (`limit`), checked: 1 to [`MAX_PAGE_SIZE`].
pub fn page_size(limit: Option<u32>) -> Result<u32, Problem> {
    match limit {
        None => Ok(DEFAULT_PAGE_SIZE),
        Some(n @ 1..=MAX_PAGE_SIZE) => Ok(n),
        Some(n) => Err(Problem::validation(format!(
            "limit: must be between 1 and {MAX_PAGE_SIZE}, got {n}"
        ))
        .with("field", "limit")),
    }
}

/// A record a list pages through.
pub trait Listed: for<'r> sqlx::FromRow<'r, PgRow> + Send + Unpin {
    /// The table, which has `user_id`, `state` (a `fairlane_work_state`), `created_at` and `id`
    /// and the index `(user_id, state, created_at, id)`.
    const TABLE: &'static str;
    /// The `SELECT` list of the type.
    const COLUMNS: &'static str;
    fn cursor(&self) -> Cursor;
}

impl Listed for AnalysisSummary {
    const TABLE: &'static str = "analyses";
    const COLUMNS: &'static str = super::analysis_columns_but_result!();
    fn cursor(&self) -> Cursor {
        Cursor {
            created_at: self.created_at,
            id: self.id,
        }
    }
}

impl Listed for SpecviewSummary {
    const TABLE: &'static str = "specviews";
    const COLUMNS: &'static str = super::specview_columns_but_values!();
    fn cursor(&self) -> Cursor {
        Cursor {
            created_at: self.created_at,
            id: self.id,
        }
    }
}

/// A condition a list's rows must meet besides being the caller's.
#[derive(Debug, Clone)]
pub enum Filter {
    State(WorkState),
    /// Any of these stored repository URLs (a repository's spellings).
    Repository(Vec<String>),
    Analysis(Uuid),
}

/// One page of `user`'s records of type `T` after `after` (from the newest when `None`), with
/// the cursor of the next page if there are more.
pub async fn page<T: Listed>(
    pool: &PgPool,
    user: Uuid,
    filters: &[Filter],
    after: Option<Cursor>,
    size: u32,
) -> Result<(Vec<T>, Option<String>), sqlx::Error> {
    let mut query = page_statement::<T>(user, filters, after, size);
    let mut rows: Vec<T> = query.build_query_as().fetch_all(pool).await?;
    let more = rows.len() > size as usize;
    rows.truncate(size as usize);
    let next = if more {
        rows.last().map(|last| last.cursor().encode())
    } else {
        None
    };
    Ok((rows, next))
}

/// The statement that reads a page (see [`page`]) and its arguments: one row more than `size`,
/// which tells whether there is a next page without a count.
///
/// Each page is read by the index of the narrowest thing it names, so it reads about a page of
/// rows however long the caller's history, and the plan cannot drift to another index:
/// - one state: a range scan of `(user_id, state, created_at, id)` from the cursor;
/// - nothing: up to a page from each state's range of that index, the newest kept (at most four
///   pages of rows);
/// - an analysis (with or without a state): that analysis's specviews after the cursor by
///   `specviews_analysis`, the caller and the state checked on them, sorted: an analysis costs
///   what it has of specviews (a few, each one billed);
/// - a repository (with or without a state): the caller's analyses of each spelling after the
///   cursor by the cache's `analyses_user`, the state checked on them, sorted: a repository
///   costs what the caller has of it.
///
/// The last two read their rows in a subquery with `OFFSET 0`, which PostgreSQL neither merges
/// into the outer query nor pushes the outer conditions into: otherwise the user's and the
/// state's conditions could lead the planner (before an `ANALYZE` above all) to walk the
/// caller's whole range of a state instead.
pub fn page_statement<T: Listed>(
    user: Uuid,
    filters: &[Filter],
    after: Option<Cursor>,
    size: u32,
) -> QueryBuilder<Postgres> {
    let rows = i64::from(size) + 1;
    let (mut state, mut spellings, mut analysis) = (None, None, None);
    for filter in filters {
        match filter {
            Filter::State(s) => state = Some(records::WorkState::from(*s)),
            Filter::Repository(s) => spellings = Some(s.clone()),
            Filter::Analysis(id) => analysis = Some(*id),
        }
    }
    let columns = T::COLUMNS;
    let table = T::TABLE;
    let mut query = QueryBuilder::new("SELECT ");
    // The rows of the page's range(s) as `page`, with the conditions still to check on them.
    let mut checks: Vec<(&str, Bound)> = Vec::new();
    if let Some(analysis) = analysis {
        query
            .push(format!(
                "page.* FROM (SELECT {columns}, user_id AS owner FROM {table} WHERE analysis_id = "
            ))
            .push_bind(analysis);
        push_after(&mut query, after);
        query.push(" OFFSET 0) AS page");
        checks.push(("page.owner = ", Bound::User(user)));
        checks.extend(state.map(|s| ("page.state = ", Bound::State(s))));
    } else if let Some(spellings) = spellings {
        query
            .push("page.* FROM (SELECT DISTINCT unnest(")
            .push_bind(spellings)
            .push(format!(
                "::text[])) AS listed (repository) CROSS JOIN LATERAL (SELECT {columns} \
                 FROM {table} WHERE {table}.repository = listed.repository AND user_id = "
            ))
            .push_bind(user);
        push_after(&mut query, after);
        query.push(" OFFSET 0) AS page");
        checks.extend(state.map(|s| ("page.state = ", Bound::State(s))));
    } else if let Some(state) = state {
        query
            .push(format!("{columns} FROM {table} WHERE user_id = "))
            .push_bind(user)
            .push(" AND state = ")
            .push_bind(state);
        push_after(&mut query, after);
        query
            .push(" ORDER BY created_at DESC, id DESC LIMIT ")
            .push_bind(rows);
        return query;
    } else {
        query
            .push(format!(
                "page.* FROM unnest(enum_range(NULL::fairlane_work_state)) AS listed (state) \
                 CROSS JOIN LATERAL (SELECT {columns} FROM {table} \
                 WHERE {table}.state = listed.state AND user_id = "
            ))
            .push_bind(user);
        push_after(&mut query, after);
        query
            .push(" ORDER BY created_at DESC, id DESC LIMIT ")
            .push_bind(rows)
            .push(") AS page");
    }
    for (n, (check, value)) in checks.into_iter().enumerate() {
        query
            .push(if n == 0 { " WHERE " } else { " AND " })
            .push(check);
        match value {
            Bound::User(user) => query.push_bind(user),
            // The page's `state` is the column's text.
            Bound::State(state) => query.push_bind(state.as_str()),
        };
    }
    query
        .push(" ORDER BY page.created_at DESC, page.id DESC LIMIT ")
        .push_bind(rows);
    query
}

/// A value a page's rows are checked against after they are read.
enum Bound {
    User(Uuid),
    State(records::WorkState),
}

/// The keyset condition of the page after `after`, if any.
fn push_after(query: &mut QueryBuilder<Postgres>, after: Option<Cursor>) {
    if let Some(after) = after {
        query
            .push(" AND (created_at, id) < (")
            .push_bind(after.created_at)
            .push(", ")
            .push_bind(after.id)
            .push(")");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_as_written() {
        let cursor = Cursor {
            created_at: DateTime::from_timestamp_micros(1_795_000_000_123_456).unwrap(),
            id: Uuid::now_v7(),
        };
        let text = cursor.encode();
        assert!(
            text.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "{text}"
        );
        assert_eq!(Cursor::decode(&text).unwrap(), cursor);
        for micros in [0, MAX_CURSOR_MICROS] {
            let edge = Cursor {
                created_at: DateTime::from_timestamp_micros(micros).unwrap(),
                id: Uuid::nil(),
            };
            assert_eq!(Cursor::decode(&edge.encode()).unwrap(), edge);
        }
    }

    #[test]
    fn anything_else_is_refused_by_name() {
        let id = Uuid::now_v7();
        for text in [
            String::new(),
            "not base64!".to_owned(),
            URL_SAFE_NO_PAD.encode("2.1.".to_owned() + &id.simple().to_string()),
            URL_SAFE_NO_PAD.encode(format!("1.x.{}", id.simple())),
            URL_SAFE_NO_PAD.encode(format!("1.1.{}", id.hyphenated())),
            URL_SAFE_NO_PAD.encode(format!("1.1.{}.x", id.simple())),
            URL_SAFE_NO_PAD.encode(format!("1.{}.{}", i64::MAX, id.simple())),
            // Times PostgreSQL cannot hold, and other spellings of a good cursor.
            URL_SAFE_NO_PAD.encode(format!("1.-300000000000000000.{}", id.simple())),
            URL_SAFE_NO_PAD.encode(format!("1.-1.{}", id.simple())),
            URL_SAFE_NO_PAD.encode(format!("1.{}.{}", MAX_CURSOR_MICROS + 1, id.simple())),
            URL_SAFE_NO_PAD.encode(format!("1.+5.{}", id.simple())),
            URL_SAFE_NO_PAD.encode(format!("1.05.{}", id.simple())),
            URL_SAFE_NO_PAD.encode(format!("1.5.{}", id.simple().to_string().to_uppercase())),
            URL_SAFE_NO_PAD.encode([0xff, 0xfe]),
        ] {
            let problem = Cursor::decode(&text).unwrap_err();
            assert_eq!(problem.code(), "validation_failed", "{text}");
            assert_eq!(problem.body()["field"], "cursor", "{text}");
        }
    }

    #[test]
    fn page_sizes_are_bounded() {
        assert_eq!(page_size(None).unwrap(), DEFAULT_PAGE_SIZE);
        assert_eq!(page_size(Some(1)).unwrap(), 1);
        assert_eq!(page_size(Some(MAX_PAGE_SIZE)).unwrap(), MAX_PAGE_SIZE);
        for n in [0, MAX_PAGE_SIZE + 1, u32::MAX] {
            let problem = page_size(Some(n)).unwrap_err();
            assert_eq!(problem.body()["field"], "limit");
        }
    }
}
