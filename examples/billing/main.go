// Command billing is the example `make demo` runs: an order service, a billing
// service that charges a payment provider over HTTP, and a notification
// service, on PostgreSQL and a Kafka-protocol broker, with redeliveries,
// concurrent duplicates, a lost provider response, a provider slowdown, a
// billing process killed between its call and its completion, a lease taken
// over from a frozen owner and malformed events injected. Billing runs the
// dedup middleware in lease mode; the demo re-executes itself for the
// billing processes it kills. It prints a summary table and exits non-zero if
// any order was charged, booked or notified other than exactly once.
//
//	go run ./examples/billing [-orders 1000] [-v]
//
// DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test) names the
// PostgreSQL server; the demo uses a fresh schema and drops it at the end.
// KAFKA_BROKERS (comma separated) selects a real Kafka cluster; without it an
// in-process Kafka-protocol broker (kfake) is started.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

func main() {
	runChildIfSet() // a billing process the demo started (phase 3)
	cfg := demoConfig{DatabaseURL: databaseURL(), Brokers: kafkatest.External(), Progress: os.Stdout, CrashAndTakeover: true}
	flag.IntVar(&cfg.Orders, "orders", 1000, "orders to confirm (phase 1)")
	flag.IntVar(&cfg.RedeliverEvery, "redeliver-every", 5, "publish every n-th order's event twice (0: never)")
	flag.IntVar(&cfg.ConcurrentDuplicates, "concurrent", 10, "phase 4: orders whose event is also published on every partition at once")
	flag.IntVar(&cfg.LostResponses, "lost", 3, "orders whose provider response is lost after the charge")
	flag.DurationVar(&cfg.ProviderLatency, "provider-latency", 20*time.Millisecond, "time a charge takes at the provider")
	flag.IntVar(&cfg.BillingInFlight, "billing-in-flight", 16, "charges in flight per billing instance (the parallel subscriber's MaxInFlight)")
	flag.DurationVar(&cfg.LeaseDuration, "lease", 3*time.Second, "billing's lease duration (lease mode; renewed every third of it)")
	flag.IntVar(&cfg.SlowOrders, "slow", 48, "phase 2: orders charged during the provider slowdown, 1-2 s each (0: skip)")
	flag.DurationVar(&cfg.IdleInTxLimit, "idle-limit", 100*time.Millisecond, "phase 2: the longest a demo session may sit idle in a transaction (0: report only)")
	flag.BoolVar(&cfg.CrashAndTakeover, "crash", true, "phase 3: SIGKILL a billing process between its call and its completion, and take a frozen owner's lease over")
	verbose := flag.Bool("v", false, "log Watermill and library messages (debug)")
	flag.Parse()
	if *verbose {
		cfg.Logger = watermill.NewStdLogger(true, false)
		cfg.childVerbose = true
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rep, err := runDemo(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(2)
	}
	printReport(os.Stdout, rep)
	if len(rep.Violations) > 0 {
		os.Exit(1)
	}
}

// defaultDatabaseURL is used when DATABASE_URL is not set.
const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

func databaseURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return defaultDatabaseURL
}
