package idemprom_test

import (
	"fmt"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemkit/watermill-idempotency/components/idemprom"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
)

// Export the dedup middleware's counters on /metrics.
func ExampleNewCollector() {
	var pool *pgxpool.Pool // your pool
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing"}, nil)
	if err != nil {
		panic(err)
	}
	c := idemprom.NewCollector()
	c.AddDedup(dedup)
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
}

// The retry topics' counters and KeyOrder's parked keys (queried from the
// database at each scrape).
func ExampleCollector_AddParked() {
	var pool *pgxpool.Pool        // your pool
	var rt *retrytopic.RetryTopic // retrytopic.New(…, KeyOrder: …)
	c := idemprom.NewCollector()
	c.AddRetryTopic("billing", rt)
	c.AddParked(pool, retrytopic.ParkedKeysTable{}, "billing")
	prometheus.MustRegister(c)
}

// The parallel subscriber's messages in flight, keys waiting, and per
// partition the distance between the committed offset and the highest one
// handed out.
func ExampleCollector_AddSubscriber() {
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: []string{"kafka:9092"}}, ConsumerGroup: "billing"}, nil)
	if err != nil {
		panic(err)
	}
	c := idemprom.NewCollector()
	c.AddSubscriber(sub) // labelled consumer_group="billing" (sub.ConsumerGroup())
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	fmt.Println(sub.ConsumerGroup())
	// Output: billing
}
