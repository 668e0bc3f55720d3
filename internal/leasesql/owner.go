package leasesql

// Of returns the lease protocol that package deduplicator bound to the
// claim table and consumer group of d, a *deduplicator.Deduplicator, or
// nil for another value. Lease mode writes claims, and deduplicator is
// the one package that binds a statement writing the claim table to a
// table and a group (deduplicator's writers test holds it): the
// middleware gets its protocol here, from the Deduplicator it made, and
// never calls [New]. deduplicator sets Of when it is initialised; a hook
// rather than an exported method, so the protocol stays out of the public
// API.
var Of func(d any) *Protocol
