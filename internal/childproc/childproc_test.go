package childproc_test

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/childproc"
)

const env = "CHILDPROC_TEST_CHILD"

type config struct {
	Say  string `json:"say"`
	Fail bool   `json:"fail"`
}

func TestMain(m *testing.M) {
	childproc.RunIfSet(env, "test child", func(c config) error {
		if c.Fail {
			return errors.New("told to fail")
		}
		in, err := io.ReadAll(os.Stdin)
		if err != nil {
			return err
		}
		_, err = fmt.Printf("%s %s", c.Say, in)
		return err
	})
	os.Exit(m.Run())
}

// The test binary runs itself as a child: the config travels as JSON, the
// pipes carry the streams, and a failing child exits 1 with its error.
func TestStartRunsTheBinaryAsAChild(t *testing.T) {
	t.Parallel()
	p, err := childproc.Start("", env, config{Say: "hello"})
	require.NoError(t, err)
	_, err = io.WriteString(p.Stdin, "world")
	require.NoError(t, err)
	require.NoError(t, p.Stdin.Close())
	out, err := io.ReadAll(p.Stdout)
	require.NoError(t, err)
	_, _ = io.ReadAll(p.Stderr)
	require.NoError(t, p.Cmd.Wait())
	require.Equal(t, "hello world", string(out))

	p, err = childproc.Start("", env, config{Fail: true})
	require.NoError(t, err)
	_ = p.Stdin.Close()
	_, _ = io.ReadAll(p.Stdout)
	stderr, err := io.ReadAll(p.Stderr)
	require.NoError(t, err)
	var ee *exec.ExitError
	require.ErrorAs(t, p.Cmd.Wait(), &ee)
	require.Equal(t, 1, ee.ExitCode())
	require.Equal(t, "test child: told to fail\n", string(stderr))
}
