package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/idemkit/watermill-idempotency/tests/bench"
)

// compareConfig is a -compare run: head (the working tree) against base, a
// commit built in a temporary git worktree.
type compareConfig struct {
	base    string   // the ref to compare against
	filters []string // -only filters, one process per filter per round
	rounds  int      // head/base alternations
	inner   int      // -rounds passed to each process
	short   bool
	log     io.Writer
}

// compareRun is one process's report: commit side, round and filter.
type compareRun struct {
	head   bool
	round  int
	filter string
	report bench.Report
}

// compareMain is -compare: only's comma-separated filters (all sections
// when empty), inner rounds per process (1 unless -rounds was given), the
// report printed and, with out, written there.
func compareMain(base, only string, rounds, inner int, short bool, out string) error {
	c := compareConfig{base: base, rounds: rounds, inner: 1, short: short, log: os.Stderr}
	flag.Visit(func(f *flag.Flag) {
		if f.Name == "rounds" {
			c.inner = inner
		}
	})
	for _, f := range strings.Split(only, ",") {
		if f = strings.TrimSpace(f); f != "" {
			c.filters = append(c.filters, f)
		}
	}
	if len(c.filters) == 0 {
		c.filters = []string{""}
	}
	if c.rounds < 1 {
		return fmt.Errorf("-compare-rounds: must be at least 1")
	}
	// Interrupted, the run stops its processes and still removes the
	// temporary worktree.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	md, err := runCompare(ctx, c)
	if err != nil {
		return err
	}
	fmt.Print(md)
	if out != "" {
		return os.WriteFile(out, []byte(md), 0o644)
	}
	return nil
}

// runCompare builds both commits' cmd/bench once, alternates them round by
// round (head first on odd rounds, base first on even ones) over every
// filter, and returns the comparison as markdown.
func runCompare(ctx context.Context, c compareConfig) (string, error) {
	root, err := gitOut(ctx, "", "rev-parse", "--show-toplevel")
	if err != nil {
		return "", err
	}
	sha, err := gitOut(ctx, root, "rev-parse", "--verify", c.base+"^{commit}")
	if err != nil {
		return "", fmt.Errorf("-compare %s: %w", c.base, err)
	}
	headDesc, _ := gitOut(ctx, root, "describe", "--always", "--dirty")
	tmp, err := os.MkdirTemp("", "bench-compare-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	wt := filepath.Join(tmp, "base")
	if _, err := gitOut(ctx, root, "worktree", "add", "--detach", wt, sha); err != nil {
		return "", err
	}
	defer func() {
		_, _ = gitOut(context.WithoutCancel(ctx), root, "worktree", "remove", "--force", wt)
	}()
	bins := map[bool]string{true: filepath.Join(tmp, "bench-head"), false: filepath.Join(tmp, "bench-base")}
	for head, dir := range map[bool]string{true: root, false: wt} {
		fmt.Fprintf(c.log, "compare: building %s's cmd/bench\n", side(head))
		if err := run(ctx, dir, c.log, nil, "go", "build", "-o", bins[head], "./cmd/bench"); err != nil {
			return "", fmt.Errorf("build %s: %w", side(head), err)
		}
	}
	var runs []compareRun
	for r := range c.rounds {
		order := []bool{true, false}
		if r%2 == 1 {
			order = []bool{false, true}
		}
		for _, f := range c.filters {
			for _, head := range order {
				fmt.Fprintf(c.log, "compare: round %d/%d, %s, %s\n", r+1, c.rounds, f, side(head))
				args := []string{"-only", f, "-rounds", fmt.Sprint(c.inner)}
				if c.short {
					args = append(args, "-short")
				}
				var out bytes.Buffer
				if err := run(ctx, root, c.log, &out, bins[head], args...); err != nil {
					// A section that fails in one process is reported, not fatal:
					// its cells are missing from that round.
					fmt.Fprintf(c.log, "compare: %s -only %s: %v\n", side(head), f, err)
				}
				runs = append(runs, compareRun{head: head, round: r, filter: f, report: bench.ParseReport(out.String())})
			}
		}
	}
	load := loadAvg()
	return compareMarkdown(c, headDesc, shortSHA(sha), load, runs), nil
}

func side(head bool) string {
	if head {
		return "head"
	}
	return "base"
}

func shortSHA(sha string) string { return sha[:min(len(sha), 10)] }

// gitOut runs git in dir and returns its trimmed output.
func gitOut(ctx context.Context, dir string, args ...string) (string, error) {
	var out, errOut bytes.Buffer
	if err := run(ctx, dir, &errOut, &out, "git", args...); err != nil {
		return "", fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(errOut.String()))
	}
	return strings.TrimSpace(out.String()), nil
}

// run runs name in dir, its stdout to out (log when nil), its stderr to log.
func run(ctx context.Context, dir string, log io.Writer, out io.Writer, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir = dir
	if out == nil {
		out = log
	}
	cmd.Stdout, cmd.Stderr = out, log
	cmd.WaitDelay = 10 * time.Second
	return cmd.Run()
}
