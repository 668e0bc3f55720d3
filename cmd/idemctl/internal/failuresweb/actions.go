package failuresweb

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/internal/auditsql"
)

// maxForm bounds an action's form: an edited payload fits.
const maxForm = 1 << 20

// action is one of the explorer's actions: the fields it posts, what it
// asks before, and what it runs.
type action struct {
	fields   []string
	batch    bool
	question func(f map[string]string) string
	run      func(e *failures.Explorer, ctx context.Context, a failures.Action) (auditsql.Entry, error)
}

var actions = map[string]action{
	"replay": {fields: []string{"topic", "partition", "offset"}, run: (*failures.Explorer).Replay,
		question: func(f map[string]string) string {
			return fmt.Sprintf("Replay record %s@%s of %s to its original topic? Its consumers apply it once: a second replay is a duplicate for their claims.", f["partition"], f["offset"], f["topic"])
		}},
	"discard": {fields: []string{"topic", "partition", "offset"}, run: (*failures.Explorer).Discard,
		question: func(f map[string]string) string {
			return fmt.Sprintf("Discard record %s@%s of %s? Nothing is published; the record is marked as handled and filtered replays leave it alone.", f["partition"], f["offset"], f["topic"])
		}},
	"edit-replay": {fields: []string{"topic", "partition", "offset", "payload"}, run: (*failures.Explorer).EditReplay,
		question: func(f map[string]string) string {
			return fmt.Sprintf("Replay record %s@%s of %s with this payload? It is checked against the event's contract first and keeps its event id; the original stays in the audit trail.", f["partition"], f["offset"], f["topic"])
		}},
	"replay-matching": {fields: []string{"topic"}, batch: true, run: (*failures.Explorer).Replay,
		question: func(f map[string]string) string {
			return fmt.Sprintf("Replay every record of %s that this filter selects (%s) and no action handled yet?", f["topic"], describe(f))
		}},
	"discard-matching": {fields: []string{"topic"}, batch: true, run: (*failures.Explorer).Discard,
		question: func(f map[string]string) string {
			return fmt.Sprintf("Discard every record of %s that this filter selects (%s) and no action handled yet?", f["topic"], describe(f))
		}},
}

// filterFields are the explorer's filter fields a batch action posts.
var filterFields = []string{"reason", "exact", "original", "handler", "since", "until"}

func describe(f map[string]string) string {
	var parts []string
	for _, k := range filterFields {
		if f[k] != "" {
			parts = append(parts, k+" "+strconv.Quote(f[k]))
		}
	}
	if len(parts) == 0 {
		return "no filter: every record"
	}
	return strings.Join(parts, ", ")
}

func (p *pages) refuse(w http.ResponseWriter, why string) {
	p.render(w, http.StatusForbidden, "result", &view{Page: "result", AllowActions: p.cfg.AllowActions, Error: "refused: " + why})
}

// action takes a POSTed action as the console's own actions are taken:
// refused when read-only, from another origin or without the session's
// CSRF token; without confirm=yes it shows the confirm page; with it, it
// needs the token and the operator's name, which the audit row records.
func (p *pages) action(w http.ResponseWriter, r *http.Request) {
	if !p.cfg.AllowActions {
		p.refuse(w, "the console is read-only (start idemctl serve with --allow-actions and a token)")
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxForm)
	if err := r.ParseForm(); err != nil {
		p.refuse(w, "unreadable form")
		return
	}
	if err := p.cfg.CheckFunc(r); err != nil {
		p.refuse(w, err.Error())
		return
	}
	name := r.PathValue("action")
	act, ok := actions[name]
	if !ok {
		http.NotFound(w, r)
		return
	}
	if p.cfg.Explorer == nil {
		p.refuse(w, "no Kafka brokers: start idemctl serve with --brokers")
		return
	}
	f := map[string]string{}
	for _, k := range act.fields {
		if f[k] = r.PostForm.Get(k); f[k] == "" {
			p.refuse(w, "missing "+k)
			return
		}
	}
	if act.batch {
		for _, k := range filterFields {
			if v := r.PostForm.Get(k); v != "" {
				f[k] = v
			}
		}
	}
	v := p.view(w, r, "confirm", 0)
	if r.PostForm.Get("confirm") != "yes" {
		v.Action, v.Fields, v.Question = name, f, act.question(f)
		if name == "edit-replay" {
			v.Preview = f["payload"]
		}
		p.render(w, http.StatusOK, "confirm", v)
		return
	}
	if !p.cfg.TokenFunc(r.PostForm.Get("token")) {
		p.refuse(w, "missing or wrong token")
		return
	}
	actor := strings.TrimSpace(r.PostForm.Get("actor"))
	if actor == "" || len(actor) > 64 || strings.ContainsFunc(actor, unicode.IsControl) {
		p.refuse(w, "your name (1 to 64 characters) is required: the audit trail records who acted")
		return
	}
	a, err := toAction(actor, f, act.batch)
	if err != nil {
		p.refuse(w, err.Error())
		return
	}
	entry, err := act.run(p.cfg.Explorer, r.Context(), a)
	v.Page, v.Data = "result", entry
	status := http.StatusOK
	switch {
	case entry.ID == 0 && err != nil: // refused before the trail, or the trail failed
		status, v.Error = http.StatusConflict, name+" failed: "+p.cfg.ErrorFunc(err)
		v.Data = nil
	case errors.Is(err, failures.ErrInvalidEdit):
		status = http.StatusUnprocessableEntity
	case err != nil:
		status = http.StatusConflict
	}
	p.render(w, status, "result", v)
}

// toAction builds the explorer's action from the posted fields.
func toAction(actor string, f map[string]string, batch bool) (failures.Action, error) {
	a := failures.Action{Actor: actor, Topic: f["topic"]}
	if batch {
		filter, err := query{Reason: f["reason"], ReasonExact: f["exact"] == "1", OriginalTopic: f["original"],
			Handler: f["handler"], Since: f["since"], Until: f["until"]}.filter(time.Now())
		if err != nil {
			return a, err
		}
		a.Filter = &filter
		return a, nil
	}
	part, err1 := strconv.ParseInt(f["partition"], 10, 32)
	off, err2 := strconv.ParseInt(f["offset"], 10, 64)
	if err1 != nil || err2 != nil || part < 0 || off < 0 {
		return a, errors.New("partition and offset must be numbers")
	}
	a.Locations = []auditsql.Location{{Partition: int32(part), Offset: off}}
	if p, ok := f["payload"]; ok {
		a.Payload = []byte(p)
	}
	return a, nil
}
