package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/google/uuid"
)

// poisonOptions are the flags of poison list and poison replay, parsed and
// checked: the fields of the poison-replay library's Filter and Config
// (issue 14 §2), which this build does not have yet.
type poisonOptions struct {
	topic         string      // the poison topic (Config.Topic)
	reason        string      // substring of reason_poisoned (Filter.Reason)
	reasonExact   bool        // Filter.ReasonExact
	eventIDs      []uuid.UUID // Filter.EventIDs
	originalTopic string      // Filter.OriginalTopic
	since, until  time.Time   // Filter.PoisonedFrom / PoisonedTo
	occurredSince time.Time   // Filter.OccurredFrom
	occurredUntil time.Time   // Filter.OccurredTo
	limit         int         // Config.Limit
	dryRun        bool        // Config.DryRun (replay)
	rate          float64     // Config.Rate: messages/s, 0 = no limit
}

// poisonFlags adds the filter flags (and, for replay, --dry-run and --rate)
// to fs; the returned function checks them after parsing.
func poisonFlags(fs *flag.FlagSet, replay bool) (*poisonOptions, func() error) {
	o := &poisonOptions{}
	var ids stringsFlag
	var since, until, occSince, occUntil string
	fs.StringVar(&o.topic, "topic", "", "the poison `topic` to read (required)")
	fs.StringVar(&o.reason, "reason", "", "only messages whose reason_poisoned contains this `text`")
	fs.BoolVar(&o.reasonExact, "reason-exact", false, "--reason must match the whole reason_poisoned")
	fs.Var(&ids, "event-id", "only this event `id`; repeat it or separate with commas")
	fs.StringVar(&o.originalTopic, "original-topic", "", "only messages poisoned from this `topic` (topic_poisoned)")
	fs.StringVar(&since, "since", "", "only messages poisoned at or after this `time` (RFC 3339, or a duration ago: 2h, 7d)")
	fs.StringVar(&until, "until", "", "only messages poisoned before this `time` (RFC 3339, or a duration ago)")
	fs.StringVar(&occSince, "occurred-since", "", "only events that occurred at or after this `time` (occurred_at, else the UUIDv7 time)")
	fs.StringVar(&occUntil, "occurred-until", "", "only events that occurred before this `time`")
	fs.IntVar(&o.limit, "limit", 0, "stop after this many matching messages (default: no limit)")
	if replay {
		fs.BoolVar(&o.dryRun, "dry-run", false, "list what would be replayed, publish nothing")
		fs.Float64Var(&o.rate, "rate", 50, "most messages published per `second`; 0 for no limit")
	}
	check := func() error {
		now := time.Now()
		var err error
		for _, t := range []struct {
			name string
			v    string
			dst  *time.Time
		}{{"--since", since, &o.since}, {"--until", until, &o.until}, {"--occurred-since", occSince, &o.occurredSince}, {"--occurred-until", occUntil, &o.occurredUntil}} {
			if *t.dst, err = parseTime(t.v, now); err != nil {
				return usageError("usage: %s: %v", t.name, err)
			}
		}
		for _, s := range ids {
			id, err := uuid.Parse(s)
			if err != nil {
				return usageError("invalid event id %q: %v", s, err)
			}
			o.eventIDs = append(o.eventIDs, id)
		}
		switch {
		case o.topic == "":
			return usageError("usage: --topic (the poison topic) is required")
		case o.reasonExact && o.reason == "":
			return usageError("usage: --reason-exact needs --reason")
		case !o.since.IsZero() && !o.until.IsZero() && !o.since.Before(o.until):
			return usageError("usage: --since must be before --until")
		case !o.occurredSince.IsZero() && !o.occurredUntil.IsZero() && !o.occurredSince.Before(o.occurredUntil):
			return usageError("usage: --occurred-since must be before --occurred-until")
		case o.limit < 0:
			return usageError("usage: --limit must not be negative")
		case o.rate < 0:
			return usageError("usage: --rate must not be negative (0: no limit)")
		}
		return nil
	}
	return o, check
}

// parseTime reads RFC 3339 or a duration before now; "" is the zero time.
func parseTime(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := parseDuration(s); err == nil {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%q is neither an RFC 3339 time nor a duration ago (2h, 7d)", s)
}

// errPoisonUnavailable: the poison-replay library (issue 14 §2) is not part
// of this build yet; the flags are parsed and checked so that the commands'
// interface is settled.
var errPoisonUnavailable = errors.New("not available in this build: it needs the poison-replay library (issue 14 §2); nothing was read or published")

func (a *app) poisonCommand(args []string, replay bool) error {
	fs := a.flags()
	_, check := poisonFlags(fs, replay)
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	if err := check(); err != nil {
		return err
	}
	brokers := a.opts.brokers
	if brokers == "" {
		brokers = a.getenv("KAFKA_BROKERS")
	}
	if len(splitList(brokers)) == 0 {
		return usageError("no Kafka brokers: set KAFKA_BROKERS or pass --brokers")
	}
	return &exitError{code: exitFailure, err: errPoisonUnavailable}
}

func poisonList(_ context.Context, a *app, args []string) error {
	return a.poisonCommand(args, false)
}

func poisonReplay(_ context.Context, a *app, args []string) error {
	return a.poisonCommand(args, true)
}
