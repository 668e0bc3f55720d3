// Command soak runs the chaos soak of tests/soak (`make soak`): by default
// 20,000 events over 64 aggregates with every default fault kind (consumer
// processes killed with SIGKILL, database outages, rebalances, offset
// resets...), then checks that every event was applied exactly once per
// consumer group. 5 % of the events fail transiently 1 to 3 times and go
// through the consumers' retry topics. It prints the faults injected, the
// duplicates absorbed, the events that went through a retry topic and the
// events lost or doubled per group, and exits 1 on a violation, printing
// the seed to reproduce the event plan and fault schedule. The consumers are
// this same binary, re-executed. With -lease, the consumers' dedup
// middleware runs in lease mode and the handler calls a fake payment
// provider; processes are killed between the phases, and the run checks
// each event was charged once per group at the provider. With -parallel
// (not -lease) the run adds a hot key and a failing key and runs the main
// topic's subscriber with a PartitionWindow of 16 (soak.Config.HostileKeys;
// -hostile-keys=false leaves them out). With -engine franz the consumers
// run idemkafka/franz's Subscriber (KIP-848 by default, -group-protocol
// classic for cooperative-sticky) on the main topic and the retry topics,
// and the fault mix adds rolling restarts; with -share the main topic is
// consumed by a KIP-932 share group: no order, the broker's delivery count
// drives the poison queue (1 % of the events fail on every delivery and
// must be poisoned), every other event applied exactly once.
//
//	go run ./cmd/soak [-seed N] [-events N] [-timeout 25m] [-short] [-faults kind=n,...] [-direct] [-group-commit] [-parallel [-hostile-keys=false]] [-lease [-lease-duration 3s]] [-engine franz [-group-protocol consumer|classic] [-static]] [-share] [-retry-percent 5] [-keep] [-v]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/tests/soak"
)

func main() {
	// The soak runs its consumers as child processes of this binary, and
	// kills them with SIGKILL.
	soak.RunConsumerIfChild()

	seed := flag.Uint64("seed", uint64(time.Now().UnixNano()), "seed of the event plan and the fault schedule")
	events := flag.Int("events", soak.DefaultEvents, "events to produce")
	aggregates := flag.Int("aggregates", soak.DefaultAggregates, "aggregates (partition keys)")
	partitions := flag.Int("partitions", soak.DefaultPartitions, "partitions of the topic")
	timeout := flag.Duration("timeout", soak.DefaultTimeout, "abort (and fail) after this long")
	short := flag.Bool("short", false, "2,000 events and the short fault mix")
	keep := flag.Bool("keep", false, "keep the run's PostgreSQL database for inspection")
	verbose := flag.Bool("v", false, "log the components (Watermill, middleware, consumer processes) at info level")
	direct := flag.Bool("direct", false, "producer publishes directly to Kafka after its commit (no outbox)")
	groupCommit := flag.Bool("group-commit", false, "consumers in group-commit mode (idem.Config.Mode = &idem.GroupCommitConfig{}, defaults)")
	parallel := flag.Bool("parallel", false, "consumers on idemkafka's parallel subscriber (key order, more messages in flight than partitions) instead of watermill-kafka's")
	hostile := flag.Bool("hostile-keys", true, "with -parallel (not -lease): a hot key (1 % of the events, 200-500 ms each) and a failing key (its first event nacked until 60 % of the others are applied), PartitionWindow 16")
	lease := flag.Bool("lease", false, "consumers in lease mode (idem.Config.Mode = &idem.LeaseConfig{}): the handler calls a fake provider with no transaction held and registers its write with idem.Complete; kills land between the phases (not with -group-commit)")
	leaseDuration := flag.Duration("lease-duration", soak.DefaultLeaseDuration, "the lease's duration in lease mode: how long a killed consumer's event waits before it is taken over")
	engine := flag.String("engine", "", "the consumers' Kafka engine: sarama (watermill-kafka's subscriber, or -parallel) or franz (idemkafka/franz's Subscriber on every topic, either commit mode, not -parallel nor -lease; its fault mix adds rolling restarts); default sarama")
	groupProtocol := flag.String("group-protocol", "", `with -engine franz: the consumer group protocol, "consumer" (KIP-848, the default) or "classic" (cooperative-sticky)`)
	static := flag.Bool("static", false, "with -engine franz: each consumer process is a static member (InstanceID) named after its slot; a restarted process takes the slot it freed")
	share := flag.Bool("share", false, "the main topic consumed by a KIP-932 share group (idemkafka/franz's share subscriber; implies -engine franz): no order checked, no retry topics, failures redelivered by the broker and poisoned at delivery 4; its fault mix has no offset resets")
	subProgress := flag.Bool("subscriber-progress", false, "watermill-kafka's subscribers keep the groups' positions in PostgreSQL themselves (idemkafka.ClientConfig.Progress): no rewind after the failover fault (not with -parallel or -engine franz, which keep theirs)")
	retryPercent := flag.Int("retry-percent", soak.DefaultRetryPercent, "percent of the events that fail transiently 1-3 times and go through the retry topics (negative: none)")
	faults := flag.String("faults", "", `change the fault mix, e.g. "kill=6,crash-loop=1" (kinds: mid-handler, mid-call (lease mode), after-commit, kill, crash-loop, disrupt, join, pg-consumer, pg-producer, restart-forwarder, offset-reset, leader-election, oversize-row, rolling-restart, failover); "none" starts from an empty mix`)
	flag.Parse()

	cfg := soak.Config{
		Seed:               *seed,
		Events:             *events,
		Aggregates:         *aggregates,
		Partitions:         int32(*partitions),
		Timeout:            *timeout,
		DatabaseURL:        pgtest.URL(),
		Brokers:            kafkatest.External(),
		KeepDatabase:       *keep,
		DirectPublish:      *direct,
		GroupCommit:        *groupCommit,
		Parallel:           *parallel,
		HostileKeys:        *parallel && !*lease && *hostile,
		Lease:              *lease,
		LeaseDuration:      *leaseDuration,
		RetryPercent:       *retryPercent,
		Engine:             *engine, // "": sarama, or franz with -share
		Share:              *share,
		Static:             *static,
		GroupProtocol:      *groupProtocol,
		SubscriberProgress: *subProgress,
		Log:                os.Stderr,
	}
	fc, err := faultMix(*lease, *short, *engine == soak.EngineFranz, *share, *faults)
	if err != nil {
		fmt.Fprintf(os.Stderr, "soak: -faults: %v\n", err)
		os.Exit(2)
	}
	cfg.Faults = fc
	if *short {
		cfg.Events = 2000
	}
	if *verbose {
		cfg.Logger = watermill.NewStdLogger(false, false)
		cfg.ConsumerLogs = true
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rep, err := soak.Run(ctx, cfg)
	if rep != nil {
		fmt.Print(rep.String())
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "soak: %v (seed %d)\n", err, cfg.Seed)
		os.Exit(2)
	}
	if !rep.OK() {
		fmt.Fprintf(os.Stderr, "soak: FAILED, reproduce the plan with: go run ./cmd/soak -seed %d -events %d\n", cfg.Seed, cfg.Events)
		os.Exit(1)
	}
}

// faultMix returns the fault mix: the full or short one (of lease mode when
// lease, of the franz-go engine when franz, of the share-group leg when
// share), changed by the -faults spec.
func faultMix(lease, short, franz, share bool, spec string) (soak.FaultCounts, error) {
	full, shortMix := soak.FullFaults, soak.ShortFaults
	switch {
	case lease:
		full, shortMix = soak.FullLeaseFaults, soak.ShortLeaseFaults
	case share:
		full, shortMix = soak.FullShareFaults, soak.ShortShareFaults
	case franz:
		full, shortMix = soak.FullFranzFaults, soak.ShortFranzFaults
	}
	base := full
	if short {
		base = shortMix
	}
	if spec == "" {
		return base, nil
	}
	if rest, ok := strings.CutPrefix(spec, "none"); ok {
		base, spec = soak.FaultCounts{}, strings.TrimPrefix(rest, ",")
	}
	fc, err := soak.ParseFaults(base, spec)
	if err != nil {
		return soak.FaultCounts{}, err
	}
	if fc == (soak.FaultCounts{}) {
		return soak.FaultCounts{}, errors.New("no fault left")
	}
	return fc, nil
}
