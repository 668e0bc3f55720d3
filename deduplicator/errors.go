package deduplicator

import (
	"errors"

	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
)

// The errors of this package; match them with errors.Is.
var (
	// ErrStaleEvent is wrapped by the error [Deduplicator.CheckStale]
	// returns for a stale event (its message names the event, its time and
	// the limits it passed): the event's UUIDv7 time is older than the dedup retention (or the Cleaner's cutoff), so its
	// claim may be gone and [Deduplicator.CheckStale] cannot vouch that it was
	// not applied before. It is permanent: route it to a poison queue.
	ErrStaleEvent = errors.New("event is older than the dedup retention")

	// The reasons [Check] refuses a table, wrapped in a
	// [*migrate.TableError].

	// ErrTableMissing: the table does not exist (or is not a table).
	ErrTableMissing = dedupsql.ErrTableMissing
	// ErrTableKey: the rows are not keyed by (event_id, consumer_group)
	// alone: another primary key, another unique key or exclusion
	// constraint claims would also conflict on, or partitions not keyed on
	// event_id. Claims then skip events never processed, or process events
	// twice.
	ErrTableKey = errors.New("deduplicator: processed_event is not keyed by (event_id, consumer_group)")
	// ErrTableColumns: a column is missing, has another type, is nullable,
	// or would make a claim's INSERT fail.
	ErrTableColumns = errors.New("deduplicator: processed_event columns are not the expected ones")
	// ErrLayoutMismatch: the table's layout in the database is not
	// TableConfig.Layout (migrate with the same TableConfig).
	ErrLayoutMismatch = errors.New("deduplicator: table layout in the database does not match TableConfig.Layout")

	// ErrRetentionMismatch is returned when a configured [TableConfig.Retention]
	// differs from the one recorded with the table. Every component reads the
	// recorded retention, so the stale rule and the Cleaner cannot disagree;
	// change it with idemctl retention set.
	ErrRetentionMismatch = errors.New("deduplicator: retention does not match the table's recorded retention")

	// ErrCleanerTimeout is returned (wrapped, with the server's error) when
	// MaxTimeouts consecutive batches hit the statement timeout.
	ErrCleanerTimeout = errors.New("deduplicator: cleaner batches keep hitting statement_timeout")

	// ErrInvalidGroupName is the sentinel of a consumer group name that
	// PostgreSQL cannot store in a text column: a NUL byte, bytes that are not
	// valid UTF-8, or (found by the server) a character the database's encoding
	// cannot represent. The error wrapping it names the field (or argument)
	// and the name: "ConsumerGroup: \"bill\\x00ing\" contains a NUL byte, ...".
	ErrInvalidGroupName = errors.New("deduplicator: invalid consumer group name")

	// The errors of the consumer-group registry.

	// ErrGroupExists is returned by [RenameGroup] when the new name is
	// already registered or holds claims.
	ErrGroupExists = dedupsql.ErrGroupExists
	// ErrGroupNotFound is returned by [RenameGroup] and [ForgetGroup] for a
	// group that is not registered.
	ErrGroupNotFound = dedupsql.ErrGroupNotFound

	// ErrNamespaceMismatch is returned by [Deduplicator.Register] when the
	// configured Idempotency-Key namespace differs from the one recorded
	// for the group: the downstream keys of every event would change, and
	// a provider would apply a call a second time.
	ErrNamespaceMismatch = errors.New("deduplicator: idempotency namespace does not match the one recorded for the consumer group")
)
