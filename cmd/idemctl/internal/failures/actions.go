package failures

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/internal/auditsql"
)

// Action is what an operator asked for, on the records of one poison
// topic: the ones at Locations, or every record Filter selects that no
// earlier action did (at most Config.BatchLimit read).
type Action struct {
	// Actor is the name given with the console's token. Required.
	Actor string
	// Topic is the poison topic. Required.
	Topic     string
	Locations []auditsql.Location
	Filter    *poison.Filter
	// Payload is the edited payload of edit-and-replay (one location).
	Payload []byte
}

// ErrNothingSelected: the action names no record.
var ErrNothingSelected = errors.New("failures: the action selects no record")

// Replay publishes the records back to their original topics (see
// poison.Record.Republish) and writes the audit row. A record that cannot
// be replayed (no topic_poisoned, or the poison topic itself) is skipped and
// named in the row's detail; a publish error stops the action, and the row
// lists what was replayed before it.
func (e *Explorer) Replay(ctx context.Context, a Action) (auditsql.Entry, error) {
	return e.act(ctx, a, auditsql.ActionReplay, func(r poison.Record) error {
		return r.Republish(e.cfg.Publisher, nil, e.cfg.NowFunc())
	})
}

// Discard marks the records as handled, without publishing anything (Kafka
// cannot delete a record): the explorer shows them as discarded and
// filtered actions leave them alone.
func (e *Explorer) Discard(ctx context.Context, a Action) (auditsql.Entry, error) {
	return e.act(ctx, a, auditsql.ActionDiscard, func(poison.Record) error { return nil })
}

// EditReplay replays one record with a.Payload in place of its payload,
// once the edit passes the event's contract and keeps its event id
// ([ErrInvalidEdit] otherwise, written to the audit trail as refused). The
// audit row keeps the original payload.
func (e *Explorer) EditReplay(ctx context.Context, a Action) (auditsql.Entry, error) {
	if len(a.Locations) != 1 || a.Filter != nil {
		return auditsql.Entry{}, errors.New("failures: edit-and-replay acts on one record")
	}
	if err := e.check(a); err != nil {
		return auditsql.Entry{}, err
	}
	l := a.Locations[0]
	r, err := e.get(ctx, a.Topic, l.Partition, l.Offset)
	if err != nil {
		return auditsql.Entry{}, err
	}
	entry := auditsql.Entry{Actor: a.Actor, Action: auditsql.ActionEditReplay, Topic: a.Topic,
		Messages: []auditsql.Message{{Partition: l.Partition, Offset: l.Offset, EventID: r.EventID, Original: r.Payload}}}
	cause := e.cfg.Contracts.checkEdit(a.Payload, r.EventID, r.Metadata.Get(metadataEventType))
	if cause == nil {
		cause = replayable(*r, a.Topic)
	}
	if cause == nil {
		cause = r.Republish(e.cfg.Publisher, a.Payload, e.cfg.NowFunc())
		if cause != nil {
			entry.Messages = nil
		}
	}
	switch {
	case cause == nil:
		entry.Result, entry.Detail = auditsql.ResultOK, fmt.Sprintf("replayed to %s with an edited payload (%d bytes, was %d)", r.OriginalTopic, len(a.Payload), len(r.Payload))
	case errors.Is(cause, ErrInvalidEdit):
		entry.Result, entry.Detail = auditsql.ResultRefused, cause.Error()
	default:
		entry.Result, entry.Detail = auditsql.ResultFailed, cause.Error()
	}
	return e.record(ctx, entry, cause)
}

func (e *Explorer) check(a Action) error {
	switch {
	case a.Actor == "":
		return errors.New("failures: an action needs the actor's name")
	case a.Topic == "":
		return errors.New("failures: an action needs its poison topic")
	case len(a.Locations) == 0 && a.Filter == nil:
		return ErrNothingSelected
	case e.cfg.Publisher == nil:
		return errNoPublisher
	}
	return nil
}

// replayable says why r cannot go back, nil if it can.
func replayable(r poison.Record, topic string) error {
	switch {
	case r.Skipped != "":
		return errors.New(r.Skipped)
	case r.OriginalTopic == topic:
		return errors.New("topic_poisoned is the poison topic itself")
	}
	return nil
}

// act runs do on each selected record and writes the audit row.
func (e *Explorer) act(ctx context.Context, a Action, action string, do func(poison.Record) error) (auditsql.Entry, error) {
	if err := e.check(a); err != nil {
		return auditsql.Entry{}, err
	}
	recs, err := e.selected(ctx, a)
	if err != nil {
		return auditsql.Entry{}, err
	}
	entry := auditsql.Entry{Actor: a.Actor, Action: action, Topic: a.Topic}
	if a.Filter != nil {
		entry.Filter = filterJSON(*a.Filter)
	}
	var skipped []string
	var cause error
	for _, r := range recs {
		if action == auditsql.ActionReplay {
			if why := replayable(r, a.Topic); why != nil {
				skipped = append(skipped, fmt.Sprintf("%d@%d: %v", r.Partition, r.Offset, why))
				continue
			}
		}
		if cause = do(r); cause != nil {
			break
		}
		entry.Messages = append(entry.Messages, auditsql.Message{Partition: r.Partition, Offset: r.Offset, EventID: r.EventID})
	}
	entry.Result, entry.Detail = auditsql.ResultOK, fmt.Sprintf("%d of %d selected", len(entry.Messages), len(recs))
	if len(skipped) > 0 {
		entry.Detail += fmt.Sprintf("; %d skipped: %v", len(skipped), skipped)
	}
	if cause != nil {
		entry.Result = auditsql.ResultFailed
		entry.Detail += "; stopped: " + cause.Error()
	}
	return e.record(ctx, entry, cause)
}

// selected reads the records an action names.
func (e *Explorer) selected(ctx context.Context, a Action) ([]poison.Record, error) {
	if a.Filter == nil {
		out := make([]poison.Record, 0, len(a.Locations))
		for _, l := range a.Locations {
			r, err := e.get(ctx, a.Topic, l.Partition, l.Offset)
			if err != nil {
				return nil, err
			}
			out = append(out, *r)
		}
		return out, nil
	}
	var out []poison.Record
	var from map[int32]int64
	for read := 0; read < e.cfg.BatchLimit; {
		p, err := e.Page(ctx, a.Topic, *a.Filter, from, 500)
		if err != nil {
			return nil, err
		}
		for _, r := range p.Rows {
			if r.Done == nil {
				out = append(out, r.Record)
			}
		}
		read += p.Scanned
		if p.End || p.Scanned == 0 {
			break
		}
		from = p.Next
	}
	return out, nil
}

// record writes entry; cause, when set, is returned with it.
func (e *Explorer) record(ctx context.Context, entry auditsql.Entry, cause error) (auditsql.Entry, error) {
	id, at, err := auditsql.Append(context.WithoutCancel(ctx), e.cfg.DB, e.cfg.Schema, entry)
	if err != nil {
		return entry, errors.Join(cause, fmt.Errorf("failures: %s done (%s) but its audit row was not written: %w", entry.Action, entry.Result, err))
	}
	entry.ID, entry.At, entry.MessageCount = id, at, len(entry.Messages)
	return entry, cause
}

// filterJSON is the fields of f that are set, for the audit trail.
func filterJSON(f poison.Filter) json.RawMessage {
	m := map[string]any{}
	if f.Reason != "" {
		m["reason"], m["reason_exact"] = f.Reason, f.ReasonExact
	}
	if len(f.EventIDs) > 0 {
		m["event_ids"] = f.EventIDs
	}
	if f.OriginalTopic != "" {
		m["original_topic"] = f.OriginalTopic
	}
	if f.Handler != "" {
		m["handler"] = f.Handler
	}
	for k, t := range map[string]time.Time{"poisoned_from": f.PoisonedFrom, "poisoned_to": f.PoisonedTo,
		"occurred_from": f.OccurredFrom, "occurred_to": f.OccurredTo} {
		if !t.IsZero() {
			m[k] = t.UTC()
		}
	}
	b, _ := json.Marshal(m)
	return b
}
