package outbox

// SetHook makes f call hook at each step of its transactions ("locked",
// "cut", "sent", "commit"); call it before Run.
func SetHook(f *Forwarder, hook func(step string)) { f.hook = hook }

// Channel is the NOTIFY channel of topic's table.
func Channel(o *Outbox, topic string) string { return o.channel(topic) }
