package soak

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/google/uuid"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// The lease-mode leg ([Config.Lease]) has its handlers call a fake payment
// provider: an HTTP server in the soak's process that acts on the first
// request of each Idempotency-Key and answers every later one with the
// first answer (as Stripe does), whoever sends it. It keeps executing a
// charge when its client dies (a consumer process SIGKILLed in the middle
// of the call): the charge is made, the caller never learns it.

// providerPath is the provider's one endpoint.
const providerPath = "/charge"

// headerInstance names the consumer process that sends a request.
const headerInstance = "X-Soak-Instance"

// chargeRequest is the body of a call.
type chargeRequest struct {
	Group   string `json:"group"`
	EventID string `json:"eventId"`
	Amount  int64  `json:"amount"`
}

// chargeResponse is the provider's answer; Replayed: the key was executed
// before, nothing was done now.
type chargeResponse struct {
	ChargeID string `json:"chargeId"`
	Replayed bool   `json:"replayed"`
}

// callDuration is how long the provider takes to execute the charge of an
// event: 20–59 ms, and 300–500 ms for one event in ten (a slow provider),
// so that calls are in flight when a consumer process is killed. Drawn from
// the event id (its random last byte), so the consumer knows it too (the
// mid-call kill waits for half of it).
func callDuration(id uuid.UUID) time.Duration {
	b := int(id[15])
	if b%10 == 0 {
		return time.Duration(300+(b/10)%3*100) * time.Millisecond
	}
	return time.Duration(20+b%40) * time.Millisecond
}

// charge is what the provider knows of one Idempotency-Key.
type charge struct {
	group, eventID string
	executions     int // charges made: 1, or a bug of the provider
	requests       int // requests received with the key
	inFlight       bool
	resp           chargeResponse
}

// provider is the fake payment provider.
type provider struct {
	srv *http.Server
	url string

	mu        sync.Mutex
	byKey     map[string]*charge
	keysOf    map[[2]string]map[string]bool // (group, event id) → the keys its requests carried
	requests  int
	replayed  int
	conflicts int // a request whose key was being executed: 409, as Stripe answers
	bad       []string
}

func newProvider() (*provider, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &provider{byKey: map[string]*charge{}, keysOf: map[[2]string]map[string]bool{}, url: "http://" + ln.Addr().String() + providerPath}
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+providerPath, p.serve)
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

func (p *provider) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = p.srv.Shutdown(ctx)
}

func (p *provider) serve(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(idem.IdempotencyKeyHeader)
	var req chargeRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || key == "" {
		p.mu.Lock()
		p.bad = append(p.bad, fmt.Sprintf("a request from %s without a key or a body (key %q): %v", r.Header.Get(headerInstance), key, err))
		p.mu.Unlock()
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	id, err := uuid.Parse(req.EventID)
	if err != nil {
		http.Error(w, "bad event id", http.StatusBadRequest)
		return
	}
	p.mu.Lock()
	p.requests++
	ev := [2]string{req.Group, req.EventID}
	if p.keysOf[ev] == nil {
		p.keysOf[ev] = map[string]bool{}
	}
	p.keysOf[ev][key] = true
	c := p.byKey[key]
	switch {
	case c == nil:
		c = &charge{group: req.Group, eventID: req.EventID, inFlight: true}
		p.byKey[key] = c
	case c.group != req.Group || c.eventID != req.EventID:
		p.bad = append(p.bad, fmt.Sprintf("key %s sent for %s/%s and for %s/%s", key, c.group, c.eventID, req.Group, req.EventID))
	}
	c.requests++
	if c.inFlight && c.executions == 0 && c.requests > 1 {
		p.conflicts++
		p.mu.Unlock()
		http.Error(w, "a request with this Idempotency-Key is in progress", http.StatusConflict)
		return
	}
	if c.executions > 0 {
		p.replayed++
		resp := c.resp
		resp.Replayed = true
		p.mu.Unlock()
		writeJSON(w, resp)
		return
	}
	p.mu.Unlock()

	// The charge: it completes whether or not the caller is still there.
	time.Sleep(callDuration(id))
	p.mu.Lock()
	c.executions++
	c.inFlight = false
	c.resp = chargeResponse{ChargeID: "ch_" + uuid.NewString()}
	resp := c.resp
	p.mu.Unlock()
	writeJSON(w, resp)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// ProviderReport is what the fake provider saw in a lease-mode run.
type ProviderReport struct {
	// Requests received; Replayed of them answered from an executed key
	// (a call repeated after a kill, a lost lease, a failure); Conflicts
	// refused because the key was being executed.
	Requests, Replayed, Conflicts int
	// Charges executed, in all.
	Charges int
}

// check compares the charges with the events of each group: every event
// charged exactly once per group, with one key across all its requests.
// It returns the violations and the group's charged events.
func (p *provider) check(group string, events map[string]bool) (violations []string, charged int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	perEvent := map[string]int{}
	for key, c := range p.byKey {
		if c.group != group {
			continue
		}
		if c.executions > 1 {
			violations = append(violations, fmt.Sprintf("%s: key %s executed %d times", group, key, c.executions))
		}
		if c.inFlight {
			violations = append(violations, fmt.Sprintf("%s: key %s still executing at the end", group, key))
		}
		if !events[c.eventID] {
			violations = append(violations, fmt.Sprintf("%s: charge for event %s, which the producer never committed", group, c.eventID))
		}
		perEvent[c.eventID] += c.executions
	}
	var twice, unstable, never int
	for ev := range events {
		switch n := perEvent[ev]; {
		case n == 0:
			never++
		case n > 1:
			twice++
		}
		if len(p.keysOf[[2]string{group, ev}]) > 1 {
			unstable++
		}
		charged += min(perEvent[ev], 1)
	}
	if never > 0 {
		violations = append(violations, fmt.Sprintf("%s: %d events never charged at the provider", group, never))
	}
	if twice > 0 {
		violations = append(violations, fmt.Sprintf("%s: %d events charged more than once at the provider", group, twice))
	}
	if unstable > 0 {
		violations = append(violations, fmt.Sprintf("%s: %d events called with more than one Idempotency-Key", group, unstable))
	}
	return violations, charged
}

func (p *provider) report() (ProviderReport, []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := ProviderReport{Requests: p.requests, Replayed: p.replayed, Conflicts: p.conflicts}
	for _, c := range p.byKey {
		r.Charges += c.executions
	}
	return r, append([]string(nil), p.bad...)
}

// errProviderBusy is the consumer's error for a 409: the key's first
// request is still being executed (the caller of that one was killed, or
// lost its lease). Transient: the message is retried.
var errProviderBusy = errors.New("provider: a request with this Idempotency-Key is in progress")
