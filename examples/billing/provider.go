package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// chargeRequest is the body of POST /charges.
type chargeRequest struct {
	OrderID    string `json:"orderId"`
	CustomerID string `json:"customerId"`
	Amount     string `json:"amount"`
	Currency   string `json:"currency"`
}

// chargeResponse is the provider's answer to a successful charge.
type chargeResponse struct {
	ChargeID string `json:"chargeId"`
	OrderID  string `json:"orderId"`
	Amount   string `json:"amount"`
	Currency string `json:"currency"`
	Status   string `json:"status"`
}

// providerStats counts what the payment provider saw.
type providerStats struct {
	Requests   int // POST /charges received
	Charges    int // charges created (money moved)
	Replayed   int // repeated key, same body: first response returned again
	InFlight   int // repeated key while the first request was still running: 409
	Mismatched int // repeated key with a different body: 422
	Dropped    int // responses lost on purpose after the charge was recorded
}

type storedResponse struct {
	bodyHash [32]byte
	done     bool
	status   int
	body     []byte
}

// paymentProvider is a payment provider that deduplicates on the Idempotency-Key
// header the way public payment APIs do:
//
//   - a new key: the charge is made, the response stored under the key;
//   - the same key and the same body again: the stored response is returned
//     (header Idempotent-Replayed: true), no second charge;
//   - the same key while the first request is still being processed: 409;
//   - the same key with a different body: 422 (a client bug, never retried);
//   - no key: 400.
//
// [paymentProvider.DropResponse] makes it lose the response of an order's next
// charge: the charge is recorded, then the connection is cut in the middle
// of the 201 response (the client sees unexpected EOF).
type paymentProvider struct {
	mu       sync.Mutex
	keys     map[string]*storedResponse
	perOrder map[string]int // charges per order id
	drop     map[string]bool
	slow     map[string]time.Duration
	held     map[string]*heldCharge
	holds    []*heldCharge // every hold, released by Close
	// executed counts, per Idempotency-Key, the charges the provider made
	// for it: its own key table's view, which must say 1 for every key.
	executed map[string]int
	stats    providerStats
	latency  time.Duration
	// ignoreKeys turns the provider's dedup off (a negative control: the
	// demo must then detect double charges).
	ignoreKeys bool
	nextID     int

	srv      *http.Server
	listener net.Listener
}

// newPaymentProvider starts the provider on 127.0.0.1 (a random port). latency is
// how long a charge takes (the window in which a repeated key gets 409).
func newPaymentProvider(latency time.Duration) (*paymentProvider, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("provider: listen: %w", err)
	}
	p := &paymentProvider{
		keys:     map[string]*storedResponse{},
		perOrder: map[string]int{},
		drop:     map[string]bool{},
		slow:     map[string]time.Duration{},
		held:     map[string]*heldCharge{},
		executed: map[string]int{},
		latency:  latency,
		listener: ln,
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charges", p.handleCharge)
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

// URL is the provider's base URL.
func (p *paymentProvider) URL() string { return "http://" + p.listener.Addr().String() }

// Close stops the server and releases the held charges.
func (p *paymentProvider) Close() error {
	p.mu.Lock()
	for _, h := range p.holds {
		h.Release()
	}
	p.mu.Unlock()
	return p.srv.Close()
}

// DropResponse makes the provider lose the response to the next charge of
// orderID, after recording it.
func (p *paymentProvider) DropResponse(orderID string) {
	p.mu.Lock()
	p.drop[orderID] = true
	p.mu.Unlock()
}

// SlowCharge makes charges of orderID take d instead of the default latency.
func (p *paymentProvider) SlowCharge(orderID string, d time.Duration) {
	p.mu.Lock()
	p.slow[orderID] = d
	p.mu.Unlock()
}

// heldCharge is a charge the provider keeps in progress until released: a
// call that hangs at the card network.
type heldCharge struct {
	arrived chan struct{} // closed when the held request arrives
	release chan struct{} // close to let it finish
	once    sync.Once
}

// Release lets the held charge finish (its response is then sent).
func (h *heldCharge) Release() { h.once.Do(func() { close(h.release) }) }

// Arrived is closed once the held request is in progress.
func (h *heldCharge) Arrived() <-chan struct{} { return h.arrived }

// HoldCharge makes the next charge of orderID stay in progress (after its
// latency) until the returned hold is released: a repeated key meanwhile
// gets 409.
func (p *paymentProvider) HoldCharge(orderID string) *heldCharge {
	h := &heldCharge{arrived: make(chan struct{}), release: make(chan struct{})}
	p.mu.Lock()
	p.held[orderID] = h
	p.holds = append(p.holds, h)
	p.mu.Unlock()
	return h
}

// ExecutionsPerKey returns how many charges the provider made under each
// Idempotency-Key it stored.
func (p *paymentProvider) ExecutionsPerKey() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := make(map[string]int, len(p.executed))
	for k, v := range p.executed {
		m[k] = v
	}
	return m
}

// Stats returns the counters.
func (p *paymentProvider) Stats() providerStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stats
}

// ChargesPerOrder returns how many charges each order got.
func (p *paymentProvider) ChargesPerOrder() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	m := make(map[string]int, len(p.perOrder))
	for k, v := range p.perOrder {
		m[k] = v
	}
	return m
}

func (p *paymentProvider) handleCharge(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		http.Error(w, "read body", http.StatusBadRequest)
		return
	}
	key := r.Header.Get(idem.IdempotencyKeyHeader)
	hash := sha256.Sum256(body)

	p.mu.Lock()
	p.stats.Requests++
	if key == "" {
		p.mu.Unlock()
		writeJSONError(w, http.StatusBadRequest, "Idempotency-Key header required")
		return
	}
	if prev, ok := p.keys[key]; ok && !p.ignoreKeys {
		switch {
		case prev.bodyHash != hash:
			p.stats.Mismatched++
			p.mu.Unlock()
			writeJSONError(w, http.StatusUnprocessableEntity, "Idempotency-Key reused with a different request body")
		case !prev.done:
			p.stats.InFlight++
			p.mu.Unlock()
			writeJSONError(w, http.StatusConflict, "a request with this Idempotency-Key is in progress")
		default:
			p.stats.Replayed++
			status, stored := prev.status, prev.body
			p.mu.Unlock()
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Idempotent-Replayed", "true")
			w.WriteHeader(status)
			_, _ = w.Write(stored)
		}
		return
	}
	entry := &storedResponse{bodyHash: hash}
	p.keys[key] = entry
	p.mu.Unlock()

	var req chargeRequest
	if err := json.Unmarshal(body, &req); err != nil || req.OrderID == "" || req.Amount == "" || req.Currency == "" {
		p.finish(entry, http.StatusBadRequest, mustJSON(map[string]string{"error": "invalid charge request"}))
		writeStored(w, entry)
		return
	}
	p.callCardNetwork(req.OrderID)

	p.mu.Lock()
	p.nextID++
	resp := chargeResponse{ChargeID: "ch_" + strconv.Itoa(p.nextID), OrderID: req.OrderID, Amount: req.Amount, Currency: req.Currency, Status: "succeeded"}
	p.stats.Charges++
	p.perOrder[req.OrderID]++
	p.executed[key]++
	drop := p.drop[req.OrderID]
	delete(p.drop, req.OrderID)
	if drop {
		p.stats.Dropped++
	}
	p.mu.Unlock()
	p.finish(entry, http.StatusCreated, mustJSON(resp))

	if drop {
		cutResponse(w, entry)
		return
	}
	writeStored(w, entry)
}

// callCardNetwork takes the provider's latency (or the order's, when the
// demo slowed it), then waits while the demo holds the order.
func (p *paymentProvider) callCardNetwork(orderID string) {
	p.mu.Lock()
	latency, ok := p.slow[orderID]
	hold := p.held[orderID]
	delete(p.held, orderID)
	p.mu.Unlock()
	if !ok {
		latency = p.latency
	}
	time.Sleep(latency) // the card network
	if hold != nil {
		close(hold.arrived)
		<-hold.release
	}
}

func (p *paymentProvider) finish(e *storedResponse, status int, body []byte) {
	p.mu.Lock()
	e.status, e.body, e.done = status, body, true
	p.mu.Unlock()
}

// cutResponse sends the status line and half of the body, then closes the
// connection: the money moved, but the client never learns the charge id.
func cutResponse(w http.ResponseWriter, e *storedResponse) {
	hj, ok := w.(http.Hijacker)
	if !ok {
		w.WriteHeader(http.StatusInternalServerError)
		return
	}
	conn, buf, err := hj.Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	half := e.body[:len(e.body)/2]
	fmt.Fprintf(buf, "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", e.status, http.StatusText(e.status), len(e.body))
	_, _ = buf.Write(half)
	_ = buf.Flush()
}

func writeStored(w http.ResponseWriter, e *storedResponse) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(e.status)
	_, _ = w.Write(e.body)
}

func writeJSONError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(mustJSON(map[string]string{"error": msg}))
}

func mustJSON(v any) []byte {
	var b bytes.Buffer
	if err := json.NewEncoder(&b).Encode(v); err != nil {
		panic(err)
	}
	return bytes.TrimSpace(b.Bytes())
}
