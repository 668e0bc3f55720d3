package middleware

// OpenGroupSize returns how many messages the open (gathering) group holds,
// for tests that arrange a group's members deterministically.
func OpenGroupSize(d *Dedup) int {
	d.gc.mu.Lock()
	defer d.gc.mu.Unlock()
	if d.gc.open == nil {
		return 0
	}
	return len(d.gc.open.reqs)
}
