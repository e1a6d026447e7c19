//! Integration tests of the inventory crate against real git repositories in temporary folders
//! (no network: fixtures are fetched over `file://` with the policy allowing it).

// This whole crate is test code; its helpers panic on setup failures by design.
#![allow(clippy::unwrap_used)]

mod caps;
mod fixture_scan;
mod resolve;
mod spec_golden;
mod support;
mod url_dns;
mod walk;
