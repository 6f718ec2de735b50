# Sourced by the clients' test scripts: a real broker to run an example
# against.
#
# start_attested_broker DIR: starts "$BROKER_BIN serve" on 127.0.0.1:0
# with its data in DIR, trusting a fresh attestor whose seed is
# DIR/attestor.seed; sets broker_pid and address (HOST:PORT), or exits 1
# with what the broker printed.
start_attested_broker() {
    local dir=$1 attestor_pub
    mkdir -p "$dir"
    attestor_pub="$("$BROKER_BIN" keygen --out "$dir/attestor.seed")"
    printf '[trust]\nattestors = ["%s"]\n' "$attestor_pub" >"$dir/broker.toml"
    BROKER_LOG="${BROKER_LOG:-warn}" "$BROKER_BIN" serve --listen 127.0.0.1:0 --data-dir "$dir/data" \
        --config "$dir/broker.toml" >"$dir/stdout" 2>"$dir/log" </dev/null &
    broker_pid=$!
    address=""
    for _ in $(seq 300); do  # up to 30 s for its first line, "listening on ADDR"
        if [[ "$(wc -l <"$dir/stdout")" -ge 1 ]]; then
            address="$(sed -n '1s/^listening on //p' "$dir/stdout")"
            break
        fi
        kill -0 "$broker_pid" 2>/dev/null || break
        sleep 0.1
    done
    if [[ -z "$address" ]]; then
        echo "the broker did not print 'listening on ADDR'; stdout: $(head -c 500 "$dir/stdout"); log:" >&2
        cat "$dir/log" >&2
        exit 1
    fi
}
