// Package conformance holds no code: its tests are the one suite both
// Kafka engines pass, idemkafka/parallel's Sarama Subscriber and
// idemkafka/franz's franz-go one (classic cooperative-sticky and KIP-848):
// Watermill's universal Pub/Sub tests, and the library's own checks (key
// order under nacks, a failing key holding neither its partition's other
// keys nor more than its own offset, revocation, members joining and
// leaving), each written once and run per engine against the broker of
// internal/testkit/kafkatest (kfake over TCP, or KAFKA_BROKERS).
package conformance
