// Package parkedsql reads the parked-keys table of retrytopic's KeyOrder
// for the operator's tools: the parked keys with their first event
// ([Keys]: idemctl retry parked, its console) and a summary per consumer
// group ([Summarize]: the same, and idemprom's gauges). KeyOrder itself
// parks, hands off and releases keys in retrytopic; no service reads this
// view.
package parkedsql
