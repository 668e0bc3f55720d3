package idemtest

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/watermill-idempotency/contract"
)

// RequireCompatible fails tb unless reader, a contract in its current form,
// stays compatible with the events already published, kept as golden
// payloads in dir: one subdirectory per published version, named by its
// event type, holding *.json payloads as they went on the wire
// (dir/order.confirmed.v1/full.json). Add a fixture when you publish a
// version or a new optional field; never edit one.
//
//   - BACKWARD: reader decodes every fixture of its own version and of every
//     older version of its event (those through its upcasters, see
//     contract.Upcast): consumers can upgrade first.
//   - FORWARD: previous, the contract as consumers run it today (keep the
//     published struct in a test file), decodes payloads of reader's struct
//     (each fixture of reader's version, decoded by reader and encoded
//     again): producers can upgrade first.
//
// previous must declare reader's event type: across versions FORWARD does
// not hold by design (a new version is the breaking change, and upcasters
// carry it). Pass reader itself when there is no previous form. A fixture
// without an eventType field is read with the event_type metadata of its
// directory's name.
//
// The failure names the direction, the fixture, and the field and rule
// that broke (a *contract.Error).
func RequireCompatible[T, P any](tb testing.TB, dir string, reader *contract.Contract[T], previous *contract.Contract[P]) {
	tb.Helper()
	name, version, ok := splitType(reader.Type())
	if !ok {
		tb.Fatalf("RequireCompatible: %q is not an event type", reader.Type())
	}
	if previous.Type() != reader.Type() {
		tb.Fatalf("RequireCompatible: previous is %s, reader %s: FORWARD compares two forms of one version (pass reader itself when there is no previous form)",
			previous.Type(), reader.Type())
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		tb.Fatalf("RequireCompatible: %v", err)
	}
	var own []string // fixtures of reader's version
	for _, e := range entries {
		n, v, ok := splitType(e.Name())
		if !e.IsDir() || !ok || n != name || v > version {
			continue
		}
		files, err := filepath.Glob(filepath.Join(dir, e.Name(), "*.json"))
		if err != nil {
			tb.Fatalf("RequireCompatible: %v", err)
		}
		slices.Sort(files)
		for _, f := range files {
			payload, err := os.ReadFile(f)
			if err != nil {
				tb.Fatalf("RequireCompatible: %v", err)
			}
			if _, err := reader.Decode(fixtureMessage(e.Name(), payload)); err != nil {
				tb.Fatalf("BACKWARD: %s cannot read the published payload %s: %v", reader.Type(), f, err)
			}
			if v == version {
				own = append(own, f)
			}
		}
	}
	if len(own) == 0 {
		tb.Fatalf("RequireCompatible: no golden payload of %s: add one as %s",
			reader.Type(), filepath.Join(dir, reader.Type(), "<name>.json"))
	}
	for _, f := range own {
		payload, _ := os.ReadFile(f)
		ev, _ := reader.Decode(fixtureMessage(reader.Type(), payload))
		encoded, err := json.Marshal(ev)
		if err != nil {
			tb.Fatalf("FORWARD: encoding %s as read by %s: %v", f, reader.Type(), err)
		}
		if _, err := previous.Decode(fixtureMessage(reader.Type(), encoded)); err != nil {
			tb.Fatalf("FORWARD: the previous %s cannot read the new struct's payload (%s decoded and encoded again): %v", previous.Type(), f, err)
		}
	}
}

func fixtureMessage(eventType string, payload []byte) *message.Message {
	msg := message.NewMessage("fixture", payload)
	msg.Metadata.Set("event_type", eventType)
	return msg
}

// splitType splits "order.confirmed.v2" into "order.confirmed" and 2.
func splitType(typ string) (string, int, bool) {
	i := strings.LastIndex(typ, ".v")
	if i <= 0 {
		return "", 0, false
	}
	v, err := strconv.Atoi(typ[i+2:])
	return typ[:i], v, err == nil && v > 0
}
