package idemkafka_test

import (
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// kfake, the test broker, can keep a member that joined under a new member
// id and whose connection died before the coordinator answered its
// JoinGroup: it arms such a member's session timer only when its answer is
// queued on the connection (about half the time once the connection is
// closed), while Kafka schedules every member's session expiry when a
// rebalance completes. The ghost then holds its partitions for as long as the group
// stays stable, which is why TestSubscriberSurvivesSIGKILL kills only
// members of a stable group (docs/soak.md, "The consumer-group livelock",
// item 1, describes the same for the soak). If this test fails, kfake
// expires such a member now, and that restriction can go.
func TestKfakeKeepsAMemberThatDiedInJoin(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	if broker.Fake == nil {
		t.Skip("about kfake; KAFKA_BROKERS points at another broker")
	}
	topic := broker.Topic(t, "ghost", 2)
	// The ghost appears only when kfake's answer to the dead member fails:
	// with the connection closed, its reply picks at random between the
	// closed connection and the connection's response buffer (a select
	// with both ready), and before kfake has seen the close it always
	// queues the answer, which arms the timer. So: up to 12 attempts, each
	// with at most even odds of expiring the member, one of which must
	// leave the ghost.
	const attempts = 12
	for attempt := 1; attempt <= attempts; attempt++ {
		if kept := ghostStays(t, broker.Addrs[0], topic, fmt.Sprintf("ghost-%d", attempt)); kept {
			return
		}
		t.Logf("attempt %d: the member that died in JoinGroup was expired", attempt)
	}
	t.Fatalf("kfake expired the member that died in JoinGroup in %d attempts out of %d: it expires such members now", attempts, attempts)
}

// ghostStays builds the case in group and reports whether the member that
// died in JoinGroup is still in the stable group three session timeouts
// later.
func ghostStays(t *testing.T, addr, topic, group string) bool {
	t.Helper()
	const session = time.Second
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_3_0_0
	dialAt := func(addr string) *sarama.Broker {
		b := sarama.NewBroker(addr)
		require.NoError(t, b.Open(cfg))
		_, err := b.Connected()
		require.NoError(t, err)
		return b
	}
	dial := func() *sarama.Broker { return dialAt(addr) }
	join := func(b *sarama.Broker, memberID string) (*sarama.JoinGroupResponse, error) {
		req := &sarama.JoinGroupRequest{Version: 5, GroupId: group, SessionTimeout: int32(session / time.Millisecond),
			RebalanceTimeout: 10_000, MemberId: memberID, ProtocolType: "consumer"}
		require.NoError(t, req.AddGroupProtocolMetadata("range", &sarama.ConsumerGroupMemberMetadata{Topics: []string{topic}}))
		return b.JoinGroup(req)
	}
	// joinNew joins under a new member id: the first JoinGroup (v4+) only
	// hands out the id.
	joinNew := func(b *sarama.Broker) string {
		resp, err := join(b, "")
		require.NoError(t, err)
		require.Equal(t, sarama.ErrMemberIdRequired, resp.Err)
		return resp.MemberId
	}

	// x leads a stable group of one and keeps heartbeating.
	bx := dial()
	defer bx.Close()
	x := joinNew(bx)
	jr, err := join(bx, x)
	require.NoError(t, err)
	require.Equal(t, sarama.ErrNoError, jr.Err)
	sync := func(gen int32, members ...string) {
		req := &sarama.SyncGroupRequest{Version: 3, GroupId: group, GenerationId: gen, MemberId: x}
		for i, m := range members {
			require.NoError(t, req.AddGroupAssignmentMember(m, &sarama.ConsumerGroupMemberAssignment{Topics: map[string][]int32{topic: {int32(i)}}}))
		}
		resp, err := bx.SyncGroup(req)
		require.NoError(t, err)
		require.Equal(t, sarama.ErrNoError, resp.Err)
	}
	sync(jr.GenerationId, x)
	heartbeat := func(gen int32) sarama.KError {
		resp, err := bx.Heartbeat(&sarama.HeartbeatRequest{Version: 3, GroupId: group, MemberId: x, GenerationId: gen})
		require.NoError(t, err)
		return resp.Err
	}

	// y joins under a new id, through a proxy that can cut its connection
	// as a process death does; its JoinGroup waits for x to join again.
	proxy, cut := cuttableProxy(t, addr)
	by := dialAt(proxy)
	defer by.Close()
	y := joinNew(by)
	go func() { _, _ = join(by, y) }()
	require.Eventually(t, func() bool { return heartbeat(jr.GenerationId) == sarama.ErrRebalanceInProgress }, 10*time.Second, 10*time.Millisecond)
	// y's process dies before the answer.
	cut()
	time.Sleep(300 * time.Millisecond)

	// x joins again: the rebalance completes with y in it (y had joined),
	// the answer to y cannot be delivered, and x assigns y a partition.
	jr, err = join(bx, x)
	require.NoError(t, err)
	require.Equal(t, sarama.ErrNoError, jr.Err)
	sync(jr.GenerationId, x, y)

	// Kafka would remove y one session timeout later and rebalance; kfake
	// keeps it, stable, however long x heartbeats.
	for deadline := time.Now().Add(3 * session); time.Now().Before(deadline); time.Sleep(session / 10) {
		// A rebalance: y was expired. Anything else (x itself expired on
		// a machine too loaded to heartbeat in time) leaves the attempt
		// without an answer; the next one starts afresh.
		if e := heartbeat(jr.GenerationId); e != sarama.ErrNoError {
			t.Logf("heartbeat: %v", e)
			return false
		}
	}
	a := dial()
	defer a.Close()
	resp, err := a.DescribeGroups(&sarama.DescribeGroupsRequest{Groups: []string{group}})
	require.NoError(t, err)
	require.Len(t, resp.Groups, 1)
	g := resp.Groups[0]
	require.Equal(t, "Stable", g.State)
	require.Contains(t, g.Members, y)
	return true
}

// cuttableProxy forwards TCP connections to addr; cut closes every one of
// them at once, as the death of the process on the other side would.
func cuttableProxy(t *testing.T, addr string) (string, func()) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", addr)
			if err != nil {
				_ = c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, up)
			mu.Unlock()
			go func() { _, _ = io.Copy(up, c); _ = up.Close() }()
			go func() { _, _ = io.Copy(c, up); _ = c.Close() }()
		}
	}()
	cut := func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	}
	t.Cleanup(func() { _ = ln.Close(); cut() })
	return ln.Addr().String(), cut
}
