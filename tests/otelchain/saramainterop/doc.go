// Package saramainterop proves that the dedup middleware's tracing and
// watermill-kafka's own Sarama tracer (kafka.SubscriberConfig.Tracer and
// kafka.PublisherConfig.Tracer = kafka.NewOTELSaramaTracer(), which uses
// dnwe/otelsarama with the GLOBAL TracerProvider and propagator) give one
// coherent trace when both are on. Its tests set the global provider and
// propagator, so they live in a package (a test process) of their own and
// never run in parallel. It has no API.
package saramainterop
