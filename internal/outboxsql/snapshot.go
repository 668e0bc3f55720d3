package outboxsql

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Snapshot is a pg_snapshot: transactions below Xmin have ended, those at
// or above Xmax had not started, and Xip lists those in between still
// running. A transaction is visible in it when it committed and is below
// Xmin, or below Xmax and not in Xip (pg_visible_in_snapshot).
type Snapshot struct {
	Xmin, Xmax uint64
	Xip        []uint64
}

// Start is the snapshot in which no transaction is visible: a position
// there forwards every row.
var Start = Snapshot{Xmin: 1, Xmax: 1}

// ParseSnapshot parses pg_snapshot's text form, xmin:xmax:xip,xip,...
func ParseSnapshot(s string) (Snapshot, error) {
	parts := strings.Split(s, ":")
	if len(parts) != 3 {
		return Snapshot{}, fmt.Errorf("snapshot %q: not xmin:xmax:xip", s)
	}
	var snap Snapshot
	var err error
	if snap.Xmin, err = strconv.ParseUint(parts[0], 10, 64); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if snap.Xmax, err = strconv.ParseUint(parts[1], 10, 64); err != nil {
		return Snapshot{}, fmt.Errorf("snapshot %q: %w", s, err)
	}
	if parts[2] != "" {
		for _, x := range strings.Split(parts[2], ",") {
			v, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return Snapshot{}, fmt.Errorf("snapshot %q: %w", s, err)
			}
			snap.Xip = append(snap.Xip, v)
		}
	}
	if snap.Xmin == 0 || snap.Xmin > snap.Xmax {
		return Snapshot{}, fmt.Errorf("snapshot %q: xmin must be positive and at most xmax", s)
	}
	return snap, nil
}

// String is pg_snapshot's text form.
func (s Snapshot) String() string {
	var b strings.Builder
	b.WriteString(strconv.FormatUint(s.Xmin, 10))
	b.WriteByte(':')
	b.WriteString(strconv.FormatUint(s.Xmax, 10))
	b.WriteByte(':')
	for i, x := range s.Xip {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatUint(x, 10))
	}
	return b.String()
}

// Visible reports whether transaction xid, if it committed, is visible in s.
func (s Snapshot) Visible(xid uint64) bool {
	return xid < s.Xmin || xid < s.Xmax && !slices.Contains(s.Xip, xid)
}

// Intersect returns the snapshot in which a transaction is visible exactly
// when it is visible in every one of snaps (Start when snaps is empty).
func Intersect(snaps ...Snapshot) Snapshot {
	if len(snaps) == 0 {
		return Start
	}
	out := Snapshot{Xmax: snaps[0].Xmax}
	for _, s := range snaps[1:] {
		out.Xmax = min(out.Xmax, s.Xmax)
	}
	for _, s := range snaps {
		for _, x := range s.Xip {
			if x < out.Xmax && !slices.Contains(out.Xip, x) {
				out.Xip = append(out.Xip, x)
			}
		}
	}
	slices.Sort(out.Xip)
	// Below the lowest running transaction and the lowest xmax, every
	// snapshot sees every committed transaction.
	out.Xmin = out.Xmax
	if len(out.Xip) > 0 {
		out.Xmin = out.Xip[0]
	}
	return out
}
