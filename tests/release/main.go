// Command release checks the repository as a user meets it once it is
// tagged: it builds a file-based module proxy from the working tree (every
// module of go.work at -version, each zip without its nested modules, as the
// go command makes them), then, outside the workspace and with the proxy
// chained before the real one (third-party modules come from there),
//
//   - installs cmd/idemctl with go install …@version (refused if the
//     library's go.mod has a replace directive) and runs it;
//   - builds examples/quickstart copied into a fresh module that requires the
//     library at -version, and fails if that module's go.mod, go.sum or
//     module graph (go mod graph: what a vulnerability scan reads) names a
//     development-only dependency (chromedp, cdproto: the console's browser
//     tests).
//
// With -api it runs gorelease instead (api.go): which version the public API
// changes since the last release need, or, before the first one, v0.1.0.
//
// Run it from the repository root: make release/check, make release/api.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/mod/module"
	"golang.org/x/mod/zip"
)

const library = "github.com/idemkit/watermill-idempotency"

// devOnly are module paths that must never reach a user's module graph.
var devOnly = []string{"github.com/chromedp/chromedp", "github.com/chromedp/cdproto"}

func main() {
	version := flag.String("version", "v0.1.0", "the version the working tree is served as")
	keep := flag.Bool("keep", false, "keep the temporary directory (proxy, module cache, quickstart) and print it")
	apiMode := flag.Bool("api", false, "run gorelease on HEAD instead: the version the API changes need")
	base := flag.String("base", "", "with -api: the released version to compare with (default: the newest the proxy serves)")
	flag.Parse()
	tmp, err := os.MkdirTemp("", "idem-release-")
	switch {
	case err != nil:
	case *apiMode:
		v := ""
		if isFlagSet("version") {
			v = *version
		}
		err = api(tmp, *base, v)
	default:
		err = check(tmp, *version)
	}
	if *keep {
		fmt.Println("release/check: kept", tmp)
	} else if tmp != "" {
		_ = os.RemoveAll(tmp)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "release/check: FAIL:", err)
		os.Exit(1)
	}
	if !*apiMode {
		fmt.Println("release/check: ok")
	}
}

func isFlagSet(name string) bool {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == name })
	return set
}

type mod struct{ path, dir string }

func check(tmp, version string) error {
	mods, err := workspaceModules()
	if err != nil {
		return err
	}
	proxy := filepath.Join(tmp, "proxy")
	for _, m := range mods {
		if err := serve(proxy, m, version); err != nil {
			return fmt.Errorf("module %s: %w", m.path, err)
		}
		fmt.Printf("release/check: proxy serves %s@%s\n", m.path, version)
	}
	env, err := userEnv(tmp, proxy)
	if err != nil {
		return err
	}
	if err := install(tmp, env, version); err != nil {
		return err
	}
	var quickstart string
	for _, m := range mods {
		if m.path == library {
			quickstart = filepath.Join(m.dir, "examples", "quickstart")
		}
	}
	if quickstart == "" {
		return fmt.Errorf("go.work does not use the library module %s", library)
	}
	return buildQuickstart(tmp, env, version, quickstart)
}

// workspaceModules lists the modules of the workspace (go.work), or the
// main module alone outside one.
func workspaceModules() ([]mod, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Path}}\t{{.Dir}}").Output()
	if err != nil {
		return nil, fmt.Errorf("go list -m: %w", err)
	}
	var mods []mod
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		path, dir, ok := strings.Cut(line, "\t")
		if !ok {
			return nil, fmt.Errorf("go list -m: unexpected line %q", line)
		}
		mods = append(mods, mod{path, dir})
	}
	return mods, nil
}

// serve writes m at version into the file proxy rooted at proxy: list, info,
// mod and a zip made as the go command makes one (nested modules, VCS
// directories and vendor trees left out).
func serve(proxy string, m mod, version string) error {
	esc, err := module.EscapePath(m.path)
	if err != nil {
		return err
	}
	dir := filepath.Join(proxy, filepath.FromSlash(esc), "@v")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	gomod, err := os.ReadFile(filepath.Join(m.dir, "go.mod"))
	if err != nil {
		return err
	}
	info, _ := json.Marshal(struct {
		Version string
		Time    time.Time
	}{version, time.Now().UTC().Truncate(time.Second)})
	for name, data := range map[string][]byte{"list": []byte(version + "\n"), version + ".info": info, version + ".mod": gomod} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			return err
		}
	}
	f, err := os.Create(filepath.Join(dir, version+".zip"))
	if err != nil {
		return err
	}
	if err := zip.CreateFromDir(f, module.Version{Path: m.path, Version: version}, m.dir); err != nil {
		_ = f.Close()
		return err
	}
	return f.Close()
}

// userEnv is a user's environment: no workspace, a module cache and GOBIN of
// its own, the file proxy first and then the configured proxies (the local
// module cache's download directory in between spares the network what it
// already holds; go.sum and the checksum database verify it all the same).
// The project's own modules are not in the checksum database yet (GONOSUMDB).
func userEnv(tmp, proxy string) ([]string, error) {
	get := func(name string) (string, error) {
		out, err := exec.Command("go", "env", name).Output()
		return strings.TrimSpace(string(out)), err
	}
	upstream, err := get("GOPROXY")
	if err != nil {
		return nil, fmt.Errorf("go env GOPROXY: %w", err)
	}
	modcache, err := get("GOMODCACHE")
	if err != nil {
		return nil, fmt.Errorf("go env GOMODCACHE: %w", err)
	}
	proxies := []string{"file://" + filepath.ToSlash(proxy)}
	if modcache != "" {
		proxies = append(proxies, "file://"+filepath.ToSlash(filepath.Join(modcache, "cache", "download")))
	}
	if upstream != "" && upstream != "off" {
		proxies = append(proxies, upstream)
	}
	var env []string
	for _, kv := range os.Environ() {
		switch name, _, _ := strings.Cut(kv, "="); name {
		case "GOPROXY", "GOFLAGS", "GOWORK", "GONOSUMDB", "GONOSUMCHECK", "GOPRIVATE", "GONOPROXY", "GOMODCACHE", "GOBIN", "GOTOOLCHAIN":
		default:
			env = append(env, kv)
		}
	}
	return append(env,
		"GOPROXY="+strings.Join(proxies, ","),
		"GOFLAGS=-mod=mod -modcacherw -trimpath",
		"GOWORK=off",
		"GONOSUMDB="+library,
		"GOMODCACHE="+filepath.Join(tmp, "modcache"),
		"GOBIN="+filepath.Join(tmp, "bin"),
		"GOTOOLCHAIN=local",
	), nil
}

func goCmd(dir string, env []string, args ...string) ([]byte, error) {
	cmd := exec.Command("go", args...)
	cmd.Dir, cmd.Env = dir, env
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return out, nil
}

// install runs go install …/cmd/idemctl@version as a user would, then the
// installed binary, and checks which module version it was built from.
func install(tmp string, env []string, version string) error {
	pkg := library + "/cmd/idemctl@" + version
	if _, err := goCmd(tmp, env, "install", pkg); err != nil {
		return err
	}
	bin := filepath.Join(tmp, "bin", "idemctl")
	out, err := goCmd(tmp, env, "version", "-m", bin)
	if err != nil {
		return err
	}
	if want := "mod\t" + library + "\t" + version; !bytes.Contains(out, []byte(want)) {
		return fmt.Errorf("the installed idemctl was not built from %s@%s:\n%s", library, version, out)
	}
	help, err := exec.Command(bin, "--help").CombinedOutput()
	if err != nil || !bytes.Contains(help, []byte("migrate up")) {
		return fmt.Errorf("idemctl --help (err %v) does not list its commands:\n%s", err, help)
	}
	fmt.Printf("release/check: go install %s: ok; idemctl --help lists its commands\n", pkg)
	return nil
}

// buildQuickstart copies the quickstart into a fresh module that requires
// the library at version, tidies, builds and vets it, and checks its go.mod
// and go.sum for development-only modules.
func buildQuickstart(tmp string, env []string, version, src string) error {
	dir := filepath.Join(tmp, "quickstart")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	entries, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if e.IsDir() || !strings.HasSuffix(e.Name(), ".go") {
			continue
		}
		data, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err == nil {
			err = os.WriteFile(filepath.Join(dir, e.Name()), data, 0o644)
		}
		if err != nil {
			return err
		}
	}
	gomod := fmt.Sprintf("module example.com/quickstart\n\ngo 1.26.0\n\nrequire %s %s\n", library, version)
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte(gomod), 0o644); err != nil {
		return err
	}
	for _, args := range [][]string{{"mod", "tidy"}, {"build", "./..."}, {"vet", "./..."}, {"test", "-count=1", "-run", "^$", "./..."}} {
		if _, err := goCmd(dir, env, args...); err != nil {
			return fmt.Errorf("the quickstart copied into its own module: %w", err)
		}
	}
	graph, err := goCmd(dir, env, "mod", "graph")
	if err != nil {
		return err
	}
	var bad []string
	for _, name := range []string{"go.mod", "go.sum", "go mod graph"} {
		data, err := os.ReadFile(filepath.Join(dir, name))
		if name == "go mod graph" {
			data, err = graph, nil
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		for _, p := range devOnly {
			if bytes.Contains(data, []byte(p)) {
				bad = append(bad, name+" names "+p)
			}
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("a user's module requiring %s@%s gets development-only modules: %s", library, version, strings.Join(bad, "; "))
	}
	fmt.Printf("release/check: the quickstart builds in a module of its own requiring %s@%s; its go.mod, go.sum and module graph name none of %s\n", library, version, strings.Join(devOnly, ", "))
	return nil
}
