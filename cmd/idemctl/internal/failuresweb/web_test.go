package failuresweb

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/internal/testkit/kafkatest"
	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/migrate"
)

// An action is refused, before anything is read or written, when the
// console is read-only, the origin or CSRF check fails, the token is wrong
// or the operator gives no name; without confirm=yes it only asks.
func TestActionRefusals(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 1)
	require.NoError(t, migrate.Up(context.Background(), db.Pool, failures.MigrationLines(db.Schema)...))
	broker := kafkatest.Start(t)
	e, err := failures.New(failures.Config{DB: db.Pool, Schema: db.Schema, Kafka: idemkafka.ClientConfig{Brokers: broker.Addrs}})
	require.NoError(t, err)
	mount := func(allow bool, check error) *http.ServeMux {
		mux := http.NewServeMux()
		require.NoError(t, Register(mux, Config{Explorer: e, DB: db.Pool, Schema: db.Schema, AllowActions: allow, Layout: testLayout,
			SessionFunc: func(http.ResponseWriter, *http.Request) string { return "csrf" },
			CheckFunc:   func(*http.Request) error { return check },
			TokenFunc:   func(typed string) bool { return typed == "right" },
			RedactFunc:  func(s string) string { return strings.ReplaceAll(s, "right", "[redacted]") },
			ErrorFunc:   func(err error) string { return err.Error() }}))
		return mux
	}
	post := func(mux *http.ServeMux, form url.Values) (int, string) {
		r := httptest.NewRequest(http.MethodPost, "/failures/actions/replay", strings.NewReader(form.Encode()))
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		w := httptest.NewRecorder()
		mux.ServeHTTP(w, r)
		return w.Code, w.Body.String()
	}
	loc := url.Values{"topic": {"payments.poison"}, "partition": {"0"}, "offset": {"3"}}
	with := func(kv ...string) url.Values {
		v := url.Values{}
		for k, vs := range loc {
			v[k] = vs
		}
		for i := 0; i+1 < len(kv); i += 2 {
			v.Set(kv[i], kv[i+1])
		}
		return v
	}

	code, body := post(mount(false, nil), with("confirm", "yes", "token", "right", "actor", "alice"))
	require.Equal(t, http.StatusForbidden, code)
	require.Contains(t, body, "read-only")

	code, body = post(mount(true, errors.New("request from another origin")), with("confirm", "yes", "token", "right", "actor", "alice"))
	require.Equal(t, http.StatusForbidden, code)
	require.Contains(t, body, "another origin")

	allowed := mount(true, nil)
	code, body = post(allowed, with())
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `id="question"`)
	require.Contains(t, body, "Replay record 0@3 of payments.poison")

	code, body = post(allowed, with("confirm", "yes", "token", "wrong", "actor", "alice"))
	require.Equal(t, http.StatusForbidden, code)
	require.Contains(t, body, "wrong token")

	code, body = post(allowed, with("confirm", "yes", "token", "right"))
	require.Equal(t, http.StatusForbidden, code)
	require.Contains(t, body, "your name")

	code, _ = post(allowed, url.Values{"topic": {"payments.poison"}, "confirm": {"yes"}, "token": {"right"}, "actor": {"alice"}})
	require.Equal(t, http.StatusForbidden, code, "missing partition")
	require.Zero(t, db.Count(t, `SELECT 1 FROM idem_audit`), "refused before any action: no audit row")
}

func TestParseFrom(t *testing.T) {
	t.Parallel()
	m, err := parseFrom("1:98,0:120")
	require.NoError(t, err)
	require.Equal(t, map[int32]int64{0: 120, 1: 98}, m)
	require.Equal(t, "0:120,1:98", formatFrom(m))
	for _, bad := range []string{"x", "0:", "-1:3", "0:-3", "0:1,"} {
		_, err := parseFrom(bad)
		require.ErrorIs(t, err, errBadRequest, bad)
	}
	require.Equal(t, "4bf92f3577b34da6a3ce929d0e0e0001", traceID("00-4bf92f3577b34da6a3ce929d0e0e0001-00f067aa0ba902b7-01"))
	require.Empty(t, traceID("garbage"))
}

// A record's payload, headers and reason come from the message: HTML in
// them shows as text on its page, and the page goes through the
// console's redaction.
func TestRecordPageEscapesAndRedacts(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t, 1)
	require.NoError(t, migrate.Up(context.Background(), db.Pool, failures.MigrationLines(db.Schema)...))
	broker := kafkatest.Start(t)
	kc := idemkafka.ClientConfig{Brokers: broker.Addrs}
	topic := broker.Topic(t, "payments.poison", 1)
	pc, err := idemkafka.WatermillPublisherConfig(kc)
	require.NoError(t, err)
	pub, err := kafka.NewPublisher(pc, watermill.NopLogger{})
	require.NoError(t, err)
	defer pub.Close()
	m := message.NewMessage(watermill.NewUUID(), []byte(`{"note":"<img src=x onerror=alert(1)>","card":"s3cret-pan"}`))
	m.Metadata.Set(wmiddleware.ReasonForPoisonedKey, `<script>alert(2)</script>`)
	m.Metadata.Set(wmiddleware.PoisonedTopicKey, "payments")
	m.Metadata.Set("x-<b>", `"><svg onload=alert(3)>`)
	require.NoError(t, pub.Publish(topic, m))

	e, err := failures.New(failures.Config{DB: db.Pool, Schema: db.Schema, Kafka: kc})
	require.NoError(t, err)
	mux := http.NewServeMux()
	require.NoError(t, Register(mux, Config{Explorer: e, DB: db.Pool, Schema: db.Schema, Layout: testLayout,
		TopicsFunc: func(context.Context) ([]string, error) { return []string{topic}, nil },
		RedactFunc: func(s string) string { return strings.ReplaceAll(s, "s3cret-pan", "[redacted]") },
		ErrorFunc:  func(err error) string { return err.Error() }}))
	w := httptest.NewRecorder()
	mux.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/failures/record?topic="+topic+"&partition=0&offset=0", nil))
	require.Equal(t, http.StatusOK, w.Code, w.Body.String())
	body := w.Body.String()
	for _, raw := range []string{"<img", "<script>alert", "<svg", "<b>", "s3cret-pan"} {
		require.NotContains(t, body, raw)
	}
	require.Contains(t, body, "&lt;img src=x onerror=alert(1)&gt;")
	require.Contains(t, body, "[redacted]")

	w = httptest.NewRecorder()
	mux.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/failures/record?topic="+topic+"&partition=0&offset=9", nil))
	require.Equal(t, http.StatusNotFound, w.Code)

	// The explorer's page lists it, as text too.
	w = httptest.NewRecorder()
	mux.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/failures?topic="+topic, nil))
	require.Equal(t, http.StatusOK, w.Code, w.Body.String())
	require.Contains(t, w.Body.String(), `data-partition="0" data-offset="0"`)
	require.Contains(t, w.Body.String(), "1 records in 1 partitions")
	require.NotContains(t, w.Body.String(), "<script>alert")
}

// testLayout stands for the console's layout: the blocks the pages fill.
const testLayout = `<main id="main">{{if .Error}}<p class="error" id="error">{{.Error}}</p>{{end}}{{block "content" .}}{{end}}</main>{{block "title" .}}{{end}}`
