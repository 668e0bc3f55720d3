package contract

import (
	"fmt"
)

// Upcast lets next read the events of prev, an older version of the same
// event, so that a handler sees one type while both versions are on the
// topic: next's Decode reads an event of prev's version (or of any version
// prev itself reads) with prev, checking it against prev's rules, turns it
// into a New with up, and checks the result against next's rules.
//
// Declare the upcasts from the oldest version up (v1→v2 on the v2 contract,
// then v2→v3 on the v3 contract, which then reads v1 as well) and before the
// contract is used. An error from up refuses the event (rule upcast).
func Upcast[Old, New any](next *Contract[New], prev *Contract[Old], up func(Old) (New, error)) error {
	if prev.name != next.name || prev.version >= next.version {
		return fmt.Errorf("contract %s: cannot upcast from %s: not an older version of the same event", next.cfg.Type, prev.cfg.Type)
	}
	read := func(readPrev func([]byte) (Old, error)) func([]byte) (New, error) {
		return func(payload []byte) (New, error) {
			var zero New
			old, err := readPrev(payload)
			if err != nil {
				return zero, err
			}
			v, err := up(old)
			if err != nil {
				return zero, &Error{Type: next.cfg.Type, Rule: "upcast", Param: prev.cfg.Type, Detail: truncate(err.Error())}
			}
			if err := next.check(&v); err != nil {
				return zero, err
			}
			return v, nil
		}
	}
	if _, dup := next.from[prev.version]; dup {
		return fmt.Errorf("contract %s: already reads %s", next.cfg.Type, prev.cfg.Type)
	}
	next.from[prev.version] = read(prev.decodeOwn)
	for v, f := range prev.from {
		if _, dup := next.from[v]; !dup {
			next.from[v] = read(f)
		}
	}
	return nil
}
