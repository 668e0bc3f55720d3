package console

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"io/fs"
	"net/http"
	"time"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failuresweb"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
)

// registerFailures mounts the failures explorer, history and audit pages
// (package failuresweb) with the console's session, CSRF, origin and token
// checks and its redaction.
func (s *Server) registerFailures() error {
	layout, err := fs.ReadFile(webFS, "web/layout.html")
	if err != nil {
		return err
	}
	return failuresweb.Register(s.mux, failuresweb.Config{
		Layout:   string(layout),
		Explorer: s.cfg.Explorer,
		DB:       s.cfg.Pool,
		Schema:   s.cfg.Table.Schema,
		TopicsFunc: func(context.Context) ([]string, error) {
			if s.cfg.Kafka == nil {
				return nil, nil
			}
			return s.cfg.Kafka.PoisonTopics(s.cfg.PoisonTopics)
		},
		DeadFunc: func(ctx context.Context) ([]failuresweb.DeadTopic, error) {
			bl, err := s.c.ReadBacklog(ctx)
			if err != nil {
				return nil, err
			}
			var out []failuresweb.DeadTopic
			for _, t := range bl.Topics {
				if t.Dead > 0 {
					out = append(out, failuresweb.DeadTopic{Topic: t.Topic, Dead: t.Dead})
				}
			}
			return out, nil
		},
		AllowActions: s.cfg.AllowActions,
		SessionFunc:  func(w http.ResponseWriter, r *http.Request) string { return s.view(w, r, "").CSRF },
		CheckFunc: func(r *http.Request) error {
			if err := sameOrigin(r); err != nil {
				return err
			}
			ck, err := r.Cookie(sessionCookie)
			if err != nil || subtle.ConstantTimeCompare([]byte(r.PostForm.Get("csrf")), []byte(s.csrf(ck.Value))) != 1 {
				return errors.New("missing or wrong CSRF token: reload the page and try again")
			}
			return nil
		},
		TokenFunc: func(typed string) bool {
			// Hashed first, so that the comparison takes the same time
			// whatever the length typed.
			t, want := sha256.Sum256([]byte(typed)), sha256.Sum256(s.token)
			return subtle.ConstantTimeCompare(t[:], want[:]) == 1
		},
		RedactFunc:     s.redact,
		ErrorFunc:      ops.Describe,
		RefreshSeconds: int(s.cfg.Refresh / time.Second),
	})
}

// overviewPage is the overview's HTML page: the overview and, when the
// heartbeat table exists, the last hour's charts.
type overviewPage struct {
	*ops.OverviewPage
	History *failures.History
}

func (s *Server) overviewPage(r *http.Request) (any, error) {
	out := &overviewPage{OverviewPage: s.c.Overview(r.Context())}
	h, err := failures.ReadHistory(r.Context(), s.cfg.Pool, s.cfg.Table.Schema, time.Hour, time.Minute)
	switch {
	case err == nil:
		out.History = h
	case errors.Is(err, failures.ErrNoHistory): // the overview without history
	default:
		out.Errors["history"] = ops.Describe(err)
	}
	return out, nil
}
