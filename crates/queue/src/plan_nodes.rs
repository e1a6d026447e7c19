//! Test support: the nodes of a plan from `EXPLAIN (ANALYZE, FORMAT JSON)`, to check which
//! path PostgreSQL took and how many rows it read.

use serde_json::Value;

/// Every node of the plan in `explained` (the JSON `EXPLAIN` returns), depth first.
pub(crate) fn plan_nodes(explained: &Value) -> Vec<&Value> {
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
