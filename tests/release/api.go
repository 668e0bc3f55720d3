package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/mod/module"
)

// gorelease is pinned: its suggestions must not change under the project.
const gorelease = "golang.org/x/exp/cmd/gorelease@v0.0.0-20261120182113-8801fbdfac81"

// api runs gorelease on a clone of HEAD (gorelease refuses a tree with
// uncommitted changes) against the newest version the module proxy serves,
// or against none before the first release, when it suggests the first
// version. base and version are passed on when set (-base, -version).
func api(tmp, base, version string) error {
	root, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		return fmt.Errorf("git rev-parse: %w", err)
	}
	if dirty, _ := exec.Command("git", "status", "--porcelain").Output(); len(dirty) > 0 {
		fmt.Println("release/api: uncommitted changes are not checked (gorelease reads HEAD)")
	}
	src := filepath.Join(tmp, "src")
	if out, err := exec.Command("git", "clone", "-q", strings.TrimSpace(string(root)), src).CombinedOutput(); err != nil {
		return fmt.Errorf("git clone: %w\n%s", err, out)
	}
	env := append(os.Environ(), "GOWORK=off")
	if base == "" && !published(src, env) {
		// No version yet: a proxy that lists none for the library (the
		// module proxy answers "not found" for an unknown module, which
		// gorelease takes for an error).
		esc, _ := module.EscapePath(library)
		dir := filepath.Join(tmp, "noversions", filepath.FromSlash(esc), "@v")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, "list"), nil, 0o644); err != nil {
			return err
		}
		upstream, _ := exec.Command("go", "env", "GOPROXY").Output()
		env = append(env, "GOPROXY=file://"+filepath.ToSlash(filepath.Join(tmp, "noversions"))+","+strings.TrimSpace(string(upstream)),
			"GONOSUMDB="+library)
	}
	args := []string{"run", gorelease}
	if base != "" {
		args = append(args, "-base="+base)
	}
	if version != "" {
		args = append(args, "-version="+version)
	}
	cmd := exec.Command("go", args...)
	cmd.Dir, cmd.Env, cmd.Stdout, cmd.Stderr = src, env, os.Stdout, os.Stderr
	fmt.Println("release/api: go", strings.Join(args, " "))
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("gorelease: %w", err)
	}
	return nil
}

// published reports whether the module proxy serves a version of the library.
func published(dir string, env []string) bool {
	cmd := exec.Command("go", "list", "-m", "-versions", library)
	cmd.Dir, cmd.Env = dir, env
	out, err := cmd.Output()
	return err == nil && len(strings.Fields(string(out))) > 1
}
