// Package netfault dials connections that a test can cut as a host does
// that vanishes without a reset (a frozen VM, a pulled cable, a dropped
// route): once cut, nothing is sent and nothing arrives, not even the FIN
// of a Close. A read or write
// then blocks until its deadline passes, as on a real silent peer, or
// until the test releases the blackhole. The server sees a silent peer,
// not a closed connection.
package netfault

import (
	"context"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// Blackhole dials connections that Cut silences together.
type Blackhole struct {
	cut  atomic.Bool
	done chan struct{}
	once sync.Once
}

// NewBlackhole returns a Blackhole that lets traffic through until Cut.
func NewBlackhole() *Blackhole { return &Blackhole{done: make(chan struct{})} }

// Cut silences every connection the Blackhole dialled or will dial.
func (b *Blackhole) Cut() { b.cut.Store(true) }

// Release ends the blocked reads and writes with net.ErrClosed. Call it
// before the test ends (t.Cleanup), so that nothing blocks past it.
func (b *Blackhole) Release() { b.once.Do(func() { close(b.done) }) }

// Dial dials addr; use it as pgconn.Config.DialFunc or a net.Dialer's
// replacement.
func (b *Blackhole) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &conn{Conn: c, b: b, changed: make(chan struct{}, 1)}, nil
}

type conn struct {
	net.Conn
	b       *Blackhole
	mu      sync.Mutex
	rd, wd  time.Time
	changed chan struct{}
}

func (c *conn) Read(p []byte) (int, error) {
	if c.b.cut.Load() {
		return 0, c.stall(func() time.Time { return c.rd })
	}
	n, err := c.Conn.Read(p)
	if c.b.cut.Load() {
		return 0, c.stall(func() time.Time { return c.rd })
	}
	return n, err
}

func (c *conn) Write(p []byte) (int, error) {
	if c.b.cut.Load() {
		return 0, c.stall(func() time.Time { return c.wd })
	}
	return c.Conn.Write(p)
}

// stall blocks until the deadline deadline() returns passes (it is read
// again whenever a deadline is set) or the Blackhole is released.
func (c *conn) stall(deadline func() time.Time) error {
	for {
		c.mu.Lock()
		d := deadline()
		c.mu.Unlock()
		var expired <-chan time.Time
		if !d.IsZero() {
			t := time.NewTimer(time.Until(d))
			defer t.Stop()
			expired = t.C
		}
		select {
		case <-c.b.done:
			return net.ErrClosed
		case <-expired:
			return os.ErrDeadlineExceeded
		case <-c.changed:
		}
	}
}

// Close of a cut connection tells the server nothing, as from a vanished
// host: the socket stays open, silent, until Release.
func (c *conn) Close() error {
	if c.b.cut.Load() {
		go func() {
			<-c.b.done
			_ = c.Conn.Close()
		}()
		return nil
	}
	return c.Conn.Close()
}

func (c *conn) SetDeadline(t time.Time) error {
	c.setDeadlines(&t, &t)
	return c.Conn.SetDeadline(t)
}

func (c *conn) SetReadDeadline(t time.Time) error {
	c.setDeadlines(&t, nil)
	return c.Conn.SetReadDeadline(t)
}

func (c *conn) SetWriteDeadline(t time.Time) error {
	c.setDeadlines(nil, &t)
	return c.Conn.SetWriteDeadline(t)
}

func (c *conn) setDeadlines(rd, wd *time.Time) {
	c.mu.Lock()
	if rd != nil {
		c.rd = *rd
	}
	if wd != nil {
		c.wd = *wd
	}
	c.mu.Unlock()
	select {
	case c.changed <- struct{}{}:
	default:
	}
}
