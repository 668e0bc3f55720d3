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
	"io"
	"os"
	"os/signal"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/kafkatest"
)

func main() {
	cfg := DemoConfig{DatabaseURL: databaseURL(), Brokers: kafkatest.External(), Progress: os.Stdout}
	flag.IntVar(&cfg.Orders, "orders", 1000, "orders to confirm (phase 1)")
	flag.IntVar(&cfg.RedeliverEvery, "redeliver-every", 5, "publish every n-th order's event twice (0: never)")
	flag.IntVar(&cfg.ConcurrentDuplicates, "concurrent", 10, "phase 2 orders whose event is also published on every partition at once")
	flag.IntVar(&cfg.LostResponses, "lost", 3, "orders whose provider response is lost after the charge")
	flag.DurationVar(&cfg.ProviderLatency, "provider-latency", 2*time.Millisecond, "time a charge takes at the provider")
	verbose := flag.Bool("v", false, "log Watermill and library messages (debug)")
	flag.Parse()
	if *verbose {
		cfg.Logger = watermill.NewStdLogger(true, false)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rep, err := RunDemo(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo failed:", err)
		os.Exit(2)
	}
	PrintReport(os.Stdout, rep)
	if len(rep.Violations) > 0 {
		os.Exit(1)
	}
}

// PrintReport writes the summary table and the invariant verdict.
func PrintReport(w io.Writer, r *Report) {
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(label string, vals ...any) {
		fmt.Fprint(tw, label, "\t")
		for _, v := range vals {
			fmt.Fprint(tw, v, "\t")
		}
		fmt.Fprintln(tw)
	}
	row("", "billing", "notification")
	row("events (orders confirmed)", r.Orders, r.Orders)
	row("copies published (+redelivered, +concurrent, +malformed)", r.Published, r.Published)
	row("deliveries (incl. redeliveries after errors)", r.Billing.Deliveries, r.Notification.Deliveries)
	row("processed (handler committed)", r.Billing.Processed, r.Notification.Processed)
	row("duplicates skipped", r.Billing.Skipped, r.Notification.Skipped)
	row("  of which met the first copy in flight", r.Billing.InFlightSkipped, r.Notification.InFlightSkipped)
	row("failed, rolled back, redelivered", r.Billing.Failed, r.Notification.Failed)
	row("processed_event rows", r.Billing.Claims, r.Notification.Claims)
	row("poisoned messages", r.Billing.Poisoned, r.Notification.Poisoned)
	row("ledger rows / notifications", r.LedgerRows, r.Notifications)
	row("provider charges", r.Provider.Charges, "-")
	row("provider: requests, replayed, 409, 422", fmt.Sprintf("%d, %d, %d, %d", r.Provider.Requests, r.Provider.Replayed, r.Provider.InFlight, r.Provider.Mismatched), "-")
	row("provider responses lost after charging", r.Provider.Dropped, "-")
	row("billing.charged.v1 (outbox rows / on Kafka)", fmt.Sprintf("%d / %d", r.ChargedOutbox, r.ChargedConsumed), "-")
	_ = tw.Flush()
	fmt.Fprintf(w, "\ninjected: %d redelivered copies, %d concurrent copies, %d malformed events, %d lost responses; outbox forwarded %d messages, then pruned %d rows\n",
		r.Redelivered, r.ConcurrentSent, r.Malformed, r.LostResponses, r.Forwarded, r.OutboxPruned)
	if len(r.PoisonReasons) > 0 {
		fmt.Fprintln(w, "poison reasons:")
		for _, reason := range r.PoisonReasons {
			fmt.Fprintln(w, "  -", reason)
		}
	}
	if len(r.Violations) == 0 {
		fmt.Fprintf(w, "\nOK: every order charged once, booked once, notified once; every malformed event poisoned (%.1fs)\n", r.Elapsed.Seconds())
		return
	}
	fmt.Fprintf(w, "\nFAILED: %d invariant(s) broken:\n  %s\n", len(r.Violations), strings.Join(r.Violations, "\n  "))
}

// DefaultDatabaseURL is used when DATABASE_URL is not set.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

func databaseURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultDatabaseURL
}
