// Package e2e holds cross-package end-to-end tests: events published to Kafka
// with the publisher package's safe configs, consumed by Watermill routers
// with the dedup middleware, applied to PostgreSQL. It has no API.
package e2e
