package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/internal/dedupsql"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

//go:embed web
var webFS embed.FS

// tokenEnv is the environment variable holding the actions' token.
const tokenEnv = "IDEMCTL_TOKEN"

// csp is the pages' Content-Security-Policy: only the console's own
// script, styles and images, no inline script or style, no frame.
const csp = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; " +
	"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// sessionCookie holds the browser's session id; the forms' CSRF token is
// its HMAC under the server's key.
const sessionCookie = "idemctl_session"

// parkedPageLimit bounds the keys the parked page lists (the longest
// queues first).
const parkedPageLimit = 500

func serve(ctx context.Context, a *app, args []string) error {
	fs := a.flags()
	listen := fs.String("listen", "127.0.0.1:8080", "`address` to listen on (host:port; port 0 picks one); keep it on loopback or behind an authenticating proxy")
	allow := fs.Bool("allow-actions", false, "allow the actions (unblock or skip a parked key, forget a group); each needs the token and a confirmation. Default: read-only")
	token := fs.String("token", "", "the `token` an action needs (default $"+tokenEnv+"; prefer the variable: flags show in ps)")
	refresh := fs.Duration("refresh", 5*time.Second, "how often the pages refresh themselves (0: never)")
	forwarder := fs.String("forwarder", outbox.DefaultForwarderName, "the forwarder `name` whose position the outbox pages show")
	kafkaTopics := fs.String("kafka-topics", "", "with --brokers: the poison and retry `topics` whose depth and lag the overview shows (default: every topic whose name has poison or retry)")
	kafkaGroups := fs.String("kafka-groups", "", "with --brokers: the Kafka consumer `groups` whose lag on those topics it shows (default: every group with a committed offset on them)")
	parkedTable := a.parkedTableFlag(fs)
	fo := failuresFlags(fs)
	if _, err := a.parse(fs, args); err != nil {
		return err
	}
	pt, err := parkedTable()
	if err != nil {
		return err
	}
	if *token == "" {
		*token = a.getenv(tokenEnv)
	}
	if *allow && len(*token) < 16 {
		return usageError("--allow-actions needs a token of 16 characters or more: set %s (or --token)", tokenEnv)
	}
	if *refresh < 0 {
		return usageError("usage: --refresh must not be negative")
	}
	a.extraSecrets = append(a.extraSecrets, *token)
	tc := deduplicator.TableConfig{Schema: a.opts.schema, Table: a.opts.table}
	if err := tc.Validate(); err != nil {
		return usageError("--schema/--table: %v", err)
	}
	ocfg, err := a.outboxConfig(ctx, false)
	if err != nil {
		return err
	}
	pool, err := a.connect(ctx)
	if err != nil {
		return err
	}
	c := &console{pool: pool, table: tc, layout: a.opts.layout, outbox: ocfg, parked: pt, forwarder: *forwarder}
	closeKafka, err := a.consoleKafka(c, splitList(*kafkaTopics), splitList(*kafkaGroups), fo)
	if err != nil {
		return err
	}
	defer closeKafka()
	srv, err := newServer(c, *allow, *token, *refresh)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return usageError("--listen: %v", err)
	}
	srv.secrets = a.secrets
	if host, _, _ := net.SplitHostPort(ln.Addr().String()); net.ParseIP(host).IsLoopback() {
		srv.loopbackOnly = true
	}
	mode := "read-only (start with --allow-actions to allow actions)"
	if *allow {
		mode = "actions allowed, with the token"
	}
	fmt.Fprintf(a.stdout, "idemctl serve: listening on http://%s, %s\n", ln.Addr(), mode)
	_ = a.stdout.Flush()
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = hs.Shutdown(sctx)
	}()
	if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// server is the console's HTTP handler.
type server struct {
	c       *console
	allow   bool
	token   []byte
	refresh time.Duration
	key     []byte // HMAC key of the CSRF tokens, new at each start
	// loopbackOnly: listening on a loopback address, the console answers
	// only requests for a loopback host name, so that a page of another
	// site whose name was rebound to 127.0.0.1 (DNS rebinding) reads
	// nothing.
	loopbackOnly bool
	// secrets returns what no page may show (idemctl's: the database
	// password, PGPASSWORD, Kafka's, the token); nil: none.
	secrets func() []string
	tmpl    map[string]*template.Template
	mux     *http.ServeMux
}

func newServer(c *console, allow bool, token string, refresh time.Duration) (*server, error) {
	s := &server{c: c, allow: allow, token: []byte(token), refresh: refresh, key: make([]byte, 32), tmpl: map[string]*template.Template{}, mux: http.NewServeMux()}
	if _, err := rand.Read(s.key); err != nil {
		return nil, err
	}
	funcs := template.FuncMap{
		"ago":     func(sec float64) string { return humanDuration(time.Duration(sec * float64(time.Second))) },
		"bytes":   humanBytes,
		"time":    func(t jsonTime) string { return humanTime(time.Time(t)) },
		"when":    humanTime,
		"seconds": func(sec float64) string { return humanDuration(time.Duration(sec * float64(time.Second))) },
		"yesno":   func(b bool) string { return map[bool]string{true: "yes", false: "no"}[b] },
	}
	for _, page := range []string{"overview", "parked", "leases", "topic", "group", "confirm", "message"} {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(webFS, "web/layout.html", "web/"+page+".html")
		if err != nil {
			return nil, err
		}
		s.tmpl[page] = t
	}
	static, err := fs.Sub(webFS, "web/static")
	if err != nil {
		return nil, err
	}
	s.mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	s.mux.HandleFunc("GET /{$}", s.page("overview", func(r *http.Request) (any, error) { return s.c.overview(r.Context()), nil }))
	s.mux.HandleFunc("GET /api/overview", s.api(func(r *http.Request) (any, error) { return s.c.overview(r.Context()), nil }))
	parked := func(r *http.Request) (any, error) {
		return s.c.parkedKeys(r.Context(), r.URL.Query().Get("group"), parkedPageLimit)
	}
	s.mux.HandleFunc("GET /parked", s.page("parked", parked))
	s.mux.HandleFunc("GET /api/parked", s.api(parked))
	leases := func(r *http.Request) (any, error) { return s.c.leases(r.Context()) }
	s.mux.HandleFunc("GET /leases", s.page("leases", leases))
	s.mux.HandleFunc("GET /api/leases", s.api(leases))
	topic := func(r *http.Request) (any, error) { return s.c.topic(r.Context(), r.PathValue("topic")) }
	s.mux.HandleFunc("GET /outbox/{topic}", s.page("topic", topic))
	s.mux.HandleFunc("GET /api/outbox/{topic}", s.api(topic))
	group := func(r *http.Request) (any, error) { return s.c.group(r.Context(), r.PathValue("group")) }
	s.mux.HandleFunc("GET /groups/{group}", s.page("group", group))
	s.mux.HandleFunc("GET /api/groups/{group}", s.api(group))
	s.mux.HandleFunc("POST /actions/{action}", s.action)
	if err := s.registerFailures(); err != nil {
		return nil, err
	}
	return s, nil
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", csp)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	// same-origin, not no-referrer: under no-referrer browsers send
	// "Origin: null" with a form POST, which sameOrigin refuses.
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	if s.loopbackOnly && !loopbackHost(r.Host) {
		http.Error(w, "idemctl serve answers only requests for localhost, 127.0.0.1 or [::1] when it listens on loopback", http.StatusMisdirectedRequest)
		return
	}
	s.mux.ServeHTTP(w, r)
}

// view is what a page's template gets.
type view struct {
	Page           string
	Data           any
	Error          string
	AllowActions   bool
	CSRF           string
	RefreshSeconds int
	// Action, Fields and Question: the confirm page's.
	Action   string
	Fields   map[string]string
	Question string
	Message  string
}

func (s *server) page(name string, load func(*http.Request) (any, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		v := s.view(w, r, name)
		data, err := load(r)
		v.Data = data
		status := http.StatusOK
		if err != nil {
			status, v.Error = pageError(err)
			v.Data = nil
		}
		s.render(w, status, name, v)
	}
}

func (s *server) api(load func(*http.Request) (any, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		data, err := load(r)
		status := http.StatusOK
		if err != nil {
			var msg string
			status, msg = pageError(err)
			data = struct {
				Error string `json:"error"`
			}{msg}
		}
		var buf bytes.Buffer
		enc := json.NewEncoder(&buf)
		enc.SetIndent("", "  ")
		_ = enc.Encode(data)
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		w.WriteHeader(status)
		_, _ = io.WriteString(w, s.redact(buf.String()))
	}
}

func pageError(err error) (int, string) {
	if errors.Is(err, errNotFound) {
		return http.StatusNotFound, "not found"
	}
	return http.StatusInternalServerError, consoleError(err)
}

// view starts a page's view, giving the browser a session (and so a CSRF
// token) when it has none.
func (s *server) view(w http.ResponseWriter, r *http.Request, name string) *view {
	v := &view{Page: name, AllowActions: s.allow, RefreshSeconds: int(s.refresh / time.Second)}
	if !s.allow {
		return v
	}
	sid := ""
	if ck, err := r.Cookie(sessionCookie); err == nil && len(ck.Value) == 64 {
		sid = ck.Value
	} else {
		b := make([]byte, 32)
		_, _ = rand.Read(b)
		sid = hex.EncodeToString(b)
		http.SetCookie(w, &http.Cookie{Name: sessionCookie, Value: sid, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode})
	}
	v.CSRF = s.csrf(sid)
	return v
}

func (s *server) csrf(sid string) string {
	m := hmac.New(sha256.New, s.key)
	m.Write([]byte(sid))
	return hex.EncodeToString(m.Sum(nil))
}

func (s *server) render(w http.ResponseWriter, status int, name string, v *view) {
	var buf bytes.Buffer
	if err := s.tmpl[name].Execute(&buf, v); err != nil {
		buf.Reset()
		buf.WriteString("<p>template error</p>")
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, s.redact(buf.String()))
}

// redact masks the secrets and any password of a connection string in a
// page, as every line idemctl prints is.
func (s *server) redact(page string) string {
	var secrets []string
	if s.secrets != nil {
		secrets = s.secrets()
	}
	return redact(page, secrets)
}

// loopbackHost reports whether the Host header names the loopback
// interface.
func loopbackHost(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		host = hostport
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// refuse answers a refused action with 403 and why.
func (s *server) refuse(w http.ResponseWriter, r *http.Request, why string) {
	v := &view{Page: "message", AllowActions: s.allow, Error: "refused: " + why}
	s.render(w, http.StatusForbidden, "message", v)
}

// sameOrigin reports whether the request comes from a page of this
// console: Sec-Fetch-Site same-origin when the browser sends it, and an
// Origin naming this host. A request with neither is refused: browsers
// send Origin with every POST form.
func sameOrigin(r *http.Request) error {
	site := r.Header.Get("Sec-Fetch-Site")
	if site != "" && site != "same-origin" {
		return fmt.Errorf("request from another site (Sec-Fetch-Site %s)", site)
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		return errors.New("no Origin header: actions are only taken from the console's own pages")
	}
	u, err := url.Parse(origin)
	if err != nil || u.Host != r.Host || (u.Scheme != "http" && u.Scheme != "https") {
		return fmt.Errorf("request from another origin (%s)", origin)
	}
	return nil
}

// actions are the changes the console can make: what they ask before, and
// what they run.
var actions = map[string]struct {
	fields   []string
	question func(f map[string]string) string
	run      func(ctx context.Context, c *console, f map[string]string) (string, error)
}{
	"unblock": {
		fields: []string{"group", "key"},
		question: func(f map[string]string) string {
			return fmt.Sprintf("Send the first event of key %q (consumer group %q) to the retry path again? A copy still on its way then runs as a duplicate, which the claim absorbs.", f["key"], f["group"])
		},
		run: func(ctx context.Context, c *console, f map[string]string) (string, error) {
			return c.unblock(ctx, f["group"], f["key"], false)
		},
	},
	"skip": {
		fields: []string{"group", "key"},
		question: func(f map[string]string) string {
			return fmt.Sprintf("Remove the first event of key %q (consumer group %q) unapplied and hand the key to its next event? The removed event is neither applied nor poisoned: replay it.", f["key"], f["group"])
		},
		run: func(ctx context.Context, c *console, f map[string]string) (string, error) {
			return c.unblock(ctx, f["group"], f["key"], true)
		},
	},
	"release": {
		fields: []string{"event_id", "group"},
		question: func(f map[string]string) string {
			return fmt.Sprintf("Release the lease of event %q (consumer group %q)? Its next delivery then runs at once; an owner still calling writes nothing (its call stands, under the same Idempotency-Key).", f["event_id"], f["group"])
		},
		run: func(ctx context.Context, c *console, f map[string]string) (string, error) {
			return c.release(ctx, f["event_id"], f["group"])
		},
	},
	"forget": {
		fields: []string{"group"},
		question: func(f map[string]string) string {
			return fmt.Sprintf("Delete every claim and the registration of consumer group %q? A consumer started again under that name applies every event it reads again.", f["group"])
		},
		run: func(ctx context.Context, c *console, f map[string]string) (string, error) {
			tc, err := c.tableConfig(ctx)
			if err != nil {
				return "", err
			}
			if _, err := c.group(ctx, f["group"]); err != nil {
				return "", err
			}
			n, err := dedupsql.ForgetGroup(ctx, c.pool, tc.Schema, tc.Table, f["group"], deduplicator.ValidateGroupName)
			if err != nil {
				return "", err
			}
			return fmt.Sprintf("forgot %s: %d claims deleted, registration removed", f["group"], n), nil
		},
	},
}

// action takes a POSTed action: refused when read-only, from another
// origin or without the session's CSRF token; without confirm=yes it
// shows the confirm page; with it, it needs the token.
func (s *server) action(w http.ResponseWriter, r *http.Request) {
	if !s.allow {
		s.refuse(w, r, "the console is read-only (start idemctl serve with --allow-actions and a token)")
		return
	}
	if err := sameOrigin(r); err != nil {
		s.refuse(w, r, err.Error())
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
	if err := r.ParseForm(); err != nil {
		s.refuse(w, r, "unreadable form")
		return
	}
	ck, err := r.Cookie(sessionCookie)
	if err != nil || subtle.ConstantTimeCompare([]byte(r.PostForm.Get("csrf")), []byte(s.csrf(ck.Value))) != 1 {
		s.refuse(w, r, "missing or wrong CSRF token: reload the page and try again")
		return
	}
	name := r.PathValue("action")
	act, ok := actions[name]
	if !ok {
		http.NotFound(w, r)
		return
	}
	f := map[string]string{}
	for _, k := range act.fields {
		if f[k] = r.PostForm.Get(k); f[k] == "" {
			s.refuse(w, r, "missing "+k)
			return
		}
	}
	v := s.view(w, r, "confirm")
	v.RefreshSeconds = 0 // a form to fill, a result to read
	if r.PostForm.Get("confirm") != "yes" {
		v.Action, v.Fields, v.Question = name, f, act.question(f)
		s.render(w, http.StatusOK, "confirm", v)
		return
	}
	// Hashed first, so that the comparison takes the same time whatever
	// the length typed.
	typed, want := sha256.Sum256([]byte(r.PostForm.Get("token"))), sha256.Sum256(s.token)
	if subtle.ConstantTimeCompare(typed[:], want[:]) != 1 {
		s.refuse(w, r, "missing or wrong token")
		return
	}
	msg, err := act.run(r.Context(), s.c, f)
	v.Page = "message"
	status := http.StatusOK
	if err != nil {
		status = http.StatusConflict
		if errors.Is(err, errNotFound) || isBadInput(err) {
			status = http.StatusNotFound
		}
		v.Error = name + " failed: " + consoleError(err)
	} else {
		v.Message = msg
	}
	s.render(w, status, "message", v)
}

// unblock is the parked page's unblock and skip (idemctl retry unblock).
func (c *console) unblock(ctx context.Context, group, key string, skip bool) (string, error) {
	ob, err := outbox.New(c.outbox, nil)
	if err != nil {
		return "", err
	}
	res, err := retrytopic.Unblock(ctx, c.pool, ob, c.parked, group, key, &retrytopic.UnblockOpts{Skip: skip})
	if err != nil {
		return "", err
	}
	switch {
	case res.Resent:
		return fmt.Sprintf("event %s sent to %s again through the outbox (due now)", res.Head, res.Topic), nil
	case res.HandedOff != nil:
		return fmt.Sprintf("event %s removed (neither applied nor poisoned: replay it); the key is handed to event %s on %s", res.Head, *res.HandedOff, res.Topic), nil
	default:
		return fmt.Sprintf("event %s removed (neither applied nor poisoned: replay it); nothing else waits: the key is free", res.Head), nil
	}
}
