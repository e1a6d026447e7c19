//! Layered configuration for every binary: built-in defaults < optional config file < environment.
//!
//! Settings are flat structs whose field names are the lower-case form of the environment variable
//! that sets them (`FAIRNESS_FREE_LIMIT` sets `fairness_free_limit`), so the names in SPEC, the
//! config file and the Kubernetes manifests are one and the same. Durations are humantime strings
//! (`30s`, `1h`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use clap::builder::TypedValueParser as _;
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Map, Value};

/// The longest duration any setting accepts (100 years). A longer one is a mistake, and would
/// overflow the arithmetic of deadlines and timers (`Instant + duration` panics on overflow).
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `d` as a PostgreSQL duration setting (`lock_timeout`, `idle_in_transaction_session_timeout`
/// …), in whole milliseconds: at least 1 (0 would mean none) and at most 2³¹−1 (about 24.8
/// days; PostgreSQL refuses more, and a session option it refuses fails every connection).
pub fn postgres_millis(d: Duration) -> String {
    format!(
        "{}ms",
        d.as_millis().clamp(1, i32::MAX.unsigned_abs().into())
    )
}

/// The `--config FILE` option of the service binaries, also set by `FAIRLANE_CONFIG`. An empty
/// value counts as unset, as for every other variable (clap alone refuses an empty path).
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigFileArg {
    /// A TOML file with settings (environment variables override it).
    #[arg(
        long = "config",
        env = "FAIRLANE_CONFIG",
        value_name = "FILE",
        value_parser = clap::builder::OsStringValueParser::new().map(std::path::PathBuf::from)
    )]
    file: Option<std::path::PathBuf>,
}

impl ConfigFileArg {
    /// The file to read, if any.
    pub fn path(&self) -> Option<&Path> {
        self.file
            .as_deref()
            .filter(|path| !path.as_os_str().is_empty())
    }
}

/// A configuration that could not be assembled, naming where the bad value came from: the
/// environment variable, or the config file and its key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {problem}")]
    File { path: String, problem: String },
    #[error("environment variable {name}={value:?}: {problem}")]
    Env {
        name: String,
        value: String,
        problem: String,
    },
    /// The value is not repeated: it may be a secret (`DATABASE_URL`, `ADMIN_TOKEN`).
    #[error("environment variable {name} is not valid UTF-8")]
    NotUnicode { name: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Loads `T`: its `Default` first, then the TOML file at `file` (if given; it must exist), then
/// environment variables. Unknown environment variables are ignored; a key in the file that is
/// not one of `T`'s settings (the keys of its serialized default) is refused, so a misspelt
/// setting cannot go unnoticed.
pub fn load<T>(file: Option<&Path>) -> Result<T, ConfigError>
where
    T: Default + Serialize + DeserializeOwned,
{
    load_from(file, unicode_env::<T>(std::env::vars_os())?)
}

/// The environment as text. A variable whose name or value is not Unicode is left out, unless
/// it is one of `T`'s settings: that is refused by name (`std::env::vars` would panic on any
/// such variable, even an unrelated one).
fn unicode_env<T>(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Result<Vec<(String, String)>, ConfigError>
where
    T: Default + Serialize,
{
    let settings =
        serde_json::to_value(T::default()).map_err(|e| ConfigError::Invalid(e.to_string()))?;
    let mut env = Vec::new();
    for (name, value) in vars {
        let Ok(name) = name.into_string() else {
            continue;
        };
        match value.into_string() {
            Ok(value) => env.push((name, value)),
            Err(_)
                if is_setting_name(&name) && settings.get(name.to_ascii_lowercase()).is_some() =>
            {
                return Err(ConfigError::NotUnicode { name });
            }
            Err(_) => {}
        }
    }
    Ok(env)
}

/// Settings are set by their upper-case names only (`DATABASE_URL`, not `database_url`), so
/// two spellings of one setting cannot both apply in an order the environment decides.
fn is_setting_name(name: &str) -> bool {
    !name.bytes().any(|b| b.is_ascii_lowercase())
}

/// [`load`] with an explicit environment, for tests and for tools that build child environments.
///
/// An environment value takes the JSON type of the field's default: numbers and booleans are
/// parsed (and refused with a message naming the variable when they do not parse); everything
/// else (strings, durations such as `30s`, optional settings) is kept as the exact text, so a
/// token like `0123` stays `0123`. An empty variable (or an empty string in the file) counts as
/// unset. A setting whose default is a duration (`30s`) takes only a duration with a unit, of
/// at most [`MAX_DURATION`], from the environment and the file alike. Any value the settings' types refuse (`-3` for a count)
/// is reported with the variable's name, or the file's key.
pub fn load_from<T, I>(file: Option<&Path>, env: I) -> Result<T, ConfigError>
where
    T: Default + Serialize + DeserializeOwned,
    I: IntoIterator<Item = (String, String)>,
{
    let defaults =
        serde_json::to_value(T::default()).map_err(|e| ConfigError::Invalid(e.to_string()))?;
    let Value::Object(defaults) = defaults else {
        return Err(ConfigError::Invalid(
            "a configuration must be a struct".into(),
        ));
    };
    let mut merged = defaults.clone();
    // Where each value that is not a default came from (the environment wins over the file).
    let mut origins: BTreeMap<String, Origin> = BTreeMap::new();
    if let Some(path) = file {
        let path = path.display().to_string();
        for (key, value) in read_file(&path)? {
            let Some(default) = defaults.get(&key) else {
                return Err(ConfigError::File {
                    path,
                    problem: format!(
                        "unknown setting `{key}` (settings are the environment variables' names in lower case)"
                    ),
                });
            };
            // As in the environment, an empty value means the setting is not set.
            if value.as_str() == Some("") {
                continue;
            }
            let origin = Origin::File(path.clone());
            if let Value::String(default) = default
                && is_duration(default)
            {
                let checked = match &value {
                    Value::String(text) => duration(text).map(|_| ()),
                    _ => Err(duration_problem()),
                };
                checked.map_err(|problem| origin.refuse(&key, problem))?;
            }
            merged.insert(key.clone(), value);
            origins.insert(key, origin);
        }
    }
    for (name, text) in env {
        if !is_setting_name(&name) {
            continue;
        }
        let key = name.to_ascii_lowercase();
        let Some(default) = defaults.get(&key) else {
            continue;
        };
        if text.is_empty() {
            continue;
        }
        merged.insert(key.clone(), typed(&name, &text, default)?);
        origins.insert(key, Origin::Env { name, text });
    }
    let merged = Value::Object(merged);
    T::deserialize(&merged).map_err(|whole| {
        // Name the culprit: the first setting that, alone on top of the defaults, is refused.
        for (key, origin) in &origins {
            let mut alone = defaults.clone();
            alone.insert(key.clone(), merged[key].clone());
            if let Err(e) = T::deserialize(&Value::Object(alone)) {
                return origin.refuse(key, e.to_string());
            }
        }
        ConfigError::Invalid(whole.to_string())
    })
}

/// Where a setting's value came from.
enum Origin {
    File(String),
    Env { name: String, text: String },
}

impl Origin {
    /// The error for the value of `key` from here.
    fn refuse(&self, key: &str, problem: String) -> ConfigError {
        match self {
            Origin::File(path) => ConfigError::File {
                path: path.clone(),
                problem: format!("`{key}` ({}): {problem}", key.to_ascii_uppercase()),
            },
            Origin::Env { name, text } => ConfigError::Env {
                name: name.clone(),
                value: text.clone(),
                problem,
            },
        }
    }
}

/// The TOML file's top-level keys as JSON values.
fn read_file(path: &str) -> Result<Map<String, Value>, ConfigError> {
    let refuse = |problem: String| ConfigError::File {
        path: path.to_owned(),
        problem,
    };
    let text = std::fs::read_to_string(path).map_err(|e| refuse(e.to_string()))?;
    config::Config::builder()
        .add_source(config::File::from_str(&text, config::FileFormat::Toml))
        .build()
        .and_then(config::Config::try_deserialize::<Map<String, Value>>)
        .map_err(|e| refuse(one_line(&e.to_string())))
}

/// `message` on one line: a TOML parse error quotes the offending line (`2 | b = = 2`) and marks
/// the column below it (`|     ^`); keep the position and the reason.
fn one_line(message: &str) -> String {
    let quoted = |line: &str| {
        line.trim_start_matches(|c: char| c.is_ascii_digit())
            .trim_start()
            .starts_with('|')
    };
    message
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !quoted(line))
        .collect::<Vec<_>>()
        .join(": ")
}

/// Whether a setting whose default is `default` is a duration.
fn is_duration(default: &str) -> bool {
    humantime::parse_duration(default).is_ok()
}

/// `text` as a setting's duration.
fn duration(text: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(text).map_err(|_| duration_problem())?;
    if d > MAX_DURATION {
        return Err("longer than the most a duration setting accepts (100 years)".to_owned());
    }
    Ok(d)
}

fn duration_problem() -> String {
    "expected a duration with a unit, such as `30s`, `500ms` or `2h`".to_owned()
}

/// `text` as the JSON type of `default`.
fn typed(name: &str, text: &str, default: &Value) -> Result<Value, ConfigError> {
    let refuse = |problem: &str| ConfigError::Env {
        name: name.to_owned(),
        value: text.to_owned(),
        problem: problem.to_owned(),
    };
    match default {
        Value::Bool(_) => match text.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(Value::Bool(true)),
            "false" | "0" | "no" | "off" => Ok(Value::Bool(false)),
            _ => Err(refuse("expected true or false")),
        },
        Value::Number(n) => {
            let t = text.trim();
            if n.is_f64() {
                t.parse::<f64>()
                    .ok()
                    .and_then(serde_json::Number::from_f64)
                    .map(Value::Number)
                    .ok_or_else(|| refuse("expected a number"))
            } else if let Ok(i) = t.parse::<u64>() {
                Ok(Value::from(i))
            } else if let Ok(i) = t.parse::<i64>() {
                Ok(Value::from(i))
            } else {
                Err(refuse("expected a whole number"))
            }
        }
        Value::String(d) if is_duration(d) => match duration(text) {
            Ok(_) => Ok(Value::String(text.to_owned())),
            Err(problem) => Err(refuse(&problem)),
        },
        _ => Ok(Value::String(text.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// Shaped like the services' configurations: flat keys, part of them in a flattened struct
    /// (which rules out `deny_unknown_fields`).
    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(default)]
    struct Sample {
        database_url: String,
        fairness_free_limit: u32,
        fairness_enabled: bool,
        label: String,
        #[serde(flatten)]
        inner: Inner,
    }

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(default)]
    struct Inner {
        quota_free_limit: u32,
        #[serde(with = "humantime_serde")]
        ratelimit_deadline: Duration,
        version: String,
    }

    impl Default for Sample {
        fn default() -> Self {
            Sample {
                database_url: "postgres://default".into(),
                fairness_free_limit: 1,
                fairness_enabled: true,
                label: "x".into(),
                inner: Inner::default(),
            }
        }
    }

    impl Default for Inner {
        fn default() -> Self {
            Inner {
                quota_free_limit: 50,
                ratelimit_deadline: Duration::from_millis(20),
                version: "0.1.0".into(),
            }
        }
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// A TOML file with `text` in a fresh folder, removed when dropped.
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new(label: &str, text: &str) -> TempFile {
            static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!(
                "fairlane-config-{label}-{}-{n}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            let file = dir.join("c.toml");
            std::fs::write(&file, text).unwrap();
            TempFile(file)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            if let Some(dir) = self.0.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }

    fn env_error(pairs: &[(&str, &str)]) -> String {
        load_from::<Sample, _>(None, env(pairs))
            .unwrap_err()
            .to_string()
    }

    fn file_error(text: &str) -> (String, String) {
        let file = TempFile::new("bad", text);
        let err = load_from::<Sample, _>(Some(file.path()), env(&[]))
            .unwrap_err()
            .to_string();
        (err, file.path().display().to_string())
    }

    #[test]
    fn postgres_durations_are_whole_milliseconds_within_what_postgresql_holds() {
        assert_eq!(postgres_millis(Duration::ZERO), "1ms");
        assert_eq!(postgres_millis(Duration::from_millis(1500)), "1500ms");
        assert_eq!(postgres_millis(MAX_DURATION), "2147483647ms");
    }

    #[test]
    fn a_setting_that_is_not_utf8_is_refused_by_name_and_others_are_ignored() {
        use std::os::unix::ffi::OsStringExt as _;
        let bad = || std::ffi::OsString::from_vec(vec![b'a', 0xff]);
        let unrelated = vec![
            (std::ffi::OsString::from("SOMETHING_ELSE"), bad()),
            (std::ffi::OsString::from_vec(vec![0xff]), "x".into()),
            ("LABEL".into(), "kept".into()),
        ];
        let env = unicode_env::<Sample>(unrelated).unwrap();
        assert_eq!(env, [("LABEL".to_owned(), "kept".to_owned())]);
        let err = unicode_env::<Sample>(vec![("LABEL".into(), bad())]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "environment variable LABEL is not valid UTF-8"
        );
    }

    #[test]
    fn settings_are_read_from_upper_case_names_only() {
        let s: Sample = load_from(None, env(&[("label", "lower"), ("LABEL", "upper")])).unwrap();
        assert_eq!(s.label, "upper");
        let s: Sample = load_from(None, env(&[("LABEL", "upper"), ("label", "lower")])).unwrap();
        assert_eq!(s.label, "upper");
    }

    #[test]
    fn defaults_apply_without_file_or_env() {
        let s: Sample = load_from(None, env(&[("PATH", "/bin")])).unwrap();
        assert_eq!(s, Sample::default());
    }

    #[test]
    fn env_overrides_file_overrides_defaults() {
        let file = TempFile::new(
            "layers",
            "fairness_free_limit = 2\nlabel = \"from-file\"\ndatabase_url = \"postgres://file\"\n\
             ratelimit_deadline = \"1s\"\nquota_free_limit = 9\n",
        );
        let s: Sample = load_from(
            Some(file.path()),
            env(&[
                ("DATABASE_URL", "postgres://env"),
                ("FAIRNESS_ENABLED", "false"),
                ("LABEL", "12345"),
                ("QUOTA_FREE_LIMIT", ""),
                ("RATELIMIT_DEADLINE", "250ms"),
            ]),
        )
        .unwrap();
        assert_eq!(s.database_url, "postgres://env");
        assert_eq!(s.fairness_free_limit, 2);
        assert!(!s.fairness_enabled);
        assert_eq!(s.label, "12345", "numeric-looking env values stay strings");
        assert_eq!(s.inner.quota_free_limit, 9, "an empty variable is unset");
        assert_eq!(s.inner.ratelimit_deadline, Duration::from_millis(250));
        let s: Sample =
            load_from(None, env(&[("LABEL", "0123"), ("FAIRNESS_ENABLED", "0")])).unwrap();
        assert_eq!(
            s.label, "0123",
            "text is taken verbatim, leading zeros and all"
        );
        assert!(!s.fairness_enabled);
    }

    #[test]
    fn bad_values_and_files_are_reported() {
        let err = env_error(&[("FAIRNESS_FREE_LIMIT", "lots")]);
        assert!(
            err.contains("FAIRNESS_FREE_LIMIT") && err.contains("whole number"),
            "{err}"
        );
        let err = env_error(&[("FAIRNESS_ENABLED", "maybe")]);
        assert!(
            err.contains("FAIRNESS_ENABLED") && err.contains("true or false"),
            "{err}"
        );

        let missing = Path::new("/nonexistent/fairlane.toml");
        let err = load_from::<Sample, _>(Some(missing), env(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/fairlane.toml"), "{err}");
    }

    #[test]
    fn a_value_its_type_refuses_names_the_variable() {
        // Refused by the field's type, not by the loader's parsing: a negative count, in a
        // flattened struct.
        let err = env_error(&[("QUOTA_FREE_LIMIT", "-3"), ("LABEL", "fine")]);
        assert_eq!(
            err,
            "environment variable QUOTA_FREE_LIMIT=\"-3\": invalid value: integer `-3`, expected u32"
        );
        let err = env_error(&[("FAIRNESS_FREE_LIMIT", "5000000000")]);
        assert!(
            err.starts_with("environment variable FAIRNESS_FREE_LIMIT="),
            "{err}"
        );

        let (err, path) = file_error("label = \"ok\"\nquota_free_limit = -3\n");
        assert_eq!(
            err,
            format!(
                "config file {path}: `quota_free_limit` (QUOTA_FREE_LIMIT): invalid value: integer `-3`, expected u32"
            )
        );
        let (err, path) = file_error("fairness_enabled = \"sometimes\"\n");
        assert!(
            err.starts_with(&format!(
                "config file {path}: `fairness_enabled` (FAIRNESS_ENABLED): "
            )),
            "{err}"
        );
    }

    #[test]
    fn a_duration_needs_a_unit_and_a_sane_size() {
        let err = env_error(&[("RATELIMIT_DEADLINE", "30")]);
        assert_eq!(
            err,
            "environment variable RATELIMIT_DEADLINE=\"30\": expected a duration with a unit, such as `30s`, `500ms` or `2h`"
        );
        let err = env_error(&[("RATELIMIT_DEADLINE", "18446744073709551615s")]);
        assert!(
            err.starts_with("environment variable RATELIMIT_DEADLINE=")
                && err.contains("100 years"),
            "{err}"
        );
        let err = env_error(&[("RATELIMIT_DEADLINE", "99999999999999999999999s")]);
        assert!(
            err.contains("RATELIMIT_DEADLINE") && err.contains("`30s`"),
            "{err}"
        );
        let (err, path) = file_error("ratelimit_deadline = 30\n");
        assert_eq!(
            err,
            format!(
                "config file {path}: `ratelimit_deadline` (RATELIMIT_DEADLINE): expected a duration with a unit, such as `30s`, `500ms` or `2h`"
            )
        );
        // A text setting whose default merely looks like a version is not a duration.
        let s: Sample = load_from(None, env(&[("VERSION", "2")])).unwrap();
        assert_eq!(s.inner.version, "2");
        let s: Sample = load_from(None, env(&[("RATELIMIT_DEADLINE", "36500days")])).unwrap();
        assert_eq!(s.inner.ratelimit_deadline, MAX_DURATION);
    }

    #[test]
    fn unknown_keys_in_file_are_refused() {
        let (err, path) = file_error("fairnes_free_limit = 2\n");
        assert_eq!(
            err,
            format!(
                "config file {path}: unknown setting `fairnes_free_limit` (settings are the environment variables' names in lower case)"
            )
        );
        // Keys of the flattened struct are known; a table is not a setting.
        let file = TempFile::new("known", "quota_free_limit = 3\n");
        let s: Sample = load_from(Some(file.path()), env(&[])).unwrap();
        assert_eq!(s.inner.quota_free_limit, 3);
        let (err, _) = file_error("[inner]\nquota_free_limit = 3\n");
        assert!(err.contains("unknown setting `inner`"), "{err}");
    }

    #[test]
    fn a_file_that_does_not_parse_is_one_line_and_says_why_once() {
        let (err, path) = file_error("label = \"x\"\nfairness_free_limit = = 2\n");
        assert_eq!(
            err,
            format!(
                "config file {path}: TOML parse error at line 2, column 23: extra `=`, expected nothing"
            )
        );
        let missing =
            load_from::<Sample, _>(Some(Path::new("/nonexistent/f.toml")), env(&[])).unwrap_err();
        let chain = anyhow_like(&missing);
        assert_eq!(
            chain.matches("No such file or directory").count(),
            1,
            "{chain}"
        );
    }

    /// The error with its sources, as `anyhow`'s `{:#}` prints it.
    fn anyhow_like(e: &(dyn std::error::Error + 'static)) -> String {
        let mut out = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            out.push_str(": ");
            out.push_str(&s.to_string());
            source = s.source();
        }
        out
    }
}
