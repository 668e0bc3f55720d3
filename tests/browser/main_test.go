package browser_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/idemkit/watermill-idempotency/internal/testkit/ctltest"
)

// bin is the idemctl binary the tests drive, built once with buildFlags.
var (
	bin        ctltest.Binary
	buildFlags []string
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "idemctl-browser-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if bin, err = ctltest.Build(dir, "github.com/idemkit/watermill-idempotency/cmd/idemctl", buildFlags...); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}
