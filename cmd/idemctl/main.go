package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/redact"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}

// command is one leaf command: idemctl <group> <name>.
type command struct {
	group, name string
	// args is the synopsis after the name; summary one line.
	args, summary string
	run           func(ctx context.Context, a *app, args []string) error
}

var commands = []command{
	{"migrate", "status", "[--only dedup,outbox,retry]", "applied, pending and unknown versions of every table (dedup, outbox topics, retry parked keys), and the tables' checks", migrateStatus},
	{"migrate", "up", "[--only dedup,outbox,retry] [--target N] [--retention D] [--dry-run]", "apply the pending versions", migrateUp},
	{"migrate", "down", "[--only dedup,outbox,retry] [--target N | --all] [--dry-run] --yes", "revert the newest version of each component (or down to --target)", migrateDown},
	{"migrate", "sql", "[--only dedup,outbox,retry] [--down] [--pending]", "print the migrations' SQL (for goose, golang-migrate or psql)", migrateSQL},
	{"dedup", "check", "EVENT_ID [--group G]...", "was the event processed by the group (default: every registered group), and when", dedupCheck},
	{"dedup", "convert", "[--group G] [--retention D] [--dry-run]", "convert an existing processed_event table (another key, NULL or no consumer_group) to the library's, keeping one row per (event, group)", dedupConvert},
	{"dedup", "leases", "[--group G] [--state live|expired] [--limit N]", "lease mode's leases: live (calls in flight) and expired (taken over at the event's next delivery)", dedupLeases},
	{"dedup", "release", "EVENT_ID --group G --yes", "delete a lease whose owner is gone, so the event's next delivery runs at once", dedupRelease},
	{"dedup", "stats", "", "claims per group and per partition, oldest and newest, table size (reads every row)", dedupStats},
	{"cleanup", "run", "[--dry-run] [--batch-size N] [--delete-non-v7]", "one retention pass of the Cleaner (deletes, or drops partitions)", cleanupRun},
	{"partitions", "list", "", "the partitions of a partitioned table, with their days and sizes", partitionsList},
	{"partitions", "maintain", "[--dry-run] [--ahead N]", "create the days ahead, move rows out of DEFAULT, drop expired partitions", partitionsMaintain},
	{"outbox", "backlog", "[--forwarder NAME]", "rows not yet forwarded and the age of the oldest, per topic", outboxBacklog},
	{"outbox", "prune", "[--forwarders A,B] [--batch-size N]", "delete the rows every forwarder has passed", outboxPrune},
	{"outbox", "reposition", "[--forwarder NAME] [--dry-run]", "reset the forwarder's position so every row still in the table is forwarded again (the recovery from a position of another cluster, after a restore)", outboxReposition},
	{"outbox", "dead", "list | retry --topics T --key K --yes | drop --topics T --id N --yes", "rows the forwarder could not send (over the producer's limit, unreadable metadata) and the later rows of their keys, held behind them: list them, send a key's rows again, or delete a poison row", outboxDead},
	{"groups", "list", "", "the registered consumer groups", groupsList},
	{"groups", "rename", "FROM TO", "give FROM's claims and registration to TO (FROM's are kept)", groupsRename},
	{"groups", "progress", "GROUP [--kafka-group K] [--topic T] [--rewind --yes]", "the group's position in PostgreSQL beside its committed Kafka offsets (exit 3 when Kafka is ahead: after a failover or a restore); --rewind sets them back to PostgreSQL's", groupsProgress},
	{"groups", "forget", "GROUP --yes", "delete a group's claims and registration", groupsForget},
	{"retention", "show", "", "the retention recorded with the table", retentionShow},
	{"retention", "set", "DURATION [--yes]", "change the recorded retention (7d, 720h...); shortening needs --yes", retentionSet},
	{"retry", "parked", "[--group G] [--limit N] [--parked-table T]", "parked keys of retry topics' KeyOrder: queue per key, age of the oldest, how overdue the first event's copy is", retryParked},
	{"retry", "unblock", "--group G (--key K [--skip] | --overdue D) [--topic T] --yes", "send a parked key's first event to the retry path again (or --skip it) when its copy is not coming back; --overdue: every key whose copy is overdue by more than D", retryUnblock},
	{"serve", "", "[--listen 127.0.0.1:8080] [--allow-actions] [--refresh 5s]", "the operator console in a browser: overview, parked keys, outbox topics, groups, with JSON twins under /api/ (read-only unless --allow-actions, each action needing $IDEMCTL_TOKEN)", serve},
	{"poison", "list", "--topic T [filters]", "the poison topic's messages matching the filters", poisonList},
	{"poison", "replay", "--topic T [filters] [--dry-run] [--rate N]", "publish matching poison messages back to their original topic", poisonReplay},
}

// run runs the command line args and returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	a := &app{getenv: getenv, opts: defaultOptions(), path: "idemctl"}
	a.stdout = redact.NewWriter(stdout, a.secrets)
	a.stderr = redact.NewWriter(stderr, a.secrets)
	err := a.dispatch(ctx, args)
	code := exitOK
	var ee *exitError
	switch {
	case err == nil:
	case errors.Is(err, flag.ErrHelp):
		err = nil
	case errors.As(err, &ee):
		code = ee.code
		err = ee.err
	case ops.IsBadInput(err):
		code = exitUsage
	default:
		code = exitFailure
	}
	asJSON := a.opts.json || jsonRequested(args)
	if err != nil {
		a.report(code, ops.MissingTable(err), asJSON)
	}
	if code == exitUsage && err != nil && strings.HasPrefix(err.Error(), "usage:") && !asJSON {
		fmt.Fprintf(a.stderr, "Run '%s -h' for help.\n", a.path)
	}
	a.close()
	_ = a.stdout.Flush()
	_ = a.stderr.Flush()
	return code
}

// report prints err: on stderr, or with --json as {"error", "code"} on
// stdout (unless the command already printed its document, which then
// carries the error itself).
func (a *app) report(code int, err error, asJSON bool) {
	if !asJSON || a.printedJSON {
		fmt.Fprintf(a.stderr, "%s: %v\n", a.path, err)
		return
	}
	_ = a.printJSON(struct {
		Error string `json:"error"`
		Code  int    `json:"code"`
	}{a.path + ": " + err.Error(), code})
}

// jsonRequested reports whether args ask for --json, for an error met
// before the flags were parsed (or while parsing them).
func jsonRequested(args []string) bool {
	for _, arg := range args {
		if arg == "--" {
			return false
		}
		name, val, hasVal := strings.Cut(strings.TrimLeft(arg, "-"), "=")
		if !strings.HasPrefix(arg, "-") || name != "json" {
			continue
		}
		if !hasVal {
			return true
		}
		if b, err := strconv.ParseBool(val); err == nil {
			return b
		}
	}
	return false
}

func (a *app) dispatch(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("idemctl", flag.ContinueOnError)
	a.opts.register(fs)
	fs.Usage = func() { a.usage(a.stdout) }
	fs.SetOutput(io.Discard)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			a.usage(a.stdout)
			return err
		}
		return usageError("usage: %v", err)
	}
	rest := fs.Args()
	if len(rest) == 0 || rest[0] == "help" {
		a.usage(a.stdout)
		if len(rest) == 0 {
			return &exitError{code: exitUsage}
		}
		return nil
	}
	group := rest[0]
	var inGroup []command
	for _, c := range commands {
		if c.group == group {
			inGroup = append(inGroup, c)
		}
	}
	if len(inGroup) == 0 {
		a.usage(a.stderr)
		return usageError("unknown command %q", group)
	}
	a.path = "idemctl " + group
	if len(inGroup) == 1 && inGroup[0].name == "" { // a command without subcommands
		a.cmd = &inGroup[0]
		return inGroup[0].run(ctx, a, rest[1:])
	}
	if len(rest) < 2 || rest[1] == "-h" || rest[1] == "--help" || rest[1] == "help" {
		a.groupUsage(a.stdout, inGroup)
		if len(rest) < 2 {
			return usageError("usage: %s needs a subcommand", a.path)
		}
		return nil
	}
	for _, c := range inGroup {
		if c.name == rest[1] {
			a.path = "idemctl " + group + " " + c.name
			a.cmd = &c
			return c.run(ctx, a, rest[2:])
		}
	}
	a.groupUsage(a.stderr, inGroup)
	return usageError("unknown command %q", group+" "+rest[1])
}

func (a *app) usage(w io.Writer) {
	fmt.Fprint(w, `idemctl operates the tables of watermill-idempotency: the processed_event
(dedup) table and the outbox, and its poison topics, with the library's own
functions.

Usage: idemctl [flags] COMMAND SUBCOMMAND [ARGS] [flags]

Commands:
`)
	tw := a.tableOn(w)
	for _, c := range commands {
		row(tw, "  "+c.group+" "+c.name, c.summary)
	}
	_ = tw.Flush()
	fmt.Fprint(w, `
Flags (before or after the command):
`)
	fs := flag.NewFlagSet("idemctl", flag.ContinueOnError)
	o := defaultOptions()
	o.register(fs)
	fs.SetOutput(w)
	fs.PrintDefaults()
	fmt.Fprint(w, `
Environment: DATABASE_URL (PostgreSQL), KAFKA_BROKERS (poison commands);
Kafka TLS and SASL: KAFKA_TLS, KAFKA_TLS_CA, KAFKA_TLS_CERT, KAFKA_TLS_KEY,
KAFKA_TLS_SERVER_NAME, KAFKA_SASL_MECHANISM, KAFKA_SASL_USER and
KAFKA_SASL_PASSWORD (the password has no flag).
Passwords are never printed: they are masked in every message and output.

Exit codes: 0 done; 1 failed; 2 bad usage or input (nothing was changed);
3 dedup check: the event was not processed (by one of the groups).

Run 'idemctl COMMAND SUBCOMMAND -h' for a command's flags; see docs/idemctl.md.
`)
}

func (a *app) groupUsage(w io.Writer, cs []command) {
	fmt.Fprintf(w, "Usage:\n")
	tw := a.tableOn(w)
	for _, c := range cs {
		row(tw, "  idemctl "+c.group+" "+c.name+" "+c.args, c.summary)
	}
	_ = tw.Flush()
	fmt.Fprintf(w, "\nRun 'idemctl %s SUBCOMMAND -h' for its flags, 'idemctl -h' for the common ones.\n", cs[0].group)
}

// flags returns the flag set of the running leaf command, with the common
// flags.
func (a *app) flags() *flag.FlagSet {
	fs := flag.NewFlagSet(a.path, flag.ContinueOnError)
	a.opts.register(fs)
	fs.SetOutput(io.Discard)
	return fs
}

// parse parses args into fs, flags and positional arguments in any order,
// and checks the count of positional arguments (-1: any).
func (a *app) parse(fs *flag.FlagSet, args []string, positional ...string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				a.leafUsage(fs, positional)
				return nil, err
			}
			return nil, usageError("usage: %v", err)
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	if len(pos) != len(positional) {
		if len(pos) > len(positional) {
			return nil, usageError("usage: unexpected argument %q (want %s %s)", pos[len(positional)], a.path, strings.Join(positional, " "))
		}
		return nil, usageError("usage: missing %s (want %s %s)", positional[len(pos)], a.path, strings.Join(positional, " "))
	}
	return pos, nil
}

func (a *app) leafUsage(fs *flag.FlagSet, positional []string) {
	if c := a.cmd; c != nil {
		fmt.Fprintf(a.stdout, "Usage: %s %s\n\n%s.\n\nFlags:\n", a.path, c.args, c.summary)
	}
	_ = positional
	fs.SetOutput(a.stdout)
	fs.PrintDefaults()
	fs.SetOutput(io.Discard)
}
