// Package kafkactx gives a Kafka record's message the context values
// watermill-kafka's subscriber sets (kafka.MessagePartitionFromCtx,
// kafka.MessagePartitionOffsetFromCtx, kafka.MessageTimestampFromCtx,
// kafka.MessageKeyFromCtx, which the retry topics and the dedup
// middleware's tracing read), for both of idemkafka's subscribers.
// watermill-kafka does not export its context keys: each is learnt once
// by asking its accessor, through a context that records the key it is
// asked for ([KeyOf]).
package kafkactx

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
)

// watermill-kafka's context keys.
var (
	keyPartition = KeyOf(func(ctx context.Context) { kafka.MessagePartitionFromCtx(ctx) })
	keyOffset    = KeyOf(func(ctx context.Context) { kafka.MessagePartitionOffsetFromCtx(ctx) })
	keyTimestamp = KeyOf(func(ctx context.Context) { kafka.MessageTimestampFromCtx(ctx) })
	keyKey       = KeyOf(func(ctx context.Context) { kafka.MessageKeyFromCtx(ctx) })
)

// keyProbe is a context that records the key of its last Value call.
type keyProbe struct {
	context.Context
	key any
}

func (p *keyProbe) Value(key any) any {
	p.key = key
	return nil
}

// KeyOf returns the context key accessor reads: the last key it asks its
// context's Value for.
func KeyOf(accessor func(context.Context)) any {
	p := &keyProbe{Context: context.Background()}
	accessor(p)
	return p.key
}

// Record is what a message's context tells of its Kafka record.
type Record struct {
	Partition int32
	Offset    int64
	Timestamp time.Time
	Key       []byte
}

// Value returns r's value for key, when key is one of watermill-kafka's:
// a subscriber's context type answers them with it, and passes the other
// keys on.
func (r Record) Value(key any) (any, bool) {
	switch key {
	case keyPartition:
		return r.Partition, true
	case keyOffset:
		return r.Offset, true
	case keyTimestamp:
		return r.Timestamp, true
	case keyKey:
		return r.Key, true
	}
	return nil, false
}
