package franz

import (
	"errors"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// The values of [SubscriberConfig].GroupProtocol, as Kafka's consumer
// setting group.protocol names them.
const (
	protocolClassic  = "classic"
	protocolConsumer = "consumer"
)

// UnsupportedError reports a broker that does not speak what the
// configuration asks for (the KIP-848 consumer protocol, share groups).
type UnsupportedError struct {
	// Feature is what was asked for, e.g. "KIP-848 consumer group protocol".
	Feature string
	// API is the Kafka request the broker lacks, e.g. "ConsumerGroupHeartbeat v1".
	API string
}

func (e *UnsupportedError) Error() string {
	return "franz: the broker does not support the " + e.Feature + " (" + e.API + "): use a Kafka 4.0+ cluster or another setting"
}

// Defaults of [SubscriberConfig].
const (
	defaultMaxInFlight     = 64
	defaultPartitionWindow = 1024
	defaultNackResendSleep = 100 * time.Millisecond
	defaultRevokeTimeout   = 10 * time.Second
	defaultCommitInterval  = time.Second
	defaultPollRecords     = 500
	defaultFetchMaxWait    = 100 * time.Millisecond
	defaultMaxDeliveries   = 4
	defaultShareMembers    = 2
	defaultShareReset      = "earliest"
)

// SubscriberConfig configures a [Subscriber].
type SubscriberConfig struct {
	// Brokers are the seed brokers. Required.
	Brokers []string
	// ConsumerGroup is the Kafka consumer group. Required.
	ConsumerGroup string
	// GroupProtocol is the consumer group protocol, as Kafka's consumer
	// setting group.protocol names it: "classic" (JoinGroup/SyncGroup with
	// the cooperative-sticky balancer: only the partitions that move are
	// revoked) or "consumer" (KIP-848's next-generation protocol, Kafka
	// 4.0+: the broker assigns the partitions, with no group-wide
	// rebalance barrier; Subscribe returns an [*UnsupportedError] where
	// the broker lacks ConsumerGroupHeartbeat v1). Defaults to "classic".
	GroupProtocol string
	// InstanceID makes the member static (Kafka's group.instance.id,
	// KIP-345; with GroupProtocol "consumer", KIP-848's static
	// membership): Close keeps the member's partitions reserved for it
	// instead of handing them to the others, and a process that comes back
	// with the same InstanceID within the session timeout (45 s by
	// default: kgo.SessionTimeout in ClientOpts for "classic", the
	// broker's group.consumer.session.timeout.ms for "consumer") gets them
	// again at once, with no reassignment. A rolling restart then moves no
	// partition: with KIP-848 a dynamic member's partitions move at the
	// others' heartbeats, which come every group.consumer.heartbeat.interval.ms
	// (5 s by default), and the restarted member waits for them (see
	// docs/engines.md). The other side: the partitions of an instance that
	// does not come back (scaled down, crashed for good) wait the session
	// timeout, and after a crash (no Close) a KIP-848 broker refuses the
	// returning instance until that timeout expires the crashed member.
	// Give each process its own stable name, such as a StatefulSet pod's
	// name, and each Subscriber of one process and group its own: a second
	// live member with the same name fences the first (classic) or is
	// refused (KIP-848). A Subscribe call joins as "<InstanceID>-<topic>";
	// a second live call on the same topic is refused. Letters, digits,
	// '.', '_' and '-' only, at most 100 characters, as Kafka requires.
	// Not with ShareGroup. Defaults to "" (a dynamic member).
	InstanceID string
	// Ordering is which earlier messages a message waits for, as for
	// idemkafka/parallel's Subscriber. Defaults to parallel.OrderKey.
	Ordering parallel.Ordering
	// MaxInFlight is how many messages this Subscriber (all its Subscribe
	// calls together) has handed out and not yet seen acked or nacked. With
	// the dedup middleware in one-transaction-per-message mode each holds a
	// database connection. Defaults to 64.
	MaxInFlight int
	// PartitionWindow is how many records a partition holds that are not
	// done (ready, in flight, backing off, waiting for an earlier record of
	// their key). When it is reached the partition's fetching is paused
	// until there is room for a poll again (PollRecords, at most half the
	// window); the other partitions keep flowing. A partition may exceed
	// it by one poll. Defaults to 1024.
	PartitionWindow int
	// PollRecords is the most records one poll takes from the client.
	// Defaults to 500.
	PollRecords int
	// FetchMaxWait is how long a fetch with no new data waits at the
	// broker (kgo.FetchMaxWait). A resumed partition joins the broker's
	// next fetch, after the one in flight, and that one waits this long
	// when the other partitions there are idle: so it bounds how long a
	// partition whose window filled waits for more records beside idle
	// ones. franz-go's own default, 5 s, held such a partition 5 s on each
	// refill. A kgo.FetchMaxWait in ClientOpts overrides it. Defaults to
	// 100 ms.
	FetchMaxWait time.Duration
	// NackResendSleep is how long a nacked message waits before it is
	// handed out again; the later messages of its key wait behind it.
	// Defaults to 100 ms.
	NackResendSleep time.Duration
	// RevokeTimeout is how long the messages in flight of a revoked
	// partition (rebalance, Close) get to be acked before its offset is
	// committed and they are abandoned (their contexts are cancelled; the
	// next owner gets them again). It and 1 s for the final commit must
	// be shorter than the rebalance timeout (kgo.RebalanceTimeout in
	// ClientOpts, 60 s by default): Validate refuses it otherwise.
	// Defaults to 10 s.
	RevokeTimeout time.Duration
	// CommitInterval is how often the offsets below the lowest record not
	// done are committed; a revocation and Close commit at once. Defaults
	// to 1 s.
	CommitInterval time.Duration
	// ShareGroup, when set, makes the Subscriber a member of this KIP-932
	// share group instead of a consumer group (set only one of the two):
	// the broker hands each record to one member and takes per-record
	// acknowledgements (an ack accepts, a nack releases the record for
	// redelivery, a nack with a permanent error rejects it), so
	// concurrency is not bounded by partitions, and no order is kept: it
	// requires Ordering parallel.OrderNone, and only handlers that need no
	// order (each event stands alone; effectively once through the dedup
	// claim) may use it. See docs/engines.md. Defaults to "" (a consumer
	// group).
	ShareGroup string
	// ShareMembers is, with ShareGroup, how many members of the share
	// group (franz-go clients) each Subscribe call runs. A member polls
	// up to its share of MaxInFlight and polls again only once each of
	// those records was acked or nacked (franz-go accepts at the next
	// poll whatever the previous one left), so a lone member idles while
	// its poll's last handlers finish; with several, the others hand out
	// their records meanwhile, and one slow handler holds only its
	// member's share. At most MaxInFlight. Defaults to 2 (1 with a
	// MaxInFlight of 1).
	ShareMembers int
	// MaxDeliveries is, with ShareGroup, the delivery of a record from
	// which a failing handler's error is made permanent by
	// [RecordErrors] (idem.Permanent), so that a poison queue filtered by
	// idem.IsPermanent takes the message; without a poison queue the
	// record is rejected. Keep it at or below the group's
	// share.delivery.count.limit (5 by default), past which the broker
	// archives the record unseen. Defaults to 4.
	MaxDeliveries int
	// IsPermanentFunc is, with ShareGroup, what else than an error wrapped
	// by idem.Permanent (or made permanent by [RecordErrors] at
	// MaxDeliveries) rejects a nacked record instead of releasing it; set
	// idem.IsPermanent to reject every error the poison queue would take
	// (this package cannot import middleware). Defaults to nil (only
	// idem.Permanent's mark).
	IsPermanentFunc func(error) bool
	// ShareOffsetReset is, with ShareGroup, the share group's
	// share.auto.offset.reset, set by Subscribe (IncrementalAlterConfigs on
	// the group): "earliest" delivers the records already in the topic
	// when the group is new, as the consumer-group subscribers do; "latest"
	// only later ones; "none" leaves the group's setting alone. Defaults to
	// "earliest".
	ShareOffsetReset string
	// Progress, when set, keeps the group's position in PostgreSQL, in the
	// claims' database (a *pgxpool.Pool of the same cluster as the dedup
	// middleware's, or the position would not follow the claims through a
	// failover), as idemkafka/parallel's Subscriber does: each partition's
	// commit offset (below it every record is acked, so its transaction
	// committed) is written to <table>_progress before it is committed to
	// Kafka, and every assignment (cooperative-sticky and KIP-848 alike)
	// starts each partition from PostgreSQL's position, which wins over
	// Kafka's committed offset (still committed, for lag tools); a
	// partition without a row gets its start written as its row first. After a
	// failover to an asynchronous standby or a point-in-time restore the
	// events of the lost transactions are handed out again instead of
	// being skipped (docs/guarantees.md). A write finding the server on a
	// new timeline restarts the member's partitions from the new history's
	// position. Not with ShareGroup (a share group has no offsets).
	// Defaults to nil (the position is kept in Kafka only).
	Progress migrate.DBTX
	// ProgressSchema is the schema of the claims' table, as the
	// middleware's deduplicator.TableConfig.Schema. Defaults to "" (public).
	ProgressSchema string
	// ProgressTable is the claims' table, as
	// deduplicator.TableConfig.Table: deduplicator.MigrationLine creates
	// its <table>_progress companion, where Progress is kept. Defaults to
	// "" (processed_event).
	ProgressTable string
	// ClientOpts are more franz-go options (TLS, SASL, ClientID, session
	// and rebalance timeouts...). The Subscriber sets FetchMaxWait before
	// them, and the seed brokers, the group, the topic, the balancer,
	// DisableAutoCommit, BlockRebalanceOnPoll and the partition callbacks
	// after them.
	// Defaults to none.
	ClientOpts []kgo.Opt
}

func (c *SubscriberConfig) setDefaults() {
	if c.GroupProtocol == "" {
		c.GroupProtocol = protocolClassic
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = defaultMaxInFlight
	}
	if c.PartitionWindow == 0 {
		c.PartitionWindow = defaultPartitionWindow
	}
	if c.PollRecords == 0 {
		c.PollRecords = defaultPollRecords
	}
	if c.FetchMaxWait == 0 {
		c.FetchMaxWait = defaultFetchMaxWait
	}
	if c.NackResendSleep == 0 {
		c.NackResendSleep = defaultNackResendSleep
	}
	if c.RevokeTimeout == 0 {
		c.RevokeTimeout = defaultRevokeTimeout
	}
	if c.CommitInterval == 0 {
		c.CommitInterval = defaultCommitInterval
	}
	if c.ShareMembers == 0 {
		c.ShareMembers = min(defaultShareMembers, max(c.MaxInFlight, 1))
	}
	if c.MaxDeliveries == 0 {
		c.MaxDeliveries = defaultMaxDeliveries
	}
	if c.ShareOffsetReset == "" {
		c.ShareOffsetReset = defaultShareReset
	}
}

// Validate reports the first bad field: its error starts with the field's
// name.
func (c SubscriberConfig) Validate() error {
	bad := func(field, problem string) error { return errors.New(field + ": " + problem) }
	switch {
	case len(c.Brokers) == 0:
		return bad("Brokers", "required")
	case c.ConsumerGroup == "" && c.ShareGroup == "":
		return bad("ConsumerGroup", "required (without a group nothing is committed)")
	case c.ConsumerGroup != "" && c.ShareGroup != "":
		return bad("ShareGroup", "set only one of ConsumerGroup and ShareGroup")
	case c.ShareGroup != "" && c.Progress != nil:
		return bad("Progress", "not with a share group: it has no offsets, the broker keeps each record's state")
	case c.ShareGroup != "" && c.Ordering != parallel.OrderNone:
		return bad("Ordering", fmt.Sprintf("%s with a share group: a share group keeps no order, set parallel.OrderNone (handlers that need their key's order cannot use a share group)", c.Ordering))
	case c.ShareMembers < 0:
		return bad("ShareMembers", "must be positive")
	case c.ShareMembers > c.MaxInFlight && c.MaxInFlight > 0:
		return bad("ShareMembers", fmt.Sprintf("%d members for MaxInFlight %d: each member needs at least one slot", c.ShareMembers, c.MaxInFlight))
	case c.MaxDeliveries < 0:
		return bad("MaxDeliveries", "must be positive")
	case c.ShareOffsetReset != "" && c.ShareOffsetReset != "earliest" && c.ShareOffsetReset != "latest" && c.ShareOffsetReset != "none":
		return bad("ShareOffsetReset", fmt.Sprintf("%q: earliest, latest or none", c.ShareOffsetReset))
	case c.InstanceID != "" && c.ShareGroup != "":
		return bad("InstanceID", "not with a share group: share groups have no static membership")
	case !validInstanceID(c.InstanceID):
		return bad("InstanceID", fmt.Sprintf("%q: letters, digits, '.', '_' and '-' only, at most %d characters", c.InstanceID, maxInstanceID))
	case c.GroupProtocol != "" && c.GroupProtocol != protocolClassic && c.GroupProtocol != protocolConsumer:
		return bad("GroupProtocol", fmt.Sprintf("%q: classic or consumer", c.GroupProtocol))
	case c.Ordering < parallel.OrderKey || c.Ordering > parallel.OrderNone:
		return bad("Ordering", fmt.Sprintf("unknown value %d", int(c.Ordering)))
	case c.MaxInFlight < 1:
		return bad("MaxInFlight", "must be positive")
	case c.PartitionWindow < 1:
		return bad("PartitionWindow", "must be positive")
	case c.PollRecords < 1:
		return bad("PollRecords", "must be positive")
	case c.FetchMaxWait < 0:
		return bad("FetchMaxWait", "must not be negative")
	case c.NackResendSleep < 0:
		return bad("NackResendSleep", "must not be negative")
	case c.RevokeTimeout < 0:
		return bad("RevokeTimeout", "must not be negative")
	case c.CommitInterval < 0:
		return bad("CommitInterval", "must not be negative")
	}
	return c.validateClientOpts()
}

// maxInstanceID leaves room in Kafka's 249 characters for the topic that
// Subscribe appends.
const maxInstanceID = 100

// validInstanceID says whether id is empty or a legal group.instance.id
// prefix (Kafka's rule: [a-zA-Z0-9._-]).
func validInstanceID(id string) bool {
	if len(id) > maxInstanceID {
		return false
	}
	for _, r := range id {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-'
		if !ok {
			return false
		}
	}
	return true
}

// revokeCommitAllowance is what the RevokeTimeout check gives a revoked
// partition's final commit.
const revokeCommitAllowance = time.Second

// validateClientOpts builds a client of ClientOpts (it connects to
// nothing) to read what they set: a revocation's RevokeTimeout and final
// commit must end within the rebalance timeout, or the coordinator expels
// the member.
func (c SubscriberConfig) validateClientOpts() error {
	if len(c.ClientOpts) == 0 || c.ShareGroup != "" {
		return nil
	}
	cl, err := kgo.NewClient(append(append([]kgo.Opt(nil), c.ClientOpts...), kgo.SeedBrokers(c.Brokers...))...)
	if err != nil {
		return errors.New("ClientOpts: " + err.Error())
	}
	rebalance, _ := cl.OptValue(kgo.RebalanceTimeout).(time.Duration)
	cl.Close()
	revoke := c.RevokeTimeout
	if revoke == 0 {
		revoke = defaultRevokeTimeout
	}
	final := revokeCommitAllowance
	if c.Progress != nil {
		final += progressSaveTimeout
	}
	if rebalance > 0 && revoke+final >= rebalance {
		return fmt.Errorf("RevokeTimeout: %s + %s for the final commit must be shorter than the rebalance timeout of ClientOpts (%s): "+
			"a revoked member must rejoin before it, or the coordinator expels it", revoke, final, rebalance)
	}
	return nil
}
