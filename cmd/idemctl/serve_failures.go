package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"flag"
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
	contracts    *string // --contracts: a directory of <event type>.json schemas
	poisonTopics *string // --poison-topics
}

func failuresFlags(fs *flag.FlagSet) failuresOptions {
	return failuresOptions{
		contracts:    fs.String("contracts", "", "a `directory` of <event type>.json JSON Schemas (contract.JSONSchema) that edit-and-replay checks an edited payload with (default: none, edits are refused)"),
		poisonTopics: fs.String("poison-topics", "", "with --brokers: the poison `topics` the failures explorer offers (default: every topic whose name has poison)"),
	}
}

// consoleKafka opens the console's Kafka side when brokers are named (else
// it does nothing): the overview's view of the poison and retry topics, and
// the failures explorer with its publisher. The returned function closes
// them.
func (a *app) consoleKafka(c *console, topics, groups []string, o failuresOptions) (func(), error) {
	c.poisonTopicsFlag = splitList(*o.poisonTopics)
	if a.opts.brokers == "" && a.getenv("KAFKA_BROKERS") == "" {
		return func() {}, nil
	}
	kc, err := a.kafkaConfig()
	if err != nil {
		return nil, err
	}
	var contracts failures.Contracts
	if *o.contracts != "" {
		if contracts, err = failures.LoadContracts(*o.contracts); err != nil {
			return nil, usageError("--contracts: %v", err)
		}
	}
	if c.kafka, err = newKafkaView(kc.Brokers, kc.Sarama, topics, groups); err != nil {
		return nil, err
	}
	pub, err := newPublisher(kc)
	if err != nil {
		c.kafka.close()
		return nil, err
	}
	if c.explorer, err = failures.New(failures.Config{DB: c.pool, Schema: c.table.Schema, Kafka: kc, Publisher: pub, Contracts: contracts}); err != nil {
		_ = pub.Close()
		c.kafka.close()
		return nil, err
	}
	return func() { _ = pub.Close(); c.kafka.close() }, nil
}

// newPublisher is a Kafka publisher keyed by partition_key, as poison
// replay's.
func newPublisher(kc idemkafka.ClientConfig) (*kafka.Publisher, error) {
	pc, err := idemkafka.WatermillPublisherConfig(kc)
	if err != nil {
		return nil, err
	}
	pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
	if err != nil {
		return nil, fmt.Errorf("kafka publisher: %w", err)
	}
	return pub, nil
}

// registerFailures mounts the failures explorer, history and audit pages
// with the console's session, CSRF, origin and token checks and its
// redaction.
func (s *server) registerFailures() error {
	return failuresweb.Register(s.mux, failuresweb.Config{
		Explorer:   s.c.explorer,
		DB:         s.c.pool,
		Schema:     s.c.table.Schema,
		TopicsFunc: func(ctx context.Context) ([]string, error) { return s.c.poisonTopics(s.c.poisonTopicsFlag) },
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
