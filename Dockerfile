# The broker as a container: `docker build -t delegation-broker .`, then
# README, "Running it in production". scripts/docker-test.sh builds and
# checks it. Plain Dockerfile syntax (no BuildKit-only features), so the
# legacy builder builds it too.

# --- build ------------------------------------------------------------------
# glibc (not musl): a2a-pb's build script runs a vendored protoc binary.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /build

# `release` (no debug info) or `profiling` (line tables, for perf).
ARG PROFILE=release
# What `delegation-broker version` and broker_build_info report: the
# context has no .git, so the builder passes them, e.g.
#   --build-arg BROKER_BUILD_COMMIT=$(git rev-parse --short=12 HEAD)
#   --build-arg BROKER_BUILD_DATE=$(git log -1 --format=%cI)
# ("unknown" otherwise). build.rs reads them from the environment.
ARG BROKER_BUILD_COMMIT=unknown
ARG BROKER_BUILD_DATE=unknown

# The workspace: the root package, its crates, and what they read at
# compile time: proto/ (crates/wire's build.rs), the migrations
# (crates/store, sqlx::migrate! embeds them) and console/dist/ (the
# console's page, include_bytes!). benches/ is there because Cargo.toml
# declares its benches ([[bench]]): cargo refuses a manifest whose
# declared targets have no file; fuzz/'s manifest and sources because the
# workspace lists it (a member whose files are missing fails every cargo
# command). .cargo/config.toml selects
# curve25519-dalek's AVX-512 backend (x86_64; chosen at run time).
# Tests, examples and the README are read only by tests.
COPY Cargo.toml Cargo.lock build.rs ./
COPY .cargo/ .cargo/
COPY proto/ proto/
COPY benches/ benches/
COPY crates/ crates/
COPY fuzz/Cargo.toml fuzz/Cargo.toml
COPY fuzz/src/ fuzz/src/
COPY fuzz/fuzz_targets/ fuzz/fuzz_targets/
COPY src/ src/
COPY console/dist/ console/dist/
RUN cargo build --profile "$PROFILE" --locked --bin delegation-broker \
 && install -D "target/$PROFILE/delegation-broker" /out/delegation-broker

# --- run --------------------------------------------------------------------
FROM debian:bookworm-slim

# CA roots: TLS to an OTLP collector or to the MCP/A2A gateways' upstreams.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# A fixed non-root uid, numeric in USER so Kubernetes' runAsNonRoot can
# check it. /data is created owned by it: Docker copies that ownership
# into a new named volume; a bind-mounted directory must be chown'ed to
# 10001 by hand.
RUN groupadd --system --gid 10001 broker \
 && useradd --system --uid 10001 --gid broker --home-dir /data \
        --no-create-home --shell /usr/sbin/nologin broker \
 && mkdir /data \
 && chown broker:broker /data \
 && chmod 0700 /data

COPY --from=build /out/delegation-broker /usr/local/bin/delegation-broker

USER 10001:10001
# The signing key (broker_signing_key, broker_retired_keys) and, without
# BROKER_DATABASE_URL, the SQLite database (broker.sqlite3, -wal, -shm):
# losing the volume loses the key and every contract.
# Beyond loopback the broker refuses to start without declared tenants
# ([tenants] or [orchestrators] in the file BROKER_CONFIG names), unless
# BROKER_ALLOW_OPEN_TENANT=true says every caller may share one tenant.
ENV BROKER_DATA_DIR=/data \
    BROKER_LISTEN=0.0.0.0:50051
WORKDIR /data
VOLUME ["/data"]

# gRPC; metrics only with BROKER_METRICS=0.0.0.0:9464 (off by default).
EXPOSE 50051 9464

# SIGTERM drains in-flight calls ([limits] shutdown_drain_ms, 10 s by
# default): give `docker stop` more than its default 10 s
# (docker run --stop-timeout 20).
STOPSIGNAL SIGTERM

# The binary is its own gRPC health probe (`health` exits 0 while the
# broker serves; BROKER_ADDR, and BROKER_CA_FILE with [tls], say where).
# Kubernetes can probe gRPC natively instead (grpc: {port: 50051}).
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
  CMD ["delegation-broker", "health"]
ENTRYPOINT ["delegation-broker"]
CMD ["serve"]
