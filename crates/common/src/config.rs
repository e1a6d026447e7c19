//! Layered configuration for every binary: built-in defaults < optional config file < environment.
//!
//! Settings are flat structs whose field names are the lower-case form of the environment variable
//! that sets them (`FAIRNESS_FREE_LIMIT` sets `fairness_free_limit`), so the names in SPEC, the
//! config file and the Kubernetes manifests are one and the same. Durations are humantime strings
//! (`30s`, `1h`).

use std::path::Path;

use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Map, Value};

/// A configuration that could not be assembled, naming where the bad value came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {source}")]
    File {
        path: String,
        #[source]
        source: config::ConfigError,
    },
    #[error("environment variable {name}={value:?}: {problem}")]
    Env {
        name: String,
        value: String,
        problem: String,
    },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Loads `T`: its `Default` first, then the TOML file at `file` (if given; it must exist), then
/// environment variables. Unknown environment variables are ignored; unknown keys in the file are
/// refused when `T` says `#[serde(deny_unknown_fields)]`.
pub fn load<T>(file: Option<&Path>) -> Result<T, ConfigError>
where
    T: Default + Serialize + DeserializeOwned,
{
    load_from(file, std::env::vars())
}

/// [`load`] with an explicit environment, for tests and for tools that build child environments.
///
/// An environment value takes the JSON type of the field's default: numbers and booleans are
/// parsed (and refused with a message naming the variable when they do not parse); everything
/// else — strings, durations such as `30s`, optional settings — is kept as the exact text, so a
/// token like `0123` stays `0123`.
pub fn load_from<T, I>(file: Option<&Path>, env: I) -> Result<T, ConfigError>
where
    T: Default + Serialize + DeserializeOwned,
    I: IntoIterator<Item = (String, String)>,
{
    let defaults =
        serde_json::to_value(T::default()).map_err(|e| ConfigError::Invalid(e.to_string()))?;
    let Value::Object(mut merged) = defaults else {
        return Err(ConfigError::Invalid(
            "a configuration must be a struct".into(),
        ));
    };
    let types = merged.clone();
    if let Some(path) = file {
        for (key, value) in read_file(path)? {
            merged.insert(key, value);
        }
    }
    for (name, text) in env {
        let key = name.to_ascii_lowercase();
        let Some(default) = types.get(&key) else {
            continue;
        };
        if text.is_empty() {
            continue;
        }
        merged.insert(key, typed(&name, &text, default)?);
    }
    serde_json::from_value(Value::Object(merged)).map_err(|e| ConfigError::Invalid(e.to_string()))
}

/// The TOML file's top-level keys as JSON values.
fn read_file(path: &Path) -> Result<Map<String, Value>, ConfigError> {
    let display = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: display.clone(),
        source: config::ConfigError::Foreign(Box::new(e)),
    })?;
    config::Config::builder()
        .add_source(config::File::from_str(&text, config::FileFormat::Toml))
        .build()
        .and_then(config::Config::try_deserialize::<Map<String, Value>>)
        .map_err(|source| ConfigError::File {
            path: display,
            source,
        })
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
        _ => Ok(Value::String(text.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(default, deny_unknown_fields)]
    struct Sample {
        database_url: String,
        fairness_free_limit: u32,
        fairness_enabled: bool,
        label: String,
    }

    impl Default for Sample {
        fn default() -> Self {
            Sample {
                database_url: "postgres://default".into(),
                fairness_free_limit: 1,
                fairness_enabled: true,
                label: "x".into(),
            }
        }
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn defaults_apply_without_file_or_env() {
        let s: Sample = load_from(None, env(&[("PATH", "/bin")])).unwrap();
        assert_eq!(s, Sample::default());
    }

    #[test]
    fn env_overrides_file_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("fairlane-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(
            &file,
            "fairness_free_limit = 2\nlabel = \"from-file\"\ndatabase_url = \"postgres://file\"\n",
        )
        .unwrap();
        let s: Sample = load_from(
            Some(&file),
            env(&[
                ("DATABASE_URL", "postgres://env"),
                ("FAIRNESS_ENABLED", "false"),
                ("LABEL", "12345"),
            ]),
        )
        .unwrap();
        assert_eq!(s.database_url, "postgres://env");
        assert_eq!(s.fairness_free_limit, 2);
        assert!(!s.fairness_enabled);
        assert_eq!(s.label, "12345", "numeric-looking env values stay strings");
        let s: Sample =
            load_from(None, env(&[("LABEL", "0123"), ("FAIRNESS_ENABLED", "0")])).unwrap();
        assert_eq!(
            s.label, "0123",
            "text is taken verbatim, leading zeros and all"
        );
        assert!(!s.fairness_enabled);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bad_values_and_files_are_reported() {
        let err = load_from::<Sample, _>(None, env(&[("FAIRNESS_FREE_LIMIT", "lots")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("FAIRNESS_FREE_LIMIT") && err.contains("whole number"),
            "{err}"
        );
        let err = load_from::<Sample, _>(None, env(&[("FAIRNESS_ENABLED", "maybe")]))
            .unwrap_err()
            .to_string();
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
    fn unknown_keys_in_file_are_refused() {
        let dir = std::env::temp_dir().join(format!("fairlane-config-u-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(&file, "fairnes_free_limit = 2\n").unwrap();
        let err = load_from::<Sample, _>(Some(&file), env(&[]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("fairnes_free_limit"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
