package console

import (
	"bytes"
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
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/failures"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/ops"
	"github.com/idemkit/watermill-idempotency/cmd/idemctl/internal/redact"
	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

//go:embed web
var webFS embed.FS

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

// Config is what the console shows and how it serves it.
type Config struct {
	// Pool reads (and, for the actions, writes) the tables below.
	Pool *pgxpool.Pool
	// Table is the dedup table; its layout is read at each page unless
	// Layout is plain or partitioned.
	Table  deduplicator.TableConfig
	Layout string
	// Outbox: Topics, else the topics recorded, read at each page.
	Outbox outbox.Config
	// Parked is retrytopic.KeyOrder's parked-keys table.
	Parked retrytopic.ParkedKeysTable
	// Forwarder names the forwarder whose position the outbox pages show.
	Forwarder string
	// Kafka, when set, adds the poison and retry topics' depth and lag to
	// the overview.
	Kafka *ops.KafkaView
	// Explorer, when set, reads and acts on the poison topics (the
	// failures explorer); PoisonTopics names them (none: every topic of
	// Kafka whose name has "poison").
	Explorer     *failures.Explorer
	PoisonTopics []string
	// AllowActions allows the actions (unblock or skip a parked key,
	// release a lease, forget a group), each with Token and a
	// confirmation; the console is read-only otherwise.
	AllowActions bool
	Token        string
	// Refresh is how often the pages refresh themselves (0: never).
	Refresh time.Duration
	// LoopbackOnly answers only requests for a loopback host name, so that
	// a page of another site whose name was rebound to 127.0.0.1 (DNS
	// rebinding) reads nothing. Set it when listening on loopback.
	LoopbackOnly bool
	// Secrets returns what no page may show (idemctl's: the database
	// password, PGPASSWORD, Kafka's, the token); nil: none.
	Secrets func() []string
	// Logger gets what the console cannot answer with, such as a page
	// whose template failed; nil: discarded.
	Logger *slog.Logger
}

// Server is the console's HTTP handler.
type Server struct {
	c     *ops.Reader
	cfg   Config
	token []byte
	key   []byte // HMAC key of the CSRF tokens, new at each start
	log   *slog.Logger
	tmpl  map[string]*template.Template
	mux   *http.ServeMux
}

// New returns the console over cfg.
func New(cfg Config) (*Server, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Server{
		c:   &ops.Reader{Pool: cfg.Pool, Table: cfg.Table, Layout: cfg.Layout, Outbox: cfg.Outbox, Parked: cfg.Parked, Forwarder: cfg.Forwarder, Kafka: cfg.Kafka},
		cfg: cfg, token: []byte(cfg.Token), key: make([]byte, 32), log: cfg.Logger, tmpl: map[string]*template.Template{}, mux: http.NewServeMux(),
	}
	if _, err := rand.Read(s.key); err != nil {
		return nil, err
	}
	if err := s.parseTemplates(); err != nil {
		return nil, err
	}
	s.routes()
	if err := s.registerFailures(); err != nil {
		return nil, err
	}
	return s, nil
}

// parseTemplates parses each page with the layout.
func (s *Server) parseTemplates() error {
	ago := func(sec float64) string { return ops.HumanDuration(time.Duration(sec * float64(time.Second))) }
	funcs := template.FuncMap{
		"ago":     ago,
		"bytes":   ops.HumanBytes,
		"time":    func(t ops.Time) string { return ops.HumanTime(time.Time(t)) },
		"when":    ops.HumanTime,
		"seconds": ago,
		"yesno":   func(b bool) string { return map[bool]string{true: "yes", false: "no"}[b] },
		// svg marks a chart of internal/svgchart, which escapes its text,
		// as markup.
		"svg": func(svg string) template.HTML { return template.HTML(svg) }, //nolint:gosec // svgchart escapes
	}
	for _, page := range []string{"overview", "parked", "leases", "topic", "group", "confirm", "message"} {
		t, err := template.New("layout.html").Funcs(funcs).ParseFS(webFS, "web/layout.html", "web/"+page+".html")
		if err != nil {
			return err
		}
		s.tmpl[page] = t
	}
	return nil
}

// routes registers the pages, their JSON twins, the assets and the
// actions.
func (s *Server) routes() {
	static, _ := fs.Sub(webFS, "web/static") // a directory of the embedded tree: cannot fail
	s.mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	overview := func(r *http.Request) (any, error) { return s.c.Overview(r.Context()), nil }
	s.mux.HandleFunc("GET /{$}", s.page("overview", s.overviewPage))
	s.mux.HandleFunc("GET /api/overview", s.api(overview))
	parked := func(r *http.Request) (any, error) {
		sum, keys, err := ops.ReadParked(r.Context(), s.c.Pool, s.c.Parked, r.URL.Query().Get("group"), parkedPageLimit)
		return ops.ToParked(sum, keys), err
	}
	s.mux.HandleFunc("GET /parked", s.page("parked", parked))
	s.mux.HandleFunc("GET /api/parked", s.api(parked))
	leases := func(r *http.Request) (any, error) { return s.c.Leases(r.Context()) }
	s.mux.HandleFunc("GET /leases", s.page("leases", leases))
	s.mux.HandleFunc("GET /api/leases", s.api(leases))
	topic := func(r *http.Request) (any, error) { return s.c.Topic(r.Context(), r.PathValue("topic")) }
	s.mux.HandleFunc("GET /outbox/{topic}", s.page("topic", topic))
	s.mux.HandleFunc("GET /api/outbox/{topic}", s.api(topic))
	group := func(r *http.Request) (any, error) { return s.c.Group(r.Context(), r.PathValue("group")) }
	s.mux.HandleFunc("GET /groups/{group}", s.page("group", group))
	s.mux.HandleFunc("GET /api/groups/{group}", s.api(group))
	s.mux.HandleFunc("POST /actions/{action}", s.action)
}

func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", csp)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("X-Frame-Options", "DENY")
	// same-origin, not no-referrer: under no-referrer browsers send
	// "Origin: null" with a form POST, which sameOrigin refuses.
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	if s.cfg.LoopbackOnly && !loopbackHost(r.Host) {
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

func (s *Server) page(name string, load func(*http.Request) (any, error)) http.HandlerFunc {
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

func (s *Server) api(load func(*http.Request) (any, error)) http.HandlerFunc {
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
	if errors.Is(err, ops.ErrNotFound) {
		return http.StatusNotFound, "not found"
	}
	return http.StatusInternalServerError, ops.Describe(err)
}

// view starts a page's view, giving the browser a session (and so a CSRF
// token) when it has none.
func (s *Server) view(w http.ResponseWriter, r *http.Request, name string) *view {
	v := &view{Page: name, AllowActions: s.cfg.AllowActions, RefreshSeconds: int(s.cfg.Refresh / time.Second)}
	if !s.cfg.AllowActions {
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

func (s *Server) csrf(sid string) string {
	m := hmac.New(sha256.New, s.key)
	m.Write([]byte(sid))
	return hex.EncodeToString(m.Sum(nil))
}

// render writes page name of v with status. A template that fails is
// logged and answered with a 500 and a page that says so, never with what
// it wrote before failing.
func (s *Server) render(w http.ResponseWriter, status int, name string, v *view) {
	var buf bytes.Buffer
	if err := s.tmpl[name].Execute(&buf, v); err != nil {
		s.log.Error("idemctl serve: page could not be rendered", "page", name, "error", s.redact(err.Error()))
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, "internal error: the page "+name+" could not be rendered (idemctl serve logged why)\n")
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, s.redact(buf.String()))
}

// redact masks the secrets and any password of a connection string in a
// page, as every line idemctl prints is.
func (s *Server) redact(page string) string {
	var secrets []string
	if s.cfg.Secrets != nil {
		secrets = s.cfg.Secrets()
	}
	return redact.String(page, secrets)
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
func (s *Server) refuse(w http.ResponseWriter, r *http.Request, why string) {
	v := &view{Page: "message", AllowActions: s.cfg.AllowActions, Error: "refused: " + why}
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

// action takes a POSTed action: refused when read-only, from another
// origin or without the session's CSRF token; without confirm=yes it
// shows the confirm page; with it, it needs the token.
func (s *Server) action(w http.ResponseWriter, r *http.Request) {
	if !s.cfg.AllowActions {
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
		if errors.Is(err, ops.ErrNotFound) || ops.IsBadInput(err) {
			status = http.StatusNotFound
		}
		v.Error = name + " failed: " + ops.Describe(err)
	} else {
		v.Message = msg
	}
	s.render(w, status, "message", v)
}
