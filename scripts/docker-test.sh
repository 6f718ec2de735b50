#!/usr/bin/env bash
# Builds the Docker image (Dockerfile) and checks that it works as
# deployed: `serve` as PID 1, as a non-root user, its key and SQLite
# database created in the /data volume, a clean exit on `docker stop`
# within the stop timeout, and the same key after a new container takes
# over the volume. Prints the image's size.
#
# Without Docker (no `docker` on PATH, or no daemon answering `docker
# info`) it prints "docker-test: skipped: <reason>" and exits 0;
# DOCKER_TEST_REQUIRED=1 makes that a failure (a CI machine that has
# Docker). DOCKER_TEST_IMAGE names the image (delegation-broker:test).
# The containers and the volume are removed on exit; the image is kept.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

readonly IMAGE="${DOCKER_TEST_IMAGE:-delegation-broker:test}"
# Above [limits] shutdown_drain_ms (10 s by default): docker stop's own
# default, 10 s, would leave the drain no margin.
readonly STOP_TIMEOUT=20
readonly START_TIMEOUT=60

say() { echo "docker-test: $*"; }
fail() {
    echo "docker-test: FAILED: $*" >&2
    exit 1
}
skip() {
    if [[ "${DOCKER_TEST_REQUIRED:-0}" == 1 ]]; then
        fail "$1 (and DOCKER_TEST_REQUIRED=1)"
    fi
    say "skipped: $1"
    exit 0
}

command -v docker >/dev/null 2>&1 || skip "docker is not on PATH"
# A daemon that does not answer must not hang the run.
bounded() {
    if command -v timeout >/dev/null 2>&1; then timeout 30 "$@"; else "$@"; fi
}
if ! info_err="$(bounded docker info 2>&1 >/dev/null)"; then
    reason="$(printf '%s\n' "$info_err" | grep -v '^[[:space:]]*$' | tail -n 1 || true)"
    skip "no Docker daemon (docker info: ${reason:-failed})"
fi

suffix="$$-$RANDOM"
first="delegation-broker-test-$suffix"
second="delegation-broker-test-$suffix-2"
volume="delegation-broker-test-$suffix"
cleanup() {
    docker rm -f "$first" "$second" >/dev/null 2>&1 || true
    docker volume rm -f "$volume" >/dev/null 2>&1 || true
}
trap cleanup EXIT
trap 'exit 130' INT # exit, so that the EXIT trap cleans up
trap 'exit 143' TERM

say "docker build -t $IMAGE ."
docker build -t "$IMAGE" \
    --build-arg "BROKER_BUILD_COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)" \
    --build-arg "BROKER_BUILD_DATE=$(TZ=UTC git log -1 --format=%cd --date=iso-strict-local 2>/dev/null || echo unknown)" \
    .

# Fails, with the container's output, unless it is still running.
running() {
    local state
    state="$(docker inspect -f '{{.State.Running}} {{.State.ExitCode}}' "$1")"
    if [[ "$state" != "true "* ]]; then
        docker logs "$1" >&2 || true
        fail "container $1 is not running (running, exit status: $state)"
    fi
}

# Waits for the "listening on ADDR" line the broker prints on stdout, then
# for the key and the database it creates in /data after binding.
wait_serving() {
    local container="$1" deadline=$((SECONDS + START_TIMEOUT))
    until docker logs "$container" 2>/dev/null | grep -q '^listening on '; do
        running "$container"
        ((SECONDS < deadline)) || fail "$container: no 'listening on' line in ${START_TIMEOUT} s"
        sleep 1
    done
    until docker exec "$container" test -s /data/broker_signing_key -a -e /data/broker.sqlite3; do
        running "$container"
        ((SECONDS < deadline)) || fail "$container: no key and database in /data in ${START_TIMEOUT} s"
        sleep 1
    done
    running "$container"
    say "$container: $(docker logs "$container" 2>/dev/null | grep -m 1 '^listening on ')"
}

key_digest() {
    docker exec "$1" sha256sum /data/broker_signing_key | cut -d ' ' -f 1
}

docker volume create "$volume" >/dev/null
docker run -d --name "$first" -e BROKER_ALLOW_OPEN_TENANT=true -v "$volume:/data" --stop-timeout "$STOP_TIMEOUT" "$IMAGE" >/dev/null
wait_serving "$first"

# PID 1 is the broker, as `serve` (ENTRYPOINT and CMD), and not root.
cmdline="$(docker exec "$first" cat /proc/1/cmdline | tr '\0' ' ')"
[[ "$cmdline" == "delegation-broker serve "* ]] || fail "PID 1 is '$cmdline', not 'delegation-broker serve'"
uid="$(docker exec "$first" cat /proc/1/status | awk '/^Uid:/ { print $2 }')"
[[ -n "$uid" && "$uid" != 0 ]] || fail "the broker runs as uid '$uid'"
say "the broker runs as uid $uid"
digest="$(key_digest "$first")"

# SIGTERM: drained and exited 0 before docker stop's SIGKILL (exit 137).
started=$SECONDS
docker stop -t "$STOP_TIMEOUT" "$first" >/dev/null
took=$((SECONDS - started))
status="$(docker inspect -f '{{.State.ExitCode}}' "$first")"
[[ "$status" == 0 ]] || {
    docker logs "$first" >&2 || true
    fail "exit status $status after docker stop (137: killed after ${STOP_TIMEOUT} s)"
}
((took < STOP_TIMEOUT)) || fail "docker stop took ${took} s (timeout ${STOP_TIMEOUT} s)"
say "docker stop: exit status 0 in ${took} s"

# A new container on the same volume (an upgrade) keeps the broker's key.
docker run -d --name "$second" -e BROKER_ALLOW_OPEN_TENANT=true -v "$volume:/data" --stop-timeout "$STOP_TIMEOUT" "$IMAGE" >/dev/null
wait_serving "$second"
[[ "$(key_digest "$second")" == "$digest" ]] || fail "the signing key changed across containers"
say "the volume kept the signing key across containers"

size="$(docker image inspect -f '{{.Size}}' "$IMAGE")"
say "image $IMAGE: $(awk -v b="$size" 'BEGIN { printf "%.1f MB", b / 1e6 }')"
say "ok"
