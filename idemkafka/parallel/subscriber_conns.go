package parallel

import (
	"net"
	"sync"

	"github.com/IBM/sarama"
	"golang.org/x/net/proxy"
)

// conns dials a stream's broker connections and keeps them, so that a stop
// that waits too long can cut them: Sarama closes a broker only after the
// response it waits for arrived or timed out (Net.ReadTimeout), and a
// coordinator holds a JoinGroup for up to the rebalance timeout.
type conns struct {
	next proxy.Dialer
	mu   sync.Mutex
	open map[net.Conn]struct{}
	cut  bool
}

// trackConns makes cfg (a copy of the subscriber's) dial through a new
// conns: through the proxy cfg names, else as Sarama dials itself.
func trackConns(cfg *sarama.Config) *conns {
	c := &conns{open: map[net.Conn]struct{}{}}
	if cfg.Net.Proxy.Enable && cfg.Net.Proxy.Dialer != nil {
		c.next = cfg.Net.Proxy.Dialer
	} else {
		c.next = &net.Dialer{Timeout: cfg.Net.DialTimeout, KeepAlive: cfg.Net.KeepAlive, LocalAddr: cfg.Net.LocalAddr}
	}
	cfg.Net.Proxy.Enable = true
	cfg.Net.Proxy.Dialer = c
	return c
}

func (c *conns) Dial(network, addr string) (net.Conn, error) {
	conn, err := c.next.Dial(network, addr)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cut {
		_ = conn.Close()
		return nil, net.ErrClosed
	}
	t := &trackedConn{Conn: conn, c: c}
	c.open[t] = struct{}{}
	return t, nil
}

// cutAll closes every connection, and any dialed from now on.
func (c *conns) cutAll() {
	c.mu.Lock()
	c.cut = true
	open := make([]net.Conn, 0, len(c.open))
	for conn := range c.open {
		open = append(open, conn)
	}
	c.mu.Unlock()
	for _, conn := range open {
		_ = conn.Close()
	}
}

type trackedConn struct {
	net.Conn
	c    *conns
	once sync.Once
}

func (t *trackedConn) Close() error {
	t.once.Do(func() {
		t.c.mu.Lock()
		delete(t.c.open, t)
		t.c.mu.Unlock()
	})
	return t.Conn.Close()
}
