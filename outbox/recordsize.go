package outbox

import (
	"encoding/binary"
	"fmt"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/publisher"
)

// defaultMaxMessageBytes is Sarama's default Producer.MaxMessageBytes (and
// close to Kafka's default message.max.bytes): 1 MiB.
const defaultMaxMessageBytes = 1024 * 1024

// maximumRecordOverhead is Sarama's bound of a v2 record's framing, which
// ProducerMessage.ByteSize adds.
const maximumRecordOverhead = 5*binary.MaxVarintLen32 + binary.MaxVarintLen64 + 1

// recordBytes returns the size Sarama checks against
// Producer.MaxMessageBytes (ProducerMessage.ByteSize of a v2 record) for
// the record idemkafka.Marshaler makes of msg, without building it: the payload,
// the partition key, and the UUID header and one header per metadata entry,
// with their framing.
func recordBytes(msg *message.Message) int {
	size := maximumRecordOverhead + len(msg.Payload)
	size += len(kafka.UUIDHeaderKey) + len(msg.UUID) + 2*binary.MaxVarintLen32
	for k, v := range msg.Metadata {
		size += len(k) + len(v) + 2*binary.MaxVarintLen32
	}
	size += len(msg.Metadata.Get(publisher.MetadataPartitionKey))
	return size
}

// checkRecord reports why the broker side would refuse msg as a record of at
// most maxBytes (recordBytes): metadata holding watermill-kafka's reserved
// UUID key ([publisher.ErrReservedMetadata]), or a record that is too large
// ([publisher.ErrMessageTooLarge]). maxBytes ≤ 0 checks no size.
func checkRecord(msg *message.Message, maxBytes int) error {
	if _, ok := msg.Metadata[kafka.UUIDHeaderKey]; ok {
		return fmt.Errorf("%w: %q", publisher.ErrReservedMetadata, kafka.UUIDHeaderKey)
	}
	if n := recordBytes(msg); maxBytes > 0 && n > maxBytes {
		return fmt.Errorf("%w: %d bytes > %d", publisher.ErrMessageTooLarge, n, maxBytes)
	}
	return nil
}
