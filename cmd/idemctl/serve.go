package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/console"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// tokenEnv is the environment variable holding the actions' token.
const tokenEnv = "IDEMCTL_TOKEN"

// serve runs the console (internal/console) on --listen until ctx ends.
func serve(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	listen := fs.String("listen", "127.0.0.1:8080", "`address` to listen on (host:port; port 0 picks one); keep it on loopback or behind an authenticating proxy")
	allow := fs.Bool("allow-actions", false, "allow the actions (unblock or skip a parked key, forget a group); each needs the token and a confirmation. Default: read-only")
	token := fs.String("token", "", "the `token` an action needs (default $"+tokenEnv+"; prefer the variable: flags show in ps)")
	refresh := fs.Duration("refresh", 5*time.Second, "how often the pages refresh themselves (0: never)")
	forwarder := fs.String("forwarder", outbox.DefaultForwarderName, "the forwarder `name` whose position the outbox pages show")
	kafkaTopics := fs.String("kafka-topics", "", "with --brokers: the poison and retry `topics` whose depth and lag the overview shows (default: every topic whose name has poison or retry)")
	kafkaGroups := fs.String("kafka-groups", "", "with --brokers: the Kafka consumer `groups` whose lag on those topics it shows (default: every group with a committed offset on them)")
	parkedTable := a.parkedTableFlag(fs)
	fo := failuresFlags(fs)
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	pt, err := parkedTable()
	if err != nil {
		return err
	}
	if *token == "" {
		*token = a.getenv(tokenEnv)
	}
	if *allow && len(*token) < 16 {
		return usageError("--allow-actions needs a token of 16 characters or more: set %s (or --token)", tokenEnv)
	}
	if *refresh < 0 {
		return usageError("usage: --refresh must not be negative")
	}
	a.extraSecrets = append(a.extraSecrets, *token)
	tc := deduplicator.TableConfig{Schema: a.opts.schema, Table: a.opts.table}
	if err := tc.Validate(); err != nil {
		return usageError("--schema/--table: %v", err)
	}
	ocfg, err := a.outboxConfig(ctx, false)
	if err != nil {
		return err
	}
	pool, err := a.connect(ctx)
	if err != nil {
		return err
	}
	cfg := console.Config{Pool: pool, Table: tc, Layout: a.opts.layout, Outbox: ocfg, Parked: pt, Forwarder: *forwarder,
		AllowActions: *allow, Token: *token, Refresh: *refresh, Secrets: a.secrets,
		Logger: slog.New(slog.NewTextHandler(a.stderr, nil))}
	if a.opts.brokers != "" || a.getenv("KAFKA_BROKERS") != "" {
		kc, err := a.kafkaConfig()
		if err != nil {
			return err
		}
		if cfg.Kafka, err = ops.NewKafkaView(kc.Brokers, kc.Sarama, splitList(*kafkaTopics), splitList(*kafkaGroups)); err != nil {
			return err
		}
		defer cfg.Kafka.Close()
		closeExplorer, err := fo.explorer(&cfg, kc)
		if err != nil {
			return err
		}
		defer closeExplorer()
	}
	return listenAndServe(ctx, a, cfg, *listen)
}

// listenAndServe serves the console of cfg on listen until ctx ends.
func listenAndServe(ctx context.Context, a *app, cfg console.Config, listen string) error {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return usageError("--listen: %v", err)
	}
	if host, _, _ := net.SplitHostPort(ln.Addr().String()); net.ParseIP(host).IsLoopback() {
		cfg.LoopbackOnly = true
	}
	srv, err := console.New(cfg)
	if err != nil {
		_ = ln.Close()
		return err
	}
	mode := "read-only (start with --allow-actions to allow actions)"
	if cfg.AllowActions {
		mode = "actions allowed, with the token"
	}
	fmt.Fprintf(a.stdout, "idemctl serve: listening on http://%s, %s\n", ln.Addr(), mode)
	_ = a.stdout.Flush()
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = hs.Shutdown(sctx)
	}()
	if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
