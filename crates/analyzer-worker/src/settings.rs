//! The analyzer's own settings (`ANALYZER_*`): which repository URLs it fetches, the caps on a
//! fetch and a scan, and where checkouts live.

use std::path::PathBuf;
use std::time::Duration;

use inventory::{Limits, UrlPolicy};
use serde::{Deserialize, Serialize};

/// How long the handler may take beyond the fetch and scan caps (database writes, DNS).
const JOB_TIMEOUT_MARGIN: Duration = Duration::from_secs(30);

/// The smallest git memory cap accepted: below it, git fails on its own start-up.
const MIN_GIT_MEMORY: u64 = 64 * 1024 * 1024;

/// The longest `ANALYZER_FETCH_TIMEOUT` and `ANALYZER_SCAN_TIMEOUT` accepted.
pub const MAX_STEP_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// Longest time resolving the default branch of a system re-analysis may take (within the fetch
/// cap).
const RESOLVE_CAP: Duration = Duration::from_secs(30);

/// `ANALYZER_*` settings, named after their environment variables.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AnalysisSettings {
    /// Fetch `file://` repositories (tests and local development only).
    pub analyzer_allow_file_urls: bool,
    /// Fetch from hosts that are or resolve to loopback, private, link-local … addresses
    /// (an internal git server; never on a shared deployment).
    pub analyzer_allow_private_hosts: bool,
    /// The ports repositories are fetched from (`443, 8443`); any other port in a repository URL
    /// is refused before anything connects (`web` reads the same variable).
    pub analyzer_allowed_ports: String,
    /// Cap on a checkout folder's size in bytes (git objects plus work tree).
    pub analyzer_max_repo_bytes: u64,
    /// Cap on the number of files in the analysed commit.
    pub analyzer_max_files: u64,
    /// Source files larger than this many bytes are not scanned for tests.
    pub analyzer_max_file_bytes: u64,
    /// Cap on each git process's address space in bytes (`RLIMIT_AS`).
    pub analyzer_max_git_memory_bytes: u64,
    /// Cap on resolving, fetching and checking out together; git is killed when it runs out.
    #[serde(with = "humantime_serde")]
    pub analyzer_fetch_timeout: Duration,
    /// Cap on scanning the checkout for tests.
    #[serde(with = "humantime_serde")]
    pub analyzer_scan_timeout: Duration,
    /// Where checkout folders are created; stale ones are swept at start. One per replica.
    pub analyzer_work_dir: PathBuf,
}

impl Default for AnalysisSettings {
    fn default() -> Self {
        let limits = Limits::default();
        AnalysisSettings {
            analyzer_allow_file_urls: false,
            analyzer_allow_private_hosts: false,
            analyzer_allowed_ports: inventory::url_policy::HTTPS_DEFAULT_PORT.to_string(),
            analyzer_max_repo_bytes: limits.max_bytes,
            analyzer_max_files: limits.max_files,
            analyzer_max_file_bytes: limits.max_file_bytes,
            analyzer_max_git_memory_bytes: limits.max_git_memory,
            analyzer_fetch_timeout: limits.total_time,
            analyzer_scan_timeout: Duration::from_secs(60),
            analyzer_work_dir: limits.work_root,
        }
    }
}

impl AnalysisSettings {
    /// Refuses settings that would make every analysis fail or never end.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("ANALYZER_MAX_REPO_BYTES", self.analyzer_max_repo_bytes),
            ("ANALYZER_MAX_FILES", self.analyzer_max_files),
            ("ANALYZER_MAX_FILE_BYTES", self.analyzer_max_file_bytes),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(format!("{name} must be greater than 0"));
            }
        }
        if self.analyzer_max_git_memory_bytes < MIN_GIT_MEMORY {
            return Err(format!(
                "ANALYZER_MAX_GIT_MEMORY_BYTES must be at least {MIN_GIT_MEMORY} (64 MiB): git cannot start with less"
            ));
        }
        for (name, value) in [
            ("ANALYZER_FETCH_TIMEOUT", self.analyzer_fetch_timeout),
            ("ANALYZER_SCAN_TIMEOUT", self.analyzer_scan_timeout),
        ] {
            if value.is_zero() {
                return Err(format!("{name} must be longer than 0s"));
            }
            if value > MAX_STEP_TIMEOUT {
                return Err(format!(
                    "{name} must be at most 1day (an analysis step that takes longer is stuck), got {value:?}"
                ));
            }
        }
        self.settings_url_policy()?;
        if !self.analyzer_work_dir.is_absolute() {
            return Err(format!(
                "ANALYZER_WORK_DIR must be an absolute path, got `{}`",
                self.analyzer_work_dir.display()
            ));
        }
        Ok(())
    }

    /// The URL policy the handler vets repositories with, right before fetching.
    pub fn url_policy(&self) -> UrlPolicy {
        // `validate` refuses settings that make no policy before the worker starts; were it
        // skipped, the production default is the narrower choice.
        self.settings_url_policy().unwrap_or_default()
    }

    /// The policy the `ANALYZER_*` URL settings describe; the error names the variable.
    fn settings_url_policy(&self) -> Result<UrlPolicy, String> {
        UrlPolicy::from_settings(
            self.analyzer_allow_file_urls,
            self.analyzer_allow_private_hosts,
            &self.analyzer_allowed_ports,
        )
    }

    /// The fetch and scan caps.
    pub fn limits(&self) -> Limits {
        Limits {
            total_time: self.analyzer_fetch_timeout,
            resolve_time: self.analyzer_fetch_timeout.min(RESOLVE_CAP),
            max_bytes: self.analyzer_max_repo_bytes,
            max_files: self.analyzer_max_files,
            max_file_bytes: self.analyzer_max_file_bytes,
            max_git_memory: self.analyzer_max_git_memory_bytes,
            work_root: self.analyzer_work_dir.clone(),
            ..Limits::default()
        }
    }

    /// The `analysis` handler's timeout: above the fetch and scan caps together, so a slow
    /// repository ends with the fetch's own clear error rather than a generic job timeout.
    pub fn job_timeout(&self) -> Duration {
        self.analyzer_fetch_timeout + self.analyzer_scan_timeout + JOB_TIMEOUT_MARGIN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn defaults_are_production_safe() {
        let s = AnalysisSettings::default();
        s.validate().unwrap();
        let policy = s.url_policy();
        assert!(!policy.allow_file_urls && !policy.allow_private_hosts);
        assert_eq!(policy.allowed_ports, [443]);
        assert_eq!(s.analyzer_max_repo_bytes, 512 * 1024 * 1024);
        assert_eq!(s.analyzer_max_files, 100_000);
        assert_eq!(s.analyzer_max_git_memory_bytes, 1024 * 1024 * 1024);
        assert_eq!(s.analyzer_fetch_timeout, Duration::from_secs(120));
        assert_eq!(s.job_timeout(), Duration::from_secs(120 + 60 + 30));
        assert!(s.job_timeout() > s.limits().total_time);
    }

    #[test]
    fn flat_environment_names_set_everything() {
        let s: AnalysisSettings = common::config::load_from(
            None,
            env(&[
                ("ANALYZER_ALLOW_FILE_URLS", "true"),
                ("ANALYZER_ALLOW_PRIVATE_HOSTS", "true"),
                ("ANALYZER_ALLOWED_PORTS", "8443, 443"),
                ("ANALYZER_MAX_REPO_BYTES", "1048576"),
                ("ANALYZER_MAX_FILES", "500"),
                ("ANALYZER_MAX_FILE_BYTES", "4096"),
                ("ANALYZER_MAX_GIT_MEMORY_BYTES", "268435456"),
                ("ANALYZER_FETCH_TIMEOUT", "5s"),
                ("ANALYZER_SCAN_TIMEOUT", "2s"),
                ("ANALYZER_WORK_DIR", "/var/lib/fairlane/checkouts"),
            ]),
        )
        .unwrap();
        s.validate().unwrap();
        let policy = s.url_policy();
        assert!(policy.allow_file_urls && policy.allow_private_hosts);
        assert_eq!(policy.allowed_ports, [443, 8443]);
        let limits = s.limits();
        assert_eq!(limits.max_bytes, 1_048_576);
        assert_eq!(limits.max_files, 500);
        assert_eq!(limits.max_file_bytes, 4096);
        assert_eq!(limits.max_git_memory, 268_435_456);
        assert_eq!(limits.total_time, Duration::from_secs(5));
        assert_eq!(limits.resolve_time, Duration::from_secs(5));
        assert_eq!(
            limits.work_root,
            PathBuf::from("/var/lib/fairlane/checkouts")
        );
        assert_eq!(s.job_timeout(), Duration::from_secs(37));
    }

    #[test]
    fn useless_values_are_refused() {
        let bad = |f: fn(&mut AnalysisSettings)| {
            let mut s = AnalysisSettings::default();
            f(&mut s);
            s.validate().unwrap_err()
        };
        assert_eq!(
            bad(|s| s.analyzer_max_files = 0),
            "ANALYZER_MAX_FILES must be greater than 0"
        );
        assert_eq!(
            bad(|s| s.analyzer_fetch_timeout = Duration::ZERO),
            "ANALYZER_FETCH_TIMEOUT must be longer than 0s"
        );
        assert!(bad(|s| s.analyzer_work_dir = "relative/dir".into()).contains("absolute"));
        assert_eq!(
            bad(|s| s.analyzer_fetch_timeout = Duration::from_secs(u64::MAX)),
            "ANALYZER_FETCH_TIMEOUT must be at most 1day (an analysis step that takes longer is stuck), got 18446744073709551615s"
        );
        assert!(
            bad(|s| s.analyzer_scan_timeout = MAX_STEP_TIMEOUT + Duration::from_secs(1))
                .starts_with("ANALYZER_SCAN_TIMEOUT must be at most 1day")
        );
        let longest = AnalysisSettings {
            analyzer_fetch_timeout: MAX_STEP_TIMEOUT,
            analyzer_scan_timeout: MAX_STEP_TIMEOUT,
            ..AnalysisSettings::default()
        };
        longest.validate().unwrap();
        assert!(longest.job_timeout() > longest.limits().total_time);
        assert_eq!(
            bad(|s| s.analyzer_max_git_memory_bytes = 64 * 1024 * 1024 - 1),
            "ANALYZER_MAX_GIT_MEMORY_BYTES must be at least 67108864 (64 MiB): git cannot start with less"
        );
        assert_eq!(
            bad(|s| s.analyzer_allowed_ports = "443,ssh".to_owned()),
            "ANALYZER_ALLOWED_PORTS: `ssh` is not a port (a number from 1 to 65535)"
        );
        assert!(bad(|s| s.analyzer_allowed_ports = String::new()).contains("no port"));
    }
}
