package idemotel_test

import (
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idemkit/watermill-idempotency/components/idemotel"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// Report the dedup middleware's counters through the OpenTelemetry metric
// API; any reader or exporter of the SDK (OTLP, Prometheus bridge, stdout)
// collects them.
func ExampleNew() {
	var pool *pgxpool.Pool // your pool
	dedup, err := idem.NewDedup(idem.Config{DB: pool, ConsumerGroup: "billing"}, nil)
	if err != nil {
		panic(err)
	}
	mp := sdkmetric.NewMeterProvider( /* sdkmetric.WithReader(your exporter's reader) */ )
	metrics, err := idemotel.New(mp) // nil: the global MeterProvider
	if err != nil {
		panic(err)
	}
	defer metrics.Close()
	metrics.AddDedup(dedup)
}

// The parallel subscriber's stats, with the attribute
// messaging.consumer.group.name (and per partition
// messaging.destination.name, messaging.destination.partition.id).
func ExampleMetrics_AddSubscriber() {
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{Client: idemkafka.ClientConfig{Brokers: []string{"kafka:9092"}}, ConsumerGroup: "billing"}, nil)
	if err != nil {
		panic(err)
	}
	metrics, err := idemotel.New(nil) // the global MeterProvider
	if err != nil {
		panic(err)
	}
	defer metrics.Close()
	metrics.AddSubscriber(sub)
}
