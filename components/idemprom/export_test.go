package idemprom

import "time"

// SetDBTimeout sets the deadline of a scrape's database readings.
func SetDBTimeout(c *Collector, d time.Duration) {
	c.reads.mu.Lock()
	defer c.reads.mu.Unlock()
	c.reads.timeout = d
}

// DBWaiters returns how many scrapes have shared a read in flight.
func DBWaiters(c *Collector) int {
	c.reads.mu.Lock()
	defer c.reads.mu.Unlock()
	return c.reads.waiters
}
