// Package handlertracer builds watermill-kafka SaramaTracers that wrap only
// a subscriber's consumer-group handler (the one hook where a subscriber
// exposes Sarama's group session) and pass everything else to the tracer
// they wrap.
package handlertracer

import (
	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
)

// New returns a tracer that wraps the consumer-group handler with wrap,
// after next (nil for none) wrapped it; consumers, partition consumers and
// producers go to next alone.
func New(next kafka.SaramaTracer, wrap func(sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler) kafka.SaramaTracer {
	return tracer{next: next, wrap: wrap}
}

type tracer struct {
	next kafka.SaramaTracer
	wrap func(sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler
}

func (t tracer) WrapConsumer(c sarama.Consumer) sarama.Consumer {
	if t.next != nil {
		return t.next.WrapConsumer(c)
	}
	return c
}

func (t tracer) WrapPartitionConsumer(pc sarama.PartitionConsumer) sarama.PartitionConsumer {
	if t.next != nil {
		return t.next.WrapPartitionConsumer(pc)
	}
	return pc
}

func (t tracer) WrapConsumerGroupHandler(h sarama.ConsumerGroupHandler) sarama.ConsumerGroupHandler {
	if t.next != nil {
		h = t.next.WrapConsumerGroupHandler(h)
	}
	return t.wrap(h)
}

func (t tracer) WrapSyncProducer(cfg *sarama.Config, p sarama.SyncProducer) sarama.SyncProducer {
	if t.next != nil {
		return t.next.WrapSyncProducer(cfg, p)
	}
	return p
}
