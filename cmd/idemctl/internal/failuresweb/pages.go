package failuresweb

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"time"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/internal/auditsql"
)

const (
	pageSize     = 50
	reasonWindow = 2000
	auditPage    = 100
)

// explorerData is the failures page and /api/failures.
type explorerData struct {
	Topics        []string          `json:"topics"`
	Topic         string            `json:"topic"`
	Q             query             `json:"filter"`
	From          string            `json:"from"`
	Page          *failures.Page    `json:"-"`
	Records       []recordJSON      `json:"records"`
	Next          string            `json:"next"`
	End           bool              `json:"end"`
	Depth         int64             `json:"depth"`
	Reasons       []failures.Reason `json:"reasons"`
	ReasonWindow  int               `json:"reason_window"`
	ReasonScanned int               `json:"reason_scanned"`
	Dead          []DeadTopic       `json:"dead"`
	values        url.Values
}

// recordJSON is a page's record without its payload and headers.
type recordJSON struct {
	Partition     int32                 `json:"partition"`
	Offset        int64                 `json:"offset"`
	EventID       string                `json:"event_id"`
	PoisonedAt    time.Time             `json:"poisoned_at"`
	OriginalTopic string                `json:"original_topic"`
	Reason        string                `json:"reason"`
	Replays       int                   `json:"replays"`
	Done          *auditsql.Disposition `json:"done"`
}

func (d *explorerData) FromText() string {
	if d.From == "" {
		return "the oldest records"
	}
	return d.From
}

func (d *explorerData) link(path string, extra url.Values) string {
	v := url.Values{}
	for k, vs := range d.values {
		v[k] = vs
	}
	for k, vs := range extra {
		v[k] = vs
	}
	return path + "?" + v.Encode()
}

// FirstLink, NextLink, ReasonLink and DetailLink are the page's links.
func (d *explorerData) FirstLink() string { return d.link("/failures", nil) }
func (d *explorerData) NextLink() string  { return d.link("/failures", url.Values{"from": {d.Next}}) }
func (d *explorerData) ReasonLink(reason string) string {
	return d.link("/failures", url.Values{"reason": {reason}, "exact": {"1"}})
}
func (d *explorerData) DetailLink(partition int32, offset int64) string {
	return "/failures/record?" + url.Values{"topic": {d.Topic}, "partition": {strconv.Itoa(int(partition))},
		"offset": {strconv.FormatInt(offset, 10)}}.Encode()
}

func (p *pages) explorer(r *http.Request) (any, error) {
	ctx := r.Context()
	d := &explorerData{Q: readQuery(r.URL.Query()), Topic: r.URL.Query().Get("topic"), From: r.URL.Query().Get("from"),
		ReasonWindow: reasonWindow, Records: []recordJSON{}}
	var err error
	if p.cfg.DeadFunc != nil {
		if d.Dead, err = p.cfg.DeadFunc(ctx); err != nil {
			return d, err
		}
	}
	if p.cfg.Explorer == nil {
		return d, errors.New("no Kafka brokers: start idemctl serve with --brokers (or KAFKA_BROKERS) to read the poison topics")
	}
	if d.Topics, err = p.cfg.TopicsFunc(ctx); err != nil {
		return d, err
	}
	if d.Topic == "" && len(d.Topics) > 0 {
		d.Topic = d.Topics[0]
	}
	if d.Topic == "" {
		return d, nil
	}
	if !slices.Contains(d.Topics, d.Topic) {
		d.Topics = append(d.Topics, d.Topic)
	}
	d.values = d.Q.values(d.Topic)
	filter, err := d.Q.filter(time.Now())
	if err != nil {
		return d, err
	}
	from, err := parseFrom(d.From)
	if err != nil {
		return d, err
	}
	if d.Page, err = p.cfg.Explorer.Page(ctx, d.Topic, filter, from, pageSize); err != nil {
		return d, err
	}
	d.Next, d.End, d.Depth = formatFrom(d.Page.Next), d.Page.End, d.Page.Depth
	for _, row := range d.Page.Rows {
		d.Records = append(d.Records, recordJSON{row.Partition, row.Offset, row.EventID, row.PoisonedAt, row.OriginalTopic,
			row.Reason, len(row.History), row.Done})
	}
	d.Reasons, d.ReasonScanned, err = p.cfg.Explorer.Reasons(ctx, d.Topic, filter, reasonWindow)
	return d, err
}

// recordData is the record page and /api/failures/record.
type recordData struct {
	Topic   string        `json:"topic"`
	Row     *failures.Row `json:"record"`
	Headers []header      `json:"headers"`
	Payload string        `json:"payload"`
	Attempt string        `json:"attempt"`
	TraceID string        `json:"trace_id"`
}

type header struct {
	K string `json:"key"`
	V string `json:"value"`
}

func (p *pages) record(r *http.Request) (any, error) {
	if p.cfg.Explorer == nil {
		return nil, errors.New("no Kafka brokers: start idemctl serve with --brokers")
	}
	q := r.URL.Query()
	part, err1 := strconv.ParseInt(q.Get("partition"), 10, 32)
	off, err2 := strconv.ParseInt(q.Get("offset"), 10, 64)
	if q.Get("topic") == "" || err1 != nil || err2 != nil {
		return nil, badRequest("topic, partition and offset are required")
	}
	row, err := p.cfg.Explorer.Detail(r.Context(), q.Get("topic"), int32(part), off)
	if err != nil {
		return nil, err
	}
	d := &recordData{Topic: q.Get("topic"), Row: row, Payload: prettyJSON(row.Payload),
		Attempt: row.Metadata.Get("retry_attempt"), TraceID: traceID(row.Metadata.Get("traceparent"))}
	for k, v := range row.Metadata {
		d.Headers = append(d.Headers, header{k, v})
	}
	slices.SortFunc(d.Headers, func(a, b header) int {
		if a.K < b.K {
			return -1
		}
		return 1
	})
	return d, nil
}

// traceID is the trace id of a W3C traceparent ("00-<trace>-<span>-01").
func traceID(tp string) string {
	if len(tp) == 55 && tp[2] == '-' && tp[35] == '-' {
		return tp[3:35]
	}
	return ""
}

// prettyJSON indents a JSON payload, or returns it as text.
func prettyJSON(b []byte) string {
	var out bytes.Buffer
	if json.Indent(&out, b, "", "  ") == nil {
		return out.String()
	}
	return string(b)
}

// auditData is the audit page and /api/audit.
type auditData struct {
	Entries []auditsql.Entry `json:"entries"`
	More    bool             `json:"more"`
	Before  int64            `json:"before"`
}

func (p *pages) audit(r *http.Request) (any, error) {
	var before int64
	if s := r.URL.Query().Get("before"); s != "" {
		var err error
		if before, err = strconv.ParseInt(s, 10, 64); err != nil || before < 0 {
			return nil, badRequest("before: %q is not an audit id", s)
		}
	}
	es, err := auditsql.List(r.Context(), p.cfg.DB, p.cfg.Schema, before, auditPage+1)
	if err != nil {
		return nil, err
	}
	d := &auditData{Entries: es}
	if len(es) > auditPage {
		d.Entries, d.More, d.Before = es[:auditPage], true, es[auditPage-1].ID
	}
	return d, nil
}

func (p *pages) history(r *http.Request) (any, error) {
	return failures.ReadHistory(r.Context(), p.cfg.DB, p.cfg.Schema, time.Hour, time.Minute)
}
