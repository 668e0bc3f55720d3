package saramastrategy_test

import (
	"testing"

	"github.com/IBM/sarama"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/saramastrategy"
)

// custom is a caller's own strategy: kept as it is.
type custom struct{ sarama.BalanceStrategy }

func TestOwnReplacesOnlySaramasStatefulStrategies(t *testing.T) {
	coop, sticky, rng := sarama.NewBalanceStrategyCooperativeSticky(), sarama.NewBalanceStrategySticky(), sarama.NewBalanceStrategyRange()
	mine := custom{sarama.NewBalanceStrategyRoundRobin()}
	base := sarama.NewConfig()
	base.Consumer.Group.Rebalance.GroupStrategies = []sarama.BalanceStrategy{coop, sticky, rng, mine}
	cfg := *base
	saramastrategy.Own(&cfg)

	got := cfg.Consumer.Group.Rebalance.GroupStrategies
	require.Len(t, got, 4)
	require.NotSame(t, coop, got[0], "cooperative-sticky keeps state per Plan: a new value")
	require.NotSame(t, sticky, got[1], "sticky keeps state per Plan: a new value")
	require.Equal(t, sarama.CooperativeStickyBalanceStrategyName, got[0].Name())
	require.Equal(t, sarama.StickyBalanceStrategyName, got[1].Name())
	require.Same(t, rng, got[2], "range is stateless: kept")
	require.Equal(t, mine, got[3], "a caller's own strategy is kept")
	require.Same(t, coop, base.Consumer.Group.Rebalance.GroupStrategies[0], "the config it was copied from keeps its values")
}
