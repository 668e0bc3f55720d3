package publisher

import "errors"

// Sentinel errors of an outgoing message the broker would refuse. Each is
// permanent: publishing the same message again cannot fix it, so the
// middleware's IsPermanent reports true and a poison queue takes the message
// whose handler produced it. outbox's *MessageError carries them with the
// topic, the message and the sizes.
var (
	// ErrMessageTooLarge: the message's Kafka record (payload, key and
	// metadata as headers) is larger than the producer's
	// Producer.MaxMessageBytes.
	ErrMessageTooLarge = errors.New("message is larger than the producer's limit")
	// ErrReservedMetadata: the message's metadata holds a key that the
	// broker-side encoding reserves (watermill-kafka's message UUID header,
	// "_watermill_message_uuid").
	ErrReservedMetadata = errors.New("message metadata uses a reserved key")
)
