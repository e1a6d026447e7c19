//! Reading a plan that `EXPLAIN (FORMAT JSON)` returned, for tests that check which path
//! PostgreSQL took.

use serde_json::Value;

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
