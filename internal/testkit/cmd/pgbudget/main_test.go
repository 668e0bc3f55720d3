package main

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
)

func TestCheckAgainstTheServer(t *testing.T) {
	pgtest.SkipInUnitRun(t)
	ctx := context.Background()
	_, err := check(ctx, pgtest.URL(), 1)
	require.NoError(t, err)
	_, err = check(ctx, pgtest.URL(), 1_000_000)
	require.ErrorContains(t, err, "Fix: raise max_connections to at least")
}

func TestVerdict(t *testing.T) {
	stock := server{where: "h:5432/test", maxConns: 100, superuserReserved: 3, inUse: 5}
	note, err := stock.verdict(60)
	require.NoError(t, err)
	require.Empty(t, note)

	small := stock
	small.maxConns = 50
	_, err = small.verdict(60)
	require.ErrorContains(t, err, "accepts 47 client connections (max_connections=50, 3 reserved)")
	require.ErrorContains(t, err, "ALTER SYSTEM SET max_connections = 63;")

	busy := stock
	busy.inUse = 50
	note, err = busy.verdict(60)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(note, "note: 50 of 97 connections"), note)
}

func TestUnreachable(t *testing.T) {
	_, err := check(context.Background(), "postgres://postgres@127.0.0.1:1/test?connect_timeout=2", 60)
	require.ErrorContains(t, err, "cannot connect to PostgreSQL at 127.0.0.1:1/test")
}
