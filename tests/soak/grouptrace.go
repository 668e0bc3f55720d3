package soak

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
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
}

const maxTraceEvents = 60

func newGroupTrace(c *kfake.Cluster) *groupTrace {
	t := &groupTrace{start: time.Now(), events: map[string][]string{}, beats: map[string]map[string]string{}}
	observe := func(key int16) {
		c.ControlKey(key, func(req kmsg.Request) (kmsg.Response, error, bool) {
			c.KeepControl()
			t.record(req)
			return nil, nil, false
		})
	}
	for _, k := range []int16{11, 12, 13, 14} { // JoinGroup, Heartbeat, LeaveGroup, SyncGroup
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
	case *kmsg.SyncGroupRequest:
		add(r.Group, fmt.Sprintf("SyncGroup member=%q generation=%d assignments=%d", r.MemberID, r.Generation, len(r.GroupAssignment)))
	case *kmsg.LeaveGroupRequest:
		ids := []string{r.MemberID}
		for _, m := range r.Members {
			ids = append(ids, m.MemberID)
		}
		add(r.Group, fmt.Sprintf("LeaveGroup members=%q", ids))
	case *kmsg.HeartbeatRequest:
		if t.beats[r.Group] == nil {
			t.beats[r.Group] = map[string]string{}
		}
		t.beats[r.Group][r.MemberID] = fmt.Sprintf("%s generation=%d", at, r.Generation)
	}
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
