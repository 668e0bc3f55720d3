// Package retryheaders names the metadata keys (Kafka headers) that the
// retrytopic middleware adds to a copy on a retry topic, for the packages
// that remove them again (the poison replay): retrytopic exports each one,
// documented, as its Metadata* constants.
package retryheaders

// The keys a retry-topic copy carries on top of the original message's.
const (
	Attempt           = "retry_attempt"
	NotBefore         = "retry_not_before"
	OriginalTopic     = "retry_original_topic"
	OriginalPartition = "retry_original_partition"
	OriginalOffset    = "retry_original_offset"
	Error             = "retry_error"
	Parked            = "retry_parked"
)

// Has reports whether key is one of the keys above.
func Has(key string) bool {
	switch key {
	case Attempt, NotBefore, OriginalTopic, OriginalPartition, OriginalOffset, Error, Parked:
		return true
	}
	return false
}
