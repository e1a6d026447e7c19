//! Layered configuration for every binary: built-in defaults < optional config file < environment.
//!
//! Settings are flat structs whose field names are the lower-case form of the environment variable
//! that sets them (`FAIRNESS_FREE_LIMIT` sets `fairness_free_limit`), so the names in SPEC, the
//! config file and the Kubernetes manifests are one and the same. Durations are humantime strings
//! (`30s`, `1h`).

use std::path::Path;

use serde::{Serialize, de::DeserializeOwned};

/// A configuration that could not be assembled, naming where the bad value came from.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {source}")]
    File {
        path: String,
        #[source]
        source: config::ConfigError,
    },
    #[error("invalid configuration: {0}")]
    Invalid(#[source] config::ConfigError),
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
pub fn load_from<T, I>(file: Option<&Path>, env: I) -> Result<T, ConfigError>
where
    T: Default + Serialize + DeserializeOwned,
    I: IntoIterator<Item = (String, String)>,
{
    let defaults = config::Config::try_from(&T::default()).map_err(ConfigError::Invalid)?;
    let mut builder = config::Config::builder().add_source(defaults);
    if let Some(path) = file {
        let display = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
            path: display.clone(),
            source: config::ConfigError::Foreign(Box::new(e)),
        })?;
        let parsed = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Toml))
            .build()
            .map_err(|source| ConfigError::File {
                path: display,
                source,
            })?;
        builder = builder.add_source(parsed);
    }
    // Only variables whose lower-case name is a field of T can matter; passing the rest would let
    // an unrelated variable (say `PATH`) fail a struct that denies unknown fields.
    let known = field_names::<T>()?;
    let env_source: config::Map<String, String> = env
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .filter(|(k, v)| known.iter().any(|f| f == k) && !v.is_empty())
        .collect();
    let env = config::Environment::default()
        .source(Some(env_source))
        .try_parsing(true);
    builder
        .add_source(env)
        .build()
        .and_then(config::Config::try_deserialize)
        .map_err(ConfigError::Invalid)
}

/// The top-level field names of `T`, read off its serialized default.
fn field_names<T: Default + Serialize>() -> Result<Vec<String>, ConfigError> {
    let value = serde_json::to_value(T::default())
        .map_err(|e| ConfigError::Invalid(config::ConfigError::Foreign(Box::new(e))))?;
    Ok(value
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default())
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
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn bad_values_and_files_are_reported() {
        let err = load_from::<Sample, _>(None, env(&[("FAIRNESS_FREE_LIMIT", "lots")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("fairness_free_limit"), "{err}");

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
