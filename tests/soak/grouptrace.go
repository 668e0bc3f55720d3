package soak

import (
	"fmt"
	"maps"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemkit/watermill-idempotency/internal/kfake"
)

// groupTrace records the consumer-group requests the in-process broker
// receives (JoinGroup, SyncGroup, LeaveGroup: every one; Heartbeat: the
// last per member), per group, so that a run that stalls can show the
// coordinator's side: which member joined when, with which generation, and
// which member stopped rejoining. It only observes: kfake handles every
// request as usual.
type groupTrace struct {
	mu     sync.Mutex
	start  time.Time
	events map[string][]string          // group → last maxTraceEvents lines
	beats  map[string]map[string]string // group → member → its last heartbeat
	// offered counts the JoinGroups per group and the protocols they
	// offered (their names, comma-separated).
	offered map[string]map[string]int
	// heartbeats counts the KIP-848 (ConsumerGroupHeartbeat) and KIP-932
	// (ShareGroupHeartbeat) heartbeats per group.
	heartbeats map[string]map[string]int
}

const maxTraceEvents = 60

func newGroupTrace(c *kfake.Cluster) *groupTrace {
	t := &groupTrace{start: time.Now(), events: map[string][]string{}, beats: map[string]map[string]string{}, offered: map[string]map[string]int{}, heartbeats: map[string]map[string]int{}}
	observe := func(key int16) {
		c.ControlKey(key, func(req kmsg.Request) (kmsg.Response, error, bool) {
			c.KeepControl()
			t.record(req)
			return nil, nil, false
		})
	}
	for _, k := range []int16{11, 12, 13, 14, 68, 76} { // JoinGroup, Heartbeat, LeaveGroup, SyncGroup, ConsumerGroupHeartbeat, ShareGroupHeartbeat
		observe(k)
	}
	return t
}

func (t *groupTrace) record(req kmsg.Request) {
	at := time.Since(t.start).Truncate(time.Millisecond)
	t.mu.Lock()
	defer t.mu.Unlock()
	add := func(group, line string) {
		ev := append(t.events[group], fmt.Sprintf("%s %s", at, line))
		if len(ev) > maxTraceEvents {
			ev = ev[len(ev)-maxTraceEvents:]
		}
		t.events[group] = ev
	}
	switch r := req.(type) {
	case *kmsg.JoinGroupRequest:
		add(r.Group, fmt.Sprintf("JoinGroup member=%q rebalance_timeout=%dms session_timeout=%dms", r.MemberID, r.RebalanceTimeoutMillis, r.SessionTimeoutMillis))
		names := make([]string, 0, len(r.Protocols))
		for _, p := range r.Protocols {
			names = append(names, p.Name)
		}
		if t.offered[r.Group] == nil {
			t.offered[r.Group] = map[string]int{}
		}
		t.offered[r.Group][strings.Join(names, ",")]++
	case *kmsg.SyncGroupRequest:
		add(r.Group, fmt.Sprintf("SyncGroup member=%q generation=%d assignments=%d", r.MemberID, r.Generation, len(r.GroupAssignment)))
	case *kmsg.LeaveGroupRequest:
		ids := []string{r.MemberID}
		for _, m := range r.Members {
			ids = append(ids, m.MemberID)
		}
		add(r.Group, fmt.Sprintf("LeaveGroup members=%q", ids))
	case *kmsg.ConsumerGroupHeartbeatRequest:
		t.beat(r.Group, protocolKIP848)
	case *kmsg.ShareGroupHeartbeatRequest:
		t.beat(r.GroupID, protocolShare)
	case *kmsg.HeartbeatRequest:
		if t.beats[r.Group] == nil {
			t.beats[r.Group] = map[string]string{}
		}
		t.beats[r.Group][r.MemberID] = fmt.Sprintf("%s generation=%d", at, r.Generation)
	}
}

// The heartbeat protocols [groupTrace] counts.
const (
	protocolKIP848 = "ConsumerGroupHeartbeat (KIP-848)"
	protocolShare  = "ShareGroupHeartbeat (KIP-932)"
)

// beat counts a heartbeat of protocol in group; t.mu is held.
func (t *groupTrace) beat(group, protocol string) {
	if t.heartbeats[group] == nil {
		t.heartbeats[group] = map[string]int{}
	}
	t.heartbeats[group][protocol]++
}

// heartbeatsOf returns the KIP-848 and KIP-932 heartbeats group sent,
// per protocol.
func (t *groupTrace) heartbeatsOf(group string) map[string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return maps.Clone(t.heartbeats[group])
}

// verifyFranz checks, on the franz-go legs with the in-process broker,
// that every consumer group ran the protocol asked for: KIP-848 groups
// and share groups sent only their protocol's heartbeats and no
// JoinGroup; classic ones offered cooperative-sticky alone.
func (h *harness) verifyFranz() {
	if h.trace == nil {
		h.report.Rebalance = "not checked (a real cluster)"
		return
	}
	names, want := h.consumerGroupNames(), protocolKIP848
	switch {
	case h.cfg.Share:
		names, want = []string{h.groups[0].name, h.groups[1].name}, protocolShare
	case h.cfg.GroupProtocol == "classic":
		h.verifyCooperative()
		return
	}
	beats := 0
	for _, n := range names {
		got := h.trace.heartbeatsOf(n)
		for p, c := range got {
			if p != want {
				h.violation("%s: %d heartbeats of %s, want %s alone", n, c, p, want)
			}
		}
		if got[want] == 0 {
			h.violation("%s: no %s recorded", n, want)
		}
		beats += got[want]
		if j := h.trace.offeredBy(n); len(j) > 0 {
			h.violation("%s: JoinGroups (classic protocol) recorded: %v", n, j)
		}
	}
	h.report.Rebalance = fmt.Sprintf("%s: %d groups, %d heartbeats, no JoinGroup", want, len(names), beats)
}

// dump returns group's recorded requests and last heartbeats.
func (t *groupTrace) dump(group string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var b strings.Builder
	for _, l := range t.events[group] {
		fmt.Fprintf(&b, "\n    %s", l)
	}
	members := make([]string, 0, len(t.beats[group]))
	for m := range t.beats[group] {
		members = append(members, m)
	}
	sort.Strings(members)
	for _, m := range members {
		fmt.Fprintf(&b, "\n    last Heartbeat of %s at %s", m, t.beats[group][m])
	}
	return b.String()
}

// describeGroups returns each group's state and members as the
// coordinator reports them (DescribeGroups: works on any cluster).
func describeGroups(brokers, groups []string) string {
	admin, err := sarama.NewClusterAdmin(brokers, sarama.NewConfig())
	if err != nil {
		return err.Error()
	}
	defer admin.Close()
	ds, err := admin.DescribeConsumerGroups(groups)
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, d := range ds {
		fmt.Fprintf(&b, "\n  %s: state=%s protocol=%s members=%d", d.GroupId, d.State, d.Protocol, len(d.Members))
		ids := make([]string, 0, len(d.Members))
		for id := range d.Members {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		for _, id := range ids {
			m := d.Members[id]
			fmt.Fprintf(&b, "\n    member %s client=%s host=%s", id, m.ClientId, m.ClientHost)
		}
	}
	return b.String()
}

// offeredBy returns the protocols group's JoinGroups offered (names,
// comma-separated) and how many offered each.
func (t *groupTrace) offeredBy(group string) map[string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return maps.Clone(t.offered[group])
}

// consumerGroupNames are the Kafka consumer groups of the consumers: each
// group's main one and its retry topics'.
func (h *harness) consumerGroupNames() []string {
	var names []string
	for _, g := range h.groups {
		names = append(names, g.name)
		for i := range h.retryTopics(g.idx) {
			names = append(names, retryGroup(g.name, i))
		}
	}
	return names
}

// cooperative is the protocol name of Sarama's cooperative-sticky strategy,
// sticky its eager sticky one's (a run with the failover fault: the
// parallel subscriber's Progress refuses the cooperative one).
const (
	cooperative = "cooperative-sticky"
	sticky      = "sticky"
)

// protocol is the rebalance protocol the run's parallel subscribers (or
// franz ones on the classic protocol) use: franz's Progress starts a
// partition a cooperative rebalance adds from PostgreSQL's position too,
// so its classic groups keep cooperative-sticky with the failover fault.
func (h *harness) protocol() string {
	if h.cluster != nil && h.cfg.Parallel {
		return sticky
	}
	return cooperative
}

// verifyCooperative checks, in Parallel mode, that the consumers' consumer
// groups run the cooperative-sticky strategy (sticky in a run with the
// failover fault, whose report says so): the coordinator describes
// each stable group with that protocol (any cluster; the groups may be
// settling, so it asks for up to 10 s) and, on the in-process broker, every
// JoinGroup offered it alone.
func (h *harness) verifyCooperative() {
	want := h.protocol()
	if want != cooperative {
		h.logf("rebalance: the parallel subscribers run the %s strategy in this run (the failover fault's Progress refuses %s)", want, cooperative)
	}
	names := h.consumerGroupNames()
	var last string
	for range 20 {
		var bad []string
		last = ""
		protos, err := groupProtocols(h.brokers, names)
		for _, n := range names {
			if protos[n] != want {
				bad = append(bad, fmt.Sprintf("%s: %q", n, protos[n]))
			}
		}
		if err == nil && len(bad) == 0 {
			break
		}
		last = fmt.Sprintf("%v %v", bad, err)
		time.Sleep(500 * time.Millisecond)
	}
	if last != "" {
		h.violation("consumer groups not described with protocol %s: %s", want, last)
	}
	joins := 0
	if h.trace != nil {
		for _, n := range names {
			offered := h.trace.offeredBy(n)
			for p, c := range offered {
				if p != want {
					h.violation("%s: %d JoinGroups offered the protocols %q, want %s alone", n, c, p, want)
				}
				joins += c
			}
			if len(offered) == 0 {
				h.violation("%s: no JoinGroup recorded", n)
			}
		}
	}
	h.report.Rebalance = fmt.Sprintf("%s: %d consumer groups described so, %d JoinGroups offered it", want, len(names), joins)
	if last != "" {
		h.report.Rebalance = "not " + want + " everywhere: " + last
	}
}

// groupProtocols returns each stable group's protocol, as the coordinator
// describes it ("" for a group that is not stable).
func groupProtocols(brokers, groups []string) (map[string]string, error) {
	admin, err := sarama.NewClusterAdmin(brokers, sarama.NewConfig())
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	ds, err := admin.DescribeConsumerGroups(groups)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, d := range ds {
		if d.State == "Stable" {
			out[d.GroupId] = d.Protocol
		}
	}
	return out, nil
}
