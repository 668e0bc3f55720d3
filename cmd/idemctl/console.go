package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/outboxsql"
	"github.com/idemkit/watermill-idempotency/internal/parkedsql"
	"github.com/idemkit/watermill-idempotency/internal/pgerr"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// console reads what the pages of idemctl serve show, with the library's
// functions and idemctl's own queries. Each method is one page: a fixed
// number of queries, whatever the number of rows, keys or groups (the
// outbox adds a fixed number per topic).
type console struct {
	pool      *pgxpool.Pool
	table     deduplicator.TableConfig // Layout read at each page
	layout    string                   // --layout
	outbox    outbox.Config            // Topics: --topics, else discovered at each page
	parked    retrytopic.ParkedKeysTable
	forwarder string
	kafka     *kafkaView // nil without --brokers
	// explorer reads and acts on the poison topics (nil without
	// --brokers), among poisonTopicsFlag (--poison-topics).
	explorer         *failures.Explorer
	poisonTopicsFlag []string
}

// overviewJSON is the overview page and /api/overview. Its parts have the
// shapes of groups list, partitions list, outbox backlog and retry parked
// --json. A part that cannot be read is left empty and its error is in
// Errors (by part: groups, dedup, outbox, parked), so that one missing
// table does not hide the rest.
type overviewJSON struct {
	Now    jsonTime       `json:"now"`
	Groups []jsonGroup    `json:"groups"`
	Dedup  *dedupOverview `json:"dedup"`
	Outbox jsonBacklog    `json:"outbox"`
	Parked jsonParked     `json:"parked"`
	// Leases are lease mode's (idem.Config.Lease), null when unreadable.
	Leases *leasesql.Summary `json:"leases"`
	// Kafka is null without --brokers.
	Kafka  *kafkaJSON        `json:"kafka"`
	Errors map[string]string `json:"errors"`
}

// dedupOverview is the dedup table read from the catalog only: its row
// count is the planner's estimate (pg_class.reltuples, as of the last
// ANALYZE or VACUUM), never a count(*).
type dedupOverview struct {
	Schema           string          `json:"schema"`
	Table            string          `json:"table"`
	Layout           string          `json:"layout"`
	RowsEstimate     int64           `json:"rows_estimate"`
	Bytes            int64           `json:"bytes"`
	RetentionSeconds float64         `json:"retention_seconds"`
	Partitions       []jsonPartition `json:"partitions"`
	// NextDrop is when the oldest daily partition becomes wholly older than
	// the retention, so that the Cleaner's next pass after it drops it
	// (null for a plain table, which the Cleaner deletes from in batches,
	// or without a daily partition). A young group's claims can keep it
	// longer.
	NextDrop          jsonTime `json:"next_drop"`
	NextDropPartition string   `json:"next_drop_partition"`
	// LastCleaned is when the Cleaner's last pass ran (null: never), from
	// the cutoff it recorded.
	LastCleaned jsonTime `json:"last_cleaned"`
}

func (c *console) tableConfig(ctx context.Context) (deduplicator.TableConfig, error) {
	a := &app{opts: options{schema: c.table.Schema, table: c.table.Table, layout: c.layout}, pool: c.pool}
	return a.tableConfig(ctx, false)
}

// topics returns the outbox topics: --topics, else those recorded.
func (c *console) topics(ctx context.Context) ([]string, error) {
	if len(c.outbox.Topics) > 0 {
		return c.outbox.Topics, nil
	}
	return recordedTopics(ctx, c.pool, c.outbox)
}

func (c *console) overview(ctx context.Context) *overviewJSON {
	now := time.Now()
	out := &overviewJSON{Now: jsonTime(now), Groups: []jsonGroup{}, Outbox: jsonBacklog{Forwarder: c.forwarder, Topics: []jsonBacklogTopic{}},
		Parked: jsonParked{[]jsonParkedGroup{}, []jsonParkedKey{}}, Errors: map[string]string{}}
	fail := func(part string, err error) { out.Errors[part] = consoleError(err) }

	if info, err := dedupsql.Inspect(ctx, c.pool, c.table.Schema, c.table.Table); err != nil {
		fail("dedup", err)
	} else {
		out.Dedup = toDedupOverview(info)
		if gs, err := dedupsql.Groups(ctx, c.pool, c.table.Schema, c.table.Table); err != nil {
			fail("groups", err)
		} else {
			for _, g := range gs {
				out.Groups = append(out.Groups, toJSONGroup(g, now, info.Retention))
			}
		}
	}
	if bl, err := c.backlog(ctx); err != nil {
		fail("outbox", err)
	} else {
		out.Outbox = bl
	}
	if ls, err := leasesql.Summarize(ctx, c.pool, c.table.Schema, c.table.Table); err != nil {
		fail("leases", err)
	} else {
		out.Leases = &ls
	}
	if sum, err := parkedsql.Summarize(ctx, c.pool, c.parked.Schema, c.parked.Table, "", deduplicator.ValidateGroupName); err != nil {
		fail("parked", err)
	} else {
		out.Parked = toJSONParked(sum, nil)
	}
	if c.kafka != nil {
		if k, err := c.kafka.read(); err != nil {
			fail("kafka", err)
		} else {
			out.Kafka = k
		}
	}
	return out
}

// toDedupOverview is the overview's part of dedupsql.Inspect.
func toDedupOverview(info *dedupsql.TableInfo) *dedupOverview {
	d := &dedupOverview{Schema: info.Schema, Table: info.Table, Layout: info.Layout, RowsEstimate: info.RowsEstimate, Bytes: info.Bytes,
		RetentionSeconds: info.Retention.Seconds(), Partitions: []jsonPartition{}}
	if !info.CleanedBefore.IsZero() {
		d.LastCleaned = jsonTime(info.CleanedBefore.Add(info.Retention))
	}
	for _, p := range info.Partitions {
		d.Partitions = append(d.Partitions, toJSONPartition(p))
		if p.Default || p.To.IsZero() {
			continue
		}
		if drop := p.To.Add(info.Retention); time.Time(d.NextDrop).IsZero() || drop.Before(time.Time(d.NextDrop)) {
			d.NextDrop, d.NextDropPartition = jsonTime(drop), p.Name
		}
	}
	return d
}

func (c *console) backlog(ctx context.Context) (jsonBacklog, error) {
	topics, err := c.topics(ctx)
	if err != nil {
		return jsonBacklog{}, err
	}
	if len(topics) == 0 {
		return toJSONBacklog(c.forwarder, nil), nil
	}
	ob, err := outbox.New(c.outbox, nil)
	if err != nil {
		return jsonBacklog{}, err
	}
	bl, err := ob.Backlog(ctx, c.pool, &outbox.BacklogOpts{Forwarder: c.forwarder, Topics: topics})
	if err != nil {
		return jsonBacklog{}, err
	}
	return toJSONBacklog(c.forwarder, bl), nil
}

// parkedPage is the parked-keys page and /api/parked: retry parked --json.
func (c *console) parkedKeys(ctx context.Context, group string, limit int) (jsonParked, error) {
	sum, err := parkedsql.Summarize(ctx, c.pool, c.parked.Schema, c.parked.Table, group, deduplicator.ValidateGroupName)
	if err != nil {
		return jsonParked{}, err
	}
	keys, err := parkedsql.Keys(ctx, c.pool, c.parked.Schema, c.parked.Table, group, limit, deduplicator.ValidateGroupName)
	if err != nil {
		return jsonParked{}, err
	}
	return toJSONParked(sum, keys), nil
}

// topicJSON is one outbox topic's page and /api/outbox/{topic}.
type topicJSON struct {
	Topic     string           `json:"topic"`
	Forwarder string           `json:"forwarder"`
	Backlog   jsonBacklogTopic `json:"backlog"`
	// Position is the forwarder's position: the snapshot whose
	// transactions' rows it has forwarded ("" when it has none yet), and
	// the cut it is part way through.
	Position  string        `json:"position"`
	Cut       string        `json:"cut"`
	CutOffset int64         `json:"cut_offset"`
	Recent    []jsonListRow `json:"recent"`
	Pending   []jsonListRow `json:"pending"`
}

type jsonListRow struct {
	Offset    int64    `json:"offset"`
	UUID      string   `json:"uuid"`
	EventID   string   `json:"event_id"`
	Key       string   `json:"key"`
	CreatedAt jsonTime `json:"created_at"`
	Pending   bool     `json:"pending"`
}

// pageRows is how many rows the topic page lists, newest and oldest
// pending.
const pageRows = 20

func (c *console) topic(ctx context.Context, topic string) (*topicJSON, error) {
	topics, err := c.topics(ctx)
	if err != nil {
		return nil, err
	}
	known := false
	for _, t := range topics {
		known = known || t == topic
	}
	if !known {
		return nil, errNotFound
	}
	ob, err := outbox.New(c.outbox, nil)
	if err != nil {
		return nil, err
	}
	out := &topicJSON{Topic: topic, Forwarder: c.forwarder, Recent: []jsonListRow{}, Pending: []jsonListRow{}}
	bl, err := ob.Backlog(ctx, c.pool, &outbox.BacklogOpts{Forwarder: c.forwarder, Topics: []string{topic}})
	if err != nil {
		return nil, err
	}
	out.Backlog = toJSONBacklog(c.forwarder, bl).Topics[0]
	t := outboxsql.TopicTables(ob.Config().Schema, ob.Config().TablePrefix, topic)
	p, err := t.Position(ctx, c.pool, c.forwarder)
	switch {
	case errors.Is(err, outboxsql.ErrNoPosition):
		p = outboxsql.Position{Snapshot: outboxsql.Start}
	case err != nil:
		return nil, err
	default:
		out.Position = p.Snapshot.String()
		if p.Cut != nil {
			out.Cut, out.CutOffset = p.Cut.String(), p.CutOffset
		}
	}
	for _, pendingOnly := range []bool{false, true} {
		rows, err := t.ListRows(ctx, c.pool, p, pendingOnly, pageRows)
		if err != nil {
			return nil, fmt.Errorf("rows of %s: %w", topic, err)
		}
		for _, r := range rows {
			jr := jsonListRow{r.Offset, r.UUID, r.EventID, r.Key, jsonTime(r.CreatedAt), r.Pending}
			if pendingOnly {
				out.Pending = append(out.Pending, jr)
			} else {
				out.Recent = append(out.Recent, jr)
			}
		}
	}
	return out, nil
}

// groupJSON is one consumer group's page and /api/groups/{group}.
type groupJSON struct {
	Group            jsonGroup `json:"group"`
	RetentionSeconds float64   `json:"retention_seconds"`
	// StaleHorizon: the group's consumers refuse as stale
	// (ErrStaleEvent) an event created before it, less the consumers'
	// StaleMargin; null while the group is young (it has lost no claim).
	StaleHorizon jsonTime `json:"stale_horizon"`
	// YoungUntil is when the group stops being young.
	YoungUntil jsonTime `json:"young_until"`
}

func (c *console) group(ctx context.Context, name string) (*groupJSON, error) {
	tc, err := c.tableConfig(ctx)
	if err != nil {
		return nil, err
	}
	retention, err := recordedRetention(ctx, c.pool, tc)
	if err != nil {
		return nil, err
	}
	gs, err := dedupsql.Groups(ctx, c.pool, tc.Schema, tc.Table)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	for _, g := range gs {
		if g.Name != name {
			continue
		}
		out := &groupJSON{Group: toJSONGroup(g, now, retention), RetentionSeconds: retention.Seconds()}
		if !g.FirstSeen.IsZero() {
			out.YoungUntil = jsonTime(g.FirstSeen.Add(retention))
		}
		if !g.Young(now, retention) {
			out.StaleHorizon = jsonTime(now.Add(-retention))
		}
		return out, nil
	}
	return nil, errNotFound
}

var errNotFound = errors.New("not found")

// consoleError words err for a page: a missing grant says which.
func consoleError(err error) string {
	if pgerr.Has(err, pgerrcode.InsufficientPrivilege) {
		return "the database role lacks a grant for this (docs/security.md, idemctl): " + err.Error()
	}
	return missingTable(err).Error()
}

// leasesPageLimit is the most leases the leases page lists.
const leasesPageLimit = 200

// leasesJSON is the leases page and /api/leases: the shape of idemctl
// dedup leases --json.
type leasesJSON struct {
	Leases []leasesql.Lease `json:"leases"`
}

// leases lists lease mode's leases, oldest taken first.
func (c *console) leases(ctx context.Context) (leasesJSON, error) {
	tc, err := c.tableConfig(ctx)
	if err != nil {
		return leasesJSON{}, err
	}
	ls, err := leasesql.List(ctx, c.pool, tc.Schema, tc.Table, leasesql.Filter{Limit: leasesPageLimit})
	if err != nil {
		return leasesJSON{}, err
	}
	if ls == nil {
		ls = []leasesql.Lease{}
	}
	return leasesJSON{Leases: ls}, nil
}

// release is the leases page's release (idemctl dedup release).
func (c *console) release(ctx context.Context, eventID, group string) (string, error) {
	id, err := uuid.Parse(eventID)
	if err != nil {
		return "", usageError("invalid event id %q: %v", eventID, err)
	}
	tc, err := c.tableConfig(ctx)
	if err != nil {
		return "", err
	}
	ok, err := leasesql.ForceRelease(ctx, c.pool, tc.Schema, tc.Table, id, group)
	if err != nil {
		return "", err
	}
	if !ok {
		return "", fmt.Errorf("no lease of %s for %s (completed, released, or never taken): %w", id, group, errNotFound)
	}
	return fmt.Sprintf("released the lease of %s for %s", id, group), nil
}
