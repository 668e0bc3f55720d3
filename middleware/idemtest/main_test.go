package idemtest_test

import (
	"testing"

	"go.uber.org/goleak"
)

// RunWithRedelivery's deliveries all finish before it returns.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
