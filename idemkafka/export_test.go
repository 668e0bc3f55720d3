package idemkafka

// Exported for the tests of package idemkafka_test.
var (
	MinConsumerReadTimeout = minConsumerReadTimeout
	JoinGroupTimeoutMargin = joinGroupTimeoutMargin
)

// SetProgressStep sets the hook each flush of a subscriber's positions
// calls at its steps; the returned function removes it.
func SetProgressStep(f func(step string)) (restore func()) {
	progressStep = f
	return func() { progressStep = nil }
}
