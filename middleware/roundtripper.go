package middleware

import (
	"go.opentelemetry.io/otel/trace"

	"fmt"
	"net/http"

	"github.com/idemkit/watermill-idempotency/internal/otelx"
)

// IdempotencyKeyHeader is the request header set by [IdempotencyKeyTransport].
const IdempotencyKeyHeader = "Idempotency-Key"

// IdempotencyKeyTransport is an http.RoundTripper for money calls made from a
// handler: it sets the Idempotency-Key header to [IdempotencyKey] of the
// request's context, so when the handler's transaction rolls back after the
// provider acted (a lost response, a crash before COMMIT), the redelivered
// event calls again with the SAME key and the provider returns its first
// answer instead of acting twice.
//
//	client := &http.Client{Transport: idem.NewIdempotencyKeyTransport(nil, "charge")}
//	req, _ := http.NewRequestWithContext(msg.Context(), http.MethodPost, url, body)
//	resp, err := client.Do(req)
//
// A key the caller already set on the request is kept. A request whose
// context carries no event is not sent: RoundTrip returns an error wrapping
// [ErrNotInHandler] (http.Client wraps it in a *url.Error; errors.Is
// sees through). Use a dedicated client for the calls that need a key.
//
// The request passed in is never modified; a shallow clone carries the header.
//
// Go's http.Transport treats a request with an Idempotency-Key as
// replayable: on a reused connection that fails before the first response
// byte it resends it itself, with the same key, which the provider dedups.
type IdempotencyKeyTransport struct {
	// Next sends the request. Defaults to http.DefaultTransport.
	Next http.RoundTripper

	// Operation names the call, see [IdempotencyKey]. Defaults to "" (the key
	// is the event id itself).
	Operation string

	// OperationFunc, when set, returns the operation for each request and
	// overrides Operation (e.g. one client for "charge" and "refund" by URL
	// path). Defaults to nil.
	OperationFunc func(req *http.Request) string
}

var _ http.RoundTripper = (*IdempotencyKeyTransport)(nil)

// NewIdempotencyKeyTransport returns a transport that sends through next (nil
// means http.DefaultTransport) with the key of operation.
func NewIdempotencyKeyTransport(next http.RoundTripper, operation string) *IdempotencyKeyTransport {
	return &IdempotencyKeyTransport{Next: next, Operation: operation}
}

// RoundTrip implements http.RoundTripper.
func (t *IdempotencyKeyTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	next := t.Next
	if next == nil {
		next = http.DefaultTransport
	}
	if req.Header.Get(IdempotencyKeyHeader) != "" {
		return next.RoundTrip(req)
	}
	op := t.Operation
	if t.OperationFunc != nil {
		op = t.OperationFunc(req)
	}
	key, err := IdempotencyKey(req.Context(), op)
	if err != nil {
		if req.Body != nil {
			_ = req.Body.Close() // RoundTrip must close the body, even on error
		}
		return nil, fmt.Errorf("idempotency key transport: refusing to send %s %s without an Idempotency-Key: %w", req.Method, req.URL.Redacted(), err)
	}
	r := req.Clone(req.Context())
	r.Header.Set(IdempotencyKeyHeader, key)
	// The key (never the body) on the span of the call, or of the handler.
	if span := trace.SpanFromContext(req.Context()); span.IsRecording() {
		span.SetAttributes(otelx.AttrIdempotencyKey.String(key))
	}
	return next.RoundTrip(r)
}
