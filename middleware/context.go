package middleware

import (
	"context"
	"fmt"
	"sync"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/watermill-idempotency/internal/idemctx"
)

// TxFromContext returns the transaction the dedup middleware opened for the
// message being handled. Run every business write of the handler on it: it
// commits together with the event's claim.
func TxFromContext(ctx context.Context) (pgx.Tx, bool) {
	v := idemctx.From(ctx)
	if v == nil || v.Tx == nil {
		return nil, false
	}
	return v.Tx, true
}

// MustTxFromContext is [TxFromContext] for handlers that cannot work without
// the transaction. It panics with [ErrNotInHandler] when ctx has none (in
// lease mode, wrapped with a hint: register the writes with [Complete]).
func MustTxFromContext(ctx context.Context) pgx.Tx {
	tx, ok := TxFromContext(ctx)
	if !ok {
		if leaseStateFrom(ctx) != nil {
			panic(fmt.Errorf("%w: lease mode (Config.Mode: a *LeaseConfig) runs the handler without a transaction; register its writes with idem.Complete", ErrNotInHandler))
		}
		panic(ErrNotInHandler)
	}
	return tx
}

// EventIDFromContext returns the validated event id of the message being
// handled.
func EventIDFromContext(ctx context.Context) (uuid.UUID, bool) {
	v := idemctx.From(ctx)
	if v == nil {
		return uuid.Nil, false
	}
	return v.EventID, true
}

// completeFunc is a database write of a handler, registered with
// [Complete].
type completeFunc = func(ctx context.Context, tx pgx.Tx) error

// Complete registers fn, the handler's database writes, to run in the
// transaction that claims the event: tx is that transaction, and the ctx fn
// gets carries it ([TxFromContext], outbox.PublisherFromContext work on
// it). Write handlers with it and they work in both modes:
//
//   - lease mode ([LeaseConfig]): the handler runs with no transaction;
//     fn runs after it returns nil, in the completing transaction, once the
//     lease's token is checked. A lease lost meanwhile runs no fn at all.
//     Functions run in the order registered; an error from one rolls the
//     completion back and the middleware returns it (the message is
//     retried; the call's Idempotency-Key stays the same);
//   - transaction mode: fn runs at once on the message's transaction, and
//     Complete returns its error.
//
// It returns [ErrNotInHandler] when ctx comes from neither mode.
func Complete(ctx context.Context, fn func(ctx context.Context, tx pgx.Tx) error) error {
	if s := leaseStateFrom(ctx); s != nil {
		s.add(fn)
		return nil
	}
	tx, ok := TxFromContext(ctx)
	if !ok {
		return ErrNotInHandler
	}
	return fn(ctx, tx)
}

// CompleteExec registers one statement of the handler's writes, sql with
// args, to run in the transaction that claims the event: [Complete] for a
// write that needs no result and no Go code at completion. In lease mode
// the completion then sends the claim and every CompleteExec write of its
// batch in one pipeline, one round trip and one transaction however many
// handlers and statements it holds, where [Complete]'s functions cost a
// round trip each inside the open transaction (a batch with any of them,
// or with a handler's messages for [Config.Outbox], completes that way,
// the statements sent one by one). The guarantees are Complete's: the
// statements run in the order registered (with the handler's Complete
// functions), only once its lease's token is checked, nothing when it was
// lost; a failing statement rolls the completion back and the middleware
// returns its error (a *pgconn.PgError inside). args are read at the
// completion, after the handler returned.
//
// With group commit ([GroupCommitConfig]) it gathers the statement: the
// group sends every CompleteExec statement of its handlers, in the order
// registered, with the group's outbox rows, in one pipeline before its
// COMMIT, so a handler's write-only statement costs the group no round
// trip of its own (a statement run at once costs one). The handlers of
// the group after it do not see its write, nor does the handler itself;
// a failing statement rolls the group back, and each of its messages is
// then processed alone, where the statement runs at once and its error is
// the message's.
//
// In transaction mode it runs sql at once on the message's transaction and
// returns its error. It works with [SQLDB] too (the statements travel on
// database/sql's connection, through pgx). It returns [ErrNotInHandler]
// when ctx comes from neither mode.
func CompleteExec(ctx context.Context, sql string, args ...any) error {
	if s := leaseStateFrom(ctx); s != nil {
		s.addExec(sql, args)
		return nil
	}
	tx, ok := TxFromContext(ctx)
	if !ok {
		return ErrNotInHandler
	}
	if h := idemctx.HooksFor(ctx, tx); h.Exec(sql, args) {
		return nil
	}
	_, err := tx.Exec(ctx, sql, args...)
	return err
}

// write is one registered write of a handler: fn ([Complete]), or sql
// with args ([CompleteExec]).
type write struct {
	fn   completeFunc
	sql  string
	args []any
}

// leaseState collects a lease-mode handler's writes.
type leaseState struct {
	mu sync.Mutex
	ws []write
}

func (s *leaseState) add(fn completeFunc) {
	s.mu.Lock()
	s.ws = append(s.ws, write{fn: fn})
	s.mu.Unlock()
}

func (s *leaseState) addExec(sql string, args []any) {
	s.mu.Lock()
	s.ws = append(s.ws, write{sql: sql, args: args})
	s.mu.Unlock()
}

func (s *leaseState) writes() []write {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ws
}

type leaseStateKey struct{}

func withLeaseState(ctx context.Context, s *leaseState) context.Context {
	return context.WithValue(ctx, leaseStateKey{}, s)
}

func leaseStateFrom(ctx context.Context) *leaseState {
	s, _ := ctx.Value(leaseStateKey{}).(*leaseState)
	return s
}
