package idemctx

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
)

// uncomparableTx is a pgx.Tx of a type == panics on.
type uncomparableTx struct {
	pgx.Tx
	notes []string
}

type pointerTx struct{ pgx.Tx }

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

func TestStamped(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	if Stamped(ctx) {
		t.Fatal("a plain context says stamped")
	}
	if !Stamped(WithStamped(ctx)) || !Stamped(WithHooks(WithStamped(ctx), &Hooks{})) {
		t.Fatal("WithStamped not seen")
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
