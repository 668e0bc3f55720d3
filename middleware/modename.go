package middleware

// Mode names how the middleware processes a message ([Config.Mode]):
// "transaction", "group-commit" or "lease". The console shows it for each
// running instance (components/heartbeat).
func (d *Dedup) Mode() string {
	switch d.cfg.Mode.(type) {
	case *LeaseConfig:
		return "lease"
	case *GroupCommitConfig:
		return "group-commit"
	}
	return "transaction"
}
