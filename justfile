# Shortcuts for the usual commands. Each recipe is one plain cargo / xtask / tool call, so
# everything works without `just` too: copy the line.

# List the recipes.
default:
    @just --list

# The whole system on this machine (private PostgreSQL when DATABASE_URL is unset); Ctrl-C stops it.
dev:
    cargo xtask dev

# Every check and test against real PostgreSQL and Redis (what CI runs).
test *ARGS:
    cargo xtask test {{ARGS}}

# A benchmark suite (`cargo xtask bench --help` lists them).
bench SUITE="queue":
    cargo xtask bench {{SUITE}}

# Clippy on the whole workspace, warnings as errors.
lint:
    cargo clippy --workspace --all-targets -- -D warnings

# Format every crate.
fmt:
    cargo fmt --all

# Apply the database migrations to DATABASE_URL.
migrate:
    cargo run --quiet --bin web -- migrate

# The full stack in containers (needs a Docker engine).
compose-up:
    docker compose up --build

# Render a Kubernetes overlay (dev or prod).
k8s-render OVERLAY="dev":
    kubectl kustomize deploy/k8s/overlays/{{OVERLAY}}

# Regenerate the per-queue Grafana dashboards from their template.
dashboards:
    cargo xtask dashboards
