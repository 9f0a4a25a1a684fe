# The two commands a newcomer needs: `make demo` and `make test`.
GO ?= go

.PHONY: demo test build redis prometheus chromium bench bench-peer

demo:
	$(GO) run ./cmd/tokengate demo

# bin/tokengate, stamped with the commit it was built from (tokengate version).
build:
	$(GO) build -buildvcs=auto -o bin/tokengate ./cmd/tokengate

# Runs every test with the race detector, and every benchmark once so none can rot.
# The Redis and Redis Cluster tests start their own redis-server processes; the
# dashboard test its own Prometheus; the budget page's test a headless Chromium.
test: redis prometheus chromium
	$(GO) test -race -count=1 -timeout 25m -bench . -benchtime 1x ./...

# Debian's redis-server, prometheus and chromium are the outside programs the tests need.
redis:
	@command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || { \
	  echo "installing redis-server"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }

prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "installing prometheus"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; }

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

# tokengate next to envoyproxy/ratelimit on one redis-server, rounds
# interleaved, and the table of their ratios (bench/peer-ratelimit/README.md):
#   make bench-peer RATELIMIT_BIN=<ratelimit binary> RATELIMIT_COMMIT=<its commit>
# with its knobs in the environment (N, CONC, ROUNDS, SYSTEMS, TG_BUCKET_EXTRA...).
bench-peer: redis
	@test -n "$(RATELIMIT_BIN)" || { echo "make bench-peer: set RATELIMIT_BIN to a ratelimit binary (go build ./src/service_cmd in a checkout of github.com/envoyproxy/ratelimit)"; exit 2; }
	RATELIMIT_BIN="$(RATELIMIT_BIN)" bench/peer-ratelimit/run.sh
