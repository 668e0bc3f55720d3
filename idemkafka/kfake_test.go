package idemkafka_test

import (
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
)

// The consumer-group rules of Kafka's classic protocol that the soak's
// stalls came down to (docs/soak.md, "The consumer-group livelock"). The
// in-process broker broke all three; the module runs a patched copy of it
// (internal/kfake, PATCHES.md), and these tests hold it, and any
// cluster named by KAFKA_BROKERS, to Kafka's behaviour:
//
//   - a member whose process dies while its JoinGroup is pending is expired
//     one session timeout after the join completes;
//   - a member that waits in JoinGroup is not expired while it waits (a
//     client does not heartbeat then);
//   - the join deadline is armed once, when the rebalance starts: a member
//     that heartbeats but never rejoins (its handler never returns) is
//     removed at that deadline, however often others join and leave.

// rawGroup sends a group's protocol requests one by one, as a client would.
type rawGroup struct {
	t            *testing.T
	addr, group  string
	topic        string
	cfg          *sarama.Config
	session      time.Duration
	rebalanceDur time.Duration
}

func newRawGroup(t *testing.T, addr, topic, group string, session, rebalance time.Duration) *rawGroup {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_3_0_0
	// Longer than any wait below: a JoinGroup the coordinator never
	// answers shows up as the test's own deadline, not as a read error.
	cfg.Net.ReadTimeout = time.Minute
	return &rawGroup{t: t, addr: addr, group: group, topic: topic, cfg: cfg, session: session, rebalanceDur: rebalance}
}

func (r *rawGroup) dialAt(addr string) *sarama.Broker {
	r.t.Helper()
	b := sarama.NewBroker(addr)
	require.NoError(r.t, b.Open(r.cfg))
	_, err := b.Connected()
	require.NoError(r.t, err)
	r.t.Cleanup(func() { _ = b.Close() })
	return b
}

func (r *rawGroup) join(b *sarama.Broker, memberID string) (*sarama.JoinGroupResponse, error) {
	req := &sarama.JoinGroupRequest{Version: 5, GroupId: r.group, SessionTimeout: int32(r.session / time.Millisecond),
		RebalanceTimeout: int32(r.rebalanceDur / time.Millisecond), MemberId: memberID, ProtocolType: "consumer"}
	if err := req.AddGroupProtocolMetadata("range", &sarama.ConsumerGroupMemberMetadata{Topics: []string{r.topic}}); err != nil {
		return nil, err
	}
	return b.JoinGroup(req)
}

// joinNew joins under a new member id: the first JoinGroup (v4+) only hands
// out the id.
func (r *rawGroup) joinNew(b *sarama.Broker) string {
	r.t.Helper()
	resp, err := r.join(b, "")
	require.NoError(r.t, err)
	require.Equal(r.t, sarama.ErrMemberIdRequired, resp.Err)
	return resp.MemberId
}

func (r *rawGroup) sync(b *sarama.Broker, gen int32, leader string, members ...string) {
	r.t.Helper()
	req := &sarama.SyncGroupRequest{Version: 3, GroupId: r.group, GenerationId: gen, MemberId: leader}
	for i, m := range members {
		require.NoError(r.t, req.AddGroupAssignmentMember(m, &sarama.ConsumerGroupMemberAssignment{Topics: map[string][]int32{r.topic: {int32(i)}}}))
	}
	resp, err := b.SyncGroup(req)
	require.NoError(r.t, err)
	require.Equal(r.t, sarama.ErrNoError, resp.Err)
}

func (r *rawGroup) heartbeat(b *sarama.Broker, member string, gen int32) sarama.KError {
	r.t.Helper()
	resp, err := b.Heartbeat(&sarama.HeartbeatRequest{Version: 3, GroupId: r.group, MemberId: member, GenerationId: gen})
	require.NoError(r.t, err)
	return resp.Err
}

// stable makes a stable group of one member on b and returns its id and
// generation.
func (r *rawGroup) stable(b *sarama.Broker) (string, int32) {
	r.t.Helper()
	x := r.joinNew(b)
	jr, err := r.join(b, x)
	require.NoError(r.t, err)
	require.Equal(r.t, sarama.ErrNoError, jr.Err)
	r.sync(b, jr.GenerationId, x, x)
	return x, jr.GenerationId
}

func (r *rawGroup) members() map[string]*sarama.GroupMemberDescription {
	r.t.Helper()
	resp, err := r.dialAt(r.addr).DescribeGroups(&sarama.DescribeGroupsRequest{Groups: []string{r.group}})
	require.NoError(r.t, err)
	require.Len(r.t, resp.Groups, 1)
	return resp.Groups[0].Members
}

func TestBrokerExpiresAMemberThatDiedInJoin(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "ghost", 2)
	const session = time.Second
	r := newRawGroup(t, broker.Addrs[0], topic, "ghost-"+topic, session, 10*time.Second)

	// x leads a stable group of one and keeps heartbeating.
	bx := r.dialAt(r.addr)
	x, gen := r.stable(bx)

	// y joins under a new id, through a proxy that can cut its connection
	// as a process death does; its JoinGroup waits for x to join again.
	proxy, cut := cuttableProxy(t, r.addr)
	by := r.dialAt(proxy)
	y := r.joinNew(by)
	go func() { _, _ = r.join(by, y) }()
	require.Eventually(t, func() bool { return r.heartbeat(bx, x, gen) == sarama.ErrRebalanceInProgress }, 10*time.Second, 10*time.Millisecond)
	// y's process dies before the answer.
	cut()
	time.Sleep(300 * time.Millisecond)

	// x joins again: the rebalance completes with y in it (y had joined),
	// the answer to y cannot be delivered, and x assigns y a partition.
	jr, err := r.join(bx, x)
	require.NoError(t, err)
	require.Equal(t, sarama.ErrNoError, jr.Err)
	r.sync(bx, jr.GenerationId, x, x, y)

	// y never heartbeats: one session timeout later it is expired and the
	// group rebalances; x joins again and leads a group without y.
	require.Eventually(t, func() bool { return r.heartbeat(bx, x, jr.GenerationId) == sarama.ErrRebalanceInProgress },
		30*time.Second, session/10, "the member that died in JoinGroup was never expired")
	jr, err = r.join(bx, x)
	require.NoError(t, err)
	require.Equal(t, sarama.ErrNoError, jr.Err)
	require.Len(t, jr.Members, 1, "the new generation has only x")
	r.sync(bx, jr.GenerationId, x, x)
	require.NotContains(t, r.members(), y)
}

func TestBrokerRemovesAMemberThatNeverRejoinsAtTheJoinDeadline(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "stuck", 2)
	const session, rebalance = time.Second, 3 * time.Second
	r := newRawGroup(t, broker.Addrs[0], topic, "stuck-"+topic, session, rebalance)

	// x and y: a stable group of two.
	bx, by := r.dialAt(r.addr), r.dialAt(r.addr)
	x, gen := r.stable(bx)
	y := r.joinNew(by)
	yJoined := make(chan *sarama.JoinGroupResponse, 1)
	go func() { resp, _ := r.join(by, y); yJoined <- resp }()
	require.Eventually(t, func() bool { return r.heartbeat(bx, x, gen) == sarama.ErrRebalanceInProgress }, 10*time.Second, 10*time.Millisecond)
	jr, err := r.join(bx, x)
	require.NoError(t, err)
	require.Equal(t, sarama.ErrNoError, jr.Err)
	gen = jr.GenerationId
	r.sync(bx, gen, x, x, y)
	require.NotNil(t, <-yJoined)
	r.sync(by, gen, y)

	// x's handler never returns: its heartbeats go on (they keep it
	// alive), but it never joins again.
	done := make(chan struct{})
	var beats sync.WaitGroup
	beats.Go(func() {
		for {
			select {
			case <-done:
				return
			case <-time.After(session / 5):
				_, _ = bx.Heartbeat(&sarama.HeartbeatRequest{Version: 3, GroupId: r.group, MemberId: x, GenerationId: gen})
			}
		}
	})
	defer func() { close(done); beats.Wait() }()

	// Members come and go (processes restarting): each joins, which starts
	// a rebalance, and leaves while it waits. Neither may move the join
	// deadline.
	churn := func() {
		bz := r.dialAt(r.addr)
		z := r.joinNew(bz)
		go func() { _, _ = r.join(bz, z) }()
		time.Sleep(50 * time.Millisecond)
		_, _ = by.LeaveGroup(&sarama.LeaveGroupRequest{Version: 3, GroupId: r.group, Members: []sarama.MemberIdentity{{MemberId: z}}})
	}
	churn()
	require.Eventually(t, func() bool { return r.heartbeat(by, y, gen) == sarama.ErrRebalanceInProgress }, 10*time.Second, 10*time.Millisecond)

	// y joins again at once, as a client does, and waits in JoinGroup
	// without heartbeating, longer than its session timeout.
	answered := make(chan *sarama.JoinGroupResponse, 1)
	by2 := r.dialAt(r.addr)
	go func() {
		resp, err := r.join(by2, y)
		if err != nil {
			t.Logf("y's JoinGroup: %v", err)
			resp = &sarama.JoinGroupResponse{Err: sarama.ErrUnknown}
		}
		answered <- resp
	}()
	var resp *sarama.JoinGroupResponse
	deadline := time.After(45 * time.Second)
wait:
	for {
		select {
		case resp = <-answered:
			break wait
		case <-deadline:
			t.Fatalf("y's JoinGroup was not answered in 45s (join deadline %s): a member that never rejoins holds the rebalance (%d members)", rebalance, len(r.members()))
		case <-time.After(rebalance / 4):
			churn()
		}
	}
	require.Equal(t, sarama.ErrNoError, resp.Err, "y's JoinGroup answer")
	require.Greater(t, resp.GenerationId, gen)
	var ids []string
	for _, m := range resp.Members {
		ids = append(ids, m.MemberId)
	}
	if resp.LeaderId == y {
		require.Contains(t, ids, y)
	}
	require.NotContains(t, ids, x, "x, which never rejoined, was removed at the deadline")
	require.NotContains(t, r.members(), x)
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
