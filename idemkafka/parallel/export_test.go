package parallel

// SetRevokeHook has s call f, before its first Subscribe, with each
// partition it gives up (its final mark), under its lock: f must not block.
func SetRevokeHook(s *Subscriber, f func(partition int32)) { s.onRevoke = f }
