#!/usr/bin/env bash
# Starts and stops a throwaway PostgreSQL server for the test suite.
#
#   scripts/pg.sh start DIR      initdb a new cluster in DIR/data (DIR: an
#                                empty directory the caller made, e.g. with
#                                mktemp -d), start it on a free port of
#                                127.0.0.1, wait until it accepts connections
#                                and print exactly one line on stdout:
#         export BROKER_TEST_POSTGRES_URL=postgres://broker@127.0.0.1:PORT/postgres
#                                use it as  env="$(scripts/pg.sh start "$dir")"
#                                then eval "$env" (a bare eval "$(...)" would
#                                hide a failed start from set -e)
#   scripts/pg.sh stop DIR       stop it (-m immediate) and remove DIR; safe to
#                                call twice, and after a failed start
#   scripts/pg.sh restart DIR    stop it (-m fast) and start it again on the
#                                same port, waiting until it is ready
#   scripts/pg.sh ctl DIR ARGS   pg_ctl -D DIR/data ARGS as the server's user
#                                (the port and the other settings are in the
#                                cluster's configuration, so a bare
#                                "ctl DIR start -w -l DIR/log" reuses them)
#
# Why: the tests never touch a database they did not create. Each test
# creates its own database on this server, which exists only for the run
# (superuser broker, no password: trust authentication, TCP on 127.0.0.1
# only, Unix socket in DIR, not /var/run/postgresql) and is deleted with
# everything in it by stop.
#
# Binaries: the newest /usr/lib/postgresql/*/bin, else initdb on PATH; when
# there are none, installs the Debian package postgresql (apt-get, through
# sudo when not root). initdb refuses to run as root, so as root the server
# runs as the postgres user (created by the package), else as a system user
# broker-pg created here, and DIR belongs to that user. Only the export line
# goes to stdout; every diagnostic goes to stderr.
set -euo pipefail

readonly MARKER=.broker-pg # written first by start; stop removes only such dirs
readonly SETTINGS=(
    -c listen_addresses=127.0.0.1
    -c max_connections=400 # several broker processes, each with a pool
    -c shared_buffers=128MB
    -c fsync=on
    -c synchronous_commit=on
)

log() { printf 'pg.sh: %s\n' "$*" >&2; }
die() {
    log "$*"
    exit 1
}
usage() {
    echo "usage: scripts/pg.sh start|stop|restart DIR | scripts/pg.sh ctl DIR PG_CTL_ARGS..." >&2
    exit 2
}

dir=""      # absolute path of DIR
run_user="" # user the server runs as when we are root; empty: run directly
bindir=""   # directory of initdb, pg_ctl and postgres
isready=""  # path of pg_isready

# True when $1 holds the server binaries and a pg_isready is reachable.
usable_bindir() {
    local d=$1 b
    for b in initdb pg_ctl postgres; do
        [[ -x $d/$b ]] || return 1
    done
    [[ -x $d/pg_isready ]] || command -v pg_isready >/dev/null
}

# Sets bindir and isready, or returns 1.
find_binaries() {
    local candidates=() d p
    # Newest major version first (sort -V: 9.6 < 10 < 15 < 16).
    while IFS= read -r d; do
        [[ -n $d ]] && candidates+=("$d")
    done < <(printf '%s\n' /usr/lib/postgresql/*/bin | sort -rV)
    # On PATH: resolve symlinks (/usr/local/bin/initdb -> .../15/bin/initdb)
    # so that pg_ctl and postgres come from initdb's own directory.
    if p=$(command -v initdb 2>/dev/null); then
        candidates+=("$(dirname "$(readlink -f "$p")")" "$(dirname "$p")")
    fi
    for d in "${candidates[@]}"; do
        if usable_bindir "$d"; then
            bindir=$d
            if [[ -x $d/pg_isready ]]; then
                isready=$d/pg_isready
            else
                isready=$(command -v pg_isready)
            fi
            return 0
        fi
    done
    return 1
}

install_postgres() {
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get)
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null || die "PostgreSQL is not installed and there is no sudo to install it"
        apt=(sudo "${apt[@]}")
    fi
    log "PostgreSQL server binaries not found; installing the Debian package postgresql"
    if ! "${apt[@]}" install -y --no-install-recommends postgresql >&2; then
        "${apt[@]}" update >&2
        "${apt[@]}" install -y --no-install-recommends postgresql >&2
    fi
}

# Runs "$@" as run_user (or directly), from inside DIR: pg_ctl and initdb
# look up their own path from the working directory and fail when they
# cannot read it (e.g. /root as the postgres user).
as_user() {
    (
        cd "$dir"
        if [[ -z $run_user ]]; then
            exec "$@"
        elif command -v runuser >/dev/null; then
            exec runuser -u "$run_user" -- "$@"
        else
            exec su -s /bin/sh "$run_user" -c "$(printf '%q ' "$@")"
        fi
    )
}

# Sets dir from $1: an existing directory, absolute, with no character that
# a shell word or a Unix socket path (at most 107 bytes) would trip over.
set_dir() {
    [[ -n ${1:-} ]] || usage
    [[ -d $1 ]] || die "$1 is not a directory"
    dir=$(cd "$1" && pwd -P)
    [[ $dir =~ ^/[A-Za-z0-9._/-]+$ ]] || die "$dir: use a directory path of letters, digits and ._/- only"
    [[ $dir != / ]] || die "refusing to use /"
    ((${#dir} <= 90)) || die "$dir: too long for a Unix socket path"
}

# For a cluster that start made: sets run_user, bindir and isready.
load_cluster() {
    if [[ $(id -u) -eq 0 && -d $dir/data ]]; then
        run_user=$(stat -c %U "$dir/data")
        [[ $run_user != root ]] || run_user=""
    fi
    if [[ -f $dir/bindir ]]; then
        bindir=$(<"$dir/bindir")
        isready=$(<"$dir/isready")
    fi
}

running() {
    [[ -f $dir/data/postmaster.pid ]] && as_user "$bindir/pg_ctl" -D "$dir/data" status >/dev/null 2>&1
}

# Starts the cluster on port $1 (pg_ctl -w waits until it is up or gone).
# The settings are passed on the command line and also written to
# DIR/data/broker.conf, included by postgresql.conf, for "ctl DIR start".
start_server() {
    local port=$1 a conf=""
    for a in "${SETTINGS[@]}"; do
        [[ $a == -c ]] || conf+="${a%%=*} = '${a#*=}'"$'\n'
    done
    printf "port = %s\nunix_socket_directories = '%s'\n%s" "$port" "$dir" "$conf" |
        as_user tee "$dir/data/broker.conf" >/dev/null
    as_user "$bindir/pg_ctl" -D "$dir/data" -l "$dir/log" -w -t 60 start \
        -o "-p $port -k $dir ${SETTINGS[*]}" >&2
}

# Waits (at most 30 s) until the server on port $1 accepts connections.
wait_ready() {
    local port=$1 i
    for ((i = 0; i < 60; i++)); do
        if "$isready" -q -h 127.0.0.1 -p "$port" -U broker -d postgres -t 1; then
            return 0
        fi
        sleep 0.5
    done
    log "the server on port $port is not ready after 30 s; its log ($dir/log):"
    cat "$dir/log" >&2 || true
    return 1
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null ||
        echo $((20000 + RANDOM % 40000))
}

cmd_start() {
    set_dir "${1:-}"
    [[ -z $(ls -A "$dir") ]] || die "$dir is not empty"
    : >"$dir/$MARKER"

    if ! find_binaries; then
        install_postgres
        find_binaries || die "no PostgreSQL server binaries even after installing the package"
    fi
    log "using $bindir ($("$bindir/postgres" --version))"
    printf '%s\n' "$bindir" >"$dir/bindir"
    printf '%s\n' "$isready" >"$dir/isready"

    if [[ $(id -u) -eq 0 ]]; then
        if id -u postgres >/dev/null 2>&1; then
            run_user=postgres
        else
            run_user=broker-pg
            if ! id -u "$run_user" >/dev/null 2>&1; then
                log "creating the system user $run_user (initdb refuses to run as root)"
                useradd --system --no-create-home --shell /usr/sbin/nologin "$run_user" ||
                    id -u "$run_user" >/dev/null 2>&1 # another start may have created it
            fi
        fi
        chown "$run_user:" "$dir"
        as_user test -w "$dir" -a -x "$dir" ||
            die "user $run_user cannot write to $dir (is a parent directory closed to it?); use a directory under /tmp"
    fi

    as_user "$bindir/initdb" -D "$dir/data" -U broker --auth=trust -E UTF8 --locale=C >&2
    echo "include_if_exists = 'broker.conf'" | as_user tee -a "$dir/data/postgresql.conf" >/dev/null

    # Another process may take the free port between free_port and the
    # server's bind: retry with a new one when the log says so.
    local attempt port offset
    for ((attempt = 1; ; attempt++)); do
        port=$(free_port)
        offset=$(wc -c 2>/dev/null <"$dir/log" || echo 0)
        if start_server "$port"; then
            break
        fi
        if ((attempt < 5)) &&
            tail -c "+$((offset + 1))" "$dir/log" 2>/dev/null | grep -q -e 'could not bind' -e 'Address already in use'; then
            log "port $port was taken; retrying with another"
            continue
        fi
        log "the server did not start; its log ($dir/log):"
        cat "$dir/log" >&2 || true
        exit 1
    done
    printf '%s\n' "$port" >"$dir/port"
    wait_ready "$port"
    log "PostgreSQL is up on 127.0.0.1:$port (data in $dir/data, log in $dir/log)"
    echo "export BROKER_TEST_POSTGRES_URL=postgres://broker@127.0.0.1:$port/postgres"
}

cmd_stop() {
    [[ -n ${1:-} ]] || usage
    [[ -e $1 ]] || return 0 # already stopped and removed
    set_dir "$1"
    [[ -e $dir/$MARKER || -z $(ls -A "$dir") ]] ||
        die "refusing to remove $dir: scripts/pg.sh start did not make it"
    load_cluster
    if [[ -f $dir/data/postmaster.pid ]]; then
        if [[ -n $bindir ]]; then
            as_user "$bindir/pg_ctl" -D "$dir/data" -m immediate -w stop >&2 ||
                log "pg_ctl stop failed (server not running?)"
        fi
        # Still there (pg_ctl failed or is unknown): kill the postmaster,
        # if that process id is still a postgres (not a reused id).
        local pid
        pid=$(head -n 1 "$dir/data/postmaster.pid" 2>/dev/null || true)
        if [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null &&
            tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q -- "$dir/data"; then
            log "killing postmaster $pid"
            kill -KILL "$pid" || true
        fi
    fi
    rm -rf -- "$dir"
}

cmd_restart() {
    set_dir "${1:-}"
    [[ -f $dir/port ]] || die "$dir: no cluster made by scripts/pg.sh start"
    load_cluster
    local port
    port=$(<"$dir/port")
    if running; then
        as_user "$bindir/pg_ctl" -D "$dir/data" -m fast -w stop >&2
    fi
    if ! start_server "$port"; then
        log "the server did not start again; its log ($dir/log):"
        cat "$dir/log" >&2 || true
        exit 1
    fi
    wait_ready "$port"
    log "PostgreSQL restarted on 127.0.0.1:$port"
}

cmd_ctl() {
    set_dir "${1:-}"
    shift
    [[ -f $dir/bindir ]] || die "$dir: no cluster made by scripts/pg.sh start"
    load_cluster
    as_user "$bindir/pg_ctl" -D "$dir/data" "$@"
}

case "${1:-}" in
start | stop | restart)
    [[ $# -eq 2 ]] || usage
    "cmd_$1" "$2"
    ;;
ctl)
    [[ $# -ge 3 ]] || usage
    shift
    cmd_ctl "$@"
    ;;
*) usage ;;
esac
