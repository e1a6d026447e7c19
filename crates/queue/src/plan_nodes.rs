//! Test support: analysed tables, and checks on a plan from `EXPLAIN (ANALYZE, FORMAT JSON)`,
//! to see which path PostgreSQL took and how many rows it read.

use serde_json::Value;
use testkit::TestDb;
use testkit::plan::plan_nodes;

/// A database of its own, with the jobs `insert_jobs` writes and statistics that have seen them
/// (`ANALYZE`), as autovacuum leaves a production table.
pub(crate) async fn analyzed_db(insert_jobs: &'static str) -> TestDb {
    let db = TestDb::new().await;
    sqlx::query(insert_jobs).execute(&db.pool).await.unwrap();
    sqlx::query("ANALYZE fairlane_job")
        .execute(&db.pool)
        .await
        .unwrap();
    db
}

/// Asserts that the plan in `explained` read `index` with an ordered index scan of at most
/// `at_most` rows, and used no bitmap and no sort anywhere (ADR 0013).
pub(crate) fn assert_walks_index(explained: &Value, index: &str, at_most: u64) {
    let all = plan_nodes(explained);
    let kinds: Vec<&str> = all.iter().filter_map(|n| n["Node Type"].as_str()).collect();
    assert!(
        !kinds
            .iter()
            .any(|k| *k == "Bitmap Heap Scan" || *k == "Sort"),
        "the plan reads through a bitmap or sorts: {kinds:?}"
    );
    let scan = all
        .iter()
        .find(|n| n["Index Name"] == index)
        .unwrap_or_else(|| panic!("the plan does not use {index}: {kinds:?}"));
    assert_eq!(
        scan["Node Type"], "Index Scan",
        "{index} is not walked in order"
    );
    let read = scan["Actual Rows"].as_u64().unwrap_or(u64::MAX);
    assert!(read <= at_most, "{index}: {read} rows read for {at_most}");
}

/// Asserts that the plan in `explained` found its `fairlane_job` rows through `index` and never
/// scanned the whole table.
pub(crate) fn assert_looks_jobs_up_by(explained: &Value, index: &str) {
    let all = plan_nodes(explained);
    let kinds: Vec<&str> = all.iter().filter_map(|n| n["Node Type"].as_str()).collect();
    assert!(
        !all.iter()
            .any(|n| n["Node Type"] == "Seq Scan" && n["Relation Name"] == "fairlane_job"),
        "the plan scans the whole job table: {kinds:?}"
    );
    assert!(
        all.iter().any(|n| n["Index Name"] == index),
        "the plan does not use {index}: {kinds:?}"
    );
}
