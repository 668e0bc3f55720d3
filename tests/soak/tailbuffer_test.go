package soak

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A consumer that crashes writes the panic's message first and thousands of
// goroutine frames after it: the report keeps the message and its frames,
// not only the tail.
func TestTailBufferKeepsACrashsHead(t *testing.T) {
	b := &tailBuffer{max: 3}
	b.add("router running")
	b.add("panic: runtime error: index out of range [3] with length 3")
	for i := range 100 {
		b.add(fmt.Sprintf("frame %d", i))
	}
	got := b.String()
	require.True(t, strings.HasPrefix(got, "crash: panic: runtime error: index out of range [3] with length 3 | frame 0 |"), got)
	require.Contains(t, got, "frame 14 ||", "the head's frames")
	require.NotContains(t, got, "frame 15 ")
	require.True(t, strings.HasSuffix(got, "last lines: frame 97 | frame 98 | frame 99"), got)
}
