package bench

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/internal/testkit/rtcount"
)

// cost is what a measured run consumed, for "where does the time go".
type cost struct {
	msgs       int64
	wall       time.Duration
	roundTrips int64
	serverCPU  time.Duration
	clientCPU  time.Duration
	serverOK   bool // the backends' CPU could be read (same host, Linux)
}

// costProbe snapshots the counters a cost is the difference of.
type costProbe struct {
	pool      *pgxpool.Pool
	rt        *rtcount.Counter // nil: round trips not counted
	at        time.Time
	rts       int64
	serverCPU time.Duration
	serverOK  bool
	clientCPU time.Duration
}

func probe(ctx context.Context, pool *pgxpool.Pool, rt *rtcount.Counter) (costProbe, error) {
	p := costProbe{pool: pool, rt: rt}
	p.serverCPU, p.serverOK = backendsCPU(ctx, pool)
	p.clientCPU = processCPU()
	if rt != nil {
		p.rts = rt.Load()
	}
	p.at = time.Now()
	return p, nil
}

// since returns the cost from p until now, for msgs messages. The probe's
// own queries are not subtracted (a few round trips in thousands).
func (p costProbe) since(ctx context.Context, msgs int64) (cost, error) {
	q, err := probe(ctx, p.pool, p.rt)
	if err != nil {
		return cost{}, err
	}
	return cost{
		msgs: msgs, wall: q.at.Sub(p.at), roundTrips: q.rts - p.rts,
		serverCPU: q.serverCPU - p.serverCPU, clientCPU: q.clientCPU - p.clientCPU, serverOK: p.serverOK && q.serverOK,
	}, nil
}

// plus adds two costs.
func (c cost) plus(d cost) cost {
	return cost{
		msgs: c.msgs + d.msgs, wall: c.wall + d.wall, roundTrips: c.roundTrips + d.roundTrips,
		serverCPU: c.serverCPU + d.serverCPU, clientCPU: c.clientCPU + d.clientCPU,
		serverOK: (c.serverOK || c.msgs == 0) && d.serverOK,
	}
}

// perMsg formats x per message.
func (c cost) perMsg(x int64, format string) string {
	return fmt.Sprintf(format, c.per(float64(x)))
}

// serverCPUPerMsg formats the server's CPU time per message, or "n/a" when
// it could not be read.
func (c cost) serverCPUPerMsg() string {
	if !c.serverOK {
		return "n/a"
	}
	return fmtDur(time.Duration(c.per(float64(c.serverCPU))))
}

// clientCPUPerMsg formats this process's CPU time per message.
func (c cost) clientCPUPerMsg() string { return fmtDur(time.Duration(c.per(float64(c.clientCPU)))) }

// per returns x per message.
func (c cost) per(x float64) float64 {
	if c.msgs == 0 {
		return 0
	}
	return x / float64(c.msgs)
}

// processCPU is this process's user + system CPU time.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// backendsCPU sums the user + system CPU time of the server processes
// serving pool's connections (pg_stat_activity of its application_name,
// read from /proc: only when the server runs on this Linux host).
func backendsCPU(ctx context.Context, pool *pgxpool.Pool) (time.Duration, bool) {
	rows, err := pool.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name = current_setting('application_name')")
	if err != nil {
		return 0, false
	}
	var pids []int
	for rows.Next() {
		var pid int
		if err := rows.Scan(&pid); err != nil {
			rows.Close()
			return 0, false
		}
		pids = append(pids, pid)
	}
	rows.Close()
	if rows.Err() != nil || len(pids) == 0 {
		return 0, false
	}
	var total time.Duration
	for _, pid := range pids {
		data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			return 0, false
		}
		// Fields after the command name (which may hold spaces) start at
		// the state, field 3; utime and stime are fields 14 and 15.
		f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+1:]))
		if len(f) < 13 {
			return 0, false
		}
		ut, err1 := strconv.ParseInt(f[11], 10, 64)
		st, err2 := strconv.ParseInt(f[12], 10, 64)
		if err1 != nil || err2 != nil {
			return 0, false
		}
		total += time.Duration(ut+st) * time.Second / clockTicks
	}
	return total, true
}

// clockTicks is USER_HZ, 100 on every Linux platform Go supports.
const clockTicks = 100

// waitSampler samples pg_stat_activity for the backends of one
// application_name on a connection of its own, and averages how many are in
// each state: "CPU" (active, no wait event), "client" (idle in transaction:
// the server waits for the client within a transaction), a wait event as
// type:event (WALSync, WALWrite, a lock...), while idle backends (not in a
// transaction) are not counted.
type waitSampler struct {
	counts  map[string]int
	samples int
	stop    chan struct{}
	done    chan error
}

func startWaitSampler(ctx context.Context, url, appName string, every time.Duration) (*waitSampler, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	s := &waitSampler{counts: map[string]int{}, stop: make(chan struct{}), done: make(chan error, 1)}
	go func() {
		defer conn.Close(context.WithoutCancel(ctx))
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-s.stop:
				s.done <- nil
				return
			case <-t.C:
			}
			rows, err := conn.Query(ctx, `SELECT state, coalesce(wait_event_type || ':' || wait_event, '')
				FROM pg_stat_activity WHERE application_name = $1 AND state <> 'idle'`, appName)
			if err != nil {
				s.done <- err
				return
			}
			for rows.Next() {
				var state, wait string
				if err := rows.Scan(&state, &wait); err != nil {
					rows.Close()
					s.done <- err
					return
				}
				switch {
				case state == "idle in transaction":
					s.counts["client"]++
				case wait == "":
					s.counts["CPU"]++
				default:
					s.counts[wait]++
				}
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				s.done <- err
				return
			}
			s.samples++
		}
	}()
	return s, nil
}

// finish stops sampling and returns the mean number of backends per state.
func (s *waitSampler) finish() (map[string]float64, error) {
	close(s.stop)
	if err := <-s.done; err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for k, v := range s.counts {
		if s.samples > 0 {
			out[k] = float64(v) / float64(s.samples)
		}
	}
	return out, nil
}
