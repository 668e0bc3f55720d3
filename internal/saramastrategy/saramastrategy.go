// Package saramastrategy gives a sarama.Config balance strategies of its own.
//
// Sarama's sticky and cooperative-sticky strategies are stateful: both keep
// the state of a Plan in the strategy value (its partition movements), and
// cooperative-sticky also keeps its member's generation, which it sends in
// every JoinGroup ("must not be shared between consumer groups", says
// Sarama). A sarama.Config copied by value still shares its
// GroupStrategies' values, so every member built from one user config would
// plan on one map (a data race, then a panic inside Plan, seen in the soak
// with a main topic's and a retry topic's subscribers) and report one
// generation. [Own] replaces Sarama's stateful strategies with new values
// of the same kind; the others (range, round-robin, a caller's own) are
// kept as they are.
package saramastrategy

import (
	"reflect"
	"slices"

	"github.com/IBM/sarama"
)

// stateful maps the dynamic type of each of Sarama's stateful strategies
// to its constructor.
var stateful = map[reflect.Type]func() sarama.BalanceStrategy{
	reflect.TypeOf(sarama.NewBalanceStrategySticky()):            sarama.NewBalanceStrategySticky,
	reflect.TypeOf(sarama.NewBalanceStrategyCooperativeSticky()): sarama.NewBalanceStrategyCooperativeSticky,
}

// fresh returns a new value of s's kind when s is one of Sarama's stateful
// strategies, else s.
func fresh(s sarama.BalanceStrategy) sarama.BalanceStrategy {
	if s == nil {
		return nil
	}
	if newS, ok := stateful[reflect.TypeOf(s)]; ok {
		return newS()
	}
	return s
}

// Own gives cfg strategy values of its own (a new GroupStrategies slice, so
// the config it was copied from keeps its own too). Call it on each copy
// that a consumer group will plan with.
func Own(cfg *sarama.Config) {
	rb := &cfg.Consumer.Group.Rebalance
	rb.GroupStrategies = slices.Clone(rb.GroupStrategies)
	for i, s := range rb.GroupStrategies {
		rb.GroupStrategies[i] = fresh(s)
	}
	rb.Strategy = fresh(rb.Strategy) //nolint:staticcheck // the deprecated field still works in Sarama
}
