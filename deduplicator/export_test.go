package deduplicator

// LeaseTakeSQL returns the take's statements (take, the recheck, the state
// read) with their argument order: ids, tokens, group.
func LeaseTakeSQL(d *Deduplicator) (take, recheck, state string) {
	return d.lease.take, d.lease.doneAfterTake, d.lease.state
}
