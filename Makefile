# watermill-idempotency: effectively-once Watermill consumers on Kafka + PostgreSQL.
# Tests and the demo need PostgreSQL (DATABASE_URL, default postgres://postgres@127.0.0.1:5432/test)
# and run their own in-process Kafka-protocol broker unless KAFKA_BROKERS is set.

GO            ?= go
STATICCHECK   := honnef.co/go/tools/cmd/staticcheck@v0.7.0
# The suite's PostgreSQL connection budget (docs/testing.md, "Connection budget"): packages tested
# at once (-p), tests run at once within a package (-parallel), and the client
# connections all of it may hold at once, checked against max_connections first.
TEST_P        ?= 2
TEST_PARALLEL ?= 2
TEST_CONNS    ?= 60
TEST_FLAGS    ?= -race -count=1 -timeout 30m -p $(TEST_P) -parallel $(TEST_PARALLEL)
BENCHTIME     ?= 500ms
VERSION       ?= v0.1.0
# The repository's modules: go.work lists them, the library first; a new module
# is one line there. ./... stops at a nested module's go.mod, so PKGS names
# each module's tree: ./... ./examples/billing/... and so on.
MODULES       := $(shell $(GO) list -m -f '{{.Dir}}')
# The longest test packages first: go test starts packages in the order listed
# (a package named twice runs once), so the soak's sequential runs (~7.5 min)
# overlap the rest instead of running alone at the end.
SLOW_PKGS     := ./tests/soak ./idemkafka/parallel ./cmd/idemctl ./tests/failover
PKGS          := $(SLOW_PKGS) $(patsubst $(CURDIR)%,.%/...,$(MODULES))

.DEFAULT_GOAL := help

.PHONY: help
help: ## Show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_\/-]+:.*## / {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: test
test: test/pg ## Run every test (real Postgres + in-process Kafka broker), with -race
	@command -v chromium >/dev/null 2>&1 || [ -n "$$CHROME_PATH" ] || echo "make test: idemctl serve's browser tests skip: no chromium (apt-get install -y chromium, or set CHROME_PATH)"
	@command -v promtool >/dev/null 2>&1 || echo "make test: the alert rules' promtool checks skip: no promtool (apt-get install -y prometheus)"
	$(GO) test $(TEST_FLAGS) $(PKGS)

.PHONY: test/short
test/short: test/pg ## Run the fast tests only (-short), without -race
	$(GO) test -short -count=1 -p $(TEST_P) -parallel $(TEST_PARALLEL) $(PKGS)

.PHONY: test/unit
test/unit: ## Only the tests that need neither PostgreSQL nor a Kafka broker (the others skip): seconds, on a bare machine
	IDEM_UNIT=1 $(GO) test -count=1 -run '^(Test|Fuzz)' $(PKGS)

.PHONY: test/pg
test/pg: ## Check that PostgreSQL (DATABASE_URL) is reachable and accepts the suite's TEST_CONNS connections
	@$(GO) run ./internal/testkit/cmd/pgbudget -budget $(TEST_CONNS)

.PHONY: lint
lint: mod/check ## gofmt, go vet, staticcheck, tidy go.mod files, gorelease (the API against the last release)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) run $(STATICCHECK) $(PKGS)
	$(MAKE) --no-print-directory release/api

.PHONY: mod/check
mod/check: ## Every module's go.mod and go.sum are tidy, and the library's go.mod has no replace directive
	@for d in $(MODULES); do (cd "$$d" && GOWORK=off $(GO) mod tidy -diff) || { echo "go.mod/go.sum of $$d not tidy: cd $$d && GOWORK=off go mod tidy"; exit 1; }; done
	@if grep -q '^replace\|^\s*replace' go.mod; then echo "go.mod: a replace directive breaks go install and users' builds"; exit 1; fi

.PHONY: mod/tidy
mod/tidy: ## go mod tidy in every module of go.work
	@for d in $(MODULES); do echo "tidy $$d"; (cd "$$d" && GOWORK=off $(GO) mod tidy) || exit 1; done

.PHONY: release/check
release/check: ## As a user gets v0.1.0: a module proxy from the working tree, go install cmd/idemctl@v0.1.0, the quickstart in a module of its own (no chromedp)
	$(GO) run ./tests/release -version $(VERSION)

.PHONY: release/api
release/api: ## gorelease on HEAD: the version the API changes need since the last release (v0.1.0 before the first)
	$(GO) run ./tests/release -api

.PHONY: bench
bench: ## Benchmarks as ratios against same-run baselines; writes docs/benchmarks.md
	$(GO) run ./cmd/bench -out docs/benchmarks.md -json docs/benchmarks.json

# The hot-path sections bench/compare runs unless SECTIONS names others
# (comma-separated -only filters; SECTIONS= with nothing runs every section).
SECTIONS ?= dedup-overhead,duplicate-path,group-commit-ceiling,parallel,lease
COMPARE_ROUNDS ?= 3

.PHONY: bench/compare
bench/compare: ## Head vs BASE=<ref>: both built once, alternated round by round over SECTIONS (COMPARE_ROUNDS=3), head/base per cell
	@test -n "$(BASE)" || { echo "usage: make bench/compare BASE=<ref> [SECTIONS=lease,parallel] [COMPARE_ROUNDS=3]"; exit 2; }
	$(GO) run ./cmd/bench -compare $(BASE) -only "$(SECTIONS)" -compare-rounds $(COMPARE_ROUNDS)

.PHONY: bench/short
bench/short: ## A quick benchmark pass (CI smoke), prints the table only
	$(GO) run ./cmd/bench -short

.PHONY: bench/go
bench/go: ## Go benchmarks (testing.B) of the per-message hot path: ns/op, allocs, round trips (BENCHTIME=500ms)
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) $(PKGS)

.PHONY: schemas
schemas: ## Rewrite docs/schemas (JSON Schema of the example's event contracts) from the Go structs; make test checks they are current
	$(GO) test ./examples/billing -run '^TestSchemasAreCurrent$$' -count=1 -args -update-schemas

.PHONY: rules
rules: ## Check and unit-test the Prometheus alert rules in deploy/prometheus (promtool: apt-get install -y prometheus)
	cd deploy/prometheus && promtool check rules alerts.yml && promtool test rules alerts_test.yml

.PHONY: screenshots
screenshots: ## Rewrite docs/console-*.png (the idemctl serve pages, in headless chromium) from the browser tests
	$(GO) test ./tests/browser -run '^(TestBrowserOverviewMatchesTheDatabase|TestBrowserFailuresExplorer|TestBrowserHistoryCharts)$$' -count=1 -args -update-screenshots

.PHONY: demo
demo: ## Run the billing example end to end (orders, billing with Idempotency-Key, notifications) with injected faults
	$(GO) run ./examples/billing

.PHONY: soak
soak: ## Long chaos soak: 20,000 events, consumer processes SIGKILLed, database outages, every fault type; one transaction per message, then group commit; on watermill-kafka's subscriber, then on idemkafka's parallel one (cooperative-sticky, with a hot key, a failing key and PartitionWindow 16); then lease mode on the parallel one (kills between the phases); then soak/franz and soak/failover; each run bounded by 25 min
	$(GO) run ./cmd/soak $(SOAK_FLAGS)
	$(GO) run ./cmd/soak -group-commit $(SOAK_FLAGS)
	$(GO) run ./cmd/soak -parallel $(SOAK_FLAGS)
	$(GO) run ./cmd/soak -parallel -group-commit $(SOAK_FLAGS)
	$(GO) run ./cmd/soak -parallel -lease $(SOAK_FLAGS)
	$(MAKE) --no-print-directory soak/franz
	$(MAKE) --no-print-directory soak/failover

.PHONY: soak/franz
soak/franz: ## The soak's legs on idemkafka/franz (franz-go) alone: KIP-848 consumer groups with kills and rolling restarts, with dynamic members, then static ones (InstanceID); a KIP-932 share group with kills (no order checked; the delivery count drives the poison queue); each bounded by 25 min (SOAK_FLAGS=-short: 2,000 events)
	$(GO) run ./cmd/soak -engine franz -group-protocol consumer $(SOAK_FLAGS)
	$(GO) run ./cmd/soak -engine franz -group-protocol consumer -static $(SOAK_FLAGS)
	$(GO) run ./cmd/soak -share $(SOAK_FLAGS)

.PHONY: soak/failover
soak/failover: ## The soak's full mix plus a failover to an asynchronous standby (throwaway clusters; skipped without the PostgreSQL server programs), failing events through the retry topics included; watermill-kafka's subscriber (the operator's rewind, then -subscriber-progress), then the parallel one, then the franz one (KIP-848)
	$(GO) run ./cmd/soak -faults failover=1 $(SOAK_FLAGS)
	$(GO) run ./cmd/soak -subscriber-progress -faults failover=1 $(SOAK_FLAGS)
	$(GO) run ./cmd/soak -parallel -faults failover=1 $(SOAK_FLAGS)
	$(GO) run ./cmd/soak -engine franz -faults failover=1 $(SOAK_FLAGS)

.PHONY: db/reset
db/reset: ## Drop the test schemas left behind by interrupted test runs
	psql "$${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}" -v ON_ERROR_STOP=1 -qAt \
	  -c "SELECT 'DROP SCHEMA ' || quote_ident(nspname) || ' CASCADE;' FROM pg_namespace WHERE nspname LIKE 't\_%'" \
	  | psql "$${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}" -v ON_ERROR_STOP=1 -q

.PHONY: api
api: ## Count the exported API surface
	@$(GO) run ./internal/testkit/cmd/apisurface -check
