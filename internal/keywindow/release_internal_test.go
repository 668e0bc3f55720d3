package keywindow

import "testing"

type node struct{ Entry[*node] }

func (n *node) WindowEntry() *Entry[*node] { return &n.Entry }

// Release unlinks the records: one still in flight (referenced by its
// engine after the partition is gone) keeps none behind it.
func TestReleaseUnlinks(t *testing.T) {
	w := New[*node](Config{Ordering: ByKey, Size: 8}, 0, nil)
	head := &node{}
	for i, n := range []*node{head, {}, {}} {
		w.Read(int64(i))
		w.Add(n, int64(i), []byte("a"))
	}
	if head.next == nil {
		t.Fatal("the key's records are not linked")
	}
	w.Release()
	if head.next != nil || len(w.Entries()) != 0 {
		t.Fatal("a released window's head keeps the records behind it")
	}
}
