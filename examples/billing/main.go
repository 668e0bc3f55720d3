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
	b, nt := r.Billing, r.Notification
	row("", "billing", "notification")
	row("events (orders confirmed)", r.Orders, r.Orders)
	row("records on orders.confirmed (+injected duplicates, +malformed)", r.OnTopic, r.OnTopic)
	row("deliveries (into the dedup middleware, all attempts)", b.Deliveries, nt.Deliveries)
	row("processed (handler committed)", b.Processed, nt.Processed)
	row("duplicates skipped (claim found)", b.Skipped, nt.Skipped)
	row("of which injected by the demo", r.Injected(), r.Injected())
	if n := r.Resent(); n > 0 {
		row("of which sent twice by the outbox forwarder", n, n)
	}
	row("of which redelivered by Kafka: skipped - injected", kafkaSkipped(r, b), kafkaSkipped(r, nt))
	row("of which met the first copy in flight", b.InFlightSkipped, nt.InFlightSkipped)
	row("rejected (permanent error, to the poison topic)", b.Rejected, nt.Rejected)
	row("failed (rolled back, nacked, delivered again)", b.Failed, nt.Failed)
	row("deliveries = processed + skipped + rejected + failed", sums(b), sums(nt))
	row("processed_event rows", b.Claims, nt.Claims)
	row("poisoned records / distinct messages", fmt.Sprintf("%d / %d", b.Poisoned, b.PoisonedEvents), fmt.Sprintf("%d / %d", nt.Poisoned, nt.PoisonedEvents))
	row("ledger rows / notifications", r.LedgerRows, r.Notifications)
	row("provider charges", r.Provider.Charges, "-")
	row("provider: requests, replayed, 409, 422", fmt.Sprintf("%d, %d, %d, %d", r.Provider.Requests, r.Provider.Replayed, r.Provider.InFlight, r.Provider.Mismatched), "-")
	row("provider responses lost after charging", r.Provider.Dropped, "-")
	row("billing.charged.v1 (outbox rows / on Kafka)", fmt.Sprintf("%d / %d", r.ChargedOutbox, r.ChargedConsumed), "-")
	_ = tw.Flush()
	fmt.Fprintf(w, "\ninjected: %d copies published again, %d concurrent copies, %d malformed events, %d lost responses; outbox forwarded %d messages, then pruned %d rows\n",
		r.Republished, r.ConcurrentSent, r.Malformed, r.LostResponses, r.Forwarded, r.OutboxPruned)
	if n := r.Resent(); n > 0 {
		fmt.Fprintf(w, "the outbox forwarder sent %d records twice (a failed position commit resends its batch)\n", n)
	}
	fmt.Fprintf(w, "Kafka delivered %d (billing) and %d (notification) records again after they had been acked or poisoned, as consumers joined and left the groups: each was skipped by its claim (or poisoned again)\n",
		b.KafkaRedelivered, nt.KafkaRedelivered)
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

// kafkaSkipped is the number of duplicates the demo did not put on the
// topic: records Kafka delivered again.
func kafkaSkipped(r *Report, g GroupReport) int64 {
	return int64(g.Skipped) - int64(r.Injected()+r.Resent())
}

// sums shows the deliveries equation of one group.
func sums(g GroupReport) string {
	if g.Deliveries == g.Added() {
		return fmt.Sprintf("%d = %d", g.Deliveries, g.Added())
	}
	return fmt.Sprintf("%d != %d", g.Deliveries, g.Added())
}

// DefaultDatabaseURL is used when DATABASE_URL is not set.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

func databaseURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return DefaultDatabaseURL
}
