package browser_test

import (
	"os"
	"testing"

	"github.com/idemkit/watermill-idempotency/tests/ctltest"
)

// bin is the idemctl binary the tests drive, built once with buildFlags.
var (
	bin        ctltest.Binary
	buildFlags []string
)

func TestMain(m *testing.M) {
	os.Exit(ctltest.Main(m, &bin, "github.com/idemkit/watermill-idempotency/cmd/idemctl", buildFlags...))
}
