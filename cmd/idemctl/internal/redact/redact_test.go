package redact

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRedact(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"cannot parse `postgres://u:pw12345@h:x/db`":    "cannot parse `postgres://u:xxxxx@h:x/db`",
		"host=h password=pw12345 user=u":                "host=h password=xxxxx user=u",
		"host=h password='pw 12345' user=u":             "host=h password=xxxxx user=u",
		"postgres://h/db?user=u&password=pw12345&x=1":   "postgres://h/db?user=u&password=xxxxx&x=1",
		"no secret here: postgres://u@h/db":             "no secret here: postgres://u@h/db",
		"the raw one pw12345 and decoded p@ss/word":     "the raw one xxxxx and decoded xxxxx",
		"kafka://user:kpass@broker:9092":                "kafka://user:xxxxx@broker:9092",
		"PASSWORD = hunter22 in a message":              "PASSWORD = xxxxx in a message",
		"a password= followed by a word masks the word": "a password= xxxxx by a word masks the word",
	} {
		require.Equal(t, want, String(in, []string{"pw12345", "p@ss/word"}), in)
	}

	require.Subset(t, URLSecrets("postgres://u:p%40ss@h/db"), []string{"p%40ss", "p@ss"})
	require.Contains(t, URLSecrets("host=h password=abc123"), "abc123")

	// Lines are redacted whole, even when a secret straddles two writes.
	var out bytes.Buffer
	r := NewWriter(&out, func() []string { return []string{"s3cr3t"} })
	_, _ = r.Write([]byte("error: s3c"))
	_, _ = r.Write([]byte("r3t here\nand s3cr3t"))
	require.NoError(t, r.Flush())
	require.Equal(t, "error: xxxxx here\nand xxxxx", out.String())
}
