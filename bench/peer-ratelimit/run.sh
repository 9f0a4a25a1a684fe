#!/usr/bin/env bash
# Side-by-side load comparison, in one run on this machine, of
#   (a) envoyproxy/ratelimit  (gRPC RateLimitService/ShouldRateLimit, Redis
#       backend, descriptor hits_addend = a token count, as Envoy AI Gateway
#       uses it), and
#   (b) tokengate             (Envoy ext_proc server, Redis token buckets,
#       reserve at request time, settle at response end),
# both on one redis-server, all on 127.0.0.1. See README.md.
#
#   RATELIMIT_BIN=/path/to/ratelimit bench/peer-ratelimit/run.sh   (or: make bench-peer)
#
# Nothing is fetched: RATELIMIT_BIN is a ratelimit service binary you built
# (go build ./src/service_cmd in its checkout); it is needed only when SYSTEMS
# names rl1 or rl2. tokengate is TOKENGATE_BIN, or built from TOKENGATE_SRC
# (default: the current directory) into the temporary folder; the driver is
# built from ./driver. Both builds use the usual Go caches.
#
# Environment (defaults): N=20000 decisions per system, level and round;
# WARMUP=2000; CONC=1,16,64; ROUNDS=3; CONNS=2 (gRPC connections per system);
# USERS=1000; HITS=500; SYSTEMS=rl1,rl2,tg (and bare: the same ext_proc exchange
# with a server that answers every message at once, the protocol's floor);
# OUT_DIR=$TMPDIR/peer-ratelimit-results;
# REDIS_SERVER=redis-server; RATELIMIT_COMMIT (recorded in the results; the
# binary carries no VCS stamp when built by go build ./src/service_cmd);
# TG_BUCKET_EXTRA (one more YAML line for tokengate's user bucket, e.g. "lease: auto");
# TG_REDIS_EXTRA (one more YAML line for tokengate's store.redis, e.g. "settle_window: 10ms");
# TG_EXTRA_CONFIG (top-level YAML appended to tokengate's config, e.g. its RLS mapping for
# domain ai-gateway, descriptor key user); systems tr1,tr2 send the rl1/rl2 shapes to
# tokengate's RateLimitService at TGRLS_ADDR (default: tokengate's gRPC listener);
# RL_STATS=statsd|stdout|off (ratelimit's stats:
# statsd = USE_STATSD=true to a loopback TCP port the driver drains, as Envoy
# Gateway deploys it beside a statsd-exporter sidecar; stdout = USE_STATSD=false,
# which makes ratelimit's gostats logging sink write a line per timer sample to
# stdout, here a log file; off = DISABLE_STATS=true); KEEP_TMP=1 keeps the temporary folder (configs,
# server logs). Results: OUT_DIR/run-<time>.txt (table) and .jsonl (raw).
# Every process this script starts is stopped by its PID at exit.
set -u -o pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TOKENGATE_SRC=${TOKENGATE_SRC:-$PWD}
REDIS_SERVER=${REDIS_SERVER:-redis-server}
N=${N:-20000} WARMUP=${WARMUP:-2000} CONC=${CONC:-1,16,64} ROUNDS=${ROUNDS:-3}
CONNS=${CONNS:-2} USERS=${USERS:-1000} HITS=${HITS:-500} SYSTEMS=${SYSTEMS:-rl1,rl2,tg}
RL_STATS=${RL_STATS:-statsd}
OUT_DIR=${OUT_DIR:-${TMPDIR:-/tmp}/peer-ratelimit-results}

die() { echo "run.sh: $*" >&2; exit 2; }
case ",$SYSTEMS," in
*,rl1,* | *,rl2,*) PEER=1 ;;
*) PEER=0 ;;
esac
if [ "$PEER" = 1 ]; then
	[ -n "${RATELIMIT_BIN:-}" ] || die "set RATELIMIT_BIN to the ratelimit service binary (SYSTEMS=$SYSTEMS measures it)"
	[ -x "$RATELIMIT_BIN" ] || die "RATELIMIT_BIN=$RATELIMIT_BIN is not an executable"
fi
command -v "$REDIS_SERVER" >/dev/null || die "$REDIS_SERVER not found"
command -v curl >/dev/null || die "curl not found"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/peer-ratelimit.XXXXXX") || die "mktemp failed"
PIDS=()
cleanup() {
	local p i
	for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
	for p in "${PIDS[@]}"; do
		for i in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$p" 2>/dev/null
		wait "$p" 2>/dev/null
	done
	if [ "${KEEP_TMP:-0}" = 1 ]; then echo "run.sh: kept $TMP" >&2; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

echo "== building"
(cd "$here/driver" && go build -o "$TMP/peerdriver" .) || die "driver build failed"
if [ -n "${TOKENGATE_BIN:-}" ]; then
	cp "$TOKENGATE_BIN" "$TMP/tokengate" || die "cannot copy TOKENGATE_BIN"
else
	(cd "$TOKENGATE_SRC" && go build -mod=readonly -o "$TMP/tokengate" ./cmd/tokengate) || die "tokengate build failed"
fi

read -r P_REDIS P_RL_GRPC P_RL_HTTP P_RL_DEBUG P_TG_GRPC P_TG_ADMIN P_STATSD P_BARE < <("$TMP/peerdriver" -freeports 8 | tr '\n' ' ')
[ -n "$P_BARE" ] || die "no free ports"
case "$RL_STATS" in
statsd)
	if [ "$PEER" = 1 ]; then
		"$TMP/peerdriver" -statsd-sink "127.0.0.1:$P_STATSD" &
		PIDS+=($!)
	fi
	RL_STATS_ENV=(USE_STATSD=true STATSD_HOST=127.0.0.1 STATSD_PORT="$P_STATSD") ;;
stdout) RL_STATS_ENV=(USE_STATSD=false) ;;
off) RL_STATS_ENV=(USE_STATSD=false DISABLE_STATS=true) ;;
*) die "RL_STATS must be statsd, stdout or off" ;;
esac

echo "== redis-server on 127.0.0.1:$P_REDIS"
"$REDIS_SERVER" --port "$P_REDIS" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
	--logfile "$TMP/redis.log" &
PIDS+=($!); REDIS_PID=$!
for i in $(seq 50); do redis-cli -p "$P_REDIS" ping >/dev/null 2>&1 && break; sleep 0.1; done
redis-cli -p "$P_REDIS" ping >/dev/null 2>&1 || die "redis did not start"

RL_PID=0
if [ "$PEER" = 1 ]; then
	echo "== ratelimit on 127.0.0.1:$P_RL_GRPC"
	mkdir -p "$TMP/runtime/ratelimit/config"
	cat >"$TMP/runtime/ratelimit/config/config.yaml" <<EOF
# One domain, one descriptor per user: a token budget per minute that never bites.
domain: ai-gateway
descriptors:
  - key: user
    rate_limit:
      unit: minute
      requests_per_unit: 4000000000
EOF
	env -i PATH="$PATH" HOME="${HOME:-/tmp}" \
		HOST=127.0.0.1 PORT="$P_RL_HTTP" GRPC_HOST=127.0.0.1 GRPC_PORT="$P_RL_GRPC" \
		DEBUG_HOST=127.0.0.1 DEBUG_PORT="$P_RL_DEBUG" \
		REDIS_SOCKET_TYPE=tcp REDIS_URL="127.0.0.1:$P_REDIS" \
		"${RL_STATS_ENV[@]}" LOG_LEVEL=warn \
		RUNTIME_ROOT="$TMP/runtime" RUNTIME_SUBDIRECTORY=ratelimit RUNTIME_APPDIRECTORY=config \
		RUNTIME_WATCH_ROOT=false RUNTIME_IGNOREDOTFILES=true \
		"$RATELIMIT_BIN" >"$TMP/ratelimit.log" 2>&1 &
	PIDS+=($!); RL_PID=$!
fi

BARE_PID=0
case ",$SYSTEMS," in
*,bare,*)
	echo "== bare ext_proc server on 127.0.0.1:$P_BARE"
	"$TMP/peerdriver" -bare-server "127.0.0.1:$P_BARE" &
	PIDS+=($!); BARE_PID=$! ;;
esac

echo "== tokengate on 127.0.0.1:$P_TG_GRPC"
cat >"$TMP/tokengate.yaml" <<EOF
listeners:
  grpc: 127.0.0.1:$P_TG_GRPC
  admin: 127.0.0.1:$P_TG_ADMIN
store:
  type: redis
  redis:
    addrs: ["127.0.0.1:$P_REDIS"]${TG_REDIS_EXTRA:+
    $TG_REDIS_EXTRA}
tokenizer:
  fallback_encoding: o200k_base
default_policy: bench
policies:
  - name: bench
    identities:
      - name: user
        header: x-user-id
    anonymous: reject
    buckets:
      - name: user
        per: user
        tokens_per_minute: 4000000000
        burst: 4000000000${TG_BUCKET_EXTRA:+
        $TG_BUCKET_EXTRA}
${TG_EXTRA_CONFIG:-}
EOF
"$TMP/tokengate" validate "$TMP/tokengate.yaml" || die "tokengate config invalid"
"$TMP/tokengate" serve --config "$TMP/tokengate.yaml" >"$TMP/tokengate.log" 2>&1 &
PIDS+=($!); TG_PID=$!

rl_healthy() { [ "$PEER" = 0 ] || curl -sf "http://127.0.0.1:$P_RL_HTTP/healthcheck" >/dev/null 2>&1; }
for i in $(seq 100); do
	rl_healthy && curl -sf "http://127.0.0.1:$P_TG_ADMIN/readyz" >/dev/null 2>&1 && break
	sleep 0.2
done
rl_healthy || { cat "$TMP/ratelimit.log" >&2; die "ratelimit not healthy"; }
curl -sf "http://127.0.0.1:$P_TG_ADMIN/readyz" >/dev/null || { cat "$TMP/tokengate.log" >&2; die "tokengate not ready"; }

# binfo BIN: Go version, VCS stamp (if any) and the dependencies that matter here.
binfo() {
	go version -m "$1" | awk '
		NR==1 {printf "%s ", $2}
		$1=="build" && $2 ~ /^vcs\.(revision|modified)=/ {printf "%s ", $2}
		$1=="dep" && ($2 ~ /go-control-plane\/envoy$/ || $2=="google.golang.org/grpc" || $2 ~ /radix|go-redis/) {printf "%s %s ", $2, $3}'
}
if [ -z "${TOKENGATE_BIN:-}" ] && [ -z "${TOKENGATE_COMMIT:-}" ]; then
	TOKENGATE_COMMIT="commit $(git -C "$TOKENGATE_SRC" rev-parse HEAD 2>/dev/null)$(git -C "$TOKENGATE_SRC" status --porcelain 2>/dev/null | grep -q . && echo ' (dirty)')"
fi

mkdir -p "$OUT_DIR"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
txt="$OUT_DIR/run-$stamp.txt"
{
	echo "# peer-ratelimit run $stamp"
	echo "host: $(nproc) CPUs, $(uname -sr), load $(cut -d' ' -f1-3 /proc/loadavg)"
	echo "go: $(go version)"
	echo "redis: $("$REDIS_SERVER" --version)"
	[ "$PEER" = 0 ] || echo "ratelimit: ${RATELIMIT_COMMIT:-commit unknown (set RATELIMIT_COMMIT)}; $(binfo "$RATELIMIT_BIN")"
	echo "tokengate: ${TOKENGATE_COMMIT:-commit unknown}; $(binfo "$TMP/tokengate")"
	echo "settings: N=$N WARMUP=$WARMUP CONC=$CONC ROUNDS=$ROUNDS CONNS=$CONNS USERS=$USERS HITS=$HITS SYSTEMS=$SYSTEMS RL_STATS=$RL_STATS"
	echo
} | tee "$txt"

t_start=$(date +%s)
"$TMP/peerdriver" -rls "127.0.0.1:$P_RL_GRPC" -rls-pid "$RL_PID" \
	-tg "127.0.0.1:$P_TG_GRPC" -tg-pid "$TG_PID" -redis "127.0.0.1:$P_REDIS" \
	-tgrls "${TGRLS_ADDR:-127.0.0.1:$P_TG_GRPC}" -tgrls-pid "$TG_PID" \
	-bare "127.0.0.1:$P_BARE" -bare-pid "$BARE_PID" \
	-n "$N" -warmup "$WARMUP" -conc "$CONC" -rounds "$ROUNDS" -conns "$CONNS" \
	-users "$USERS" -hits "$HITS" -systems "$SYSTEMS" -out "$OUT_DIR/run-$stamp.jsonl" 2>&1 | tee -a "$txt"
rc=${PIPESTATUS[0]}
echo "driver wall time: $(( $(date +%s) - t_start )) s" | tee -a "$txt"

{
	echo
	echo "redis after the run: $(redis-cli -p "$P_REDIS" dbsize) keys, $(redis-cli -p "$P_REDIS" info memory | grep '^used_memory_human' | tr -d '\r')"
	echo "redis keys by prefix (sample of 2000): $(redis-cli -p "$P_REDIS" --scan 2>/dev/null | head -2000 | sed -E 's/^([^:{]*[:{]?[^:{]*).*/\1/' | sort | uniq -c | sort -rn | head -5 | tr -s ' ' | tr '\n' ';')"
	[ "$PEER" = 0 ] || echo "ratelimit log lines: $(wc -l <"$TMP/ratelimit.log")"
	echo "tokengate log lines: $(wc -l <"$TMP/tokengate.log")"
	echo "tokengate decisions: $(curl -s "http://127.0.0.1:$P_TG_ADMIN/metrics" | grep '^tokengate_requests_total' | tr '\n' ' ')"
} | tee -a "$txt"
exit "$rc"
