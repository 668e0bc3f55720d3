// Package rtcount counts PostgreSQL round trips at the net.Conn level: a
// round trip is a burst of client writes followed by the server's answer.
// Counting below pgx makes the figure exact whatever pgx does above
// (implicit statement preparation, pipelining, simple or extended protocol).
package rtcount

import (
	"context"
	"net"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgconn"
)

// Counter counts round trips over every connection dialled through it.
type Counter struct {
	n atomic.Int64
}

// Load returns the number of round trips so far.
func (c *Counter) Load() int64 { return c.n.Load() }

// Reset sets the count to zero.
func (c *Counter) Reset() { c.n.Store(0) }

// DialFunc returns a pgconn.DialFunc that dials with a net.Dialer and counts
// on c. Set it as ConnConfig.DialFunc.
func (c *Counter) DialFunc() pgconn.DialFunc {
	d := &net.Dialer{KeepAlive: -1}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &countingConn{Conn: conn, c: c}, nil
	}
}

// countingConn counts one round trip each time data arrives after the
// client wrote something since the previous arrival: the answer to a burst of
// writes (one Write or several, pipelined) ends one round trip, however many
// Read calls deliver it.
type countingConn struct {
	net.Conn
	c *Counter

	mu      sync.Mutex
	pending bool // wrote since the last data arrived
}

func (cc *countingConn) Write(p []byte) (int, error) {
	cc.mu.Lock()
	cc.pending = true
	cc.mu.Unlock()
	return cc.Conn.Write(p)
}

func (cc *countingConn) Read(p []byte) (int, error) {
	n, err := cc.Conn.Read(p)
	if n > 0 {
		cc.mu.Lock()
		if cc.pending {
			cc.pending = false
			cc.c.n.Add(1)
		}
		cc.mu.Unlock()
	}
	return n, err
}
