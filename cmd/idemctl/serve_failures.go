package main

import (
	"flag"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/console"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/idemkafka"
)

// failuresOptions are serve's flags for the failures explorer.
type failuresOptions struct {
	contracts    *string // --contracts: a directory of <event type>.json schemas
	poisonTopics *string // --poison-topics
}

func failuresFlags(fs *flag.FlagSet) failuresOptions {
	return failuresOptions{
		contracts:    fs.String("contracts", "", "a `directory` of <event type>.json JSON Schemas (contract.JSONSchema) that edit-and-replay checks an edited payload with (default: none, edits are refused)"),
		poisonTopics: fs.String("poison-topics", "", "with --brokers: the poison `topics` the failures explorer offers (default: every topic whose name has poison)"),
	}
}

// explorer opens the failures explorer on kc into cfg, with a publisher
// keyed by partition_key (as poison replay's) for its replays; the returned
// function closes the publisher.
func (o failuresOptions) explorer(cfg *console.Config, kc idemkafka.ClientConfig) (func(), error) {
	cfg.PoisonTopics = splitList(*o.poisonTopics)
	var contracts failures.Contracts
	if *o.contracts != "" {
		var err error
		if contracts, err = failures.LoadContracts(*o.contracts); err != nil {
			return nil, usageError("--contracts: %v", err)
		}
	}
	pc, err := idemkafka.WatermillPublisherConfig(kc)
	if err != nil {
		return nil, err
	}
	pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
	if err != nil {
		return nil, fmt.Errorf("kafka publisher: %w", err)
	}
	cfg.Explorer, err = failures.New(failures.Config{DB: cfg.Pool, Schema: cfg.Table.Schema, Kafka: kc, Publisher: pub, Contracts: contracts})
	if err != nil {
		_ = pub.Close()
		return nil, err
	}
	return func() { _ = pub.Close() }, nil
}
