package browser_test

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"image/png"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/testkit/pgtest"
	"github.com/idemkit/watermill-idempotency/outbox"
	"github.com/idemkit/watermill-idempotency/tests/ctltest"
)

var updateScreenshots = flag.Bool("update-screenshots", false, "write the console's screenshots to docs/ (make screenshots)")

// chromiumHint is the one line a run without a browser prints.
const chromiumHint = "browser tests skipped: no chromium found (apt-get install -y chromium, or set CHROME_PATH)"

// chromePath finds the browser: $CHROME_PATH, else chromium on PATH.
func chromePath() string {
	if p := os.Getenv("CHROME_PATH"); p != "" {
		return p
	}
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome", "headless-shell"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	return ""
}

// browser starts a headless chromium for the test and counts the
// JavaScript dialogs (alert, confirm, prompt) any page opens, dismissing
// them: a page of the console opens none.
func browser(t *testing.T) (context.Context, *atomic.Int64) {
	t.Helper()
	path := chromePath()
	if path == "" {
		t.Skip(chromiumHint)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path), chromedp.NoSandbox,
		chromedp.Flag("disable-gpu", true), chromedp.WindowSize(1280, 1000))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() { cancel(); cancelAlloc() })
	var dialogs atomic.Int64
	events := chromedp.Events(ctx, page.JavascriptDialogOpening)
	go func() {
		for _, err := range events {
			if err != nil {
				return
			}
			dialogs.Add(1)
			_, _ = chromedp.Call(ctx, page.HandleJavaScriptDialog, page.HandleJavaScriptDialogParams{Accept: false})
		}
	}()
	return ctx, &dialogs
}

// do runs steps with a hang guard (not a threshold).
func do(t *testing.T, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	c, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	require.NoError(t, chromedp.Do(c, steps...))
}

func eval[T any](t *testing.T, ctx context.Context, js string) T {
	t.Helper()
	c, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	v, err := chromedp.Run(c, chromedp.Evaluate[T](js))
	require.NoError(t, err)
	return v
}

// waitJS waits until the expression is true (a minute at most: a hang
// guard, not a threshold).
func waitJS(t *testing.T, ctx context.Context, js string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !eval[bool](t, ctx, js) {
		require.True(t, time.Now().Before(deadline), "never true: %s", js)
		time.Sleep(100 * time.Millisecond)
	}
}

// click clicks the element in the page itself, in one step: the page's
// refresh may replace the nodes between a query and a click.
func click(sel string) chromedp.Action[chromedp.Void] {
	return chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
		found, err := chromedp.Evaluate[bool](`(function(){ const e = document.querySelector(`+strconv.Quote(sel)+`); if (!e) { return false; } e.click(); return true; })()`)(ctx, t)
		if err == nil && !found {
			err = fmt.Errorf("click: no element %s", sel)
		}
		return err
	})
}

func text(t *testing.T, ctx context.Context, sel string) string {
	t.Helper()
	return strings.TrimSpace(eval[string](t, ctx, `document.querySelector(`+strconv.Quote(sel)+`).textContent`))
}

// publishOutbox writes n rows to the outbox topic.
func publishOutbox(t *testing.T, db *pgtest.DB, topic string, n int) {
	t.Helper()
	ob, err := outbox.New(outbox.Config{Schema: db.Schema, Topics: []string{topic}}, nil)
	require.NoError(t, err)
	for i := 0; i < n; i++ {
		require.NoError(t, ob.PoolPublisher(db.Pool).Publish(topic, message.NewMessage(fmt.Sprint(i), []byte(`{}`))))
	}
}

// The overview in a browser shows what the database holds; a test run
// with -update-screenshots writes it to docs/console-overview.png.
func TestBrowserOverviewMatchesTheDatabase(t *testing.T) {
	t.Parallel()
	ctx, dialogs := browser(t)
	db := bin.ConsoleDB(t, "partitioned")
	bin.OK(t, db, "partitions", "maintain", "--ahead", "2")
	ctltest.Claim(t, db, "notifications", true, ctltest.V7At(time.Now().Add(-time.Hour)))
	db.Exec(t, `ANALYZE processed_event`)
	publishOutbox(t, db, "orders", 7)
	ctltest.ParkKey(t, db, "billing", "acct-1", "payment provider: 503")
	ctltest.ParkKey(t, db, "billing", "acct-2", "payment provider: timeout")
	base := bin.StartServe(t, db, []string{"IDEMCTL_TOKEN=" + ctltest.Token}, "--allow-actions")

	do(t, ctx, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.ID("dedup-rows")))
	require.Equal(t, strconv.Itoa(db.Count(t, `SELECT 1 FROM processed_event`)), text(t, ctx, "#dedup-rows"))
	require.Equal(t, "partitioned", text(t, ctx, "#dedup-layout"))
	require.Equal(t, strconv.Itoa(db.Count(t, `SELECT 1 FROM pg_inherits WHERE inhparent = 'processed_event'::regclass`)), text(t, ctx, "#dedup-partitions"))
	require.Contains(t, text(t, ctx, "#dedup-next-drop"), "processed_event_p")
	require.Equal(t, "7", text(t, ctx, `tr[data-topic="orders"] .pending`))
	require.Equal(t, "0", text(t, ctx, `tr[data-topic="orders.retry"] .pending`))
	require.Equal(t, "2", text(t, ctx, `tr[data-group="billing"].parked-group .keys`))
	require.Equal(t, 2, eval[int](t, ctx, `document.querySelectorAll("tr.group").length`))

	// The page refreshes itself: a new row shows without a reload.
	publishOutbox(t, db, "orders", 1)
	waitJS(t, ctx, `document.querySelector('tr[data-topic="orders"] .pending').textContent === "8"`)
	require.Empty(t, eval[string](t, ctx, `document.body.getAttribute("data-refresh-failed") || ""`))

	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	_, err = png.Decode(bytes.NewReader(shot))
	require.NoError(t, err, "the screenshot is a PNG")
	if *updateScreenshots {
		require.NoError(t, os.WriteFile("../../docs/console-overview.png", shot, 0o644))
	}

	// The topic and group pages, reached by their links.
	do(t, ctx, click(`tr[data-topic="orders"] a`), chromedp.WaitVisible(chromedp.ID("topic-pending")))
	require.Equal(t, "8", text(t, ctx, "#topic-pending"))
	require.Equal(t, "none yet", text(t, ctx, "#position"))
	require.Equal(t, 16, eval[int](t, ctx, `document.querySelectorAll("table.rows tbody tr").length`)) // 8 unpublished, 8 recent
	do(t, ctx, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.ID("groups")),
		click(`tr.group[data-group="billing"] a`), chromedp.WaitVisible(chromedp.ID("stale-horizon")))
	require.Equal(t, "billing", text(t, ctx, "#group"))
	require.Equal(t, "none while young", text(t, ctx, "#stale-horizon"))

	do(t, ctx, chromedp.Navigate(base+"/parked"), chromedp.WaitVisible(chromedp.ID("parked-keys")))
	shot, err = chromedp.Run(ctx, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	if *updateScreenshots {
		require.NoError(t, os.WriteFile("../../docs/console-parked.png", shot, 0o644))
	}
	require.Zero(t, dialogs.Load())
}

// Keys and reasons come from the messages: a key that is HTML shows as
// text, and runs nothing, on the first render and after a refresh.
func TestBrowserKeyIsText(t *testing.T) {
	t.Parallel()
	ctx, dialogs := browser(t)
	db := bin.ConsoleDB(t, "plain")
	const key = `<img src=x onerror=alert(1)>`
	const reason = `<script>alert(2)</script>"'><svg onload=alert(3)>`
	ctltest.ParkKey(t, db, "billing", key, reason)
	base := bin.StartServe(t, db, []string{"IDEMCTL_TOKEN=" + ctltest.Token}, "--allow-actions")

	do(t, ctx, chromedp.Navigate(base+"/parked"), chromedp.WaitVisible(chromedp.CSS("tr.parked-key")))
	check := func() {
		t.Helper()
		require.Equal(t, []string{key}, eval[[]string](t, ctx, `Array.from(document.querySelectorAll("#parked-keys td.key")).map(e => e.textContent)`))
		require.Equal(t, []string{reason}, eval[[]string](t, ctx, `Array.from(document.querySelectorAll("#parked-keys td.reason")).map(e => e.textContent)`))
		require.Equal(t, key, eval[string](t, ctx, `document.querySelector("tr.parked-key").dataset.key`))
		require.Zero(t, eval[int](t, ctx, `document.querySelectorAll("main img, main script, main svg").length`))
		require.Zero(t, dialogs.Load(), "a page opened a dialog: script ran")
	}
	check()
	waitJS(t, ctx, `document.body.hasAttribute("data-refreshed")`)
	check()

	// The confirm page quotes it as text too.
	do(t, ctx, click("button.skip"), chromedp.WaitVisible(chromedp.ID("question")))
	require.Contains(t, text(t, ctx, "#question"), key)
	require.Zero(t, eval[int](t, ctx, `document.querySelectorAll("main img").length`))
	require.Zero(t, dialogs.Load())
}

// Unblock and skip from the parked page: the confirm step, the token,
// and the key leaving the list; without the token, or from a page of
// another origin, nothing changes.
func TestBrowserUnblockAndRefusals(t *testing.T) {
	t.Parallel()
	ctx, dialogs := browser(t)
	db := bin.ConsoleDB(t, "plain")
	resent := ctltest.ParkKey(t, db, "billing", "acct-1", "boom")
	ctltest.ParkKey(t, db, "billing", "acct-2", "boom")
	base := bin.StartServe(t, db, []string{"IDEMCTL_TOKEN=" + ctltest.Token}, "--allow-actions")
	row := func(key string) string { return `tr.parked-key[data-key="` + key + `"]` }
	keys := func() int { return db.Count(t, `SELECT 1 FROM retry_parked_key`) }

	// Without the token: refused.
	do(t, ctx, chromedp.Navigate(base+"/parked"), chromedp.WaitVisible(chromedp.CSS(row("acct-2"))),
		click(row("acct-2")+" button.skip"), chromedp.WaitVisible(chromedp.ID("confirm")),
		click("#confirm"), chromedp.WaitVisible(chromedp.ID("error")))
	require.Contains(t, text(t, ctx, "#error"), "refused: missing or wrong token")
	require.Equal(t, 2, keys())

	// From a page of another origin (another port): refused, although the
	// browser sends the session cookie along.
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/go.js" {
			w.Header().Set("Content-Type", "text/javascript")
			fmt.Fprint(w, `document.forms[0].submit();`)
			return
		}
		w.Header().Set("Content-Type", "text/html")
		fmt.Fprintf(w, `<form method="post" action="%s/actions/skip"><input name="group" value="billing"><input name="key" value="acct-2"><input name="confirm" value="yes"><input name="token" value="%s"></form><script src="/go.js"></script>`, base, ctltest.Token)
	}))
	defer evil.Close()
	do(t, ctx, chromedp.Navigate(evil.URL), chromedp.WaitVisible(chromedp.ID("error")))
	require.Contains(t, text(t, ctx, "#error"), "refused")
	require.Equal(t, 2, keys())

	// Unblock acct-1: its first event goes to the retry path again.
	do(t, ctx, chromedp.Navigate(base+"/parked"), chromedp.WaitVisible(chromedp.CSS(row("acct-1"))),
		click(row("acct-1")+" button.unblock"), chromedp.WaitVisible(chromedp.ID("token")),
		chromedp.SendKeys(chromedp.ID("token"), ctltest.Token), click("#confirm"), chromedp.WaitVisible(chromedp.ID("message")))
	require.Contains(t, text(t, ctx, "#message"), "event "+resent+" sent to orders.retry again")
	require.Equal(t, 1, db.Count(t, `SELECT 1 FROM "outbox_orders.retry" WHERE metadata->>'event_id' = $1`, resent))

	// The list follows the table by itself: the copy is applied (the
	// consumer releases the key) and acct-1 leaves the open page.
	do(t, ctx, chromedp.Navigate(base+"/parked"), chromedp.WaitVisible(chromedp.CSS(row("acct-1"))))
	db.Exec(t, `DELETE FROM retry_parked_key WHERE partition_key = 'acct-1'`)
	do(t, ctx, chromedp.WaitNotPresent(chromedp.CSS(row("acct-1"))))

	// Skip acct-2: its only event is removed, the key leaves the list.
	do(t, ctx, click(row("acct-2")+" button.skip"), chromedp.WaitVisible(chromedp.ID("token")),
		chromedp.SendKeys(chromedp.ID("token"), ctltest.Token), click("#confirm"), chromedp.WaitVisible(chromedp.ID("message")))
	require.Contains(t, text(t, ctx, "#message"), "the key is free")
	do(t, ctx, chromedp.Navigate(base+"/parked"), chromedp.WaitVisible(chromedp.ID("no-parked")))
	require.Zero(t, keys())
	require.Zero(t, dialogs.Load())
}
