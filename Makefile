# The two commands a newcomer needs: `make demo` and `make test`.
GO ?= go

.PHONY: demo test build redis prometheus chromium bench

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
