package pgcluster

import (
	"io"
	"net"
	"strconv"
	"sync"
)

// Proxy is one address in front of a cluster that can be pointed at
// another, as a virtual IP or a DNS name is in a failover: the clients'
// pools keep their configuration, and their new connections reach the new
// primary.
type Proxy struct {
	e      *Env
	ln     net.Listener
	Port   int
	mu     sync.Mutex
	target string
	conns  map[net.Conn]struct{}
}

// Proxy listens on a port of the range and forwards to c.
func (e *Env) Proxy(c *Cluster) *Proxy {
	e.tb.Helper()
	p, err := e.OpenProxy(c)
	e.must(err)
	return p
}

// OpenProxy is Proxy returning its error.
func (e *Env) OpenProxy(c *Cluster) (*Proxy, error) {
	port, err := e.takePort()
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		return nil, err
	}
	p := &Proxy{e: e, ln: ln, Port: port, conns: map[net.Conn]struct{}{}}
	p.PointTo(c)
	go p.serve()
	e.cleanup(func() {
		_ = ln.Close()
		p.closeConns()
	})
	return p, nil
}

// URL connects to database postgres through the proxy.
func (p *Proxy) URL() string {
	return "postgres://postgres@127.0.0.1:" + strconv.Itoa(p.Port) + "/postgres?sslmode=disable"
}

// PointTo sends the new connections to c and closes the open ones.
func (p *Proxy) PointTo(c *Cluster) {
	p.mu.Lock()
	p.target = "127.0.0.1:" + strconv.Itoa(c.Port)
	p.mu.Unlock()
	p.closeConns()
}

func (p *Proxy) closeConns() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
	clear(p.conns)
}

func (p *Proxy) serve() {
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		target := p.target
		p.mu.Unlock()
		out, err := net.Dial("tcp", target)
		if err != nil {
			_ = in.Close()
			continue
		}
		p.mu.Lock()
		p.conns[in], p.conns[out] = struct{}{}, struct{}{}
		p.mu.Unlock()
		go p.pipe(in, out)
		go p.pipe(out, in)
	}
}

func (p *Proxy) pipe(dst, src net.Conn) {
	_, _ = io.Copy(dst, src)
	_ = dst.Close()
	_ = src.Close()
	p.mu.Lock()
	delete(p.conns, dst)
	delete(p.conns, src)
	p.mu.Unlock()
}
