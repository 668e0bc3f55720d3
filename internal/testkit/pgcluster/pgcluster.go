// Package pgcluster runs throwaway PostgreSQL clusters for the failover and
// point-in-time-restore tests: a primary made with initdb, an asynchronous
// streaming standby made with pg_basebackup -R, a restore of a base backup
// plus archived WAL to a target LSN. Each cluster listens on 127.0.0.1 on
// its own port, keeps its data under a directory of the test's, and is
// stopped (immediately) and removed when the test ends, failed or not.
//
// Running as root (a container), the server programs run as the postgres
// user through runuser, and the data directories are given to it.
package pgcluster

import (
	"context"
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
// as its local port), held until the test ends.
func (e *Env) takePort() int {
	e.tb.Helper()
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
		e.tb.Cleanup(func() {
			ports.Lock()
			delete(ports.used, p)
			ports.Unlock()
		})
		return p
	}
	e.tb.Fatalf("pgcluster: no free port in %d-%d", FirstPort, LastPort)
	return 0
}

// Env is the test's set of clusters: a base directory and the OS user the
// servers run as.
type Env struct {
	tb   testing.TB
	dir  string
	uid  int
	gid  int
	asPG bool
}

// New returns an Env for tb, or skips tb where the server programs are
// missing. Its directory is removed when tb ends, after its clusters stop.
func New(tb testing.TB) *Env {
	tb.Helper()
	if _, err := os.Stat(filepath.Join(BinDir, "pg_ctl")); err != nil {
		tb.Skip("needs the PostgreSQL 15 server programs in " + BinDir)
	}
	dir, err := os.MkdirTemp("", "idem-failover-")
	if err != nil {
		tb.Fatal(err)
	}
	e := &Env{tb: tb, dir: dir, uid: -1, gid: -1}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			tb.Fatalf("pgcluster: running as root needs a postgres user: %v", err)
		}
		e.uid, _ = strconv.Atoi(u.Uid)
		e.gid, _ = strconv.Atoi(u.Gid)
		e.asPG = true
		if err := os.Chown(dir, e.uid, e.gid); err != nil {
			tb.Fatal(err)
		}
	}
	tb.Cleanup(func() { _ = os.RemoveAll(dir) }) // runs after the clusters' cleanups (LIFO)
	return e
}

// Dir returns a new directory under the Env's, owned by the servers' user.
func (e *Env) Dir(name string) string {
	e.tb.Helper()
	d := filepath.Join(e.dir, name)
	if err := os.MkdirAll(d, 0o700); err != nil {
		e.tb.Fatal(err)
	}
	if e.asPG {
		if err := os.Chown(d, e.uid, e.gid); err != nil {
			e.tb.Fatal(err)
		}
	}
	return d
}

// run runs a server program as the servers' user and fails the test on an
// error, with its output.
func (e *Env) run(prog string, args ...string) string {
	e.tb.Helper()
	out, err := e.command(prog, args...).CombinedOutput()
	if err != nil {
		e.tb.Fatalf("pgcluster: %s %s: %v\n%s", prog, strings.Join(args, " "), err, out)
	}
	return string(out)
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

// Primary initializes and starts a primary on port with wal_level=replica,
// archiving its WAL segments to archive when it is not "".
func (e *Env) Primary(name, archive string) *Cluster {
	e.tb.Helper()
	c := &Cluster{e: e, Data: filepath.Join(e.Dir(name), "data")}
	e.run("initdb", "-D", c.Data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C")
	conf := []string{
		"wal_level = replica", "max_wal_senders = 4", "fsync = off", "full_page_writes = on",
		"max_connections = 30", "shared_buffers = 32MB", "wal_keep_size = 256MB",
	}
	if archive != "" {
		conf = append(conf, "archive_mode = on", "archive_timeout = 0",
			fmt.Sprintf("archive_command = 'cp %%p %s/%%f'", archive))
	}
	c.conf = conf
	c.Start()
	return c
}

// Standby takes a base backup of c (pg_basebackup -R: an asynchronous
// streaming standby) and starts it on port.
func (c *Cluster) Standby(name string) *Cluster {
	c.e.tb.Helper()
	s := &Cluster{e: c.e, Data: filepath.Join(c.e.Dir(name), "data")}
	c.e.run("pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(c.Port), "-U", "postgres", "-D", s.Data,
		"-R", "-X", "stream", "-c", "fast", "--no-sync")
	s.Start()
	return s
}

// BaseBackup takes a base backup of c into a new directory, not started:
// [Cluster.RestoreTo] turns it into a restored cluster.
func (c *Cluster) BaseBackup(name string) string {
	c.e.tb.Helper()
	dir := filepath.Join(c.e.Dir(name), "data")
	c.e.run("pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(c.Port), "-U", "postgres", "-D", dir,
		"-X", "stream", "-c", "fast", "--no-sync")
	return dir
}

// Restore starts the base backup in data on port as a point-in-time
// restore: it replays the WAL archived in archive up to targetLSN
// (inclusive), then ends recovery on a new timeline (promote).
func (e *Env) Restore(data, archive, targetLSN string) *Cluster {
	e.tb.Helper()
	c := &Cluster{e: e, Data: data}
	c.conf = append(c.conf, fmt.Sprintf("restore_command = 'cp %s/%%f %%p'", archive),
		"recovery_target_lsn = '"+targetLSN+"'", "recovery_target_action = 'promote'", "archive_mode = off")
	if err := os.WriteFile(filepath.Join(data, "recovery.signal"), nil, 0o600); err != nil {
		e.tb.Fatal(err)
	}
	if e.asPG {
		_ = os.Chown(filepath.Join(data, "recovery.signal"), e.uid, e.gid)
	}
	c.Start()
	c.WaitPrimary()
	return c
}

func (c *Cluster) appendConf(lines ...string) {
	c.e.tb.Helper()
	conf := append([]string{
		"", "listen_addresses = '127.0.0.1'", "port = " + strconv.Itoa(c.Port),
		"unix_socket_directories = ''",
	}, lines...)
	f, err := os.OpenFile(filepath.Join(c.Data, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		c.e.tb.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(strings.Join(conf, "\n") + "\n"); err != nil {
		c.e.tb.Fatal(err)
	}
}

// Start starts the server on a port of the range and waits for it; the
// test's end stops it immediately, failed or not. A port taken meanwhile
// (by a client's outgoing connection) is replaced by another.
func (c *Cluster) Start() {
	c.e.tb.Helper()
	logFile := filepath.Join(filepath.Dir(c.Data), "log")
	for attempt := 1; ; attempt++ {
		c.Port = c.e.takePort()
		c.appendConf(c.conf...)
		out, err := c.e.command("pg_ctl", "-D", c.Data, "-l", logFile, "-w", "-t", "120", "start").CombinedOutput()
		if err == nil {
			break
		}
		log, _ := os.ReadFile(logFile)
		if attempt < 3 && strings.Contains(string(log), "could not bind") {
			continue
		}
		c.e.tb.Fatalf("pgcluster: start the server on port %d: %v\n%s\n%s", c.Port, err, out, log)
	}
	c.e.tb.Cleanup(func() { _ = c.e.command("pg_ctl", "-D", c.Data, "-m", "immediate", "-w", "stop").Run() })
}

// StopImmediate stops the server at once: no shutdown checkpoint, and a
// standby gets nothing more (a crash, as far as the data is concerned).
func (c *Cluster) StopImmediate() {
	c.e.tb.Helper()
	c.e.run("pg_ctl", "-D", c.Data, "-m", "immediate", "-w", "stop")
}

// Promote promotes a standby and waits until it accepts writes.
func (c *Cluster) Promote() {
	c.e.tb.Helper()
	c.e.run("pg_ctl", "-D", c.Data, "-w", "-t", "120", "promote")
	c.WaitPrimary()
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
	c.waitTrue("SELECT NOT pg_is_in_recovery()")
}

// CutReplication stops the standby's WAL receiver for good (its
// primary_conninfo is emptied): the standby keeps what it has replayed
// and receives nothing more, as a standby does behind a lost link.
func (c *Cluster) CutReplication() {
	c.e.tb.Helper()
	ctx := context.Background()
	conn := c.Conn(ctx)
	for _, q := range []string{"ALTER SYSTEM SET primary_conninfo = ''", "SELECT pg_reload_conf()"} {
		if _, err := conn.Exec(ctx, q); err != nil {
			c.e.tb.Fatalf("pgcluster: %s: %v", q, err)
		}
	}
	c.waitTrue("SELECT NOT EXISTS (SELECT FROM pg_stat_wal_receiver)")
}

// CaughtUp waits until the standby has replayed everything primary has
// written so far.
func (c *Cluster) CaughtUp(primary *Cluster) {
	c.e.tb.Helper()
	ctx := context.Background()
	conn := primary.Conn(ctx)
	var lsn string
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn); err != nil {
		c.e.tb.Fatal(err)
	}
	_ = conn.Close(ctx)
	c.waitTrue("SELECT pg_last_wal_replay_lsn() >= '" + lsn + "'::pg_lsn")
}

// waitTrue polls query (one boolean) on c until it is true, for up to a
// minute.
func (c *Cluster) waitTrue(query string) {
	c.e.tb.Helper()
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
				return
			}
		}
		cancel()
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	c.e.tb.Fatalf("pgcluster: %q never true on port %d (last error: %v)", query, c.Port, last)
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
	c.waitTrue("SELECT coalesce(last_archived_wal >= '" + seg + "', false) FROM pg_stat_archiver")
}
