// Package heartbeatsql holds the heartbeat table (idem_heartbeat): its
// embedded migrations ([Migrations]), the sample each running instance
// writes every few seconds ([Beat], with the pruning of old samples), and
// what idemctl serve reads from it: the instances with their last sample
// ([Instances]) and the rates of the last hour as a series ([Series]). All
// times are the database's clock.
package heartbeatsql
