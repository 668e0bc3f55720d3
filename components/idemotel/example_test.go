package idemotel_test

import (
	"github.com/jackc/pgx/v5/pgxpool"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idemkit/watermill-idempotency/components/idemotel"
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
