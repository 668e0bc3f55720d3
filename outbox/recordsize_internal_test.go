package outbox

import (
	"errors"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/publisher"
)

// recordBytes is what Sarama checks: ByteSize of the record Marshaler makes.
func TestRecordBytesIsSaramasByteSize(t *testing.T) {
	t.Parallel()
	for _, md := range []message.Metadata{
		nil,
		{"a": "b"},
		{publisher.MetadataPartitionKey: "order-7", publisher.MetadataEventID: "0190f5a8-7b2c-7cc0-8f00-3a4b5c6d7e8f", "x": strings.Repeat("y", 300)},
	} {
		msg := message.NewMessage("0190f5a8-7b2c-7cc0-8f00-3a4b5c6d7e8f", []byte(strings.Repeat("p", 1000)))
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
		pm, err := idemkafka.Marshaler{}.Marshal("t", msg)
		require.NoError(t, err)
		require.Equal(t, pm.ByteSize(2), recordBytes(msg))
	}
}

func TestCheckRecord(t *testing.T) {
	t.Parallel()
	msg := message.NewMessage("u", make([]byte, 2000))
	require.NoError(t, checkRecord(msg, 0))
	require.NoError(t, checkRecord(msg, recordBytes(msg)))
	err := checkRecord(msg, recordBytes(msg)-1)
	require.True(t, errors.Is(err, publisher.ErrMessageTooLarge), "%v", err)
	msg.Metadata.Set("_watermill_message_uuid", "x")
	require.True(t, errors.Is(checkRecord(msg, 0), publisher.ErrReservedMetadata))
}
