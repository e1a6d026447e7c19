# syntax=docker/dockerfile:1
# One image for every Fairlane service: web, analyzer-worker, specgen-worker, scheduler.
# Pick one with the command (`web serve`, `web migrate`, `analyzer-worker`, …); see
# docker-compose.yml and deploy/k8s.
#
# Stages: `planner` reduces the workspace to its dependency recipe, `builder` compiles the
# dependencies from that recipe alone (a layer that stays cached until Cargo.lock or a manifest
# changes), then the workspace; `runtime` is Debian slim with git (the analyzer fetches
# repositories), CA certificates, curl (health checks) and tini, running as an unprivileged user.
# tini is PID 1: the analyzer kills runaway git processes on its caps, and something must reap
# them (and forward SIGTERM) in a container.

ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS chef
RUN cargo install cargo-chef --locked --version 0.1.78
WORKDIR /src

FROM chef AS planner
COPY Cargo.toml Cargo.lock ./
COPY crates crates
RUN cargo chef prepare --recipe-path recipe.json

FROM chef AS builder
COPY --from=planner /src/recipe.json recipe.json
RUN cargo chef cook --release --locked --recipe-path recipe.json \
      --package web --package analyzer-worker --package specgen-worker --package scheduler
COPY Cargo.toml Cargo.lock ./
COPY crates crates
COPY migrations migrations
RUN cargo build --release --locked --bins \
      --package web --package analyzer-worker --package specgen-worker --package scheduler

FROM debian:${DEBIAN_RELEASE}-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates git curl tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 fairlane \
 && useradd --system --uid 10001 --gid fairlane --home-dir /app --shell /usr/sbin/nologin fairlane
WORKDIR /app
COPY --from=builder /src/target/release/web /src/target/release/analyzer-worker \
     /src/target/release/specgen-worker /src/target/release/scheduler /usr/local/bin/
# The default RATELIMIT_RULES path (deploy/ratelimit/rules.yaml, relative to /app).
COPY deploy/ratelimit/rules.yaml deploy/ratelimit/rules.yaml
USER 10001:10001
ENV LOG_FORMAT=json RUST_LOG=info
EXPOSE 8080 9091 9092 9093
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["web", "serve"]
