// Command billing is the example `make demo` runs: an order service, a billing
// service that charges a payment provider over HTTP, and a notification
// service, in one process on PostgreSQL and a Kafka-protocol broker, with
// redeliveries, concurrent duplicates, a lost provider response and
// malformed events injected. It prints a summary table and exits non-zero if
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
	cfg := demoConfig{DatabaseURL: databaseURL(), Brokers: kafkatest.External(), Progress: os.Stdout}
	flag.IntVar(&cfg.Orders, "orders", 1000, "orders to confirm (phase 1)")
	flag.IntVar(&cfg.RedeliverEvery, "redeliver-every", 5, "publish every n-th order's event twice (0: never)")
	flag.IntVar(&cfg.ConcurrentDuplicates, "concurrent", 10, "phase 2 orders whose event is also published on every partition at once")
	flag.IntVar(&cfg.LostResponses, "lost", 3, "orders whose provider response is lost after the charge")
	flag.DurationVar(&cfg.ProviderLatency, "provider-latency", 20*time.Millisecond, "time a charge takes at the provider")
	flag.IntVar(&cfg.BillingInFlight, "billing-in-flight", 16, "charges in flight per billing instance (the parallel subscriber's MaxInFlight)")
	verbose := flag.Bool("v", false, "log Watermill and library messages (debug)")
	flag.Parse()
	if *verbose {
		cfg.Logger = watermill.NewStdLogger(true, false)
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
