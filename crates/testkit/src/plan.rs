//! Reading a plan that `EXPLAIN (FORMAT JSON)` returned, for tests that check which path
//! PostgreSQL took.

use serde_json::Value;
use sqlx::Connection;

use crate::TestDb;

/// Every node of the plan in `explained` (the JSON `EXPLAIN` returns), depth first: the nodes of
/// init plans and subplans included, as they sit under `Plans` too.
pub fn plan_nodes(explained: &Value) -> Vec<&Value> {
    fn walk<'a>(node: &'a Value, out: &mut Vec<&'a Value>) {
        out.push(node);
        for child in node["Plans"].as_array().into_iter().flatten() {
            walk(child, out);
        }
    }
    let mut out = Vec::new();
    walk(&explained[0]["Plan"], &mut out);
    out
}

/// The generic plan (`EXPLAIN (FORMAT JSON)`) PostgreSQL makes for `sql` as the services that
/// plan generically run it (`plan_cache_mode = force_generic_plan`), on a connection of its own
/// to `db`: `sql`'s parameters are typed by their casts or their context, and `arguments` is the
/// SQL list of values it is run with.
pub async fn generic_plan(db: &TestDb, sql: &str, arguments: &str) -> Value {
    explain_generic(db, sql, arguments, "FORMAT JSON").await
}

/// [`generic_plan`] run (`EXPLAIN (ANALYZE, FORMAT JSON)`): each node also says how many rows
/// it returned (`Actual Rows`, per loop, over `Actual Loops`) and how many its filter dropped.
pub async fn generic_plan_run(db: &TestDb, sql: &str, arguments: &str) -> Value {
    explain_generic(db, sql, arguments, "ANALYZE, FORMAT JSON").await
}

/// About how many rows of `table` the nodes of `explained` (from [`generic_plan_run`]) read:
/// the rows its scans returned and their filters dropped, and the entries its indexes named
/// `<table>_…` gave to bitmap scans, over all their loops. `EXPLAIN` gives each count per loop,
/// rounded, so the sum is approximate; index entries an index scan skips within its range
/// (a condition on a column after the first it cannot use) are not counted.
pub fn rows_read_from(explained: &Value, table: &str) -> u64 {
    let prefix = format!("{table}_");
    plan_nodes(explained)
        .into_iter()
        .filter(|n| {
            n["Relation Name"] == table
                || (n["Node Type"] == "Bitmap Index Scan"
                    && n["Index Name"]
                        .as_str()
                        .is_some_and(|i| i.starts_with(&prefix)))
        })
        .map(|n| {
            let per_loop = n["Actual Rows"].as_u64().unwrap_or(0)
                + n["Rows Removed by Filter"].as_u64().unwrap_or(0)
                + n["Rows Removed by Index Recheck"].as_u64().unwrap_or(0);
            per_loop * n["Actual Loops"].as_u64().unwrap_or(1)
        })
        .sum()
}

async fn explain_generic(db: &TestDb, sql: &str, arguments: &str, options: &str) -> Value {
    let mut conn = sqlx::PgConnection::connect(&db.url())
        .await
        .expect("connect for a plan");
    sqlx::raw_sql("SET plan_cache_mode = force_generic_plan")
        .execute(&mut conn)
        .await
        .expect("plan generically");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("PREPARE checked AS {sql}")))
        .execute(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("prepare {sql}: {e}"));
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN ({options}) EXECUTE checked({arguments})"
    )))
    .fetch_one(&mut conn)
    .await
    .unwrap_or_else(|e| panic!("explain {sql}: {e}"))
}
