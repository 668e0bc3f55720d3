package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/idemkafka"
)

// poisonOptions are the flags of poison list and poison replay, parsed and
// checked: the fields of poison.Filter and poison.Config.
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
	rate          float64     // Config.Rate: messages/s, 0 = no limit (Config.Rate < 0)
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
		fs.Float64Var(&o.rate, "rate", 50, "publish at most `N` messages per second; 0 for no limit")
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
		case o.rate < 0 || math.IsNaN(o.rate):
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

// filter is the poison.Filter of the flags.
func (o *poisonOptions) filter() poison.Filter {
	return poison.Filter{
		Reason:        o.reason,
		ReasonExact:   o.reasonExact,
		EventIDs:      o.eventIDs,
		OriginalTopic: o.originalTopic,
		PoisonedFrom:  o.since,
		PoisonedTo:    o.until,
		OccurredFrom:  o.occurredSince,
		OccurredTo:    o.occurredUntil,
	}
}

// kafkaConfig is the Kafka of --brokers, else $KAFKA_BROKERS. Its Sarama
// config never asks the brokers to create a topic: a mistyped --topic, or a
// topic_poisoned naming a topic that is gone, is an error rather than a new
// empty topic.
func (a *app) kafkaConfig() (idemkafka.ClientConfig, error) {
	brokers := a.opts.brokers
	if brokers == "" {
		brokers = a.getenv("KAFKA_BROKERS")
	}
	list := splitList(brokers)
	if len(list) == 0 {
		return idemkafka.ClientConfig{}, usageError("no Kafka brokers: set KAFKA_BROKERS or pass --brokers")
	}
	sc := sarama.NewConfig()
	sc.ClientID = "idemctl"
	sc.Net.DialTimeout = 10 * time.Second
	sc.Metadata.AllowAutoTopicCreation = false
	sc.Consumer.MaxWaitTime = 100 * time.Millisecond
	if err := a.opts.kafka.apply(sc, a.getenv); err != nil {
		return idemkafka.ClientConfig{}, err
	}
	return idemkafka.ClientConfig{Brokers: list, Sarama: sc}, nil
}

func poisonList(ctx context.Context, a *app, args []string) error {
	return a.poisonCommand(ctx, args, false)
}

func poisonReplay(ctx context.Context, a *app, args []string) error {
	return a.poisonCommand(ctx, args, true)
}

// poisonCommand runs poison list (replay false) or poison replay: the table
// is printed as the messages are read (and replayed), then a summary; --json
// prints one document at the end, also when the read or the replay stopped
// on an error once it had begun (with "error"; the counts tell how far it
// got).
func (a *app) poisonCommand(ctx context.Context, args []string, replay bool) error {
	fs := a.flags()
	o, check := poisonFlags(fs, replay)
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	if err := check(); err != nil {
		return err
	}
	kc, err := a.kafkaConfig()
	if err != nil {
		return err
	}
	cfg := poison.Config{
		Kafka:  kc,
		Topic:  o.topic,
		Filter: o.filter(),
		DryRun: !replay || o.dryRun,
		Limit:  o.limit,
		Rate:   o.rate,
	}
	if cfg.Rate == 0 {
		cfg.Rate = -1 // --rate 0: no limit
	}
	if !cfg.DryRun {
		pc, err := idemkafka.WatermillPublisherConfig(kc)
		if err != nil {
			return err
		}
		pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
		if err != nil {
			return fmt.Errorf("kafka publisher: %w", err)
		}
		defer func() { _ = pub.Close() }()
		cfg.Publisher = pub
	}
	out := &poisonTable{w: a.stdout, replay: replay}
	if !a.opts.json {
		cfg.OnMessageFunc = out.message
	}
	var res *poison.Result
	if replay {
		res, err = poison.Replay(ctx, cfg, nil)
	} else {
		res, err = poison.List(ctx, cfg, nil)
	}
	if err != nil && (res == nil || res.Scanned == 0) { // nothing was read, nothing published
		if errors.Is(err, sarama.ErrUnknownTopicOrPartition) {
			return usageError("unknown poison topic %q: the brokers do not have it (check --topic); nothing was read", o.topic)
		}
		return err
	}
	if a.opts.json {
		doc := poisonJSON{Topic: o.topic, DryRun: cfg.DryRun, Scanned: res.Scanned, Matched: res.Matched,
			Replayed: res.Replayed, Skipped: res.Skipped, Messages: []poisonMessageJSON{}}
		for _, m := range res.Messages {
			doc.Messages = append(doc.Messages, toPoisonJSON(m))
		}
		if err != nil {
			doc.Error = err.Error()
		}
		if perr := a.printJSON(doc); perr != nil && err == nil {
			return perr
		}
	} else {
		out.summary(o, cfg, res)
	}
	switch {
	case err == nil:
		return nil
	case cfg.DryRun:
		return fmt.Errorf("stopped after reading %d messages: %w", res.Scanned, err)
	default:
		return fmt.Errorf("stopped after replaying %d of the %d matching messages: %w", res.Replayed, res.Matched, err)
	}
}

// poisonTable prints the matching messages as they come, one row each, and
// the summary.
type poisonTable struct {
	w      io.Writer
	replay bool
	rows   int
}

// Column widths: fixed, since rows are printed as they come; a longer cell
// pushes the rest of its row right.
var (
	poisonHeader = []string{"PARTITION", "OFFSET", "POISONED AT", "EVENT ID", "ORIGINAL TOPIC", "REPLAYS", "REASON"}
	poisonWidths = []int{9, 6, 20, 36, 16, 7, 0}
)

func (t *poisonTable) message(m poison.Message) {
	header, widths := poisonHeader, poisonWidths
	if t.replay {
		header, widths = append([]string{"STATUS"}, header...), append([]int{12}, widths...)
	}
	if t.rows == 0 {
		streamRow(t.w, widths, header...)
	}
	t.rows++
	cells := []string{
		strconv.Itoa(int(m.Partition)), strconv.FormatInt(m.Offset, 10), ops.HumanTime(m.PoisonedAt),
		orDash(m.EventID), orDash(m.OriginalTopic), strconv.Itoa(len(m.History)), orDash(m.Reason),
	}
	if t.replay {
		status := "would replay"
		switch {
		case m.Replayed:
			status = "replayed"
		case m.Skipped != "":
			status = "skipped"
		}
		cells = append([]string{status}, cells...)
	}
	streamRow(t.w, widths, cells...)
}

func (t *poisonTable) summary(o *poisonOptions, cfg poison.Config, res *poison.Result) {
	if t.rows > 0 {
		fmt.Fprintln(t.w)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d read from %s, %d %s", res.Scanned, printable(o.topic), res.Matched, plural(res.Matched, "matches", "match"))
	switch {
	case !t.replay:
	case cfg.DryRun:
		fmt.Fprintf(&b, ": %d would be replayed", res.Matched-res.Skipped)
	default:
		fmt.Fprintf(&b, ": %d replayed to %s", res.Replayed, plural(res.Replayed, "its original topic", "their original topics"))
		if cfg.Rate > 0 && !math.IsInf(cfg.Rate, 1) {
			fmt.Fprintf(&b, " (at most %s/s)", strconv.FormatFloat(cfg.Rate, 'f', -1, 64))
		}
	}
	if res.Skipped > 0 {
		if t.replay {
			fmt.Fprintf(&b, ", %d skipped", res.Skipped)
		} else {
			fmt.Fprintf(&b, ", %d of them cannot be replayed", res.Skipped)
		}
		fmt.Fprintf(&b, " (%s)", skipReasons(res.Messages))
	}
	if o.limit > 0 && res.Matched >= o.limit {
		fmt.Fprintf(&b, "; stopped at --limit %d", o.limit)
	}
	if t.replay && cfg.DryRun {
		b.WriteString("; dry run: nothing was published")
	}
	fmt.Fprintln(t.w, b.String())
	if t.replay && !cfg.DryRun && res.Replayed > 0 {
		fmt.Fprintln(t.w, "the poison topic keeps its records: the same replay run again publishes them again (narrow it with --since or --event-id); the consumers' claims absorb events applied twice")
	}
}

// skipReasons lists why messages were skipped, with their counts.
func skipReasons(ms []poison.Message) string {
	count := map[string]int{}
	var reasons []string
	for _, m := range ms {
		if m.Skipped == "" {
			continue
		}
		if count[m.Skipped] == 0 {
			reasons = append(reasons, m.Skipped)
		}
		count[m.Skipped]++
	}
	if len(reasons) == 1 {
		return reasons[0]
	}
	slices.Sort(reasons)
	for i, r := range reasons {
		reasons[i] = fmt.Sprintf("%d: %s", count[r], r)
	}
	return strings.Join(reasons, "; ")
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return printable(s)
}

// printable escapes control characters (newlines, terminal escapes) of text
// read from Kafka headers, as Go would quote them.
func printable(s string) string {
	if !strings.ContainsFunc(s, unicode.IsControl) {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		if unicode.IsControl(r) {
			q := strconv.QuoteRune(r)
			b.WriteString(q[1 : len(q)-1])
		} else {
			b.WriteRune(r)
		}
	}
	return b.String()
}

// streamRow writes one row of cells, each padded to its width and two
// spaces apart; the last cell is not padded.
func streamRow(w io.Writer, widths []int, cells ...string) {
	var b strings.Builder
	for i, c := range cells {
		if i > 0 {
			b.WriteString("  ")
		}
		b.WriteString(c)
		if i < len(cells)-1 {
			if pad := widths[i] - len([]rune(c)); pad > 0 {
				b.WriteString(strings.Repeat(" ", pad))
			}
		}
	}
	b.WriteByte('\n')
	_, _ = io.WriteString(w, b.String())
}

// poisonJSON is the --json document of poison list and poison replay:
// poison.Result with the topic and whether it was a dry run, and the error
// that stopped a replay (how far it got is in the counts).
type poisonJSON struct {
	Topic    string              `json:"topic"`
	DryRun   bool                `json:"dry_run"`
	Scanned  int                 `json:"scanned"`
	Matched  int                 `json:"matched"`
	Replayed int                 `json:"replayed"`
	Skipped  int                 `json:"skipped"`
	Messages []poisonMessageJSON `json:"messages"`
	Error    string              `json:"error,omitempty"`
}

// poisonMessageJSON is poison.Message with idemctl's times: UTC, null when
// there is none.
type poisonMessageJSON struct {
	Partition     int32               `json:"partition"`
	Offset        int64               `json:"offset"`
	PoisonedAt    ops.Time            `json:"poisoned_at"`
	UUID          string              `json:"uuid"`
	EventID       string              `json:"event_id"`
	OccurredAt    ops.Time            `json:"occurred_at"`
	OriginalTopic string              `json:"original_topic"`
	Reason        string              `json:"reason"`
	Handler       string              `json:"handler"`
	Subscriber    string              `json:"subscriber"`
	History       []poisonHistoryJSON `json:"history"`
	Replayed      bool                `json:"replayed"`
	Skipped       string              `json:"skipped"`
}

type poisonHistoryJSON struct {
	Reason     string   `json:"reason"`
	Topic      string   `json:"topic"`
	Handler    string   `json:"handler"`
	Subscriber string   `json:"subscriber"`
	Attempt    string   `json:"attempt"`
	PoisonedAt ops.Time `json:"poisoned_at"`
	ReplayedAt ops.Time `json:"replayed_at"`
}

func toPoisonJSON(m poison.Message) poisonMessageJSON {
	out := poisonMessageJSON{
		Partition: m.Partition, Offset: m.Offset, PoisonedAt: ops.Time(m.PoisonedAt), UUID: m.UUID,
		EventID: m.EventID, OccurredAt: ops.Time(m.OccurredAt), OriginalTopic: m.OriginalTopic,
		Reason: m.Reason, Handler: m.Handler, Subscriber: m.Subscriber, History: []poisonHistoryJSON{},
		Replayed: m.Replayed, Skipped: m.Skipped,
	}
	for _, h := range m.History {
		out.History = append(out.History, poisonHistoryJSON{h.Reason, h.Topic, h.Handler, h.Subscriber, h.Attempt,
			ops.Time(h.PoisonedAt), ops.Time(h.ReplayedAt)})
	}
	return out
}
