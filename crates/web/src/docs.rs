//! The `/docs` page: a self-contained HTML rendering (no scripts, no external assets) of the
//! OpenAPI document, plus the table of problem codes.

use std::fmt::Write as _;

use serde_json::Value;

use crate::problem::CODES;

fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// A short human form of a schema: `AnalysisView`, `string (uuid)`, `[JobView]`, …
fn schema_text(schema: &Value) -> String {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.rsplit('/').next().unwrap_or(r);
        return format!("<a href=\"#schema-{0}\">{0}</a>", esc(name));
    }
    if let Some(one) = schema.get("oneOf").and_then(Value::as_array) {
        return one.iter().map(schema_text).collect::<Vec<_>>().join(" | ");
    }
    let ty = match schema.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" | "),
        _ => "any".to_owned(),
    };
    let mut text = esc(&ty);
    if ty.starts_with("array")
        && let Some(items) = schema.get("items")
    {
        text = format!("[{}]", schema_text(items));
    }
    if let Some(f) = schema.get("format").and_then(Value::as_str) {
        let _ = write!(text, " ({})", esc(f));
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        let list: Vec<String> = values.iter().map(|v| esc(&v.to_string())).collect();
        let _ = write!(text, ": {}", list.join(", "));
    }
    text
}

/// Renders the page from the OpenAPI document.
pub fn render(doc: &Value) -> String {
    let title = doc["info"]["title"].as_str().unwrap_or("API");
    let mut html = String::new();
    let _ = write!(
        html,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{t}</title><style>\
         body{{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}}\
         code,pre{{font-family:ui-monospace,monospace;background:#f4f4f4;padding:0 .25em}}\
         table{{border-collapse:collapse;width:100%;margin:.5em 0 1.5em}}\
         td,th{{border:1px solid #ddd;padding:.3em .5em;text-align:left;vertical-align:top}}\
         .op{{border-left:4px solid #888;padding-left:.8em;margin:1.5em 0}}\
         .m{{font-weight:bold;text-transform:uppercase}}\
         .get{{border-color:#2a7}}.post{{border-color:#27c}}.delete{{border-color:#c33}}.patch{{border-color:#c80}}\
         </style></head><body><h1>{t}</h1><p>{d}</p>\
         <p>Machine-readable: <a href=\"/openapi.json\">/openapi.json</a>. Authenticate with \
         <code>Authorization: Bearer &lt;api key&gt;</code>.</p><h2>Endpoints</h2>",
        t = esc(title),
        d = esc(doc["info"]["description"].as_str().unwrap_or_default()),
    );
    if let Some(paths) = doc["paths"].as_object() {
        for (path, item) in paths {
            for method in ["get", "post", "put", "patch", "delete"] {
                let Some(op) = item.get(method) else { continue };
                let _ = write!(
                    html,
                    "<div class=\"op {method}\"><h3><span class=\"m\">{method}</span> <code>{}</code></h3>",
                    esc(path)
                );
                for key in ["summary", "description"] {
                    if let Some(text) = op.get(key).and_then(Value::as_str) {
                        let _ = write!(html, "<p>{}</p>", esc(text));
                    }
                }
                if let Some(params) = op.get("parameters").and_then(Value::as_array) {
                    html.push_str("<table><tr><th>parameter</th><th>in</th><th>type</th><th>description</th></tr>");
                    for p in params {
                        let _ = write!(
                            html,
                            "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
                            esc(p["name"].as_str().unwrap_or_default()),
                            esc(p["in"].as_str().unwrap_or_default()),
                            schema_text(&p["schema"]),
                            esc(p["description"].as_str().unwrap_or_default())
                        );
                    }
                    html.push_str("</table>");
                }
                if let Some(body) = op.get("requestBody")
                    && let Some(content) = body["content"].as_object()
                {
                    for (ct, c) in content {
                        let _ = write!(
                            html,
                            "<p>Request body (<code>{}</code>): {}</p>",
                            esc(ct),
                            schema_text(&c["schema"])
                        );
                    }
                }
                html.push_str("<table><tr><th>status</th><th>description</th><th>body</th></tr>");
                if let Some(responses) = op["responses"].as_object() {
                    for (status, r) in responses {
                        let body: Vec<String> = r["content"]
                            .as_object()
                            .map(|c| {
                                c.iter()
                                    .map(|(ct, v)| {
                                        format!(
                                            "<code>{}</code> {}",
                                            esc(ct),
                                            schema_text(&v["schema"])
                                        )
                                    })
                                    .collect()
                            })
                            .unwrap_or_default();
                        let _ = write!(
                            html,
                            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                            esc(status),
                            esc(r["description"].as_str().unwrap_or_default()),
                            body.join("<br>")
                        );
                    }
                }
                html.push_str("</table></div>");
            }
        }
    }
    html.push_str("<h2>Schemas</h2>");
    if let Some(schemas) = doc["components"]["schemas"].as_object() {
        for (name, schema) in schemas {
            let _ = write!(html, "<h3 id=\"schema-{0}\">{0}</h3>", esc(name));
            if let Some(d) = schema.get("description").and_then(Value::as_str) {
                let _ = write!(html, "<p>{}</p>", esc(d));
            }
            // A schema made of others (`allOf`, from a flattened field): the fields of each
            // part it names, then its own.
            let parts: Vec<&Value> = schema["allOf"]
                .as_array()
                .map(|all| all.iter().collect())
                .unwrap_or_else(|| vec![schema]);
            let mut rows = String::new();
            for part in parts {
                if part.get("$ref").is_some() {
                    let _ = write!(html, "<p>Every field of {}, and:</p>", schema_text(part));
                    continue;
                }
                let required: Vec<&str> = part["required"]
                    .as_array()
                    .map(|r| r.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                for (field, p) in part["properties"].as_object().into_iter().flatten() {
                    let _ = write!(
                        rows,
                        "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
                        esc(field),
                        schema_text(p),
                        if required.contains(&field.as_str()) {
                            "yes"
                        } else {
                            ""
                        },
                        esc(p["description"].as_str().unwrap_or_default())
                    );
                }
            }
            if !rows.is_empty() {
                html.push_str("<table><tr><th>field</th><th>type</th><th>required</th><th>description</th></tr>");
                html.push_str(&rows);
                html.push_str("</table>");
            } else if schema.get("allOf").is_none() {
                let _ = write!(html, "<p>{}</p>", schema_text(schema));
            }
        }
    }
    html.push_str(
        "<h2>Problem codes</h2><p>Every error is <code>application/problem+json</code> \
         (RFC 9457) with <code>type</code>, <code>title</code>, <code>status</code>, \
         <code>detail</code> and a stable <code>code</code>.</p>\
         <table><tr><th>code</th><th>status</th><th>meaning</th></tr>",
    );
    for (code, status, title) in CODES {
        let _ = write!(
            html,
            "<tr id=\"problem-{c}\"><td><code>{c}</code></td><td>{status}</td><td>{}</td></tr>",
            esc(title),
            c = esc(code)
        );
    }
    html.push_str("</table></body></html>");
    html
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_path_and_escapes() {
        let doc: Value = serde_json::from_str(&crate::openapi::document_json()).unwrap();
        let html = render(&doc);
        for path in ["/v1/analyses", "/v1/jobs/{id}", "/v1/usage", "/admin/users"] {
            assert!(
                html.contains(&format!("<code>{}</code>", esc(path))),
                "{path}"
            );
        }
        assert!(html.contains("id=\"problem-quota_exceeded\""));
        // A record's schema made of its summary and its result lists both.
        let view = &html[html.find("id=\"schema-AnalysisView\"").unwrap()..];
        let view = &view[..view.find("<h3").unwrap_or(view.len())];
        assert!(
            view.contains("Every field of <a href=\"#schema-AnalysisSummary\">")
                && view.contains("<code>result</code>"),
            "{view}"
        );
        assert!(!html.contains("<script"));
        assert!(!html.contains("http://") && !html.contains("https://cdn"));
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }
}
