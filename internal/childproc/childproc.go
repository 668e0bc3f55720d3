// Package childproc runs the running binary again as a child process that
// one environment variable configures with JSON: how the billing demo and
// the soak get consumers they can stop and kill for real (SIGSTOP, SIGKILL),
// where an in-process "kill" would leave the consumer group cleanly.
//
// The parent calls [Start]; the binary's main (or TestMain) calls
// [RunIfSet] first, which returns at once in the parent.
package childproc

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
)

// RunIfSet returns at once unless env is set; then it decodes the
// variable's JSON into a C, runs run with it and exits the process: 2 when
// the JSON does not decode, 1 when run fails, 0 when it returns nil. A
// failure is printed on standard error after what (such as "soak consumer").
func RunIfSet[C any](env, what string, run func(C) error) {
	v, ok := os.LookupEnv(env)
	if !ok {
		return
	}
	var cfg C
	if err := json.Unmarshal([]byte(v), &cfg); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %s: %v\n", what, env, err)
		os.Exit(2)
	}
	if err := run(cfg); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", what, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// Process is a started child and its standard streams. Read Stdout and
// Stderr to their end before Cmd.Wait, which closes them.
type Process struct {
	Cmd    *exec.Cmd
	Stdin  io.WriteCloser
	Stdout io.ReadCloser
	Stderr io.ReadCloser
}

// Start starts exe (the running binary when exe is "") with env set to
// cfg's JSON on top of this process's environment, its three standard
// streams piped.
func Start(exe, env string, cfg any) (*Process, error) {
	if exe == "" {
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, fmt.Errorf("child process: %w", err)
		}
	}
	raw, err := json.Marshal(cfg)
	if err != nil {
		return nil, fmt.Errorf("child process: %w", err)
	}
	p := &Process{Cmd: exec.Command(exe)}
	p.Cmd.Env = append(os.Environ(), env+"="+string(raw))
	if p.Stdin, err = p.Cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if p.Stdout, err = p.Cmd.StdoutPipe(); err != nil {
		return nil, err
	}
	if p.Stderr, err = p.Cmd.StderrPipe(); err != nil {
		return nil, err
	}
	if err := p.Cmd.Start(); err != nil {
		return nil, fmt.Errorf("start child process %s: %w", exe, err)
	}
	return p, nil
}
