package deduplicator

import (
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
)

func init() {
	leasesql.Of = func(d any) *leasesql.Protocol {
		if dd, ok := d.(*Deduplicator); ok {
			return dd.leases
		}
		return nil
	}
}

// newLeases returns lease mode's protocol on cfg's table for its group: the
// lease table's statements, and the completions that insert the claims.
func newLeases(cfg Config) *leasesql.Protocol {
	return leasesql.New(cfg.Schema, cfg.Table, cfg.ConsumerGroup)
}
