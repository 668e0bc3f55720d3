// Package heartbeat lets a running service tell the operator's console
// (idemctl serve) that it is alive: every few seconds one goroutine writes a
// sample to the idem_heartbeat table — the instance's name, its dedup
// middleware's consumer group and mode, the service's version, and the
// middleware's cumulative counters. The console lists the instances with
// their last-seen time and draws the last hour's rates from the samples.
//
// It is opt-in and off the message path: it reads [idem.Dedup.Stats] (atomic
// counters) and writes one row per Interval on its own.
//
//	hb, err := heartbeat.New(heartbeat.Config{DB: pool, Dedup: dedup, Version: "v1.4.2"}, logger)
//	go hb.Run(ctx) // until ctx ends
//
// Migrate [MigrationLine] with the other lines first.
package heartbeat
