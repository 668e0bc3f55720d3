package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/internal/childproc"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// childEnv names the environment variable that makes [runChildIfSet] run
// the process as one more billing instance, in the billing group, in lease
// mode: the demo re-executes its own binary with it, so that it can stop and
// kill a consumer for real (SIGSTOP, SIGKILL): a killed member never leaves
// its consumer group, its connections drop, its lease stays behind.
const childEnv = "BILLING_DEMO_CHILD"

// The modes of a child billing instance.
const (
	// childCrash: after the provider call of its target order returned,
	// before the completion, the process kills itself with SIGKILL.
	childCrash = "crash"
	// childStall: it takes the lease of its target order and calls; the
	// demo holds the call at the provider and freezes the process
	// (SIGSTOP) so its renewals cannot get through; once resumed it reports
	// what its delivery ended with, and kills itself.
	childStall = "stall"
)

// The child-to-demo protocol: one line on standard output; and the one
// demo-to-child command, on standard input: "target " + order id, the order
// the child handles (it nacks every other one).
const (
	cmdTarget  = "target "
	lineReady  = "ready"   // the router runs
	lineCalled = "called " // + event id: crash: the call returned, about to SIGKILL
	lineTaken  = "taken "  // + event id: stall: lease held, the call starts
	lineEnded  = "ended "  // + "lost"|"error"|"ok" + " " + error: the target's delivery ended, about to SIGKILL
)

// childConfig is what a child gets from the demo, as JSON in childEnv.
type childConfig struct {
	Mode           string        `json:"mode"`
	DatabaseURL    string        `json:"database_url"`
	Schema         string        `json:"schema"`
	Brokers        []string      `json:"brokers"`
	Topic          string        `json:"topic"`
	ChargedTopic   string        `json:"charged_topic"`
	Group          string        `json:"group"`
	ClientID       string        `json:"client_id"` // the demo finds its partitions by it
	ProviderURL    string        `json:"provider_url"`
	Lease          time.Duration `json:"lease"`
	RenewInterval  time.Duration `json:"renew_interval"`
	SessionTimeout time.Duration `json:"session_timeout"`
	Verbose        bool          `json:"verbose"`
}

// runChildIfSet returns at once unless childEnv is set; then it runs a
// child billing instance and exits the process. main and TestMain call it
// first.
func runChildIfSet() { childproc.RunIfSet(childEnv, "billing child", runChild) }

// errNotMine nacks every message but the child's target: the child
// processes nothing else, so the demo's accounting (which counts the
// parent's instances) is not split across processes. After the child dies
// its records go to the parent's instances.
var errNotMine = errors.New("billing child: not this instance's order")

var childOut sync.Mutex

func emit(line string) {
	childOut.Lock()
	defer childOut.Unlock()
	_, _ = os.Stdout.WriteString(line + "\n")
}

// die kills the process with SIGKILL at the exact point of the fault.
func die() {
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {}
}

func runChild(cfg childConfig) error {
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go func() {
		in := bufio.NewScanner(os.Stdin)
		for in.Scan() {
			if t, ok := strings.CutPrefix(in.Text(), cmdTarget); ok {
				childTarget.Store(&t)
			}
		}
		stop() // the demo is gone
	}()
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if cfg.Verbose {
		logger = watermill.NewStdLoggerWithOut(os.Stderr, true, false)
	}
	pcfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return err
	}
	pcfg.ConnConfig.RuntimeParams["search_path"] = cfg.Schema
	pcfg.ConnConfig.RuntimeParams["application_name"] = cfg.Schema + "/" + cfg.ClientID
	pcfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	ob, err := outbox.New(outbox.Config{Schema: cfg.Schema, Topics: []string{cfg.Topic, cfg.ChargedTopic}}, logger)
	if err != nil {
		return err
	}
	dedup, err := idem.NewDedup(idem.Config{
		DB: pool, ConsumerGroup: cfg.Group, Table: deduplicator.TableConfig{Schema: cfg.Schema}, Outbox: ob,
		// FastPath off: these children show a crash and a freeze between
		// the phases, with a lease row for the demo's billing to take over
		// (inside the fast path they would leave an aborted transaction).
		Mode: &idem.LeaseConfig{Duration: cfg.Lease, RenewInterval: cfg.RenewInterval, Concurrency: 1, Owner: cfg.ClientID + fmt.Sprintf(" (pid %d)", os.Getpid()), FastPath: -1},
	}, logger)
	if err != nil {
		return err
	}
	sc := sarama.NewConfig()
	sc.ClientID = cfg.ClientID
	sc.Consumer.Group.Session.Timeout = cfg.SessionTimeout
	sc.Consumer.Group.Heartbeat.Interval = cfg.SessionTimeout / 4
	sub, err := parallel.NewSubscriber(parallel.SubscriberConfig{
		Client: idemkafka.ClientConfig{Brokers: cfg.Brokers, Sarama: sc}, ConsumerGroup: cfg.Group, MaxInFlight: 4,
		NackResendSleep: 200 * time.Millisecond, ReconnectRetrySleep: 100 * time.Millisecond,
	}, logger)
	if err != nil {
		return err
	}
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	svc := NewBillingService(cfg.ProviderURL)
	h := r.AddHandler(cfg.ClientID, cfg.Topic, sub, cfg.ChargedTopic, nopPublisher{}, svc.Handle)
	h.AddMiddleware(cfg.gate, dedup.Middleware, cfg.trap)
	go func() {
		<-r.Running()
		emit(lineReady)
	}()
	return r.Run(ctx)
}

// childTarget is the order the child handles, once the demo told it.
var childTarget atomic.Pointer[string]

// isTarget reports whether msg is the child's target order's event.
func isTarget(msg *message.Message) bool {
	t := childTarget.Load()
	var p struct {
		OrderID string `json:"orderId"`
	}
	return t != nil && json.Unmarshal(msg.Payload, &p) == nil && p.OrderID == *t
}

// gate sits outside the dedup middleware: it nacks every other order, and
// reports how the target's delivery ended (stall), then dies.
func (cfg childConfig) gate(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if !isTarget(msg) {
			return nil, errNotMine
		}
		_, err := h(msg)
		switch {
		case errors.Is(err, idem.ErrLeaseLost):
			emit(lineEnded + "lost " + oneLine(err))
		case err != nil:
			emit(lineEnded + "error " + oneLine(err))
		default:
			emit(lineEnded + "ok")
		}
		die() // never returns: nothing of the delivery is acked or nacked
		return nil, err
	}
}

// trap sits between the dedup middleware and the handler: the lease is
// held. crash: SIGKILL once the call returned, before the completion.
func (cfg childConfig) trap(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		id, _ := idem.EventIDFromContext(msg.Context())
		if cfg.Mode == childStall {
			emit(lineTaken + id.String())
		}
		out, err := h(msg)
		if cfg.Mode == childCrash && err == nil {
			emit(lineCalled + id.String())
			die()
		}
		return out, err
	}
}

func oneLine(err error) string { return strings.ReplaceAll(err.Error(), "\n", " ") }

// nopPublisher is the child's router publisher: its handler's messages go
// to the outbox, never through it.
type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// child is a running child process, seen from the demo.
type child struct {
	name   string
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	lines  chan string   // its protocol lines
	exited chan struct{} // closed when it has ended
	err    error         // its exit status, once exited is closed

	mu     sync.Mutex
	stderr []string // its last log lines
}

// startChild starts a child billing instance and waits for its router to
// run.
func (d *demo) startChild(ctx context.Context, cfg childConfig) (*child, error) {
	p, err := childproc.Start("", childEnv, cfg)
	if err != nil {
		return nil, fmt.Errorf("child %s: %w", cfg.ClientID, err)
	}
	cmd, stdin, stdout, stderr := p.Cmd, p.Stdin, p.Stdout, p.Stderr // stdin: closed by the demo's end: the child stops
	c := &child{name: cfg.ClientID, cmd: cmd, stdin: stdin, lines: make(chan string, 16), exited: make(chan struct{})}
	var readers sync.WaitGroup
	readers.Go(func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
	})
	readers.Go(func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			c.mu.Lock()
			c.stderr = append(c.stderr, sc.Text())
			if len(c.stderr) > 20 {
				c.stderr = c.stderr[1:]
			}
			c.mu.Unlock()
		}
	})
	go func() {
		readers.Wait()
		c.err = cmd.Wait()
		close(c.lines)
		close(c.exited)
	}()
	d.onClose(func() error {
		_ = stdin.Close()
		_ = cmd.Process.Kill() // a stopped or running leftover of a failed run
		<-c.exited
		return nil
	})
	if line, err := c.next(ctx); err != nil || line != lineReady {
		return nil, fmt.Errorf("child %s did not start (%q, %v): %s", c.name, line, err, c.logs())
	}
	return c, nil
}

// tell gives the child its target order.
func (c *child) tell(orderID string) error {
	if _, err := io.WriteString(c.stdin, cmdTarget+orderID+"\n"); err != nil {
		return fmt.Errorf("child %s: %w", c.name, err)
	}
	return nil
}

// next returns the child's next protocol line.
func (c *child) next(ctx context.Context) (string, error) {
	select {
	case line, ok := <-c.lines:
		if !ok {
			return "", fmt.Errorf("child %s exited (%v)", c.name, c.err)
		}
		return line, nil
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

// killedBySIGKILL reports whether the child has ended by SIGKILL.
func (c *child) killedBySIGKILL() bool {
	<-c.exited
	var ee *exec.ExitError
	if errors.As(c.err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			return true
		}
	}
	return false
}

func (c *child) signal(s syscall.Signal) error { return c.cmd.Process.Signal(s) }

func (c *child) logs() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return strings.Join(c.stderr, "\n")
}
