package franz

import (
	"context"
	"fmt"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/watermill-idempotency/internal/kafkactx"
	"github.com/idemkit/watermill-idempotency/internal/progresssql"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// Records and messages are watermill-kafka's DefaultMarshaler's: the
// message UUID in the _watermill_message_uuid header, the metadata as the
// other headers, the payload as the value; the partition_key metadata
// becomes the record key (idemkafka.Marshaler). Both engines read each
// other's records.

// toRecord turns msg into a record of topic.
func toRecord(topic string, msg *message.Message) (*kgo.Record, error) {
	if msg.Metadata.Get(kafka.UUIDHeaderKey) != "" {
		return nil, fmt.Errorf("franz: metadata %s is reserved for the message UUID", kafka.UUIDHeaderKey)
	}
	r := &kgo.Record{Topic: topic, Value: msg.Payload}
	r.Headers = make([]kgo.RecordHeader, 0, len(msg.Metadata)+1)
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: kafka.UUIDHeaderKey, Value: []byte(msg.UUID)})
	for k, v := range msg.Metadata {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
	}
	if key := msg.Metadata.Get(publisher.MetadataPartitionKey); key != "" {
		r.Key = []byte(key)
	}
	return r, nil
}

// toMessage turns r into a message.
func toMessage(r *kgo.Record) *message.Message {
	var uuid string
	md := make(message.Metadata, len(r.Headers))
	for _, h := range r.Headers {
		if h.Key == kafka.UUIDHeaderKey {
			uuid = string(h.Value)
			continue
		}
		md.Set(h.Key, string(h.Value))
	}
	msg := message.NewMessage(uuid, r.Value)
	msg.Metadata = md
	return msg
}

// recordContext carries r's partition, offset, timestamp and key under
// watermill-kafka's keys (internal/kafkactx).
type recordContext struct {
	context.Context
	r *kgo.Record
}

func (c *recordContext) Value(key any) any {
	if v, ok := (kafkactx.Record{Partition: c.r.Partition, Offset: c.r.Offset, Timestamp: c.r.Timestamp, Key: c.r.Key}).Value(key); ok {
		return v
	}
	switch key {
	case progresssql.SubscriberKey{}:
		// Many records of a partition in flight: the dedup middleware
		// must not record their position (a max, not a floor, and a row
		// lock that would serialize them). The Subscriber writes it
		// itself with SubscriberConfig.Progress (progress.go).
		return true
	}
	return c.Context.Value(key)
}
