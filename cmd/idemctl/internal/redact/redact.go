// Package redact masks secrets in what idemctl prints and its console
// serves: the passwords it was given (database, Kafka, the console's token)
// wherever they appear, and any password written in a connection URL or a
// key=value string, whatever it is.
package redact

import (
	"bytes"
	"io"
	"net/url"
	"regexp"
	"strings"
	"sync"
)

// NewWriter returns a Writer to w masking secrets() (read at each line).
func NewWriter(w io.Writer, secrets func() []string) *Writer {
	return &Writer{w: w, secrets: secrets}
}

var (
	dsnPasswordRe = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]+)`)
	urlUserinfoRe = regexp.MustCompile(`(://[^:/?#@\s]*:)[^@/\s]*@`)
)

// URLSecrets returns the password of a connection URL or key=value string,
// raw and decoded.
func URLSecrets(s string) []string {
	var out []string
	if u, err := url.Parse(s); err == nil && u.User != nil {
		if p, ok := u.User.Password(); ok && p != "" {
			out = append(out, p)
		}
	}
	if m := urlUserinfoRe.FindStringSubmatch(s); m != nil {
		raw := strings.TrimSuffix(strings.TrimPrefix(m[0], m[1]), "@")
		if raw != "" {
			out = append(out, raw)
			if dec, err := url.PathUnescape(raw); err == nil && dec != raw {
				out = append(out, dec)
			}
		}
	}
	for _, m := range dsnPasswordRe.FindAllStringSubmatch(s, -1) {
		if p := strings.Trim(m[2], "'"); p != "" {
			out = append(out, p, m[2])
		}
	}
	return out
}

// Writer writes complete lines to w with every secret replaced by
// "xxxxx", and passwords in URLs and key=value strings masked whatever they
// are.
type Writer struct {
	mu      sync.Mutex
	w       io.Writer
	buf     []byte
	secrets func() []string
}

func (r *Writer) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.buf = append(r.buf, p...)
	if i := bytes.LastIndexByte(r.buf, '\n'); i >= 0 {
		if err := r.emit(r.buf[:i+1]); err != nil {
			return 0, err
		}
		r.buf = append(r.buf[:0], r.buf[i+1:]...)
	}
	return len(p), nil
}

// Flush writes what is left without a final newline.
func (r *Writer) Flush() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.buf) == 0 {
		return nil
	}
	err := r.emit(r.buf)
	r.buf = r.buf[:0]
	return err
}

func (r *Writer) emit(b []byte) error {
	_, err := io.WriteString(r.w, String(string(b), r.secrets()))
	return err
}

// mask replaces a secret.
const mask = "xxxxx"

// String masks the secrets in s, and any password of a connection URL or
// key=value string whatever it is.
func String(s string, secrets []string) string {
	s = urlUserinfoRe.ReplaceAllString(s, "${1}"+mask+"@")
	s = dsnPasswordRe.ReplaceAllString(s, "${1}"+mask)
	for _, sec := range secrets {
		if len(sec) >= 3 { // shorter ones would mask ordinary output; the patterns above still mask them in URLs
			s = strings.ReplaceAll(s, sec, mask)
		}
	}
	return s
}
