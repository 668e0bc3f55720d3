package middleware

import (
	"context"
	"strconv"
	"strings"

	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
)

// idempotencyKeyNamespace is the UUIDv5 namespace of the keys
// [IdempotencyKey] derives for named operations. It is fixed forever:
// changing it would give every redelivered event a new key, and the
// downstream provider would apply the call a second time.
var idempotencyKeyNamespace = uuid.MustParse("143bda33-98c2-4c97-9cde-adc9f5df8776")

// IdempotencyKey returns the Idempotency-Key for a downstream call made while
// handling the event in ctx (msg.Context() inside a handler wrapped by the
// dedup middleware). The same event always yields the same key, so a call
// repeated after a rollback and redelivery is recognised by the provider:
//
//   - operation "": the event id itself (canonical lowercase UUID string);
//   - a named operation: a UUIDv5 in the library's fixed namespace
//     (143bda33-98c2-4c97-9cde-adc9f5df8776) over the
//     name "<event id>/<len(ns)>:<ns>/<operation>", where ns is the group's
//     recorded namespace ([Config.IdempotencyNamespace]: the group's name at
//     its first start, kept across idemctl groups rename), e.g.
//     "0190...-...-.../23:billing-order-confirmed/charge". Two calls made for
//     one event (charge, then refund-fee) or two consumer groups calling the
//     same provider for one event then never share a key, and renaming a
//     group does not change its keys.
//
// Use a named operation whenever one event leads to more than one call to the
// same provider, or more than one consumer group calls it. The key depends on
// nothing else (not the time, not the attempt), so keep the operation name
// stable across releases.
//
// It returns an error wrapping [ErrNotInHandler] when ctx carries no event.
func IdempotencyKey(ctx context.Context, operation string) (string, error) {
	v := idemctx.From(ctx)
	if v == nil || v.EventID == uuid.Nil {
		return "", ErrNotInHandler
	}
	if operation == "" {
		return v.EventID.String(), nil
	}
	ns := v.KeyNamespace
	if ns == "" {
		ns = v.ConsumerGroup
	}
	return idempotencyKeyFor(v.EventID, ns, operation), nil
}

func idempotencyKeyFor(eventID uuid.UUID, group, operation string) string {
	var b strings.Builder
	b.Grow(36 + 1 + 4 + len(group) + 1 + len(operation))
	b.WriteString(eventID.String())
	b.WriteByte('/')
	b.WriteString(strconv.Itoa(len(group)))
	b.WriteByte(':')
	b.WriteString(group)
	b.WriteByte('/')
	b.WriteString(operation)
	return uuid.NewSHA1(idempotencyKeyNamespace, []byte(b.String())).String()
}
