package idemctx

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// uncomparableTx is a pgx.Tx of a type == panics on.
type uncomparableTx struct {
	pgx.Tx
	notes []string
}

// pointerTx is a comparable pgx.Tx whose SendBatch records the batch.
type pointerTx struct {
	pgx.Tx
	sent []*pgx.Batch
}

func (tx *pointerTx) SendBatch(_ context.Context, b *pgx.Batch) pgx.BatchResults {
	tx.sent = append(tx.sent, b)
	return closedResults{}
}

// closedResults is the results of a batch that all went well.
type closedResults struct{ pgx.BatchResults }

func (closedResults) Close() error { return nil }

// sentSQL is the statements of the batches tx was sent, in order.
func (tx *pointerTx) sentSQL() (sqls []string) {
	for _, b := range tx.sent {
		for _, q := range b.QueuedQueries {
			sqls = append(sqls, q.SQL)
		}
	}
	return sqls
}

func TestHooks(t *testing.T) {
	tx, other := &pointerTx{}, &pointerTx{}
	h := &Hooks{Tx: tx}
	ran := 0
	for range 2 { // the same key twice: registered once
		if !h.OnCommit(tx, "t", func() { ran++ }) {
			t.Fatal("OnCommit on h.Tx must register")
		}
	}
	if h.OnCommit(other, "t", func() { ran++ }) {
		t.Fatal("OnCommit on another transaction must not register")
	}
	if h.OnCommit(uncomparableTx{notes: []string{"a"}}, "t", func() {}) {
		t.Fatal("an uncomparable transaction is another transaction (and no panic)")
	}
	if (&Hooks{Tx: uncomparableTx{notes: []string{"a"}}}).OnCommit(uncomparableTx{notes: []string{"a"}}, "t", func() {}) {
		t.Fatal("an uncomparable transaction cannot be told to be the same")
	}
	var none *Hooks
	if none.OnCommit(tx, "t", func() {}) || HooksFrom(context.Background()) != nil {
		t.Fatal("no hooks: the caller acts at once")
	}
	if HooksFrom(WithHooks(context.Background(), h)) != h {
		t.Fatal("WithHooks/HooksFrom")
	}
	h.Committed()
	if ran != 1 {
		t.Fatalf("one function per key, run once: ran %d", ran)
	}
	if h.OnCommit(tx, "late", func() {}) {
		t.Fatal("after Committed, OnCommit must not register")
	}
}

type recBatch struct{ name string }

func (b recBatch) Queue(pb *pgx.Batch) { pb.Queue(b.name) }

// While gathering, the writes on h.Tx join one batch per key, found from a
// context without the hooks too; Flush runs each once, in the order of the
// first writes, and ends the gathering; other transactions write at once.
func TestGather(t *testing.T) {
	t.Parallel()
	tx, other := &pointerTx{}, &pointerTx{}
	h := &Hooks{Tx: tx}
	mk := func(name string) func() Batch { return func() Batch { return recBatch{name} } }
	if h.Exec("not yet", nil) {
		t.Fatal("not gathering: Exec's statement runs at once")
	}
	if h.BatchFor(tx, "a", mk("a")) != nil {
		t.Fatal("not gathering: the write runs at once")
	}
	h.Gather()
	defer h.StopGathering()
	if HooksFor(context.Background(), tx) != h || HooksFor(context.Background(), other) != nil {
		t.Fatal("HooksFor must find the hooks gathering on tx, and only on tx")
	}
	for _, k := range []string{"b", "a", "b"} {
		if HooksFor(context.Background(), tx).BatchFor(tx, k, mk(k)) == nil {
			t.Fatal("gathering: BatchFor must return the key's batch")
		}
	}
	if h.BatchFor(other, "a", mk("x")) != nil {
		t.Fatal("another transaction's write runs at once")
	}
	for _, q := range []string{"exec 1", "exec 2"} {
		if !h.Exec(q, nil) {
			t.Fatal("gathering: Exec must gather")
		}
	}
	if err := h.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(tx.sentSQL(), ","); len(tx.sent) != 1 || got != "exec 1,exec 2,b,a" {
		t.Fatalf("one pipeline: Exec's statements in order, then one statement per key in first-write order: %d batches, %s", len(tx.sent), got)
	}
	if HooksFor(context.Background(), tx) != nil || h.BatchFor(tx, "a", mk("a")) != nil || h.Exec("late", nil) {
		t.Fatal("after Flush, writes run at once and tx is no longer registered")
	}
	if err := h.Flush(context.Background()); err != nil || len(tx.sent) != 1 {
		t.Fatalf("nothing gathered: Flush sends nothing (%v, %d batches)", err, len(tx.sent))
	}
	u := &Hooks{Tx: uncomparableTx{notes: []string{"a"}}}
	u.Gather()
	if u.BatchFor(u.Tx, "a", mk("a")) != nil {
		t.Fatal("an uncomparable transaction is never gathered")
	}
}

type otherKey struct{}

func TestWithHandler(t *testing.T) {
	t.Parallel()
	parent := context.WithValue(context.Background(), otherKey{}, "parent")
	h := &Hooks{}
	ctx := WithHandler(parent, Value{ConsumerGroup: "g"}, h)
	if v := From(ctx); v == nil || v.ConsumerGroup != "g" {
		t.Fatalf("From: %+v", v)
	}
	if HooksFrom(ctx) != h {
		t.Fatal("HooksFrom: not the hooks given")
	}
	if ctx.Value(otherKey{}) != "parent" || ctx.Value([]int{1}) != nil {
		t.Fatal("other keys are not the parent's")
	}
	if From(WithHandler(ctx, Value{ConsumerGroup: "inner"}, nil)).ConsumerGroup != "inner" {
		t.Fatal("an inner handler context does not shadow the outer one")
	}
}
