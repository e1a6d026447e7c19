//! Rebuilds the crate when a migration is added or edited, so the embedded set is never stale.

fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
