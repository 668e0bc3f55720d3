package outbox

import wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

// Adapters returns the watermill-sql adapters of o's tables, for the tests
// that read them with a watermill-sql Subscriber.
func Adapters(o *Outbox) (*wsql.DefaultPostgreSQLSchema, wsql.DefaultPostgreSQLOffsetsAdapter) {
	return o.schema, o.offsets
}
