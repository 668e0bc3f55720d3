package idemkafka_test

import (
	"fmt"

	"github.com/IBM/sarama"

	"github.com/idemkit/watermill-idempotency/idemkafka"
)

// The subscriber config for a dedup consumer: a consumer group is required,
// a new group starts from the oldest offset, and security settings of the
// base Sarama config are kept.
func ExampleWatermillSubscriberConfig() {
	base := sarama.NewConfig()
	base.ClientID = "billing-service"
	base.Net.TLS.Enable = true

	cfg, err := idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{
		Brokers: []string{"kafka-1:9092", "kafka-2:9092"},
		Sarama:  base,
	}, "billing")
	if err != nil {
		panic(err)
	}
	sc := cfg.OverwriteSaramaConfig
	fmt.Println("group:", cfg.ConsumerGroup)
	fmt.Println("oldest first:", sc.Consumer.Offsets.Initial == sarama.OffsetOldest)
	fmt.Println("auto-commit of acked offsets:", sc.Consumer.Offsets.AutoCommit.Enable)
	fmt.Println("client id and TLS kept:", sc.ClientID, sc.Net.TLS.Enable)

	_, err = idemkafka.WatermillSubscriberConfig(idemkafka.ClientConfig{Brokers: []string{"kafka-1:9092"}}, "")
	fmt.Println(err)
	// Output:
	// group: billing
	// oldest first: true
	// auto-commit of acked offsets: true
	// client id and TLS kept: billing-service true
	// invalid config: consumerGroup: required
}
