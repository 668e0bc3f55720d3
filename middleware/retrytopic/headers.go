package retrytopic

import (
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/idemkit/watermill-idempotency/internal/retryheaders"
)

// Metadata keys (Kafka headers) of a copy on a retry topic. The copy keeps
// every metadata key of the original message (event_id, partition_key,
// occurred_at, traceparent ...), its UUID and its payload, and adds these.
const (
	// MetadataAttempt is the number of this retry-topic attempt: 1 for the
	// copy made after the first failure, 2 after the second, and so on. 0
	// marks a follower (see [KeyOrder]): it has not failed, it waited for
	// its key's earlier event and was handed the key.
	MetadataAttempt = retryheaders.Attempt
	// MetadataNotBefore is the time (RFC 3339, UTC, nanoseconds) before
	// which the copy is not processed: the failure time plus the backoff.
	MetadataNotBefore = retryheaders.NotBefore
	// MetadataOriginalTopic is the topic the event was first consumed from:
	// a message poisoned on a retry topic names it in topic_poisoned, so a
	// replay goes back there.
	MetadataOriginalTopic = retryheaders.OriginalTopic
	// MetadataOriginalPartition and MetadataOriginalOffset locate the
	// original record (watermill-kafka's kafka.MessagePartitionFromCtx and
	// kafka.MessagePartitionOffsetFromCtx); absent when the subscriber is
	// not watermill-kafka.
	MetadataOriginalPartition = retryheaders.OriginalPartition
	MetadataOriginalOffset    = retryheaders.OriginalOffset
	// MetadataError is the text of the failure that sent the copy here (at
	// most [maxErrorLen] bytes).
	MetadataError = retryheaders.Error
	// MetadataParked ("true") marks a copy made with [KeyOrder]: its event
	// has a row in the parked-keys table, committed with (or after) the
	// copy. A marked copy whose event has no row, once a transaction that
	// may be parking it has ended, is acked without running: its event
	// was released (applied, poisoned, skipped), or parked in a history
	// that a failover to an asynchronous standby or a restore undid, and
	// then the event itself comes again from its topic, whose position
	// the database rewound with it. A copy without the mark (made without
	// KeyOrder) runs when its key is free.
	MetadataParked = retryheaders.Parked
)

// maxErrorLen bounds the error text kept in [MetadataError].
const maxErrorLen = 1024

// origin is where a message stands on the retry path.
type origin struct {
	attempt   int // 0 on the main topic (or a follower)
	topic     string
	partition string
	offset    string
	notBefore time.Time
}

// parseOrigin reads the retry headers of a copy consumed from a retry topic.
func parseOrigin(msg *message.Message) (origin, error) {
	var o origin
	a := msg.Metadata.Get(MetadataAttempt)
	n, err := strconv.Atoi(a)
	if err != nil || n < 0 {
		return o, fmt.Errorf("%w: %s %q is not a non-negative integer", ErrInvalidHeaders, MetadataAttempt, a)
	}
	o.attempt = n
	if o.topic = msg.Metadata.Get(MetadataOriginalTopic); o.topic == "" {
		return o, fmt.Errorf("%w: %s is missing", ErrInvalidHeaders, MetadataOriginalTopic)
	}
	o.partition = msg.Metadata.Get(MetadataOriginalPartition)
	o.offset = msg.Metadata.Get(MetadataOriginalOffset)
	if nb := msg.Metadata.Get(MetadataNotBefore); nb != "" {
		if o.notBefore, err = time.Parse(time.RFC3339Nano, nb); err != nil {
			return o, fmt.Errorf("%w: %s %q is not an RFC 3339 time", ErrInvalidHeaders, MetadataNotBefore, nb)
		}
	}
	return o, nil
}

// set writes o onto a copy's metadata, with the failure's text.
func (o origin) set(m message.Metadata, cause error) {
	m.Set(MetadataAttempt, strconv.Itoa(o.attempt))
	m.Set(MetadataNotBefore, o.notBefore.UTC().Format(time.RFC3339Nano))
	m.Set(MetadataOriginalTopic, o.topic)
	setOrDelete(m, MetadataOriginalPartition, o.partition)
	setOrDelete(m, MetadataOriginalOffset, o.offset)
	if cause != nil {
		m.Set(MetadataError, truncate(cause.Error(), maxErrorLen))
	} else {
		delete(m, MetadataError)
	}
}

func setOrDelete(m message.Metadata, k, v string) {
	if v == "" {
		delete(m, k)
		return
	}
	m.Set(k, v)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
