// Package claimsql holds the text of the claim statements, so the
// deduplicator and the benchmarks that EXPLAIN them use one definition.
package claimsql

// Claim is the single claim of (event_id, consumer_group) = ($1, $2) in
// table (quoted, schema-qualified): one row inserted for a first claim, none
// for a duplicate.
func Claim(table string) string {
	return "INSERT INTO " + table + " (event_id, consumer_group) VALUES ($1, $2) ON CONFLICT DO NOTHING"
}

// ClaimBatch claims the sorted ids of $1 for group $2 and returns those
// claimed for the first time.
func ClaimBatch(table string) string {
	return "INSERT INTO " + table + " (event_id, consumer_group) " +
		"SELECT id, $2 FROM unnest($1::uuid[]) AS u(id) ORDER BY id " +
		"ON CONFLICT DO NOTHING RETURNING event_id"
}
