// Package claimsql holds the text of the claim statements, so the
// deduplicator and the benchmarks that EXPLAIN them use one definition.
//
// The conflict target is the primary key: a stray unique index on the table
// (which deduplicator.Check refuses) would make the claim fail loudly instead
// of skipping an event that was never processed.
package claimsql

// Claim is the single claim of (event_id, consumer_group) = ($1, $2) in
// table (quoted, schema-qualified): one row inserted for a first claim, none
// for a duplicate.
func Claim(table string) string {
	return "INSERT INTO " + table + " (event_id, consumer_group) VALUES ($1, $2) ON CONFLICT (event_id, consumer_group) DO NOTHING"
}

// ClaimBatch claims the sorted ids of $1 for group $2 and returns those
// claimed for the first time.
func ClaimBatch(table string) string {
	return "INSERT INTO " + table + " (event_id, consumer_group) " +
		"SELECT id, $2 FROM unnest($1::uuid[]) AS u(id) ORDER BY id " +
		"ON CONFLICT (event_id, consumer_group) DO NOTHING RETURNING event_id"
}

// The claim table's name when a TableConfig leaves it empty: one
// definition for deduplicator and the middleware's lease mode.
const (
	DefaultSchema = "public"
	DefaultTable  = "processed_event"
)

// Names returns schema and table with the defaults for the empty ones.
func Names(schema, table string) (string, string) {
	if schema == "" {
		schema = DefaultSchema
	}
	if table == "" {
		table = DefaultTable
	}
	return schema, table
}
