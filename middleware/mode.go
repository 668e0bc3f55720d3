package middleware

// Mode names how the middleware claims: "lease" ([Config.Lease]),
// "group-commit" ([Config.GroupCommit]) or "transaction". The console shows
// it for each running instance (components/heartbeat).
func (d *Dedup) Mode() string {
	switch {
	case d.cfg.Lease != nil:
		return "lease"
	case d.cfg.GroupCommit != nil:
		return "group-commit"
	}
	return "transaction"
}
