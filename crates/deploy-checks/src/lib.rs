//! Checks of what Fairlane ships for running it (`deploy/`, `Dockerfile`, `docker-compose.yml`):
//! the per-queue Grafana dashboards generated from one template ([`dashboards`]) and the PromQL
//! name extraction ([`promql`]) the dashboard check uses. The checks themselves are this crate's
//! integration tests; they run the real tools (Prometheus, kubectl kustomize, schema validators).

pub mod dashboards;
pub mod promql;

/// The service binaries the checks build and start, each a package of the same name whose
/// Prometheus scrape job (deploy/prometheus/prometheus.yml) has that name too. A new service is
/// one line here.
pub const SERVICE_PACKAGES: &[&str] = &["web", "analyzer-worker", "specgen-worker", "scheduler"];
