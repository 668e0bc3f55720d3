// Package pgcluster runs throwaway PostgreSQL clusters for the failover and
// point-in-time-restore tests: a primary made with initdb, an asynchronous
// streaming standby made with pg_basebackup -R, a restore of a base backup
// plus archived WAL to a target LSN. Each cluster listens on 127.0.0.1 on
// its own port, keeps its data under a directory of the test's, and is
// stopped (immediately) and removed when the test ends, failed or not.
//
// Running as root (a container), the server programs run as the postgres
// user through runuser, and the data directories are given to it.
//
// Tests take an Env with [New] (a testing.TB: failures are fatal, cleanup
// at the test's end). A program that is not a test (the soak's failover
// fault) takes one with [Open]: the Start* methods return errors, and
// [Env.Close] stops and removes everything.
package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// BinDir holds the PostgreSQL 15 server programs (Debian's layout).
const BinDir = "/usr/lib/postgresql/15/bin"

// The ports the clusters listen on: FirstPort..LastPort, each taken by one
// cluster of this process at a time.
const (
	FirstPort = 55432
	LastPort  = 55449
)

var ports struct {
	sync.Mutex
	used map[int]bool
}

// takePort returns a port of the range that no cluster of this process
// holds and that is free now (a client's outgoing connection may hold one
// as its local port), held until the Env's cleanup.
func (e *Env) takePort() (int, error) {
	ports.Lock()
	defer ports.Unlock()
	if ports.used == nil {
		ports.used = map[int]bool{}
	}
	for p := FirstPort; p <= LastPort; p++ {
		if ports.used[p] {
			continue
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			continue
		}
		_ = l.Close()
		ports.used[p] = true
		e.cleanup(func() {
			ports.Lock()
			delete(ports.used, p)
			ports.Unlock()
		})
		return p, nil
	}
	return 0, fmt.Errorf("pgcluster: no free port in %d-%d", FirstPort, LastPort)
}

// Env is a set of clusters: a base directory and the OS user the servers
// run as.
type Env struct {
	tb   testing.TB // nil for an Env of Open
	dir  string
	uid  int
	gid  int
	asPG bool

	mu       sync.Mutex
	cleanups []func() // an Env of Open's, run by Close (last first)
}

// ErrNoServer is returned by Open where the server programs are missing.
var ErrNoServer = errors.New("pgcluster: needs the PostgreSQL 15 server programs in " + BinDir)

// New returns an Env for tb, or skips tb where the server programs are
// missing. Its directory is removed when tb ends, after its clusters stop.
func New(tb testing.TB) *Env {
	tb.Helper()
	e, err := open(tb)
	if errors.Is(err, ErrNoServer) {
		tb.Skip(err.Error())
	}
	if err != nil {
		tb.Fatal(err)
	}
	return e
}

// Open returns an Env for a program that is not a test, or ErrNoServer
// where the server programs are missing: its Start* methods return
// errors, and Close stops its clusters and removes its directory.
func Open() (*Env, error) { return open(nil) }

func open(tb testing.TB) (*Env, error) {
	if _, err := os.Stat(filepath.Join(BinDir, "pg_ctl")); err != nil {
		return nil, ErrNoServer
	}
	dir, err := os.MkdirTemp("", "idem-failover-")
	if err != nil {
		return nil, err
	}
	e := &Env{tb: tb, dir: dir, uid: -1, gid: -1}
	e.cleanup(func() { _ = os.RemoveAll(dir) }) // runs after the clusters' cleanups (last first)
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			e.Close()
			return nil, fmt.Errorf("pgcluster: running as root needs a postgres user: %w", err)
		}
		e.uid, _ = strconv.Atoi(u.Uid)
		e.gid, _ = strconv.Atoi(u.Gid)
		e.asPG = true
		if err := os.Chown(dir, e.uid, e.gid); err != nil {
			e.Close()
			return nil, err
		}
	}
	return e, nil
}

// cleanup runs f at the test's end, or at Close for an Env of Open.
func (e *Env) cleanup(f func()) {
	if e.tb != nil {
		e.tb.Cleanup(f)
		return
	}
	e.mu.Lock()
	e.cleanups = append(e.cleanups, f)
	e.mu.Unlock()
}

// Close stops an Env of Open's clusters (immediately), closes its proxies
// and removes its directory. A test's Env is closed at the test's end.
func (e *Env) Close() {
	e.mu.Lock()
	fs := e.cleanups
	e.cleanups = nil
	e.mu.Unlock()
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}

// must fails the test on err (the testing API's methods).
func (e *Env) must(err error) {
	if err != nil {
		e.tb.Helper()
		e.tb.Fatal(err)
	}
}

// Dir returns a new directory under the Env's, owned by the servers' user.
func (e *Env) Dir(name string) string {
	e.tb.Helper()
	d, err := e.mkdir(name)
	e.must(err)
	return d
}

func (e *Env) mkdir(name string) (string, error) {
	d := filepath.Join(e.dir, name)
	if err := os.MkdirAll(d, 0o700); err != nil {
		return "", err
	}
	if e.asPG {
		if err := os.Chown(d, e.uid, e.gid); err != nil {
			return "", err
		}
	}
	return d, nil
}

// run runs a server program as the servers' user; its error carries the
// program's output.
func (e *Env) run(prog string, args ...string) (string, error) {
	out, err := e.command(prog, args...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("pgcluster: %s %s: %w\n%s", prog, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func (e *Env) command(prog string, args ...string) *exec.Cmd {
	path := filepath.Join(BinDir, prog)
	if e.asPG {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", path}, args...)...)
	}
	return exec.Command(path, args...)
}

// Cluster is one running (or stopped) server.
type Cluster struct {
	e    *Env
	Data string
	Port int
	conf []string // settings written at Start, before the port
}

// Primary initializes and starts a primary with wal_level=replica,
// archiving its WAL segments to archive when it is not "".
func (e *Env) Primary(name, archive string) *Cluster {
	e.tb.Helper()
	c, err := e.StartPrimary(name, archive)
	e.must(err)
	return c
}

// StartPrimary is Primary returning its error; conf lines (such as
// "max_connections = 200") are written after the defaults, so they win.
func (e *Env) StartPrimary(name, archive string, conf ...string) (*Cluster, error) {
	dir, err := e.mkdir(name)
	if err != nil {
		return nil, err
	}
	c := &Cluster{e: e, Data: filepath.Join(dir, "data")}
	if _, err := e.run("initdb", "-D", c.Data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"); err != nil {
		return nil, err
	}
	c.conf = []string{
		"wal_level = replica", "max_wal_senders = 4", "fsync = off", "full_page_writes = on",
		"max_connections = 30", "shared_buffers = 32MB", "wal_keep_size = 256MB",
	}
	if archive != "" {
		c.conf = append(c.conf, "archive_mode = on", "archive_timeout = 0",
			fmt.Sprintf("archive_command = 'cp %%p %s/%%f'", archive))
	}
	c.conf = append(c.conf, conf...)
	return c, c.start()
}

// Standby takes a base backup of c (pg_basebackup -R: an asynchronous
// streaming standby) and starts it.
func (c *Cluster) Standby(name string) *Cluster {
	c.e.tb.Helper()
	s, err := c.StartStandby(name)
	c.e.must(err)
	return s
}

// StartStandby is Standby returning its error.
func (c *Cluster) StartStandby(name string) (*Cluster, error) {
	dir, err := c.e.mkdir(name)
	if err != nil {
		return nil, err
	}
	s := &Cluster{e: c.e, Data: filepath.Join(dir, "data")}
	if _, err := c.e.run("pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(c.Port), "-U", "postgres", "-D", s.Data,
		"-R", "-X", "stream", "-c", "fast", "--no-sync"); err != nil {
		return nil, err
	}
	return s, s.start()
}

// BaseBackup takes a base backup of c into a new directory, not started:
// [Env.Restore] turns it into a restored cluster.
func (c *Cluster) BaseBackup(name string) string {
	c.e.tb.Helper()
	dir := filepath.Join(c.e.Dir(name), "data")
	_, err := c.e.run("pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(c.Port), "-U", "postgres", "-D", dir,
		"-X", "stream", "-c", "fast", "--no-sync")
	c.e.must(err)
	return dir
}

// Restore starts the base backup in data as a point-in-time restore: it
// replays the WAL archived in archive up to targetLSN (inclusive), then
// ends recovery on a new timeline (promote).
func (e *Env) Restore(data, archive, targetLSN string) *Cluster {
	e.tb.Helper()
	c := &Cluster{e: e, Data: data}
	c.conf = append(c.conf, fmt.Sprintf("restore_command = 'cp %s/%%f %%p'", archive),
		"recovery_target_lsn = '"+targetLSN+"'", "recovery_target_action = 'promote'", "archive_mode = off")
	e.must(os.WriteFile(filepath.Join(data, "recovery.signal"), nil, 0o600))
	if e.asPG {
		_ = os.Chown(filepath.Join(data, "recovery.signal"), e.uid, e.gid)
	}
	e.must(c.start())
	c.WaitPrimary()
	return c
}

func (c *Cluster) appendConf(lines ...string) error {
	conf := append([]string{
		"", "listen_addresses = '127.0.0.1'", "port = " + strconv.Itoa(c.Port),
		"unix_socket_directories = ''",
	}, lines...)
	f, err := os.OpenFile(filepath.Join(c.Data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = f.WriteString(strings.Join(conf, "\n") + "\n")
	return err
}

// Start starts the server on a port of the range and waits for it; the
// Env's cleanup stops it immediately, failed or not. A port taken
// meanwhile (by a client's outgoing connection) is replaced by another.
func (c *Cluster) Start() {
	c.e.tb.Helper()
	c.e.must(c.start())
}

func (c *Cluster) start() error {
	logFile := filepath.Join(filepath.Dir(c.Data), "log")
	for attempt := 1; ; attempt++ {
		var err error
		if c.Port, err = c.e.takePort(); err != nil {
			return err
		}
		if err := c.appendConf(c.conf...); err != nil {
			return err
		}
		out, err := c.e.command("pg_ctl", "-D", c.Data, "-l", logFile, "-w", "-t", "120", "start").CombinedOutput()
		if err == nil {
			break
		}
		log, _ := os.ReadFile(logFile)
		if attempt < 3 && strings.Contains(string(log), "could not bind") {
			continue
		}
		return fmt.Errorf("pgcluster: start the server on port %d: %w\n%s\n%s", c.Port, err, out, log)
	}
	c.e.cleanup(func() { _ = c.e.command("pg_ctl", "-D", c.Data, "-m", "immediate", "-w", "stop").Run() })
	return nil
}

// StopImmediate stops the server at once: no shutdown checkpoint, and a
// standby gets nothing more (a crash, as far as the data is concerned).
func (c *Cluster) StopImmediate() {
	c.e.tb.Helper()
	c.e.must(c.Crash())
}

// Crash is StopImmediate returning its error.
func (c *Cluster) Crash() error {
	_, err := c.e.run("pg_ctl", "-D", c.Data, "-m", "immediate", "-w", "stop")
	return err
}

// Promote promotes a standby and waits until it accepts writes.
func (c *Cluster) Promote() {
	c.e.tb.Helper()
	c.e.must(c.PromoteNow())
}

// PromoteNow is Promote returning its error.
func (c *Cluster) PromoteNow() error {
	if _, err := c.e.run("pg_ctl", "-D", c.Data, "-w", "-t", "120", "promote"); err != nil {
		return err
	}
	return c.waitTrue("SELECT NOT pg_is_in_recovery()")
}

// URL connects to database postgres as user postgres.
func (c *Cluster) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.Port)
}

// Conn opens a connection, closed when the test ends.
func (c *Cluster) Conn(ctx context.Context) *pgx.Conn {
	c.e.tb.Helper()
	conn, err := pgx.Connect(ctx, c.URL())
	if err != nil {
		c.e.tb.Fatalf("pgcluster: connect to %d: %v", c.Port, err)
	}
	c.e.tb.Cleanup(func() { _ = conn.Close(context.WithoutCancel(ctx)) })
	return conn
}

// WaitPrimary waits until the server is out of recovery.
func (c *Cluster) WaitPrimary() {
	c.e.tb.Helper()
	c.e.must(c.waitTrue("SELECT NOT pg_is_in_recovery()"))
}

// CutReplication stops the standby's WAL receiver for good (its
// primary_conninfo is emptied): the standby keeps what it has replayed
// and receives nothing more, as a standby does behind a lost link.
func (c *Cluster) CutReplication() {
	c.e.tb.Helper()
	c.e.must(c.Cut())
}

// Cut is CutReplication returning its error.
func (c *Cluster) Cut() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, c.URL())
	if err != nil {
		return fmt.Errorf("pgcluster: connect to %d: %w", c.Port, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, q := range []string{"ALTER SYSTEM SET primary_conninfo = ''", "SELECT pg_reload_conf()"} {
		if _, err := conn.Exec(ctx, q); err != nil {
			return fmt.Errorf("pgcluster: %s: %w", q, err)
		}
	}
	return c.waitTrue("SELECT NOT EXISTS (SELECT FROM pg_stat_wal_receiver)")
}

// CaughtUp waits until the standby has replayed everything primary has
// written so far.
func (c *Cluster) CaughtUp(primary *Cluster) {
	c.e.tb.Helper()
	c.e.must(c.WaitCaughtUp(primary))
}

// WaitCaughtUp is CaughtUp returning its error.
func (c *Cluster) WaitCaughtUp(primary *Cluster) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, primary.URL())
	if err != nil {
		return fmt.Errorf("pgcluster: connect to %d: %w", primary.Port, err)
	}
	var lsn string
	err = conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn)
	_ = conn.Close(ctx)
	if err != nil {
		return fmt.Errorf("pgcluster: primary's WAL position: %w", err)
	}
	return c.waitTrue("SELECT pg_last_wal_replay_lsn() >= '" + lsn + "'::pg_lsn")
}

// waitTrue polls query (one boolean) on c until it is true, for up to a
// minute.
func (c *Cluster) waitTrue(query string) error {
	deadline := time.Now().Add(time.Minute)
	var last error
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		conn, err := pgx.Connect(ctx, c.URL())
		if err == nil {
			var ok bool
			err = conn.QueryRow(ctx, query).Scan(&ok)
			_ = conn.Close(ctx)
			if err == nil && ok {
				cancel()
				return nil
			}
		}
		cancel()
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("pgcluster: %q never true on port %d (last error: %v)", query, c.Port, last)
}

// LSN returns the server's current WAL insert location.
func (c *Cluster) LSN() string {
	c.e.tb.Helper()
	ctx := context.Background()
	conn := c.Conn(ctx)
	defer conn.Close(ctx)
	var lsn string
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&lsn); err != nil {
		c.e.tb.Fatal(err)
	}
	return lsn
}

// Archived switches to a new WAL segment and waits until the finished one
// is archived: the archive then holds everything written so far.
func (c *Cluster) Archived() {
	c.e.tb.Helper()
	ctx := context.Background()
	conn := c.Conn(ctx)
	defer conn.Close(ctx)
	var seg string
	if err := conn.QueryRow(ctx, "SELECT pg_walfile_name(pg_switch_wal() - 1)").Scan(&seg); err != nil {
		c.e.tb.Fatal(err)
	}
	c.e.must(c.waitTrue("SELECT coalesce(last_archived_wal >= '" + seg + "', false) FROM pg_stat_archiver"))
}
