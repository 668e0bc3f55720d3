package main_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/leasesql"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/leasetest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/publisher"
	"github.com/idemkit/watermill-idempotency/tests/ctltest"
)

// testToken is the actions' token of the tests.
const testToken = ctltest.Token

// startServe runs idemctl serve on db's schema on a free loopback port and
// returns its base URL; the process is stopped at the end of the test.
func startServe(t *testing.T, db *pgtest.DB, env []string, args ...string) string {
	t.Helper()
	return bin.StartServe(t, db, env, args...)
}

func getJSON[T any](t *testing.T, u string) (T, int) {
	t.Helper()
	resp, err := http.Get(u)
	require.NoError(t, err)
	defer resp.Body.Close()
	var v T
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&v))
	return v, resp.StatusCode
}

type overviewAPI struct {
	Groups []struct {
		Group string `json:"group"`
		Young bool   `json:"young"`
	} `json:"groups"`
	Dedup struct {
		Layout           string  `json:"layout"`
		RowsEstimate     int64   `json:"rows_estimate"`
		Bytes            int64   `json:"bytes"`
		RetentionSeconds float64 `json:"retention_seconds"`
		Partitions       []struct {
			Name string `json:"name"`
		} `json:"partitions"`
		NextDrop          *string `json:"next_drop"`
		NextDropPartition string  `json:"next_drop_partition"`
	} `json:"dedup"`
	Outbox struct {
		Forwarder string `json:"forwarder"`
		Topics    []struct {
			Topic   string `json:"topic"`
			Pending int64  `json:"pending"`
		} `json:"topics"`
	} `json:"outbox"`
	Parked parkedJSON        `json:"parked"`
	Errors map[string]string `json:"errors"`
}

// parkKey parks key in group with a first event whose copy on
// orders.retry is overdue, and returns that event.
func parkKey(t *testing.T, db *pgtest.DB, group, key, reason string) string {
	t.Helper()
	return ctltest.ParkKey(t, db, group, key, reason)
}

// consoleDB is a schema with the dedup table, the outbox topics orders
// and orders.retry, the parked-keys table, a registered group and claims.
func consoleDB(t *testing.T, layout string) *pgtest.DB {
	t.Helper()
	return bin.ConsoleDB(t, layout)
}

// The JSON twins have idemctl --json's shapes, read-only refuses every
// action, and every page carries the strict CSP.
func TestServeReadOnly(t *testing.T) {
	t.Parallel()
	db := consoleDB(t, "plain")
	parkKey(t, db, "billing", "acct-1", "boom")
	base := startServe(t, db, nil)

	ov, code := getJSON[overviewAPI](t, base+"/api/overview")
	require.Equal(t, http.StatusOK, code)
	require.Empty(t, ov.Errors)
	require.Len(t, ov.Groups, 1)
	require.Equal(t, "billing", ov.Groups[0].Group)
	require.True(t, ov.Groups[0].Young)
	require.Equal(t, "plain", ov.Dedup.Layout)
	require.EqualValues(t, db.Count(t, `SELECT 1 FROM processed_event`), ov.Dedup.RowsEstimate)
	require.Positive(t, ov.Dedup.Bytes)
	require.Nil(t, ov.Dedup.NextDrop)
	require.Len(t, ov.Outbox.Topics, 2)
	require.Len(t, ov.Parked.Groups, 1)
	require.EqualValues(t, 1, ov.Parked.Groups[0].Keys)

	// /api/parked is retry parked --json, field for field.
	resp, err := http.Get(base + "/api/parked")
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	var fromAPI, fromCLI map[string][]map[string]any
	require.NoError(t, json.Unmarshal(body, &fromAPI))
	require.NoError(t, json.Unmarshal([]byte(ok(t, db, "retry", "parked", "--json").Stdout), &fromCLI))
	for _, part := range []string{"groups", "keys"} {
		require.Len(t, fromAPI[part], 1)
		require.Len(t, fromCLI[part], 1)
		for k := range fromCLI[part][0] {
			require.Contains(t, fromAPI[part][0], k, part)
		}
		require.Len(t, fromAPI[part][0], len(fromCLI[part][0]), part)
	}
	require.Equal(t, "boom", fromAPI["keys"][0]["head_error"])

	for _, path := range []string{"/", "/parked", "/outbox/orders", "/groups/billing", "/api/overview"} {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, path)
		require.Contains(t, resp.Header.Get("Content-Security-Policy"), "script-src 'self'", path)
		require.NotContains(t, resp.Header.Get("Content-Security-Policy"), "unsafe-inline", path)
	}
	for _, path := range []string{"/outbox/nope", "/groups/nope", "/api/groups/nope"} {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusNotFound, resp.StatusCode, path)
	}

	req, _ := http.NewRequest(http.MethodPost, base+"/actions/unblock", strings.NewReader(url.Values{"group": {"billing"}, "key": {"acct-1"}, "confirm": {"yes"}, "token": {testToken}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", base)
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusForbidden, resp.StatusCode)
	require.Contains(t, string(body), "read-only")
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM retry_parked_key`))

	resp, err = http.Get(base + "/actions/unblock")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
}

// --allow-actions without a token of 16 characters or more does not start.
func TestServeActionsNeedAToken(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 1)
	r := ctl(t, db, "serve", "--allow-actions", "--listen", "127.0.0.1:0")
	require.Equal(t, 2, r.Code, r)
	require.Contains(t, r.Stderr, "IDEMCTL_TOKEN")
	r = run(t, []string{"DATABASE_URL=" + db.URL, "IDEMCTL_TOKEN=short"}, "serve", "--allow-actions", "--listen", "127.0.0.1:0")
	require.Equal(t, 2, r.Code, r)
}

var csrfRe = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// An action is a POST from the console's own origin, with the session's
// CSRF token, confirmed, with the token; anything less is refused and
// changes nothing.
func TestServeActionChecks(t *testing.T) {
	t.Parallel()
	db := consoleDB(t, "plain")
	head := parkKey(t, db, "billing", "acct-1", "boom")
	base := startServe(t, db, []string{"IDEMCTL_TOKEN=" + testToken}, "--allow-actions")

	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := client.Get(base + "/parked")
	require.NoError(t, err)
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := csrfRe.FindStringSubmatch(string(page))
	require.NotNil(t, m, string(page))
	csrf := m[1]

	post := func(origin string, form url.Values) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, base+"/actions/unblock", strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		if origin != "" {
			req.Header.Set("Origin", origin)
		}
		resp, err := client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	full := url.Values{"csrf": {csrf}, "group": {"billing"}, "key": {"acct-1"}, "confirm": {"yes"}, "token": {testToken}}
	with := func(k, v string) url.Values {
		f := url.Values{}
		for kk, vv := range full {
			f[kk] = vv
		}
		f.Set(k, v)
		return f
	}
	for _, c := range []struct {
		name, origin string
		form         url.Values
		want         string
	}{
		{"no Origin", "", full, "no Origin header"},
		{"another origin", "http://evil.example", full, "another origin"},
		{"no CSRF token", base, with("csrf", ""), "CSRF"},
		{"wrong CSRF token", base, with("csrf", strings.Repeat("0", 64)), "CSRF"},
		{"no token", base, with("token", ""), "wrong token"},
		{"wrong token", base, with("token", testToken+"x"), "wrong token"},
	} {
		code, body := post(c.origin, c.form)
		require.Equal(t, http.StatusForbidden, code, c.name)
		require.Contains(t, body, c.want, c.name)
		require.Zero(t, db.Count(t, `SELECT 1 FROM "outbox_orders.retry"`), c.name)
	}

	// Without confirm=yes: the confirm page, nothing done yet.
	code, body := post(base, with("confirm", ""))
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="confirm-form"`)
	require.Zero(t, db.Count(t, `SELECT 1 FROM "outbox_orders.retry"`))

	code, body = post(base, full)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "event "+head+" sent to orders.retry again")
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM "outbox_orders.retry" WHERE metadata->>'event_id' = $1`, head))

	code, body = post(base, with("key", "acct-404"))
	require.Equal(t, http.StatusNotFound, code, body)
	require.Contains(t, body, "not parked")
}

// With a read-only role (SELECT on the tables, docs/security.md) every page
// reads; an action answers that the role lacks a grant, and changes nothing.
func TestServeReadOnlyRole(t *testing.T) {
	t.Parallel()
	db := consoleDB(t, "plain")
	parkKey(t, db, "billing", "acct-1", "boom")
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	role := "t_console_ro_" + hex.EncodeToString(rnd[:])
	q := pgx.Identifier{role}.Sanitize()
	t.Cleanup(func() {
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, pgtest.URL())
		if err != nil {
			t.Errorf("cleanup connect: %v", err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP OWNED BY "+q+" CASCADE; DROP ROLE "+q); err != nil {
			t.Errorf("drop role %s: %v", role, err)
		}
	})
	schema := pgx.Identifier{db.Schema}.Sanitize()
	db.Exec(t, "CREATE ROLE "+q+" LOGIN; GRANT USAGE ON SCHEMA "+schema+" TO "+q+"; GRANT SELECT ON ALL TABLES IN SCHEMA "+schema+" TO "+q)
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	u.User = url.User(role)
	ro := &pgtest.DB{Schema: db.Schema, URL: u.String(), Pool: db.Pool}
	base := startServe(t, ro, []string{"IDEMCTL_TOKEN=" + testToken}, "--allow-actions")

	ov, code := getJSON[overviewAPI](t, base+"/api/overview")
	require.Equal(t, http.StatusOK, code)
	require.Empty(t, ov.Errors)
	require.Len(t, ov.Parked.Groups, 1)
	for _, path := range []string{"/parked", "/outbox/orders", "/groups/billing"} {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, path)
	}

	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := client.Get(base + "/parked")
	require.NoError(t, err)
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := csrfRe.FindStringSubmatch(string(page))
	require.NotNil(t, m)
	form := url.Values{"csrf": {m[1]}, "group": {"billing"}, "key": {"acct-1"}, "confirm": {"yes"}, "token": {testToken}}
	req, _ := http.NewRequest(http.MethodPost, base+"/actions/unblock", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", base)
	resp, err = client.Do(req)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusConflict, resp.StatusCode, string(body))
	require.Contains(t, string(body), "lacks a grant")
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM retry_parked_key`))
}

// With --brokers the overview shows the poison and retry topics' depth and
// the consumer groups' lag on each of their partitions.
func TestServeKafka(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	poisonTopic := broker.Topic(t, "orders-poison", 2)
	retryTopic := broker.Topic(t, "orders-retry", 1)
	other := broker.Topic(t, "orders", 1)
	cfg := sarama.NewConfig()
	cfg.Producer.Return.Successes = true
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	client, err := sarama.NewClient(broker.Addrs, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = client.Close() })
	prod, err := sarama.NewSyncProducerFromClient(client)
	require.NoError(t, err)
	for _, m := range []struct {
		topic     string
		partition int32
		n         int
	}{{poisonTopic, 0, 3}, {poisonTopic, 1, 2}, {retryTopic, 0, 4}, {other, 0, 1}} {
		for range m.n {
			_, _, err := prod.SendMessage(&sarama.ProducerMessage{Topic: m.topic, Partition: m.partition, Value: sarama.StringEncoder("x")})
			require.NoError(t, err)
		}
	}
	group := "billing-retry-" + strings.TrimPrefix(retryTopic, "orders-retry-")
	commitOffset(t, broker.Addrs, group, retryTopic, 1)

	db := consoleDB(t, "plain")
	base := startServe(t, db, nil, "--brokers", strings.Join(broker.Addrs, ","), "--kafka-topics", poisonTopic+","+retryTopic, "--kafka-groups", group)
	type kafkaAPI struct {
		Kafka struct {
			Topics []struct {
				Topic string `json:"topic"`
				Depth int64  `json:"depth"`
			} `json:"topics"`
			Lag []struct {
				Group     string `json:"group"`
				Topic     string `json:"topic"`
				Partition int32  `json:"partition"`
				Committed int64  `json:"committed"`
				Lag       int64  `json:"lag"`
			} `json:"lag"`
		} `json:"kafka"`
		Errors map[string]string `json:"errors"`
	}
	ov, code := getJSON[kafkaAPI](t, base+"/api/overview")
	require.Equal(t, http.StatusOK, code)
	require.Empty(t, ov.Errors)
	require.Len(t, ov.Kafka.Topics, 2)
	depth := map[string]int64{}
	for _, tp := range ov.Kafka.Topics {
		depth[tp.Topic] = tp.Depth
	}
	require.Equal(t, map[string]int64{poisonTopic: 5, retryTopic: 4}, depth)
	require.Len(t, ov.Kafka.Lag, 1)
	require.Equal(t, group, ov.Kafka.Lag[0].Group)
	require.Equal(t, retryTopic, ov.Kafka.Lag[0].Topic)
	require.EqualValues(t, 1, ov.Kafka.Lag[0].Committed)
	require.EqualValues(t, 3, ov.Kafka.Lag[0].Lag)

	// Without --kafka-topics: the topics named poison or retry.
	base = startServe(t, db, nil, "--brokers", strings.Join(broker.Addrs, ","), "--kafka-groups", group)
	ov, _ = getJSON[kafkaAPI](t, base+"/api/overview")
	require.Empty(t, ov.Errors)
	var names []string
	for _, tp := range ov.Kafka.Topics {
		names = append(names, tp.Topic)
	}
	require.Subset(t, names, []string{poisonTopic, retryTopic})
	require.NotContains(t, names, other)
	resp, err := http.Get(base + "/")
	require.NoError(t, err)
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Contains(t, string(page), `data-topic="`+poisonTopic+`"`)
}

// commitOffset joins group on topic (one partition) and commits offset.
func commitOffset(t *testing.T, brokers []string, group, topic string, offset int64) {
	t.Helper()
	cfg := sarama.NewConfig()
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	cfg.Consumer.Offsets.AutoCommit.Enable = false
	cfg.Consumer.Group.Session.Timeout = 6 * time.Second
	cg, err := sarama.NewConsumerGroup(brokers, group, cfg)
	require.NoError(t, err)
	defer cg.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a hang guard
	defer cancel()
	h := &committer{offset: offset, done: cancel}
	require.NoError(t, cg.Consume(ctx, []string{topic}, h))
	require.True(t, h.committed, "no session got the partition")
}

type committer struct {
	offset    int64
	done      func()
	committed bool
}

func (*committer) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (*committer) Cleanup(sarama.ConsumerGroupSession) error { return nil }
func (c *committer) ConsumeClaim(s sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	s.MarkOffset(claim.Topic(), claim.Partition(), c.offset, "")
	s.Commit()
	c.committed = true
	c.done()
	return nil
}

// Listening on loopback, the console answers only requests naming a
// loopback host: a site rebound to 127.0.0.1 (DNS rebinding) reads nothing.
func TestServeRefusesOtherHostsOnLoopback(t *testing.T) {
	t.Parallel()
	db := consoleDB(t, "plain")
	base := startServe(t, db, nil)
	for host, want := range map[string]int{"evil.example:80": http.StatusMisdirectedRequest, "localhost": http.StatusOK, strings.TrimPrefix(base, "http://"): http.StatusOK} {
		req, _ := http.NewRequest(http.MethodGet, base+"/api/overview", nil)
		req.Host = host
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, want, resp.StatusCode, host)
	}
}

// No page shows a secret: the database password (from DATABASE_URL or
// PGPASSWORD) and the token are masked wherever they would appear, here in
// a parked key that happens to hold one.
func TestServeShowsNoSecret(t *testing.T) {
	t.Parallel()
	db := consoleDB(t, "plain")
	const password = "pw-Secret-4711"
	parkKey(t, db, "billing", "acct-"+password, "connect postgres://u:"+password+"@db/x failed; "+testToken)
	u, err := url.Parse(db.URL)
	require.NoError(t, err)
	u.User = url.UserPassword(u.User.Username(), password) // trust authentication ignores it
	withPW := &pgtest.DB{Schema: db.Schema, URL: u.String(), Pool: db.Pool}
	base := startServe(t, withPW, []string{"IDEMCTL_TOKEN=" + testToken}, "--allow-actions")
	for _, path := range []string{"/", "/parked", "/api/overview", "/api/parked"} {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, path)
		require.NotContains(t, string(body), password, path)
		require.NotContains(t, string(body), testToken, path)
		if strings.Contains(path, "parked") {
			require.Contains(t, string(body), "acct-xxxxx", path)
		}
	}
}

// forget on a group's page: confirmed with the token, the group's claims
// and registration go; an unknown group is 404.
func TestServeForget(t *testing.T) {
	t.Parallel()
	db := consoleDB(t, "plain")
	claim(t, db, "notifications", true, publisher.NewEventID())
	base := startServe(t, db, []string{"IDEMCTL_TOKEN=" + testToken}, "--allow-actions")
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := client.Get(base + "/groups/notifications")
	require.NoError(t, err)
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Contains(t, string(page), `action="/actions/forget"`)
	m := csrfRe.FindStringSubmatch(string(page))
	require.NotNil(t, m)
	post := func(form url.Values) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, base+"/actions/forget", strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("Origin", base)
		resp, err := client.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, body := post(url.Values{"csrf": {m[1]}, "group": {"notifications"}})
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, "Delete every claim and the registration of consumer group")
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM processed_event WHERE consumer_group = 'notifications'`))

	code, body = post(url.Values{"csrf": {m[1]}, "group": {"notifications"}, "confirm": {"yes"}, "token": {testToken}})
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, "forgot notifications: 1 claims deleted")
	require.Zero(t, db.Count(t, `SELECT 1 FROM processed_event WHERE consumer_group = 'notifications'`))
	require.Zero(t, db.Count(t, `SELECT 1 FROM processed_event_group WHERE consumer_group = 'notifications'`))
	require.Equal(t, 3, db.Count(t, `SELECT 1 FROM processed_event WHERE consumer_group = 'billing'`))

	code, _ = post(url.Values{"csrf": {m[1]}, "group": {"notifications"}, "confirm": {"yes"}, "token": {testToken}})
	require.Equal(t, http.StatusNotFound, code)
}

// The leases page lists live and expired leases as `dedup leases --json`
// does, and its release action deletes one (token, confirm) so the
// owner's completion then writes nothing.
func TestServeLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db := consoleDB(t, "plain")
	p := leasesql.New(db.Schema, "processed_event", "billing")
	live := leasesql.Request{EventID: v7At(time.Now()), Token: uuid.New()}
	_, err := p.Take(ctx, db.Pool, []leasesql.Request{live}, time.Hour, "host-a:42")
	require.NoError(t, err)
	base := startServe(t, db, []string{"IDEMCTL_TOKEN=" + testToken}, "--allow-actions")

	ov, code := getJSON[struct {
		Leases leasesql.Summary `json:"leases"`
	}](t, base+"/api/overview")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, 1, ov.Leases.Live)
	require.Zero(t, ov.Leases.Expired)
	got, code := getJSON[leasesJSON](t, base+"/api/leases")
	require.Equal(t, http.StatusOK, code)
	require.Len(t, got.Leases, 1)
	require.Equal(t, live.EventID, got.Leases[0].EventID)
	require.Equal(t, "host-a:42", got.Leases[0].Owner)
	require.False(t, got.Leases[0].Expired)

	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar}
	resp, err := client.Get(base + "/leases")
	require.NoError(t, err)
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Contains(t, string(page), live.EventID.String())
	m := csrfRe.FindStringSubmatch(string(page))
	require.NotNil(t, m, string(page))
	form := url.Values{"csrf": {m[1]}, "event_id": {live.EventID.String()}, "group": {"billing"}, "confirm": {"yes"}, "token": {testToken}}
	req, _ := http.NewRequest(http.MethodPost, base+"/actions/release", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", base)
	resp, err = client.Do(req)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, string(body))
	require.Contains(t, string(body), "released the lease of "+live.EventID.String())
	require.Zero(t, db.Count(t, "SELECT 1 FROM processed_event_lease"))
	res := leasetest.Complete(t, db, p, live)
	require.Equal(t, []leasesql.Result{leasesql.Lost}, res, "the released owner's completion writes nothing")
}

// A group's page shows its position in PostgreSQL beside its committed
// Kafka offsets: after a failover left Kafka ahead, the page says by how
// much and names the rewind; without --brokers it shows PostgreSQL's
// position alone.
func TestServeGroupProgress(t *testing.T) {
	t.Parallel()
	broker := kafkatest.Start(t)
	topic := broker.Topic(t, "orders", 1)
	broker.ProduceKeyed(t, topic, "k", 20)
	client, err := sarama.NewClient(broker.Addrs, sarama.NewConfig())
	require.NoError(t, err)
	t.Cleanup(func() { _ = client.Close() })
	commitAt(t, client, "billing", topic, 0, 15)
	db := consoleDB(t, "plain")
	db.Exec(t, "INSERT INTO processed_event_progress (consumer_group, topic, kafka_partition, next_offset) VALUES ('billing', $1, 0, 9)", topic)

	type groupAPI struct {
		KafkaAhead int64 `json:"kafka_ahead"`
		Progress   []struct {
			Topic    string `json:"topic"`
			Postgres int64  `json:"postgres_offset"`
			Kafka    int64  `json:"kafka_offset"`
			Ahead    int64  `json:"kafka_ahead"`
		} `json:"progress"`
	}
	base := startServe(t, db, nil, "--brokers", strings.Join(broker.Addrs, ","))
	g, code := getJSON[groupAPI](t, base+"/api/groups/billing")
	require.Equal(t, http.StatusOK, code)
	require.EqualValues(t, 6, g.KafkaAhead)
	require.Len(t, g.Progress, 1)
	require.Equal(t, topic, g.Progress[0].Topic)
	require.EqualValues(t, 9, g.Progress[0].Postgres)
	require.EqualValues(t, 15, g.Progress[0].Kafka)
	resp, err := http.Get(base + "/groups/billing")
	require.NoError(t, err)
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Contains(t, string(page), `id="kafka-ahead"`)
	require.Contains(t, string(page), "idemctl groups progress billing --rewind --yes")

	// Kafka gone: the page still shows PostgreSQL's position, and says why
	// Kafka's side is missing.
	if broker.Fake != nil {
		broker.Fake.Close()
		type downAPI struct {
			ProgressError string `json:"progress_error"`
			Progress      []struct {
				Postgres int64 `json:"postgres_offset"`
				Kafka    int64 `json:"kafka_offset"`
			} `json:"progress"`
		}
		d, code := getJSON[downAPI](t, base+"/api/groups/billing")
		require.Equal(t, http.StatusOK, code)
		require.NotEmpty(t, d.ProgressError)
		require.Len(t, d.Progress, 1)
		require.EqualValues(t, 9, d.Progress[0].Postgres)
		require.EqualValues(t, -1, d.Progress[0].Kafka)
	}

	base = startServe(t, db, nil)
	g, _ = getJSON[groupAPI](t, base+"/api/groups/billing")
	require.Zero(t, g.KafkaAhead)
	require.Len(t, g.Progress, 1)
	require.EqualValues(t, 9, g.Progress[0].Postgres)
	require.EqualValues(t, -1, g.Progress[0].Kafka)
}
