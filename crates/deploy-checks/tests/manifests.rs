//! Static checks of the shipped deployment files with the real tools: kustomize renders every
//! overlay and the objects validate against the Kubernetes schemas (strict) and the KEDA CRD
//! schema; every environment variable handed to a container (manifests and docker-compose.yml) is
//! one its binary reads; docker-compose.yml matches the Compose specification and refers only to
//! files that exist; the Dockerfile builds packages that exist; the per-queue dashboards are what
//! the template gives; promtool accepts the Prometheus configs and alert rules.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use support::{env_names, read, temp_dir, workspace_root};

const OVERLAYS: [&str; 2] = ["dev", "prod"];
/// The Kubernetes version the manifests are validated against (the oldest supported).
const KUBERNETES_VERSION: &str = "1.30.0";

fn output(program: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(program)
        .args(args)
        .current_dir(workspace_root())
        .output()
        .unwrap_or_else(|e| panic!("running {program} (cargo xtask tools installs it): {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `kubectl kustomize` of one overlay, as JSON objects.
fn render(overlay: &str) -> Vec<Value> {
    let (ok, text) = output(
        "kubectl",
        &["kustomize", &format!("deploy/k8s/overlays/{overlay}")],
    );
    assert!(ok, "kubectl kustomize {overlay} failed:\n{text}");
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let yaml = serde_yaml::Value::deserialize(doc).unwrap();
            serde_json::to_value(yaml).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}

use serde::Deserialize as _;

fn is_keda(object: &Value) -> bool {
    object["apiVersion"]
        .as_str()
        .is_some_and(|v| v.starts_with("keda.sh/"))
}

/// Validates core objects with kubernetes-validate (strict: unknown fields are errors); returns
/// (passed, output).
fn kubernetes_validate(objects: &[Value]) -> (bool, String) {
    let dir = temp_dir("k8s-validate");
    let file = dir.join("objects.yaml");
    let yaml: Vec<String> = objects
        .iter()
        .map(|o| serde_yaml::to_string(o).unwrap())
        .collect();
    std::fs::write(&file, yaml.join("---\n")).unwrap();
    let (ok, text) = output(
        "python3",
        &[
            "-m",
            "kubernetes_validate",
            "--strict",
            "-k",
            KUBERNETES_VERSION,
            &file.to_string_lossy(),
        ],
    );
    let passed = text
        .lines()
        .filter(|l| l.starts_with("INFO") && l.contains(" passed "))
        .count();
    let clean = ok && passed == objects.len() && !text.lines().any(|l| !l.starts_with("INFO"));
    (clean, text)
}

/// Validates objects with the models generated from the Kubernetes and KEDA schemas.
fn models_validate(objects: &[Value]) -> (bool, String) {
    let modules = workspace_root().join(".fairlane/tools/node/node_modules");
    assert!(
        modules.join("@kubernetes-models/keda").exists(),
        "{} has no KEDA models: run `cargo xtask tools`",
        modules.display()
    );
    // kustomize wraps a generated Secret's longer base64 values at 76 characters. The API
    // server decodes them with Go's base64, which skips line breaks (and kubernetes-validate
    // takes them), but the models' `byte` format does not: unwrap them for the models.
    let mut objects = objects.to_vec();
    for object in objects.iter_mut().filter(|o| o["kind"] == "Secret") {
        if let Some(data) = object["data"].as_object_mut() {
            for value in data.values_mut() {
                if let Some(text) = value.as_str() {
                    *value = Value::String(text.replace('\n', ""));
                }
            }
        }
    }
    let dir = temp_dir("k8s-models");
    let file = dir.join("objects.json");
    std::fs::write(&file, serde_json::to_vec(&objects).unwrap()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/validate-models.mjs");
    output(
        "node",
        &[
            &script.to_string_lossy(),
            &modules.to_string_lossy(),
            &file.to_string_lossy(),
        ],
    )
}

#[test]
fn every_overlay_renders_and_validates_against_kubernetes_and_keda_schemas() {
    for overlay in OVERLAYS {
        let objects = render(overlay);
        let core: Vec<Value> = objects.iter().filter(|o| !is_keda(o)).cloned().collect();
        let keda: Vec<Value> = objects.iter().filter(|o| is_keda(o)).cloned().collect();
        assert!(keda.len() >= 2, "{overlay}: ScaledObjects missing");
        let (ok, text) = kubernetes_validate(&core);
        assert!(ok, "{overlay}: kubernetes-validate --strict:\n{text}");
        let (ok, text) = models_validate(&objects);
        assert!(ok, "{overlay}: schema models:\n{text}");
    }
}

#[test]
fn the_validators_refuse_broken_objects() {
    // Controls: the validators above must be able to fail.
    let objects = render("dev");
    let mut deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .unwrap()
        .clone();
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] =
        json!({});
    let (ok, text) = kubernetes_validate(&[deployment]);
    assert!(!ok, "an unknown field passed:\n{text}");
    let mut scaled = objects.iter().find(|o| is_keda(o)).unwrap().clone();
    scaled["spec"]["triggers"][0]
        .as_object_mut()
        .unwrap()
        .remove("type");
    let (ok, text) = models_validate(&[scaled]);
    assert!(!ok, "a trigger without a type passed:\n{text}");
    let (ok, text) = models_validate(&[
        json!({"apiVersion": "keda.sh/v1alpha1", "kind": "Nope", "metadata": {"name": "x"}}),
    ]);
    assert!(!ok, "an unknown kind passed:\n{text}");
}

/// Every container of a pod template: (owner, binary = args[0], container). Fairlane containers
/// set `args` (the image's CMD) and never `command`, which would replace the image's tini
/// entrypoint.
fn containers(objects: &[Value]) -> Vec<(String, String, Value)> {
    let mut out = Vec::new();
    for o in objects {
        if let Some(list) = o["spec"]["template"]["spec"]["containers"].as_array() {
            for c in list {
                assert!(
                    c.get("command").is_none(),
                    "{}/{}: `command` would bypass the image's tini entrypoint; use `args`",
                    o["kind"],
                    o["metadata"]["name"]
                );
                let binary = c["args"][0].as_str().unwrap_or_else(|| {
                    panic!(
                        "{}/{}: container without args naming its binary",
                        o["kind"], o["metadata"]["name"]
                    )
                });
                out.push((
                    format!(
                        "{}/{}",
                        o["kind"].as_str().unwrap(),
                        o["metadata"]["name"].as_str().unwrap()
                    ),
                    binary.to_owned(),
                    c.clone(),
                ));
            }
        }
    }
    out
}

/// A generated object's name without kustomize's hash suffix.
fn base_name(name: &str) -> &str {
    match name.rsplit_once('-') {
        Some((base, hash))
            if hash.len() == 10 && hash.chars().all(|c| c.is_ascii_alphanumeric()) =>
        {
            base
        }
        _ => name,
    }
}

fn keys_of(object: &Value) -> BTreeSet<String> {
    ["data", "stringData"]
        .iter()
        .filter_map(|field| object[*field].as_object())
        .flat_map(|m| m.keys().cloned())
        .collect()
}

/// The variables a container gets: `env` names and the keys of `envFrom` sources. Secrets that
/// an overlay expects to exist outside the repository (prod) are looked up in `external`.
fn container_env(
    container: &Value,
    objects: &[Value],
    external: &BTreeMap<String, BTreeSet<String>>,
) -> BTreeSet<String> {
    let mut names: BTreeSet<String> = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| e["name"].as_str().unwrap().to_owned())
        .collect();
    for source in container["envFrom"].as_array().into_iter().flatten() {
        let (kind, reference) = if source["configMapRef"].is_object() {
            ("ConfigMap", &source["configMapRef"])
        } else {
            ("Secret", &source["secretRef"])
        };
        let name = reference["name"].as_str().unwrap();
        match objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        {
            Some(object) => names.extend(keys_of(object)),
            None => {
                let keys = external
                    .get(base_name(name))
                    .unwrap_or_else(|| panic!("{kind} {name} is neither rendered nor documented"));
                names.extend(keys.iter().cloned());
            }
        }
    }
    names
}

#[test]
fn every_variable_set_in_the_manifests_is_read_by_the_container_binary() {
    // Secrets prod expects to exist hold the keys the dev overlay generates for them.
    let dev = render("dev");
    let external: BTreeMap<String, BTreeSet<String>> = dev
        .iter()
        .filter(|o| o["kind"] == "Secret")
        .map(|o| {
            (
                base_name(o["metadata"]["name"].as_str().unwrap()).to_owned(),
                keys_of(o),
            )
        })
        .collect();
    for overlay in OVERLAYS {
        let objects = render(overlay);
        let all = containers(&objects);
        assert!(all.len() >= 5, "{overlay}: {} containers", all.len());
        for (owner, binary, container) in &all {
            let known = env_names(binary)
                .unwrap_or_else(|| panic!("{overlay} {owner}: no known binary `{binary}`"));
            let given = container_env(container, &objects, &external);
            let unread: Vec<&String> = given.difference(&known).collect();
            assert!(
                unread.is_empty(),
                "{overlay} {owner} ({binary}) sets variables it never reads: {unread:?}"
            );
            assert!(
                given.contains("DATABASE_URL"),
                "{overlay} {owner}: no DATABASE_URL"
            );
        }
        // KEDA reads the connection from the scale target's own environment.
        for scaled in objects.iter().filter(|o| o["kind"] == "ScaledObject") {
            let target = scaled["spec"]["scaleTargetRef"]["name"].as_str().unwrap();
            let (_, _, container) = all
                .iter()
                .find(|(owner, _, _)| *owner == format!("Deployment/{target}"))
                .unwrap_or_else(|| panic!("{overlay}: ScaledObject targets missing {target}"));
            let env = container_env(container, &objects, &external);
            for trigger in scaled["spec"]["triggers"].as_array().unwrap() {
                let var = trigger["metadata"]["connectionFromEnv"].as_str().unwrap();
                assert!(
                    env.contains(var),
                    "{overlay} {target}: trigger reads {var}, not in the container"
                );
            }
        }
    }
}

#[test]
fn operations_doc_deletes_each_job_before_applying_a_release() {
    // A Job's pod template is immutable: applying a new image over a Job that still exists
    // (ttlSecondsAfterFinished keeps it for its logs) fails, so the deploy steps delete it.
    let doc = read("docs/operations.md");
    for overlay in OVERLAYS {
        let objects = render(overlay);
        let jobs: Vec<&Value> = objects.iter().filter(|o| o["kind"] == "Job").collect();
        assert!(!jobs.is_empty(), "{overlay}: no migration Job");
        for job in jobs {
            let name = job["metadata"]["name"].as_str().unwrap();
            let namespace = job["metadata"]["namespace"].as_str().unwrap();
            let step = format!("kubectl -n {namespace} delete job {name} --ignore-not-found");
            assert!(
                doc.contains(&step),
                "docs/operations.md does not say to run `{step}` before applying {overlay}"
            );
        }
    }
}

/// The crates a `tracing` target can start with: every package of Cargo.lock (the workspace's
/// and its dependencies'), as Rust spells its name (`analyzer-worker` → `analyzer_worker`).
fn crate_names() -> BTreeSet<String> {
    read("Cargo.lock")
        .lines()
        .filter_map(|l| l.strip_prefix("name = \""))
        .map(|n| n.trim_end_matches('"').replace('-', "_"))
        .collect()
}

/// The targets an `EnvFilter` directive list names (`info,sqlx=warn,web[span]=debug` → `sqlx`,
/// `web`): the part before `[` or `=`; a bare word is a level unless it is none.
fn rust_log_targets(filter: &str) -> Vec<String> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    filter
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .filter_map(|directive| {
            let target = directive.split(['[', '=']).next().unwrap_or_default();
            let bare_level = !directive.contains(['[', '='])
                && LEVELS.contains(&target.to_ascii_lowercase().as_str());
            (!target.is_empty() && !bare_level).then(|| target.to_owned())
        })
        .collect()
}

#[test]
fn rust_log_filters_name_only_real_crates() {
    let crates = crate_names();
    assert!(crates.contains("web") && crates.contains("sqlx"));
    let mut filters: Vec<(String, String)> = Vec::new();
    for overlay in OVERLAYS {
        for object in render(overlay) {
            if object["kind"] == "ConfigMap"
                && let Some(filter) = object["data"]["RUST_LOG"].as_str()
            {
                let name = object["metadata"]["name"].as_str().unwrap();
                filters.push((format!("{overlay} ConfigMap {name}"), filter.to_owned()));
            }
        }
    }
    for (name, service) in compose()["services"].as_mapping().unwrap() {
        if let Some(filter) = service["environment"]["RUST_LOG"].as_str() {
            let name = name.as_str().unwrap();
            filters.push((format!("docker-compose.yml {name}"), filter.to_owned()));
        }
    }
    assert!(filters.len() >= 4, "{filters:?}");
    let mut unknown = Vec::new();
    for (place, filter) in &filters {
        for target in rust_log_targets(filter) {
            let krate = target.split("::").next().unwrap();
            if !crates.contains(krate) {
                unknown.push(format!("{place}: RUST_LOG={filter} names `{target}`"));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "targets that are no crate (a target is a module path, `web::batch`; a crate's \
         name with `_` for `-`), so they filter nothing:\n{}",
        unknown.join("\n")
    );
    // Controls for the parser.
    assert_eq!(
        rust_log_targets("info, sqlx=warn,web::batch[enqueue]=debug,queue,WARN"),
        ["sqlx", "web::batch", "queue"]
    );
}

/// The value a container gets for `key`: from `env`, else from a ConfigMap of `envFrom`
/// (the last source that has it wins, as in Kubernetes).
fn container_env_value(container: &Value, objects: &[Value], key: &str) -> Option<String> {
    let from_env = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == key)
        .and_then(|e| e["value"].as_str());
    if let Some(value) = from_env {
        return Some(value.to_owned());
    }
    container["envFrom"]
        .as_array()
        .into_iter()
        .flatten()
        .rev()
        .filter_map(|source| source["configMapRef"]["name"].as_str())
        .filter_map(|name| {
            objects
                .iter()
                .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == name)
        })
        .find_map(|config_map| config_map["data"][key].as_str())
        .map(str::to_owned)
}

/// The folder part and the file name of an absolute path.
fn split_file(path: &str) -> (&str, &str) {
    assert!(path.starts_with('/'), "{path} is not absolute");
    path.rsplit_once('/').unwrap()
}

#[test]
fn web_reads_its_rate_limit_rules_from_a_mounted_config_map_folder_that_updates_live() {
    // SPEC §7: rules reload without restart. Kubernetes updates a ConfigMap volume in place
    // (an atomic swap of its `..data` link), but never a `subPath` mount, and a generated name
    // with a content hash would roll the Deployment instead.
    let shipped = read("deploy/ratelimit/rules.yaml");
    for overlay in OVERLAYS {
        let objects = render(overlay);
        let web = objects
            .iter()
            .find(|o| o["kind"] == "Deployment" && o["metadata"]["name"] == "web")
            .unwrap();
        let pod = &web["spec"]["template"]["spec"];
        let container = &pod["containers"][0];
        let path = container_env_value(container, &objects, "RATELIMIT_RULES")
            .unwrap_or_else(|| panic!("{overlay} web: no RATELIMIT_RULES (the image's copy)"));
        let (folder, file) = split_file(&path);
        let mount = container["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["mountPath"] == folder)
            .unwrap_or_else(|| panic!("{overlay} web: nothing mounted at {folder} ({path})"));
        assert!(
            mount.get("subPath").is_none() && mount.get("subPathExpr").is_none(),
            "{overlay} web: a subPath mount of {folder} never sees ConfigMap updates"
        );
        let volume = pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == mount["name"])
            .unwrap_or_else(|| panic!("{overlay} web: no volume {}", mount["name"]));
        assert!(
            volume["configMap"]["items"].is_null(),
            "{overlay} web: the rules volume remaps keys"
        );
        let name = volume["configMap"]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("{overlay} web: {folder} is not a ConfigMap volume"));
        assert_eq!(
            base_name(name),
            name,
            "{overlay}: ConfigMap {name} has a content hash: a rules change would restart web"
        );
        let config_map = objects
            .iter()
            .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("{overlay}: ConfigMap {name} is not rendered"));
        assert_eq!(
            config_map["data"][file].as_str(),
            Some(shipped.as_str()),
            "{overlay}: ConfigMap {name} key {file} is not deploy/ratelimit/rules.yaml"
        );
    }

    // Compose: a bind-mounted folder (a bind-mounted file keeps the replaced inode when an
    // editor writes a new file and renames it over the old one).
    let compose = compose();
    let web = &compose["services"]["web"];
    let path = web["environment"]["RATELIMIT_RULES"]
        .as_str()
        .expect("docker-compose.yml web: no RATELIMIT_RULES (the image's copy)");
    let (folder, file) = split_file(path);
    let host = web["volumes"]
        .as_sequence()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str())
        .find_map(|spec| {
            let mut parts = spec.split(':');
            let host = parts.next()?;
            (parts.next()? == folder).then_some(host)
        })
        .unwrap_or_else(|| panic!("docker-compose.yml web: no folder mounted at {folder}"));
    let host = workspace_root().join(host);
    assert!(host.is_dir(), "{} is not a folder", host.display());
    assert_eq!(
        std::fs::read_to_string(host.join(file)).unwrap(),
        shipped,
        "docker-compose.yml web: {path} is not deploy/ratelimit/rules.yaml"
    );
}

/// Compose publishes ports on the loopback interface only: Docker binds a bare `8080:8080` on
/// every interface, past the host's firewall, and the API behind it takes the file's fixed,
/// public `ADMIN_TOKEN` (anyone on the same network could create an enterprise user).
#[test]
fn compose_publishes_ports_on_loopback_only() {
    let compose = compose();
    let mut published = 0;
    for (name, service) in compose["services"].as_mapping().unwrap() {
        for port in service["ports"].as_sequence().into_iter().flatten() {
            let spec = port
                .as_str()
                .unwrap_or_else(|| panic!("docker-compose.yml {name:?}: ports in short form"));
            assert!(
                spec.starts_with("127.0.0.1:"),
                "docker-compose.yml {name:?}: `{spec}` is published on every interface"
            );
            published += 1;
        }
    }
    assert!(
        published >= 4,
        "web, jaeger, prometheus and grafana are published"
    );
}

/// A Kubernetes quantity of bytes (`6Gi`, `512M`, `1024`).
fn quantity_bytes(text: &str) -> u64 {
    let units: [(&str, u64); 8] = [
        ("Ki", 1 << 10),
        ("Mi", 1 << 20),
        ("Gi", 1 << 30),
        ("Ti", 1 << 40),
        ("k", 1_000),
        ("M", 1_000_000),
        ("G", 1_000_000_000),
        ("T", 1_000_000_000_000),
    ];
    let (digits, factor) = units
        .iter()
        .find_map(|(suffix, factor)| text.strip_suffix(suffix).map(|d| (d, *factor)))
        .unwrap_or((text, 1));
    digits
        .parse::<u64>()
        .unwrap_or_else(|e| panic!("{text:?} is not a quantity of bytes: {e}"))
        * factor
}

#[test]
fn quantities_read_as_kubernetes_reads_them() {
    assert_eq!(quantity_bytes("6Gi"), 6 << 30);
    assert_eq!(quantity_bytes("256Mi"), 256 << 20);
    assert_eq!(quantity_bytes("1G"), 1_000_000_000);
    assert_eq!(quantity_bytes("1024"), 1024);
}

/// A duration as the services read it (`30s`, `1m`, `1500ms`).
fn duration(text: &str) -> Duration {
    humantime::parse_duration(text)
        .unwrap_or_else(|e| panic!("{text:?} is not a duration the services read: {e}"))
}

/// KEDA's PostgreSQL scalers read `DATABASE_URL` from the workers' environment but connect
/// from the `keda` namespace: a short service name there resolves to nothing, and the workers
/// never scale. The dev overlay's generated URL names its host in full.
#[test]
fn the_database_url_keda_uses_resolves_from_its_namespace() {
    let overlay = read("deploy/k8s/overlays/dev/kustomization.yaml");
    let url = overlay
        .lines()
        .find_map(|line| line.trim().strip_prefix("- DATABASE_URL="))
        .expect("the dev overlay generates DATABASE_URL");
    let host = url
        .split('@')
        .nth(1)
        .and_then(|rest| rest.split([':', '/']).next())
        .expect("a host");
    assert!(
        host.ends_with(".svc.cluster.local"),
        "DATABASE_URL's host {host:?} does not resolve from the keda namespace"
    );
}

#[test]
fn deployments_have_probes_resources_budgets_graceful_shutdown_and_scaling() {
    let queues = |service: &str| -> BTreeSet<String> {
        ["priority", "default", "scheduled"]
            .iter()
            .map(|l| format!("{service}_{l}"))
            .collect()
    };
    let workers = [
        ("analyzer-worker", queues("analysis")),
        ("specgen-worker", queues("specview")),
    ];
    for overlay in OVERLAYS {
        let objects = render(overlay);
        let find = |kind: &str, name: &str| {
            objects
                .iter()
                .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
                .unwrap_or_else(|| panic!("{overlay}: no {kind} {name}"))
        };
        let config_opt = |name: &str, key: &str| -> Option<String> {
            objects
                .iter()
                .find(|o| {
                    o["kind"] == "ConfigMap"
                        && base_name(o["metadata"]["name"].as_str().unwrap()) == name
                })
                .and_then(|o| o["data"][key].as_str())
                .map(str::to_owned)
        };
        let config = |name: &str, key: &str| -> String {
            config_opt(name, key)
                .unwrap_or_else(|| panic!("{overlay}: ConfigMap {name} has no {key}"))
        };
        for name in ["web", "analyzer-worker", "specgen-worker", "scheduler"] {
            let deployment = find("Deployment", name);
            let pod = &deployment["spec"]["template"]["spec"];
            let c = &pod["containers"][0];
            // Liveness on /healthz (a database outage must not restart every pod), readiness on
            // /readyz, both on the port the service listens on (HTTP_ADDR), which is also the
            // one Prometheus scrapes.
            for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
                assert_eq!(
                    c[probe]["httpGet"]["path"], path,
                    "{overlay} {name}: {probe}"
                );
                assert_eq!(
                    c[probe]["httpGet"]["port"], "http",
                    "{overlay} {name}: {probe}"
                );
            }
            let listen = container_env_value(c, &objects, "HTTP_ADDR")
                .unwrap_or_else(|| panic!("{overlay} {name}: no HTTP_ADDR"));
            let port: u64 = listen
                .rsplit_once(':')
                .and_then(|(_, p)| p.parse().ok())
                .unwrap_or_else(|| panic!("{overlay} {name}: HTTP_ADDR {listen}"));
            let named = c["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["name"] == "http")
                .unwrap_or_else(|| panic!("{overlay} {name}: no port named http"));
            assert_eq!(
                named["containerPort"].as_u64(),
                Some(port),
                "{overlay} {name}: containerPort"
            );
            let annotations = &deployment["spec"]["template"]["metadata"]["annotations"];
            assert_eq!(
                annotations["prometheus.io/port"].as_str(),
                Some(port.to_string().as_str()),
                "{overlay} {name}: scrape port"
            );
            assert!(
                c["resources"]["requests"]["cpu"].is_string(),
                "{overlay} {name}: requests"
            );
            assert!(
                c["resources"]["limits"]["memory"].is_string(),
                "{overlay} {name}: limits"
            );
            // The scheduler places pods by their requests only: a pod whose emptyDirs may fill
            // to their size limits must request that much, or many land on one node and, under
            // disk pressure, the kubelet evicts those furthest over their request first, without
            // a drain (a full emptyDir evicts its pod the same way).
            let scratch: u64 = pod["volumes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v["emptyDir"]["sizeLimit"].as_str())
                .map(quantity_bytes)
                .sum();
            let requested = c["resources"]["requests"]["ephemeral-storage"]
                .as_str()
                .map_or(0, quantity_bytes);
            assert!(
                requested >= scratch,
                "{overlay} {name}: requests {requested} bytes of ephemeral storage, its emptyDirs \
                 may hold {scratch}"
            );
            find("PodDisruptionBudget", name);
            let selector = &deployment["spec"]["selector"]["matchLabels"];
            assert_eq!(
                &find("PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"],
                selector
            );
            assert_eq!(
                pod["securityContext"]["runAsNonRoot"], true,
                "{overlay} {name}"
            );
            // A read-only root leaves the temporary directory unwritable unless a volume is
            // mounted there: git (web's ref resolution, the workers' fetches) needs it.
            if c["securityContext"]["readOnlyRootFilesystem"] == true {
                let tmp = c["volumeMounts"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|m| m["mountPath"] == "/tmp")
                    .unwrap_or_else(|| {
                        panic!("{overlay} {name}: read-only root without a volume on /tmp")
                    });
                assert!(
                    pod["volumes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|v| v["name"] == tmp["name"] && v["emptyDir"].is_object()),
                    "{overlay} {name}: /tmp is not an emptyDir volume"
                );
            }
        }
        // The analyzer's checkouts live in /tmp, one per running job: its volume holds as many
        // of the largest as the pod runs at once (a full emptyDir gets the pod evicted at once,
        // with no drain).
        let analyzer = &find("Deployment", "analyzer-worker")["spec"]["template"]["spec"];
        let size_limit = analyzer["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "tmp")
            .and_then(|v| v["emptyDir"]["sizeLimit"].as_str())
            .unwrap_or_else(|| panic!("{overlay}: the analyzer's /tmp has no sizeLimit"));
        let size_limit: u64 = size_limit
            .strip_suffix("Gi")
            .and_then(|n| n.parse::<u64>().ok())
            .map(|n| n << 30)
            .unwrap_or_else(|| panic!("{overlay}: sizeLimit {size_limit:?} is not whole Gi"));
        let jobs: u64 = ["PRIORITY", "DEFAULT", "SCHEDULED"]
            .iter()
            .map(|lane| {
                config(
                    "fairlane-analyzer-worker",
                    &format!("ANALYZER_QUEUE_{lane}_WORKERS"),
                )
                .parse::<u64>()
                .unwrap()
            })
            .sum();
        let largest = config_opt("fairlane-analyzer-worker", "ANALYZER_MAX_REPO_BYTES")
            .map_or(inventory::Limits::default().max_bytes, |b| {
                b.parse().unwrap()
            });
        assert!(
            size_limit >= jobs * largest,
            "{overlay}: the analyzer's /tmp ({size_limit} bytes) holds fewer than its {jobs} \
             jobs' checkouts of up to {largest} bytes"
        );
        // web: endpoints are removed (preStop) before the drain, and the grace period covers both.
        let web = &find("Deployment", "web")["spec"]["template"]["spec"];
        let pre_stop = web["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
            .as_array()
            .unwrap();
        let delay: u64 = pre_stop[1].as_str().unwrap().parse().unwrap();
        assert!(delay > 0);
        // Each bound is reckoned from the values the container actually gets: its `env`, then
        // every ConfigMap it loads (the telemetry settings live in fairlane-common; a
        // per-service ConfigMap overrides the shared ones), else the service's default.
        let effective =
            |container: &Value, key: &str| container_env_value(container, &objects, key);
        let flush = |container: &Value| flush_bound(|key| effective(container, key)).as_secs_f64();
        let web_container = &web["containers"][0];
        let drain = duration(
            &effective(web_container, "HTTP_REQUEST_TIMEOUT")
                .unwrap_or_else(|| panic!("{overlay} web: no HTTP_REQUEST_TIMEOUT")),
        );
        let web_bound = delay as f64
            + drain.as_secs_f64()
            + web::SHUTDOWN_OVERHEAD_BOUND.as_secs_f64()
            + flush(web_container);
        let grace = web["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            grace as f64 > web_bound,
            "{overlay} web: grace {grace} s ≤ preStop, drain, collectors, pool, runtime and telemetry flush {web_bound} s"
        );
        assert_eq!(
            find("Service", "web")["spec"]["selector"],
            find("Deployment", "web")["spec"]["selector"]["matchLabels"]
        );
        // Workers: grace above the worst shutdown (the engine's drain and bounded steps, the
        // health server and gauge, the telemetry flush); KEDA owns their replicas and watches
        // their queues.
        for (name, queues) in &workers {
            let deployment = find("Deployment", name);
            let container = &deployment["spec"]["template"]["spec"]["containers"][0];
            let worker_bound = worker_shutdown_bound(|key| effective(container, key)).as_secs_f64()
                + flush(container);
            let grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                .as_u64()
                .unwrap();
            assert!(
                grace as f64 > worker_bound,
                "{overlay} {name}: grace {grace} s ≤ the worst shutdown {worker_bound} s"
            );
            assert!(
                deployment["spec"]["replicas"].is_null(),
                "{overlay} {name}: replicas fight KEDA"
            );
            let scaled = find("ScaledObject", name);
            let mut watched = BTreeSet::new();
            for trigger in scaled["spec"]["triggers"].as_array().unwrap() {
                assert_eq!(trigger["type"], "postgresql");
                let query = trigger["metadata"]["query"].as_str().unwrap();
                for queue in queues {
                    if query.contains(&format!("'{queue}'")) {
                        watched.insert(queue.clone());
                    }
                }
            }
            assert_eq!(&watched, queues, "{overlay} {name}: scaled on every lane");
        }
        // The queue-maintenance settings are shared through one election among the workers and
        // the scheduler (docs/operations.md): each must resolve to the same value in all three,
        // or a leader with a shorter QUEUE_RESCUE_AFTER than a worker's heartbeat allows would
        // rescue that worker's live jobs and run them twice.
        let queue_defaults = queue::EngineConfig::default();
        for (key, default) in [
            (
                "QUEUE_HEARTBEAT_INTERVAL",
                queue_defaults.heartbeat_interval,
            ),
            ("QUEUE_RESCUE_AFTER", queue_defaults.rescue_after),
            ("QUEUE_RESCUE_INTERVAL", queue_defaults.rescue_interval),
            ("QUEUE_PROMOTE_INTERVAL", queue_defaults.promote_interval),
            ("QUEUE_CLEAN_INTERVAL", queue_defaults.clean_interval),
            ("QUEUE_LEADER_TTL", queue_defaults.leader_ttl),
            (
                "QUEUE_RETENTION_COMPLETED",
                queue_defaults.retention_completed,
            ),
            ("QUEUE_RETENTION_FAILED", queue_defaults.retention_discarded),
        ] {
            // As the services read them: `1s` and `1000ms` agree, and so do unset and the default.
            let values: BTreeSet<Duration> = ["analyzer-worker", "specgen-worker", "scheduler"]
                .iter()
                .map(|name| {
                    let container =
                        &find("Deployment", name)["spec"]["template"]["spec"]["containers"][0];
                    effective(container, key).map_or(default, |v| duration(&v))
                })
                .collect();
            assert_eq!(
                values.len(),
                1,
                "{overlay}: {key} differs between the workers and the scheduler: {values:?}"
            );
        }
        // The repository URL policy is read by web, which accepts a URL, and by the analyzer,
        // which fetches it: a URL one accepts and the other refuses would be billed and then
        // fail. Each setting must resolve to the same value in both (unset is the default).
        let web_and_analyzer = ["web", "analyzer-worker"].map(|name| {
            find("Deployment", name)["spec"]["template"]["spec"]["containers"][0].clone()
        });
        for (key, default) in [
            ("ANALYZER_ALLOW_FILE_URLS", "false"),
            ("ANALYZER_ALLOW_PRIVATE_HOSTS", "false"),
            ("ANALYZER_ALLOWED_PORTS", "443"),
        ] {
            let values: BTreeSet<String> = web_and_analyzer
                .iter()
                .map(|container| {
                    let value = effective(container, key).unwrap_or_else(|| default.to_owned());
                    if key == "ANALYZER_ALLOWED_PORTS" {
                        format!(
                            "{:?}",
                            inventory::url_policy::parse_ports(&value)
                                .unwrap_or_else(|e| panic!("{overlay} {key}: {e}"))
                        )
                    } else {
                        value.to_ascii_lowercase()
                    }
                })
                .collect();
            assert_eq!(
                values.len(),
                1,
                "{overlay}: {key} differs between web and the analyzer: {values:?}"
            );
        }
        // Scheduler: a tick in progress, the elections' resignation and the health server, each
        // bounded, then the telemetry flush.
        let scheduler = &find("Deployment", "scheduler")["spec"]["template"]["spec"];
        let scheduler_bound =
            scheduler::SHUTDOWN_BOUND.as_secs_f64() + flush(&scheduler["containers"][0]);
        let grace = scheduler["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            grace as f64 > scheduler_bound,
            "{overlay} scheduler: grace {grace} s ≤ the worst shutdown {scheduler_bound} s"
        );
        let job = find("Job", "fairlane-migrate");
        assert_eq!(
            job["spec"]["template"]["spec"]["containers"][0]["args"],
            json!(["web", "migrate"])
        );
    }
}

#[test]
fn keda_queries_run_against_the_real_schema() {
    // The scalers' SQL is run by KEDA only in a cluster; run it here against the migrated schema,
    // and check its plan.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let db = testkit::TestDb::new().await;
        for scaled in render("prod")
            .iter()
            .filter(|o| o["kind"] == "ScaledObject")
        {
            for trigger in scaled["spec"]["triggers"].as_array().unwrap() {
                let query = trigger["metadata"]["query"].as_str().unwrap();
                let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(query.to_owned()))
                    .fetch_one(&db.pool)
                    .await
                    .unwrap_or_else(|e| panic!("{query}: {e}"));
                assert_eq!(count, 0);
                // KEDA runs each one every 15 s: an index must serve every part of it. With
                // sequential scans priced out, a part that no index can serve still shows one.
                let mut conn = db.pool.acquire().await.unwrap();
                sqlx::query("SET enable_seqscan = off")
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                let plan: Vec<String> =
                    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {query}")))
                        .fetch_all(&mut *conn)
                        .await
                        .unwrap();
                sqlx::query("RESET enable_seqscan")
                    .execute(&mut *conn)
                    .await
                    .unwrap();
                assert!(
                    !plan.iter().any(|line| line.contains("Seq Scan")),
                    "{query}\nreads the whole job table:\n{}",
                    plan.join("\n")
                );
            }
        }
    });
}

/// Compose gives each service `stop_grace_period` between SIGTERM and SIGKILL, with no
/// `preStop` wait before it: each must exceed the service's worst shutdown from the settings
/// compose hands it (or the defaults), as the Kubernetes grace periods do.
#[test]
fn compose_grace_periods_cover_each_services_worst_shutdown() {
    let compose = compose();
    let services = &compose["services"];
    let env = |service: &str, key: &str| -> Option<String> {
        let value = &services[service]["environment"][key];
        value
            .as_str()
            .map(str::to_owned)
            .or_else(|| value.as_u64().map(|n| n.to_string()))
    };
    let grace = |service: &str| {
        duration(
            services[service]["stop_grace_period"]
                .as_str()
                .unwrap_or_else(|| panic!("docker-compose.yml {service}: no stop_grace_period")),
        )
    };
    let flush = |service: &str| flush_bound(|key| env(service, key));
    let drain = env("web", "HTTP_REQUEST_TIMEOUT").map_or(
        web::config::WebConfig::default().http_request_timeout,
        |v| duration(&v),
    );
    let mut bounds = vec![("web", drain + web::SHUTDOWN_OVERHEAD_BOUND + flush("web"))];
    for worker in ["analyzer-worker", "specgen-worker"] {
        bounds.push((
            worker,
            worker_shutdown_bound(|key| env(worker, key)) + flush(worker),
        ));
    }
    bounds.push(("scheduler", scheduler::SHUTDOWN_BOUND + flush("scheduler")));
    for (service, bound) in bounds {
        assert!(
            grace(service) > bound,
            "docker-compose.yml {service}: stop_grace_period {:?} ≤ the worst shutdown {bound:?}",
            grace(service)
        );
    }
}

/// The telemetry flush's bound at shutdown, with the `OTLP_EXPORT_TIMEOUT` a service gets
/// (`setting` reads what its deployment hands it), else the default.
fn flush_bound(setting: impl Fn(&str) -> Option<String>) -> Duration {
    let mut telemetry = telemetry::TelemetryConfig::default();
    if let Some(timeout) = setting("OTLP_EXPORT_TIMEOUT") {
        telemetry.otlp_export_timeout = duration(&timeout);
    }
    telemetry.shutdown_bound()
}

/// A worker service's worst shutdown besides its telemetry flush (the engine's drain and bounded
/// steps, the health server, the gauge, the runtime's end), with the settings `setting` reads.
fn worker_shutdown_bound(setting: impl Fn(&str) -> Option<String>) -> Duration {
    let defaults = queue::EngineConfig::default();
    let read = |key: &str, default: Duration| setting(key).map_or(default, |v| duration(&v));
    let engine = queue::EngineConfig {
        shutdown_timeout: read("QUEUE_SHUTDOWN_TIMEOUT", defaults.shutdown_timeout),
        cancel_grace: read("QUEUE_CANCEL_GRACE", defaults.cancel_grace),
        ..defaults
    };
    engine.shutdown_bound() + workerkit::SHUTDOWN_OVERHEAD_BOUND
}

fn compose() -> serde_yaml::Value {
    let mut value: serde_yaml::Value = serde_yaml::from_str(&read("docker-compose.yml")).unwrap();
    value.apply_merge().unwrap();
    value
}

#[test]
fn compose_file_follows_the_spec_and_refers_to_existing_files() {
    let (ok, text) = output(
        "python3",
        &[
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            "docker-compose.yml",
        ],
    );
    assert!(ok, "compose-spec validation:\n{text}");
    let compose = compose();
    let root = workspace_root();
    let services = compose["services"].as_mapping().unwrap();
    let mut mounts: BTreeMap<String, String> = BTreeMap::new();
    for (name, service) in services {
        let name = name.as_str().unwrap();
        if let Some(build) = service.get("build") {
            let context = build["context"].as_str().unwrap();
            let dockerfile = build
                .get("dockerfile")
                .and_then(|d| d.as_str())
                .unwrap_or("Dockerfile");
            assert!(
                root.join(context).join(dockerfile).is_file(),
                "{name}: {context}/{dockerfile}"
            );
        }
        for volume in service
            .get("volumes")
            .and_then(|v| v.as_sequence())
            .into_iter()
            .flatten()
        {
            let spec = volume.as_str().unwrap();
            let mut parts = spec.split(':');
            let host = parts.next().unwrap();
            if host.starts_with("./") {
                assert!(root.join(host).exists(), "{name}: mounts missing {host}");
                mounts.insert(parts.next().unwrap().to_owned(), host.to_owned());
            } else {
                let named = compose["volumes"].get(host);
                assert!(named.is_some(), "{name}: volume {host} is not declared");
            }
        }
    }
    // Paths given to containers inside mounted folders must exist too (Grafana's home dashboard).
    for (name, service) in services {
        for (key, value) in service
            .get("environment")
            .and_then(|e| e.as_mapping())
            .into_iter()
            .flatten()
        {
            let Some(path) = value.as_str().filter(|v| v.starts_with('/')) else {
                continue;
            };
            for (inside, host) in &mounts {
                if let Some(rest) = path.strip_prefix(inside.as_str()) {
                    let file = root.join(host).join(rest.trim_start_matches('/'));
                    assert!(
                        file.exists(),
                        "{}: {} = {path} → missing {}",
                        name.as_str().unwrap(),
                        key.as_str().unwrap(),
                        file.display()
                    );
                }
            }
        }
    }
    // The Prometheus config's rule files sit beside it in the container, as in the repository.
    let prometheus: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/prometheus/prometheus.yml")).unwrap();
    for rule_file in prometheus["rule_files"].as_sequence().unwrap() {
        let inside = format!("/etc/prometheus/{}", rule_file.as_str().unwrap());
        assert!(
            mounts.contains_key(&inside),
            "prometheus: {inside} is not mounted"
        );
    }
}

#[test]
fn every_variable_set_in_compose_is_read_by_the_service_binary() {
    let compose = compose();
    let mut checked = 0;
    for (name, service) in compose["services"].as_mapping().unwrap() {
        let name = name.as_str().unwrap();
        if service.get("build").is_none() {
            continue; // third-party images
        }
        let binary = service["command"][0]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: no command"));
        let known =
            env_names(binary).unwrap_or_else(|| panic!("{name}: no known binary `{binary}`"));
        let given: BTreeSet<String> = service["environment"]
            .as_mapping()
            .unwrap_or_else(|| panic!("{name}: environment must be a mapping"))
            .keys()
            .map(|k| k.as_str().unwrap().to_owned())
            .collect();
        let unread: Vec<&String> = given.difference(&known).collect();
        assert!(
            unread.is_empty(),
            "{name} ({binary}) sets variables it never reads: {unread:?}"
        );
        checked += 1;
    }
    assert!(
        checked >= 5,
        "only {checked} Fairlane services in docker-compose.yml"
    );
}

#[test]
fn dockerfile_copies_existing_files_and_builds_existing_binaries() {
    let dockerfile = read("Dockerfile");
    let root = workspace_root();
    // Join continuation lines into instructions.
    let instructions: Vec<String> = dockerfile
        .replace("\\\n", " ")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    let mut packages = BTreeSet::new();
    for instruction in &instructions {
        let words: Vec<&str> = instruction.split_whitespace().collect();
        if words[0] == "COPY" && !words.iter().any(|w| w.starts_with("--from")) {
            for source in &words[1..words.len() - 1] {
                assert!(
                    root.join(source).exists(),
                    "Dockerfile copies missing {source}"
                );
            }
        }
        for pair in words.windows(2) {
            if pair[0] == "--package" {
                packages.insert(pair[1].to_owned());
            }
        }
    }
    for package in &packages {
        assert!(
            root.join("crates")
                .join(package)
                .join("src/main.rs")
                .is_file(),
            "Dockerfile builds {package}, which is not a binary crate of the workspace"
        );
        assert!(
            dockerfile.contains(&format!("/src/target/release/{package}")),
            "{package} is built but not copied"
        );
    }
    for package in deploy_checks::SERVICE_PACKAGES {
        assert!(packages.contains(*package), "the image lacks {package}");
    }
}

#[test]
fn queue_dashboards_are_generated_from_the_template_and_use_the_provisioned_datasource() {
    let root = workspace_root();
    for (path, text) in deploy_checks::dashboards::generate(&root).unwrap() {
        let committed = std::fs::read_to_string(root.join(&path)).unwrap_or_default();
        assert!(
            committed == text,
            "{} is stale: run `cargo xtask dashboards`",
            path.display()
        );
    }
    let queues: BTreeSet<String> = common::Service::ALL
        .iter()
        .flat_map(|s| s.queues())
        .map(|q| q.as_str().to_owned())
        .collect();
    let generated: BTreeSet<String> = deploy_checks::dashboards::QUEUE_DASHBOARDS
        .iter()
        .map(|d| d.queue.to_owned())
        .collect();
    assert_eq!(generated, queues, "one dashboard per queue of SPEC §2");

    let provisioning: serde_yaml::Value = serde_yaml::from_str(&read(
        "deploy/grafana/provisioning/datasources/datasources.yml",
    ))
    .unwrap();
    let datasource_uids: BTreeSet<&str> = provisioning["datasources"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|d| d["uid"].as_str().unwrap())
        .collect();
    let mut uids = BTreeSet::new();
    let dir = root.join(deploy_checks::dashboards::DASHBOARD_DIR);
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let dashboard: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        files += 1;
        assert!(
            uids.insert(dashboard["uid"].as_str().unwrap().to_owned()),
            "duplicate uid in {}",
            path.display()
        );
        let mut stack: Vec<&Value> = vec![&dashboard];
        while let Some(v) = stack.pop() {
            match v {
                Value::Object(m) => {
                    if let Some(uid) = m.get("datasource").and_then(|d| d["uid"].as_str()) {
                        assert!(
                            datasource_uids.contains(uid),
                            "{}: unknown datasource {uid}",
                            path.display()
                        );
                    }
                    stack.extend(m.values());
                }
                Value::Array(a) => stack.extend(a),
                _ => {}
            }
        }
    }
    assert_eq!(files, 7, "overview + six queues");
}

#[test]
fn promtool_accepts_the_prometheus_configs_and_alert_rules_and_their_unit_tests() {
    let (ok, text) = output(
        "promtool",
        &["check", "config", "deploy/prometheus/prometheus.yml"],
    );
    assert!(ok, "promtool check config prometheus.yml:\n{text}");
    assert!(
        text.contains("alerts.yml"),
        "prometheus.yml loads no alert rules:\n{text}"
    );
    let (ok, text) = output(
        "promtool",
        &["check", "rules", "deploy/prometheus/alerts.yml"],
    );
    assert!(ok, "{text}");
    // The alerts' unit tests: synthetic series in, the alerts that must (and must not) fire.
    let (ok, text) = output(
        "promtool",
        &["test", "rules", "deploy/prometheus/tests/alerts_test.yml"],
    );
    assert!(ok, "promtool test rules:\n{text}");

    // Debian's Prometheus is built without Kubernetes service discovery, so its promtool refuses
    // `kubernetes_sd_configs`. Check everything else of kubernetes.yml (relabelling, rule files)
    // with the discovery block swapped for an empty static one.
    let mut kubernetes: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/prometheus/kubernetes.yml")).unwrap();
    let mut swapped = 0;
    for scrape in kubernetes["scrape_configs"].as_sequence_mut().unwrap() {
        // Finished and evicted pods are not scraped (each would read as a service down).
        let drops_finished = scrape["relabel_configs"]
            .as_sequence()
            .into_iter()
            .flatten()
            .any(|rule| {
                rule["source_labels"][0] == "__meta_kubernetes_pod_phase"
                    && rule["action"] == "drop"
                    && rule["regex"]
                        .as_str()
                        .is_some_and(|r| r.split('|').any(|p| p == "Failed"))
                    && rule["regex"]
                        .as_str()
                        .is_some_and(|r| r.split('|').any(|p| p == "Succeeded"))
            });
        assert!(drops_finished, "kubernetes.yml scrapes finished pods");
        let scrape = scrape.as_mapping_mut().unwrap();
        let sd = scrape
            .remove("kubernetes_sd_configs")
            .expect("pod discovery");
        assert_eq!(sd[0]["role"], "pod");
        scrape.insert(
            "static_configs".into(),
            serde_yaml::from_str("[{targets: []}]").unwrap(),
        );
        swapped += 1;
    }
    assert!(swapped > 0);
    let dir = temp_dir("promtool");
    std::fs::write(
        dir.join("kubernetes.yml"),
        serde_yaml::to_string(&kubernetes).unwrap(),
    )
    .unwrap();
    std::fs::copy(
        workspace_root().join("deploy/prometheus/alerts.yml"),
        dir.join("alerts.yml"),
    )
    .unwrap();
    let file = dir.join("kubernetes.yml");
    let (ok, text) = output("promtool", &["check", "config", &file.to_string_lossy()]);
    assert!(
        ok,
        "promtool check config kubernetes.yml (discovery swapped):\n{text}"
    );
}

#[test]
fn latency_alerts_fire_below_the_largest_seconds_bucket() {
    // `histogram_quantile` never answers above the largest finite bucket boundary, so a
    // threshold at or above it is an alert that cannot fire.
    let largest = *telemetry::SECONDS_BUCKETS.last().unwrap();
    let alerts: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/prometheus/alerts.yml")).unwrap();
    let mut checked = 0;
    for group in alerts["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            let alert = rule["alert"].as_str().unwrap_or("(a recording rule)");
            let expr = rule["expr"].as_str().unwrap();
            if !(expr.contains("histogram_quantile") && expr.contains("_seconds_bucket")) {
                continue;
            }
            // The quantile's threshold is the first `>` after it; conditions may follow
            // (`and on (queue) (… > 0.9)`).
            let quantile = &expr[expr.find("_seconds_bucket").unwrap_or(0)..];
            let (_, after) = quantile
                .split_once('>')
                .unwrap_or_else(|| panic!("{alert}: no `>` threshold"));
            let threshold = after
                .trim_start()
                .split(|c: char| c.is_whitespace() || c == ')')
                .next()
                .unwrap_or_default();
            let threshold: f64 = threshold
                .parse()
                .unwrap_or_else(|e| panic!("{alert}: threshold {threshold:?}: {e}"));
            assert!(
                threshold < largest,
                "{alert}: threshold {threshold} s is not below the largest bucket, {largest} s"
            );
            checked += 1;
        }
    }
    assert!(checked >= 3, "only {checked} latency alerts found");
}

#[test]
fn otel_collector_pipelines_use_only_defined_components() {
    let config: serde_yaml::Value =
        serde_yaml::from_str(&read("deploy/otel-collector/config.yaml")).unwrap();
    let defined = |section: &str| -> BTreeSet<String> {
        config[section]
            .as_mapping()
            .into_iter()
            .flatten()
            .map(|(k, _)| k.as_str().unwrap().to_owned())
            .collect()
    };
    let pipelines = config["service"]["pipelines"].as_mapping().unwrap();
    assert!(pipelines.contains_key("traces") && pipelines.contains_key("metrics"));
    for (name, pipeline) in pipelines {
        for section in ["receivers", "processors", "exporters"] {
            for component in pipeline[section].as_sequence().into_iter().flatten() {
                let component = component.as_str().unwrap();
                assert!(
                    defined(section).contains(component),
                    "{name:?}: {section} {component} undefined"
                );
            }
        }
    }
    for extension in config["service"]["extensions"]
        .as_sequence()
        .into_iter()
        .flatten()
    {
        assert!(defined("extensions").contains(extension.as_str().unwrap()));
    }
    // The endpoint the services are given in compose is the receiver's port.
    let compose = compose();
    let endpoint = compose["services"]["web"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        .as_str()
        .unwrap();
    let port = endpoint.rsplit(':').next().unwrap();
    let receiver = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
        .as_str()
        .unwrap();
    assert!(
        receiver.ends_with(&format!(":{port}")),
        "{endpoint} vs {receiver}"
    );
}

#[test]
fn operations_doc_lists_every_variable_of_every_binary() {
    let doc = read("docs/operations.md");
    let wildcards: Vec<String> = doc
        .split('`')
        .filter(|w| {
            w.ends_with("_*")
                && w.chars()
                    .all(|c| c.is_ascii_uppercase() || c == '_' || c == '*')
        })
        .map(|w| w.trim_end_matches('*').to_owned())
        .collect();
    for binary in deploy_checks::SERVICE_PACKAGES {
        for name in env_names(binary).unwrap() {
            let listed = doc.contains(&format!("`{name}`"))
                || wildcards.iter().any(|w| name.starts_with(w.as_str()));
            assert!(listed, "docs/operations.md does not list {name} ({binary})");
        }
    }
}

/// The name the settings table gives a service binary in its "read by" column.
fn doc_name(binary: &str) -> &str {
    binary.strip_suffix("-worker").unwrap_or(binary)
}

#[test]
fn operations_doc_says_which_binaries_read_each_variable() {
    let doc = read("docs/operations.md");
    let settings = doc
        .split("\n## Settings\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/operations.md has a Settings section");
    let binaries = deploy_checks::SERVICE_PACKAGES;
    let variables: BTreeMap<&str, BTreeSet<String>> = binaries
        .iter()
        .map(|b| (*b, env_names(b).unwrap()))
        .collect();
    let readers = |matches: &dyn Fn(&str) -> bool| -> BTreeSet<String> {
        binaries
            .iter()
            .filter(|b| variables[**b].iter().any(|v| matches(v)))
            .map(|b| doc_name(b).to_owned())
            .collect()
    };
    // (the names or `PREFIX_*` patterns of a row, its "read by" binaries)
    let mut rows: Vec<(Vec<String>, BTreeSet<String>)> = Vec::new();
    for line in settings.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let names: Vec<String> = cells[1]
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect();
        let read_by: BTreeSet<String> = if cells[2] == "all" {
            binaries.iter().map(|b| doc_name(b).to_owned()).collect()
        } else {
            cells[2].split(',').map(|b| b.trim().to_owned()).collect()
        };
        rows.push((names, read_by));
    }
    assert!(
        rows.len() > 50,
        "only {} rows in the Settings table",
        rows.len()
    );
    let exact: BTreeSet<&str> = rows
        .iter()
        .flat_map(|(names, _)| names.iter())
        .filter(|n| !n.ends_with('*'))
        .map(String::as_str)
        .collect();
    let mut wrong = Vec::new();
    for (names, read_by) in &rows {
        for name in names {
            let actual = match name.strip_suffix('*') {
                // A pattern row stands for the variables no row of their own lists; it may
                // stand for none of the configuration's (`OTEL_BSP_*`: the SDK reads those).
                Some(prefix) => {
                    let actual = readers(&|v| v.starts_with(prefix) && !exact.contains(v));
                    if actual.is_empty() {
                        continue;
                    }
                    actual
                }
                None => readers(&|v| v == name),
            };
            if actual != *read_by {
                wrong.push(format!(
                    "{name}: documented {read_by:?}, read by {actual:?}"
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/operations.md, Settings, column \"read by\":\n{}",
        wrong.join("\n")
    );
}
