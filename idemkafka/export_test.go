package idemkafka

// Exported for the tests of package idemkafka_test.
var (
	MinConsumerReadTimeout = minConsumerReadTimeout
	JoinGroupTimeoutMargin = joinGroupTimeoutMargin
)
