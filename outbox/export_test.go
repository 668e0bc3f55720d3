package outbox

import (
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
)

// Adapters returns the watermill-sql adapters of o's tables, for the tests
// that read them with a watermill-sql Subscriber.
func Adapters(o *Outbox) (*wsql.DefaultPostgreSQLSchema, wsql.DefaultPostgreSQLOffsetsAdapter) {
	return o.schema, o.offsets
}

// SetHook makes f call hook at each step of its transactions ("begin",
// "locked", "cut", then per page "acked" and "sent", "commit"); call it
// before Run.
func SetHook(f *Forwarder, hook func(step string)) { f.hook = hook }

// Channel is the NOTIFY channel of topic's table.
func Channel(o *Outbox, topic string) string { return o.channel(topic) }

// StretchWaits makes every wait of f longer than a millisecond last d
// (unless a wake-up ends it); call it before Run.
func StretchWaits(f *Forwarder, d time.Duration) {
	f.stretch = func(time.Duration) time.Duration { return d }
}

// Stopping returns a channel closed once Run has seen its context end or
// Close; call it while Run runs (from a hook).
func Stopping(f *Forwarder) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.stopped
}

// OffsetsTable is the quoted table of the forwarders' positions in topic.
func OffsetsTable(o *Outbox, topic string) string { return o.tables(topic).Offsets }
