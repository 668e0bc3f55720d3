package outbox

// SetBeforeAckHook makes f run h after a batch was sent and before its
// position is committed; an error from h stops Run like a crash: the
// transaction is rolled back and the sent batch is sent again on restart.
func SetBeforeAckHook(f *Forwarder, h func(topic string, n int) error) { f.beforeAck = h }
