package console

import (
	"bytes"
	"html/template"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"
)

// A template that fails answers 500 with none of what it wrote before
// failing, and the error is logged for the operator; the pages'
// headers (CSP and the rest) are kept.
func TestRenderFailureIsLoggedAnd500(t *testing.T) {
	t.Parallel()
	var logged bytes.Buffer
	s, err := New(Config{Logger: slog.New(slog.NewTextHandler(&logged, nil))})
	require.NoError(t, err)
	s.tmpl["message"] = template.Must(template.New("layout.html").Parse(`<p>partial output</p>{{.Nope}}`))

	rec := httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/actions/forget", nil)) // read-only: the refusal renders "message"
	require.Equal(t, http.StatusInternalServerError, rec.Code)
	require.NotContains(t, rec.Body.String(), "partial output")
	require.Contains(t, rec.Body.String(), "could not be rendered")
	require.Equal(t, csp, rec.Header().Get("Content-Security-Policy"))
	require.Contains(t, logged.String(), "page could not be rendered")
	require.Contains(t, logged.String(), "page=message")
	require.Contains(t, logged.String(), "can't evaluate field Nope")

	// The same page, rendered: 403 and the refusal.
	s.tmpl["message"] = template.Must(template.New("layout.html").Parse(`<p id="error">{{.Error}}</p>`))
	rec = httptest.NewRecorder()
	s.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/actions/forget", nil))
	require.Equal(t, http.StatusForbidden, rec.Code)
	require.Contains(t, rec.Body.String(), "refused: the console is read-only")
}
