package keywindow_test

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/watermill-idempotency/internal/keywindow"
)

// rec is a test engine's record.
type rec struct {
	keywindow.Entry[*rec]
	payload string // "" once done or spilled
}

func (r *rec) WindowEntry() *keywindow.Entry[*rec] { return &r.Entry }

// engine drives a window as a subscriber does, with no broker: records
// read, released (ready), handed out, acked, nacked (ready again), spilled
// and read again. Every step is deterministic.
type engine struct {
	t        *testing.T
	w        *keywindow.Window[*rec]
	counts   keywindow.Counts
	log      map[int64]string // what Kafka holds: offset → key
	released []int64          // since the last check
	refetch  []*rec           // spilled heads to read again
	blocked  map[string]bool  // keys whose head holds them up (for Spill)
}

func newEngine(t *testing.T, cfg keywindow.Config) *engine {
	e := &engine{t: t, log: map[int64]string{}, blocked: map[string]bool{}}
	e.w = keywindow.New[*rec](cfg, -1, &e.counts)
	return e
}

func (e *engine) release(r *rec) {
	r.State = keywindow.Ready
	e.released = append(e.released, r.Off)
}

func (e *engine) find(off int64) *rec {
	r, ok := e.w.Find(off)
	if !ok {
		e.t.Fatalf("offset %d is not in the window", off)
	}
	return r
}

// step runs one command: "read OFF KEY", "take OFF", "ack OFF",
// "nack OFF", "block KEY", "spill", "refill" (every queued spilled head
// read again), "refill-one OFF" (a record read again by a refetch pass),
// "lost OFF" (a queued spilled head gone from Kafka), "stop".
func (e *engine) step(cmd string) {
	f := strings.Fields(cmd)
	off := func() int64 {
		n, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			e.t.Fatalf("%q: %v", cmd, err)
		}
		return n
	}
	switch f[0] {
	case "read":
		o := off()
		e.log[o] = f[2]
		if !e.w.Read(o) {
			return
		}
		r := &rec{payload: f[2]}
		if e.w.Add(r, o, []byte(f[2])) {
			e.release(r)
		}
	case "take":
		r := e.find(off())
		if r.State != keywindow.Ready {
			e.t.Fatalf("%q: state %d, not ready", cmd, r.State)
		}
		r.State = keywindow.InFlight
	case "ack":
		r := e.find(off())
		if r.State != keywindow.InFlight {
			e.t.Fatalf("%q: not in flight", cmd)
		}
		r.payload = ""
		e.done(r)
	case "nack":
		r := e.find(off())
		r.State = keywindow.Backoff
		e.release(r)
	case "block":
		e.blocked[f[1]] = true
	case "spill":
		e.w.Spill(func(head *rec) bool { return e.blocked[head.Key] }, func(r *rec) { r.payload = "" })
	case "refill":
		for _, r := range e.refetch {
			e.refill(r)
		}
		e.refetch = nil
	case "refill-one":
		e.refill(e.find(off()))
	case "lost":
		r := e.find(off())
		e.refetch = slices.DeleteFunc(e.refetch, func(x *rec) bool { return x == r })
		e.done(r)
	case "stop":
		e.w.Stop(nil)
	default:
		e.t.Fatalf("unknown step %q", cmd)
	}
}

func (e *engine) done(r *rec) {
	next := e.w.Done(r)
	if next == nil {
		return
	}
	switch next.State {
	case keywindow.Waiting:
		e.release(next)
	case keywindow.Spilled:
		e.refetch = append(e.refetch, next)
	}
}

func (e *engine) refill(r *rec) {
	if head, ok := e.w.Refill(r); ok {
		r.payload = e.log[r.Off]
		if head {
			e.release(r)
		}
	}
}

// check holds the released offsets since the last check and the
// committable offset to want.
func (e *engine) check(at string, released []int64, commit int64) {
	e.t.Helper()
	if !slices.Equal(e.released, released) {
		e.t.Fatalf("after %q: released %v, want %v", at, e.released, released)
	}
	e.released = nil
	if got := e.w.CommitOffset(); got != commit {
		e.t.Fatalf("after %q: commit offset %d, want %d", at, got, commit)
	}
}

type step struct {
	do       string
	released []int64
	commit   int64
}

func run(t *testing.T, cfg keywindow.Config, steps []step) *engine {
	t.Helper()
	e := newEngine(t, cfg)
	for _, s := range steps {
		e.step(s.do)
		e.check(s.do, s.released, s.commit)
	}
	return e
}

func TestKeyOrder(t *testing.T) {
	run(t, keywindow.Config{Ordering: keywindow.ByKey, Size: 10}, []step{
		{"read 0 a", []int64{0}, 0},
		{"read 1 b", []int64{1}, 0},
		{"read 2 a", nil, 0},
		{"read 3 a", nil, 0},
		{"read 4 c", []int64{4}, 0},
		{"take 1", nil, 0},
		{"ack 1", nil, 0}, // 0 not done: the commit offset stays
		{"take 0", nil, 0},
		{"take 4", nil, 0},
		{"ack 4", nil, 0},
		{"ack 0", []int64{2}, 2}, // 1 and 4 done, 2 not
		{"take 2", nil, 2},
		{"nack 2", []int64{2}, 2}, // handed out again, 3 stays behind it
		{"take 2", nil, 2},
		{"ack 2", []int64{3}, 3},
		{"take 3", nil, 3},
		{"ack 3", nil, 5}, // every record read is done
		{"read 5 a", []int64{5}, 5},
	})
}

func TestPartitionOrder(t *testing.T) {
	run(t, keywindow.Config{Ordering: keywindow.ByPartition, Size: 10}, []step{
		{"read 10 a", []int64{10}, 10},
		{"read 11 b", nil, 10},
		{"read 12 c", nil, 10},
		{"take 10", nil, 10},
		{"ack 10", []int64{11}, 11},
		{"take 11", nil, 11},
		{"ack 11", []int64{12}, 12},
		{"take 12", nil, 12},
		{"ack 12", nil, 13},
	})
}

func TestUnorderedCommitsBelowTheLowestNotDone(t *testing.T) {
	run(t, keywindow.Config{Ordering: keywindow.Unordered, Size: 10}, []step{
		{"read 0 a", []int64{0}, 0},
		{"read 1 a", []int64{1}, 0},
		{"read 2 a", []int64{2}, 0},
		{"take 2", nil, 0},
		{"take 1", nil, 0},
		{"take 0", nil, 0},
		{"ack 2", nil, 0},
		{"ack 0", nil, 1},
		{"ack 1", nil, 3},
	})
}

// A record read again (below the last read) is ignored: a refetch does not
// enter the window twice.
func TestReadAgainIsIgnored(t *testing.T) {
	e := run(t, keywindow.Config{Ordering: keywindow.ByKey, Size: 10}, []step{
		{"read 0 a", []int64{0}, 0},
		{"read 1 a", nil, 0},
		{"read 0 a", nil, 0},
		{"read 1 a", nil, 0},
	})
	if n := len(e.w.Entries()); n != 2 {
		t.Fatalf("%d records in the window, want 2", n)
	}
}

// Done records leave the window: those at its front at once, the others
// in batches, so a head that does not move keeps the window's length
// bounded by the records not done, not by the offsets read.
func TestDoneRecordsLeave(t *testing.T) {
	e := newEngine(t, keywindow.Config{Ordering: keywindow.ByKey, Size: 8})
	e.step("read 0 stuck")
	for i := int64(1); i <= 1000; i++ {
		e.step(fmt.Sprintf("read %d k%d", i, i))
		e.step(fmt.Sprintf("take %d", i))
		e.step(fmt.Sprintf("ack %d", i))
		if n := len(e.w.Entries()); n > 2*e.w.Undone()+33 {
			t.Fatalf("after %d: %d records held for %d not done", i, n, e.w.Undone())
		}
	}
	e.released = nil
	e.check("1000 acks behind 0", nil, 0)
	e.step("take 0")
	e.step("ack 0")
	e.check("ack 0", nil, 1001)
	if len(e.w.Entries()) != 0 {
		t.Fatalf("%d records left", len(e.w.Entries()))
	}
}

func TestFull(t *testing.T) {
	e := newEngine(t, keywindow.Config{Ordering: keywindow.ByKey, Size: 3})
	for i, k := range []string{"a", "a", "b"} {
		if e.w.Full() {
			t.Fatalf("full at %d records", i)
		}
		e.step(fmt.Sprintf("read %d %s", i, k))
	}
	if !e.w.Full() {
		t.Fatal("3 records not done: the window is full")
	}
	e.step("take 2")
	e.step("ack 2")
	if e.w.Full() {
		t.Fatal("an ack makes room")
	}
}

// A blocked key's waiting records are spilled, the latest first, until a
// quarter of the window is free; a key whose head is not blocked keeps its
// records. Spilled records count as not done for the commit offset, are
// read again when they become their key's head, and the others come back
// while the window has room.
func TestSpill(t *testing.T) {
	e := run(t, keywindow.Config{Ordering: keywindow.ByKey, Size: 8}, []step{
		{"read 0 a", []int64{0}, 0},
		{"read 1 a", nil, 0},
		{"read 2 b", []int64{2}, 0},
		{"read 3 a", nil, 0},
		{"read 4 b", nil, 0},
		{"read 5 a", nil, 0},
		{"read 6 a", nil, 0},
		{"read 7 a", nil, 0},
		{"take 0", nil, 0},
		{"nack 0", []int64{0}, 0},
		{"spill", nil, 0}, // nothing blocked
	})
	if !e.w.Full() {
		t.Fatal("8 records: full")
	}
	e.step("block a")
	e.step("spill")
	// The target is 8 - 2 = 6 not done: 7 and 6, a's latest, go.
	for off, want := range map[int64]keywindow.State{7: keywindow.Spilled, 6: keywindow.Spilled, 5: keywindow.Waiting, 4: keywindow.Waiting} {
		if got := e.find(off).State; got != want {
			t.Fatalf("offset %d: state %d, want %d", off, got, want)
		}
	}
	if e.w.Undone() != 6 || e.w.Spilled() != 2 || e.counts.Spilled != 2 || e.counts.Waiting != 6 {
		t.Fatalf("undone %d spilled %d counts %+v", e.w.Undone(), e.w.Spilled(), e.counts)
	}
	if e.find(7).payload != "" {
		t.Fatal("a spilled record's payload stays")
	}
	e.check("spill", nil, 0)
	steps := []step{
		{"read 8 c", []int64{8}, 0},
		{"read 9 c", nil, 0},
		{"take 0", nil, 0},
		{"ack 0", []int64{1}, 1},
		{"take 1", nil, 1},
		{"ack 1", []int64{3}, 2},
		{"take 3", nil, 2},
		{"ack 3", []int64{5}, 2},
		{"take 5", nil, 2},
		{"ack 5", nil, 2}, // 6 is spilled: read again first
		{"refill", []int64{6}, 2},
		{"take 6", nil, 2},
		{"ack 6", nil, 2},
		{"refill-one 7", []int64{7}, 2}, // the refetch pass reads on
		{"take 2", nil, 2},
		{"ack 2", []int64{4}, 4},
		{"take 7", nil, 4},
		{"ack 7", nil, 4},
		{"take 4", nil, 4},
		{"ack 4", nil, 8},
	}
	for _, s := range steps {
		e.step(s.do)
		e.check(s.do, s.released, s.commit)
	}
	if e.w.Spilled() != 0 || e.counts != (keywindow.Counts{Waiting: 1}) {
		t.Fatalf("spilled %d counts %+v: 9 waits behind 8", e.w.Spilled(), e.counts)
	}
}

// A spilled record read again while it is not its key's head comes back
// only while the window has room; a spilled head gone from Kafka
// (retention, compaction) is done.
func TestRefillAndLost(t *testing.T) {
	e := run(t, keywindow.Config{Ordering: keywindow.ByKey, Size: 4}, []step{
		{"read 0 a", []int64{0}, 0},
		{"read 1 a", nil, 0},
		{"read 2 a", nil, 0},
		{"read 3 a", nil, 0},
		{"block a", nil, 0},
		{"spill", nil, 0}, // target 3: 3 goes
		{"read 4 b", []int64{4}, 0},
		{"refill-one 3", nil, 0}, // not a head, no room: stays spilled
	})
	if e.find(3).State != keywindow.Spilled {
		t.Fatal("refilled into a full window")
	}
	for _, s := range []step{
		{"take 0", nil, 0},
		{"ack 0", []int64{1}, 1},
		{"take 1", nil, 1},
		{"ack 1", []int64{2}, 2},
		{"take 2", nil, 2},
		{"ack 2", nil, 3},
		{"lost 3", nil, 4}, // gone from Kafka: nothing to process
		{"take 4", nil, 4},
		{"ack 4", nil, 5},
	} {
		e.step(s.do)
		e.check(s.do, s.released, s.commit)
	}
	if e.counts != (keywindow.Counts{}) {
		t.Fatalf("counts %+v", e.counts)
	}
}

// Spill spills nothing but ByKey, and at most SpillFactor × Size records.
func TestSpillBounds(t *testing.T) {
	e := newEngine(t, keywindow.Config{Ordering: keywindow.ByPartition, Size: 4})
	for i := range 4 {
		e.step(fmt.Sprintf("read %d a", i))
	}
	if e.w.Spill(func(*rec) bool { return true }, func(*rec) {}) {
		t.Fatal("spilled with ByPartition")
	}
	e = newEngine(t, keywindow.Config{Ordering: keywindow.ByKey, Size: 2})
	e.step("block a")
	e.step("read 0 a")
	for i := int64(1); ; i++ {
		if !e.w.Full() {
			e.step(fmt.Sprintf("read %d a", i))
			continue
		}
		before := e.w.Spilled()
		e.step("spill")
		if e.w.Spilled() == before {
			break
		}
	}
	if got, want := e.w.Spilled(), keywindow.SpillFactor*2; got != want || e.w.SpillRoom() {
		t.Fatalf("spilled %d, want the bound %d", got, want)
	}
}

// Stop drops the records not in flight: an ack of one in flight still
// moves the commit offset, and releases nothing.
func TestStop(t *testing.T) {
	e := run(t, keywindow.Config{Ordering: keywindow.ByKey, Size: 8}, []step{
		{"read 0 a", []int64{0}, 0},
		{"read 1 a", nil, 0},
		{"read 2 b", []int64{2}, 0},
		{"take 0", nil, 0},
		{"stop", nil, 0},
		{"ack 0", nil, 1},
	})
	for _, off := range []int64{1, 2} {
		if e.find(off).State != keywindow.Dropped {
			t.Fatalf("offset %d not dropped", off)
		}
	}
	if e.counts != (keywindow.Counts{}) || e.w.Waiting() != 0 {
		t.Fatalf("counts %+v waiting %d", e.counts, e.w.Waiting())
	}
}

// The starvation rule: spilling a full partition's blocked keys is for
// when it could give a handler work, not when the handlers hold the
// partition up. The cases of parallel's TestSubscriberSpillsNothingWhileSaturated
// and TestSubscriberStarvedPartitionSpillsWhileAnotherSaturates are its
// first two.
func TestStarved(t *testing.T) {
	for _, tc := range []struct {
		name        string
		load        keywindow.Load
		othersReady bool
		want        bool
	}{
		{"saturated: every slot taken, the partition at its share", keywindow.Load{InFlight: 4, Partitions: 1, Total: 4, MaxInFlight: 4}, false, false},
		{"below its share while another partition takes the slots", keywindow.Load{InFlight: 0, Partitions: 2, Total: 4, MaxInFlight: 4}, true, true},
		{"a ready record of its own", keywindow.Load{Ready: true, InFlight: 0, Partitions: 1, Total: 0, MaxInFlight: 4}, false, false},
		{"at its share, a slot free, nothing ready for it", keywindow.Load{InFlight: 2, Partitions: 2, Total: 3, MaxInFlight: 4}, false, true},
		{"at its share, a slot free, another partition's record ready for it", keywindow.Load{InFlight: 2, Partitions: 2, Total: 3, MaxInFlight: 4}, true, false},
		{"a share of at least one", keywindow.Load{InFlight: 0, Partitions: 8, Total: 4, MaxInFlight: 4}, true, true},
		{"no partitions counted", keywindow.Load{InFlight: 3, Partitions: 0, Total: 4, MaxInFlight: 4}, false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := keywindow.Starved(tc.load, func() bool { return tc.othersReady }); got != tc.want {
				t.Fatalf("Starved(%+v, others ready %v) = %v", tc.load, tc.othersReady, got)
			}
		})
	}
}
