package heartbeat_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Run's goroutine ends with its context.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
