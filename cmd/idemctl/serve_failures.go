package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failuresweb"
	"github.com/idemkit/watermill-idempotency/idemkafka"
)

// failuresOptions are serve's flags for the failures explorer.
type failuresOptions struct {
	contracts string // --contracts: a directory of <event type>.json schemas
}

// failuresExplorer opens the explorer's Kafka side: nil without brokers.
// The returned function closes its publisher.
func (a *app) failuresExplorer(c *console, o failuresOptions) (*failures.Explorer, func(), error) {
	if a.opts.brokers == "" && a.getenv("KAFKA_BROKERS") == "" {
		return nil, func() {}, nil
	}
	kc, err := a.kafkaConfig()
	if err != nil {
		return nil, nil, err
	}
	var contracts failures.Contracts
	if o.contracts != "" {
		if contracts, err = failures.LoadContracts(o.contracts); err != nil {
			return nil, nil, usageError("--contracts: %v", err)
		}
	}
	pc, err := idemkafka.WatermillPublisherConfig(kc)
	if err != nil {
		return nil, nil, err
	}
	pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
	if err != nil {
		return nil, nil, fmt.Errorf("kafka publisher: %w", err)
	}
	e, err := failures.New(failures.Config{DB: c.pool, Schema: c.table.Schema, Kafka: kc, Publisher: pub, Contracts: contracts})
	if err != nil {
		_ = pub.Close()
		return nil, nil, err
	}
	return e, func() { _ = pub.Close() }, nil
}

// registerFailures mounts the failures explorer, history and audit pages
// with the console's session, CSRF, origin and token checks and its
// redaction.
func (s *server) registerFailures(e *failures.Explorer, poisonTopics []string) error {
	return failuresweb.Register(s.mux, failuresweb.Config{
		Explorer:   e,
		DB:         s.c.pool,
		Schema:     s.c.table.Schema,
		TopicsFunc: func(ctx context.Context) ([]string, error) { return s.c.poisonTopics(poisonTopics) },
		DeadFunc: func(ctx context.Context) ([]failuresweb.DeadTopic, error) {
			bl, err := s.c.backlog(ctx)
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
		AllowActions: s.allow,
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
		ErrorFunc:      consoleError,
		RefreshSeconds: int(s.refresh.Seconds()),
	})
}

// poisonTopics are --poison-topics, else the topics whose name has
// "poison" (none without --brokers).
func (c *console) poisonTopics(flag []string) ([]string, error) {
	if len(flag) > 0 || c.kafka == nil {
		return flag, nil
	}
	c.kafka.mu.Lock()
	defer c.kafka.mu.Unlock()
	if err := c.kafka.client.RefreshMetadata(); err != nil {
		return nil, fmt.Errorf("kafka metadata: %w", err)
	}
	all, err := c.kafka.client.Topics()
	if err != nil {
		return nil, fmt.Errorf("kafka topics: %w", err)
	}
	var out []string
	for _, t := range all {
		if strings.Contains(t, "poison") {
			out = append(out, t)
		}
	}
	slices.Sort(out)
	return out, nil
}
