package failuresweb

import (
	"bytes"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/components/poison"
	"github.com/idemkit/watermill-idempotency/internal/dbx"
)

//go:embed web
var webFS embed.FS

// Config is what the pages need from the console.
type Config struct {
	// Explorer reads and acts on the poison topics; nil without Kafka
	// brokers (the explorer page says so).
	Explorer *failures.Explorer
	// DB and Schema hold the audit trail and the heartbeat table.
	DB     dbx.Querier
	Schema string
	// TopicsFunc lists the poison topics the explorer offers.
	TopicsFunc func(ctx context.Context) ([]string, error)
	// DeadFunc, when set, returns the outbox topics with dead rows.
	DeadFunc func(ctx context.Context) ([]DeadTopic, error)
	// AllowActions, Token: the console's --allow-actions and token.
	AllowActions bool
	Token        []byte
	// SessionFunc gives the browser a session when it has none and returns
	// its CSRF token; CheckFunc refuses a POST from another origin or
	// without the session's CSRF token, and checks a typed token.
	SessionFunc func(w http.ResponseWriter, r *http.Request) string
	CheckFunc   func(r *http.Request) error
	TokenFunc   func(typed string) bool
	// RedactFunc masks secrets in a page.
	RedactFunc func(string) string
	// ErrorFunc turns an error into what a page shows.
	ErrorFunc func(error) string
	// RefreshSeconds is the history page's refresh.
	RefreshSeconds int
	// Layout is the console's layout template (its layout.html, which
	// defines the blocks "title" and "content"), so that these pages look
	// and navigate as the others do. Required.
	Layout string
}

// DeadTopic is an outbox topic's dead rows.
type DeadTopic struct {
	Topic string `json:"topic"`
	Dead  int64  `json:"dead"`
}

type pages struct {
	cfg  Config
	tmpl map[string]*template.Template
}

// view is what a page's template gets.
type view struct {
	Page           string
	Data           any
	Error          string
	AllowActions   bool
	CSRF           string
	RefreshSeconds int
	Action         string
	Fields         map[string]string
	Question       string
	Preview        string
}

// Register mounts the pages on mux: GET /failures, /failures/record,
// /audit, /history (and /api/failures, /api/audit, /api/history), POST
// /failures/actions/{action}.
func Register(mux *http.ServeMux, cfg Config) error {
	p := &pages{cfg: cfg, tmpl: map[string]*template.Template{}}
	funcs := template.FuncMap{
		"when": func(t time.Time) string {
			if t.IsZero() {
				return "-"
			}
			return t.UTC().Format("2006-01-02 15:04:05Z")
		},
		"ago": func(d time.Duration) string { return d.Round(time.Second).String() },
		// svg marks a chart of package svgchart, which escapes its text, as
		// safe markup.
		"svg": func(s string) template.HTML { return template.HTML(s) }, //nolint:gosec // svgchart escapes
	}
	for _, name := range []string{"failures", "record", "confirm", "result", "audit", "history"} {
		t, err := template.New("layout.html").Funcs(funcs).Parse(cfg.Layout)
		if err == nil {
			t, err = t.ParseFS(webFS, "web/"+name+".html")
		}
		if err != nil {
			return err
		}
		p.tmpl[name] = t
	}
	mux.HandleFunc("GET /failures", p.page("failures", 0, p.explorer))
	mux.HandleFunc("GET /api/failures", p.api(p.explorer))
	mux.HandleFunc("GET /failures/record", p.page("record", 0, p.record))
	mux.HandleFunc("GET /api/failures/record", p.api(p.record))
	mux.HandleFunc("GET /audit", p.page("audit", 0, p.audit))
	mux.HandleFunc("GET /api/audit", p.api(p.audit))
	mux.HandleFunc("GET /history", p.page("history", cfg.RefreshSeconds, p.history))
	mux.HandleFunc("GET /api/history", p.api(p.history))
	mux.HandleFunc("POST /failures/actions/{action}", p.action)
	return nil
}

func (p *pages) view(w http.ResponseWriter, r *http.Request, name string, refresh int) *view {
	v := &view{Page: name, AllowActions: p.cfg.AllowActions, RefreshSeconds: refresh}
	if p.cfg.AllowActions {
		v.CSRF = p.cfg.SessionFunc(w, r)
	}
	return v
}

func (p *pages) page(name string, refresh int, load func(*http.Request) (any, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		v := p.view(w, r, name, refresh)
		data, err := load(r)
		v.Data = data
		status := http.StatusOK
		if err != nil {
			status, v.Error = p.status(err)
		}
		p.render(w, status, name, v)
	}
}

func (p *pages) api(load func(*http.Request) (any, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		data, err := load(r)
		status := http.StatusOK
		if err != nil {
			var msg string
			status, msg = p.status(err)
			data = struct {
				Error string `json:"error"`
			}{msg}
		}
		var buf bytes.Buffer
		enc := json.NewEncoder(&buf)
		enc.SetIndent("", "  ")
		_ = enc.Encode(data)
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, p.cfg.RedactFunc(buf.String()))
	}
}

// errBadRequest marks a request's invalid parameters.
var errBadRequest = errors.New("bad request")

func badRequest(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errBadRequest, fmt.Sprintf(format, args...))
}

func (p *pages) status(err error) (int, string) {
	switch {
	case errors.Is(err, errBadRequest):
		return http.StatusBadRequest, err.Error()
	case errors.Is(err, failures.ErrNoRecord):
		return http.StatusNotFound, err.Error()
	case errors.Is(err, failures.ErrInvalidEdit):
		return http.StatusUnprocessableEntity, err.Error()
	}
	return http.StatusInternalServerError, p.cfg.ErrorFunc(err)
}

func (p *pages) render(w http.ResponseWriter, status int, name string, v *view) {
	var buf bytes.Buffer
	if err := p.tmpl[name].Execute(&buf, v); err != nil {
		buf.Reset()
		buf.WriteString("<p>template error: " + template.HTMLEscapeString(err.Error()) + "</p>")
		status = http.StatusInternalServerError
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, p.cfg.RedactFunc(buf.String()))
}

// query is the explorer's filter as typed.
type query struct {
	Reason        string
	ReasonExact   bool
	OriginalTopic string
	Handler       string
	Since, Until  string
}

func (q query) filter(now time.Time) (poison.Filter, error) {
	f := poison.Filter{Reason: q.Reason, ReasonExact: q.ReasonExact && q.Reason != "", OriginalTopic: q.OriginalTopic, Handler: q.Handler}
	var err error
	if f.PoisonedFrom, err = parseTime(q.Since, now); err != nil {
		return f, badRequest("since: %v", err)
	}
	if f.PoisonedTo, err = parseTime(q.Until, now); err != nil {
		return f, badRequest("until: %v", err)
	}
	if !f.PoisonedFrom.IsZero() && !f.PoisonedTo.IsZero() && !f.PoisonedFrom.Before(f.PoisonedTo) {
		return f, badRequest("since must be before until")
	}
	return f, nil
}

// parseTime reads RFC 3339 or a duration before now ("2h"); "" is zero.
func parseTime(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, fmt.Errorf("%q is neither an RFC 3339 time nor a duration ago (2h)", s)
}

func readQuery(v url.Values) query {
	return query{Reason: v.Get("reason"), ReasonExact: v.Get("exact") == "1", OriginalTopic: v.Get("original"),
		Handler: v.Get("handler"), Since: v.Get("since"), Until: v.Get("until")}
}

func (q query) values(topic string) url.Values {
	v := url.Values{"topic": {topic}}
	for k, s := range map[string]string{"reason": q.Reason, "original": q.OriginalTopic, "handler": q.Handler, "since": q.Since, "until": q.Until} {
		if s != "" {
			v.Set(k, s)
		}
	}
	if q.ReasonExact {
		v.Set("exact", "1")
	}
	return v
}

// parseFrom reads "0:120,1:98" (partition:offset pairs).
func parseFrom(s string) (map[int32]int64, error) {
	if s == "" {
		return nil, nil
	}
	out := map[int32]int64{}
	for _, pair := range strings.Split(s, ",") {
		ps, os, ok := strings.Cut(pair, ":")
		p, err1 := strconv.ParseInt(ps, 10, 32)
		o, err2 := strconv.ParseInt(os, 10, 64)
		if !ok || err1 != nil || err2 != nil || p < 0 || o < 0 {
			return nil, badRequest("from: %q is not partition:offset", pair)
		}
		out[int32(p)] = o
	}
	return out, nil
}

func formatFrom(m map[int32]int64) string {
	parts := make([]int32, 0, len(m))
	for p := range m {
		parts = append(parts, p)
	}
	slices.Sort(parts)
	s := make([]string, len(parts))
	for i, p := range parts {
		s[i] = fmt.Sprintf("%d:%d", p, m[p])
	}
	return strings.Join(s, ",")
}
