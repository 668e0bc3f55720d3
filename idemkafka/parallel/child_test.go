package parallel_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// childEnv makes the test binary run as one consumer process (see
// runChildIfAsked), so that a test can SIGKILL it: a real process death,
// where the member never leaves its group, its connections drop and its
// open transactions roll back.
const childEnv = "IDEMKAFKA_TEST_CONSUMER"

type childConfig struct {
	DatabaseURL string   `json:"database_url"`
	Schema      string   `json:"schema"`
	Brokers     []string `json:"brokers"`
	Topic       string   `json:"topic"`
	Group       string   `json:"group"`
	GroupCommit bool     `json:"group_commit"`
	ClientID    string   `json:"client_id"`
}

// runChildIfAsked runs a ledger consumer until SIGTERM or until its
// standard input closes, then exits, when childEnv is set.
func runChildIfAsked() {
	v, ok := os.LookupEnv(childEnv)
	if !ok {
		return
	}
	var cfg childConfig
	if err := json.Unmarshal([]byte(v), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if err := runChild(cfg); err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runChild(cfg childConfig) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		stop()
	}()
	pc, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return err
	}
	pc.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return err
	}
	defer pool.Close()
	// IDEM_CHILD_LOG=1 makes each consumer process log (info) to the
	// test's standard error, with its Stats every 5 s.
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if os.Getenv("IDEM_CHILD_LOG") != "" {
		logger = watermill.NewStdLoggerWithOut(os.Stderr, false, false).With(watermill.LogFields{"pid": os.Getpid()})
		sarama.Logger = log.New(os.Stderr, fmt.Sprintf("[sarama %d] ", os.Getpid()), log.LstdFlags|log.Lmicroseconds)
	}
	sc := sarama.NewConfig()
	sc.ClientID = cfg.ClientID
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
		Client:        idemkafka.ClientConfig{Brokers: cfg.Brokers, Sarama: sc, RevokeTimeout: 5 * time.Second},
		ConsumerGroup: cfg.Group, MaxInFlight: 8, NackResendSleep: 10 * time.Millisecond,
	}, logger)
	if err != nil {
		return err
	}
	if os.Getenv("IDEM_CHILD_LOG") != "" {
		go func() {
			for range time.Tick(5 * time.Second) {
				logger.Info("stats", watermill.LogFields{"stats": fmt.Sprintf("%+v", sub.Stats())})
			}
		}()
	}
	dc := idem.Config{DB: pool, ConsumerGroup: "ledger", Table: deduplicator.TableConfig{Schema: cfg.Schema}}
	if cfg.GroupCommit {
		dc.Mode = &idem.GroupCommitConfig{Concurrency: 2}
	}
	d, err := idem.NewDedup(dc, nil)
	if err != nil {
		return err
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	r.AddMiddleware(wmiddleware.Retry{MaxRetries: 1, InitialInterval: time.Millisecond}.Middleware, d.Middleware)
	h := ledgerHandler(func(event) error {
		time.Sleep(2 * time.Millisecond)
		return nil
	})
	r.AddConsumerHandler("ledger", cfg.Topic, sub, func(m *message.Message) error { _, err := h(m); return err })
	return r.Run(ctx)
}

// startChild starts a consumer process whose Kafka client id is name; the
// test kills what is left.
func (f *fixture) startChild(t *testing.T, group string, groupCommit bool, name string) *exec.Cmd {
	t.Helper()
	b, err := json.Marshal(childConfig{
		DatabaseURL: f.db.URL, Schema: f.db.Schema, Brokers: f.broker.Addrs,
		Topic: f.topic, Group: group, GroupCommit: groupCommit, ClientID: name,
	})
	require.NoError(t, err)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(b))
	cmd.Stderr = os.Stderr
	_, err = cmd.StdinPipe() // closed when the test process dies
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

// Consumer processes killed with SIGKILL mid-stream, and others joining:
// each key's events are still applied once each, in order.
//
// Each kill lands on a member that holds partitions in a stable group; the
// soak kills members anywhere, including between JoinGroup and its answer,
// which the broker handles as Kafka does
// (TestBrokerExpiresAMemberThatDiedInJoin).
func TestSubscriberSurvivesSIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("kills processes and waits for the group's session timeout")
	}
	for _, groupCommit := range []bool{false, true} {
		t.Run(fmt.Sprintf("group_commit=%v", groupCommit), func(t *testing.T) {
			const keys, perKey = 60, 20
			f := newFixture(t, 4, 2)
			stopWatch := f.watchGroup(t, "kill")
			defer stopWatch()
			// The first half of each key's events now, the second half
			// just before the second kill, so that both kills land
			// mid-stream.
			f.produceSeqs(t, keys, 1, perKey/2)
			a := f.startChild(t, "kill", groupCommit, "a")
			b := f.startChild(t, "kill", groupCommit, "b")
			waitFor(t, "some events applied", func() bool { return f.db.Count(t, "SELECT 1 FROM ledger") >= 150 })
			f.waitOwners(t, "kill", "a", "b")
			require.NoError(t, a.Process.Signal(syscall.SIGKILL))
			_ = a.Wait()
			waitFor(t, "more events applied", func() bool { return f.db.Count(t, "SELECT 1 FROM ledger") >= 300 })
			f.startChild(t, "kill", groupCommit, "c")
			f.waitOwners(t, "kill", "b", "c")
			f.produceSeqs(t, keys, perKey/2+1, perKey)
			waitFor(t, "events of the second half applied", func() bool { return f.db.Count(t, "SELECT 1 FROM ledger") > keys*perKey/2 })
			require.NoError(t, b.Process.Signal(syscall.SIGKILL))
			_ = b.Wait()
			killedAt := f.db.Count(t, "SELECT 1 FROM ledger")
			f.startChild(t, "kill", groupCommit, "d")
			start := time.Now()
			f.waitApplied(t, keys*perKey)
			t.Logf("the rest (%d events) applied %.1fs after the second kill", keys*perKey-killedAt, time.Since(start).Seconds())
			f.verifyLedger(t, keys, perKey)
		})
	}
}

// Instances join and leave the group (Close: revocation with messages in
// flight) while the events flow: each key's events are applied once each,
// in order.
func TestSubscriberInstancesJoinAndLeave(t *testing.T) {
	const keys, perKey = 50, 20
	f := newFixture(t, 4, 8)
	f.produce(t, keys, perKey)
	slow := ledgerHandler(func(event) error {
		time.Sleep(3 * time.Millisecond)
		return nil
	})
	start := func() func() {
		cfg := f.config("joinleave")
		cfg.MaxInFlight = 4
		cfg.Client.RevokeTimeout = 50 * time.Millisecond // some messages are abandoned in flight
		return f.router(t, f.subscriber(t, cfg), f.db.Pool, 0, nil, slow)
	}
	count := func() int { return f.db.Count(t, "SELECT 1 FROM ledger") }
	stop1 := start()
	waitFor(t, "some events", func() bool { return count() >= 100 })
	stop2 := start()
	waitFor(t, "more events", func() bool { return count() >= 300 })
	stop1()
	start()
	waitFor(t, "more events", func() bool { return count() >= 600 })
	stop2()
	f.waitApplied(t, keys*perKey)
	f.verifyLedger(t, keys, perKey)
}

// watchGroup logs, every 10 s until stop, the ledger's row count and the
// coordinator's view of group (state, members and their partitions), so
// that a run that stops short shows where the group stood.
func (f *fixture) watchGroup(t *testing.T, group string) (stop func()) {
	t.Helper()
	a := f.admin(t)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		defer a.Close()
		tick := time.NewTicker(10 * time.Second)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			desc := "?"
			if gs, err := a.DescribeConsumerGroups([]string{group}); err != nil {
				desc = err.Error()
			} else if len(gs) == 1 {
				g := gs[0]
				desc = fmt.Sprintf("state %s, %d members:", g.State, len(g.Members))
				for id, m := range g.Members {
					parts := "?"
					if as, err := m.GetMemberAssignment(); err == nil && as != nil {
						parts = fmt.Sprint(as.Topics)
					}
					desc += fmt.Sprintf(" %s (%s…) %s;", m.ClientId, id[:min(len(id), 12)], parts)
				}
			}
			t.Logf("%s: %d ledger rows; group %s", time.Now().Format("15:04:05.000"), f.db.Count(t, "SELECT 1 FROM ledger"), desc)
		}
	})
	return func() { close(done); wg.Wait() }
}

// waitOwners waits until group is stable with exactly the members whose
// client ids are names, each holding at least one partition: no member
// that is still to be expired (a process killed earlier) is left to start
// another rebalance while the test kills the next process.
func (f *fixture) waitOwners(t *testing.T, group string, names ...string) {
	t.Helper()
	a := f.admin(t)
	defer a.Close()
	waitFor(t, fmt.Sprintf("group %s stable with exactly %v, each holding partitions", group, names), func() bool {
		gs, err := a.DescribeConsumerGroups([]string{group})
		if err != nil || len(gs) != 1 || gs[0].State != "Stable" || len(gs[0].Members) != len(names) {
			return false
		}
		owns := map[string]bool{}
		for _, m := range gs[0].Members {
			if as, err := m.GetMemberAssignment(); err == nil && as != nil && len(as.Topics[f.topic]) > 0 {
				owns[m.ClientId] = true
			}
		}
		for _, n := range names {
			if !owns[n] {
				return false
			}
		}
		return true
	})
}
