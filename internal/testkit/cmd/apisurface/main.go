// Command apisurface counts the exported API of the module's public packages
// (every package outside internal/, cmd/, tests/ and examples/):
//   - top-level: the lines `go doc -short` prints (each exported func and
//     type, each const/var declaration group with an exported name, and the
//     constructors and typed constants go doc files under their type);
//   - names: each exported const, var, func and type counted by name (a
//     grouped const block counts once per exported name);
//   - identifiers: names plus the exported methods of exported types
//     (struct fields and interface methods are not counted).
//
// It reads the files `go list -json` names with go/parser and go/doc, as go
// doc does; -check also runs `go doc -short` on each package and fails when
// its line count differs, and, over the whole module, when a total exceeds
// its target (maxTopLevel, maxIdentifiers). -v lists every counted
// identifier.
//
//	go run ./internal/testkit/cmd/apisurface [-check] [-v] [packages]
//
// The packages default to ./... .
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"go/ast"
	"go/doc"
	"go/parser"
	"go/token"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"text/tabwriter"
)

// The targets -check holds the module's totals to: lower them as the API
// shrinks, never raise them without a reason in the commit.
const (
	maxTopLevel    = 173
	maxIdentifiers = 313
)

// excluded matches the import paths that are not public API.
var excluded = regexp.MustCompile(`/(internal|cmd|tests|examples)(/|$)`)

type listed struct {
	ImportPath string
	Name       string
	Dir        string
	GoFiles    []string
	CgoFiles   []string
}

type count struct {
	path     string
	topLevel int // go doc -short lines
	names    int // exported consts, vars, funcs, types, by name
	methods  int // exported methods of exported types
	lines    []string
}

func main() {
	verbose := flag.Bool("v", false, "list every counted identifier")
	check := flag.Bool("check", false, "compare each top-level count with `go doc -short`, and the totals with their targets")
	flag.Parse()
	patterns := flag.Args()
	if len(patterns) == 0 {
		patterns = []string{"./..."}
	}
	pkgs, err := list(patterns)
	if err != nil {
		fmt.Fprintln(os.Stderr, "apisurface:", err)
		os.Exit(1)
	}
	var counts []count
	for _, p := range pkgs {
		if p.Name == "main" || excluded.MatchString(p.ImportPath) || len(p.GoFiles)+len(p.CgoFiles) == 0 {
			continue // a command, not public, or only tests (deploy): no API
		}
		c, err := measure(p)
		if err != nil {
			fmt.Fprintln(os.Stderr, "apisurface:", err)
			os.Exit(1)
		}
		if *check {
			if err := checkGoDoc(c); err != nil {
				fmt.Fprintln(os.Stderr, "apisurface:", err)
				os.Exit(1)
			}
		}
		counts = append(counts, c)
	}
	sort.SliceStable(counts, func(i, j int) bool { return counts[i].ids() > counts[j].ids() })
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "top-level\tnames\tmethods\tidentifiers\t\tpackage")
	var total count
	for _, c := range counts {
		fmt.Fprintf(w, "%d\t%d\t%d\t%d\t\t%s\n", c.topLevel, c.names, c.methods, c.ids(), c.path)
		total.topLevel += c.topLevel
		total.names += c.names
		total.methods += c.methods
	}
	fmt.Fprintf(w, "%d\t%d\t%d\t%d\t\t%s\n", total.topLevel, total.names, total.methods, total.ids(), "total")
	w.Flush()
	fmt.Printf("targets: top-level ≤ %d (%d), identifiers ≤ %d (%d)\n", maxTopLevel, total.topLevel, maxIdentifiers, total.ids())
	if *check && len(flag.Args()) == 0 && (total.topLevel > maxTopLevel || total.ids() > maxIdentifiers) {
		fmt.Fprintln(os.Stderr, "apisurface: the exported API is above its targets")
		os.Exit(1)
	}
	if *verbose {
		for _, c := range counts {
			fmt.Println("==", c.path)
			for _, l := range c.lines {
				fmt.Println("  ", l)
			}
		}
	}
}

// checkGoDoc compares c.topLevel with the number of lines go doc -short prints.
func checkGoDoc(c count) error {
	out, err := exec.Command("go", "doc", "-short", c.path).Output()
	if err != nil {
		return fmt.Errorf("go doc -short %s: %v", c.path, err)
	}
	if n := bytes.Count(out, []byte("\n")); n != c.topLevel {
		return fmt.Errorf("%s: go doc -short prints %d lines, counted %d", c.path, n, c.topLevel)
	}
	return nil
}

func (c count) ids() int { return c.names + c.methods }

func list(patterns []string) ([]listed, error) {
	cmd := exec.Command("go", append([]string{"list", "-json=ImportPath,Name,Dir,GoFiles,CgoFiles"}, patterns...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list: %v: %s", err, stderr.Bytes())
	}
	var pkgs []listed
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p listed
		if err := dec.Decode(&p); err == io.EOF {
			return pkgs, nil
		} else if err != nil {
			return nil, err
		}
		pkgs = append(pkgs, p)
	}
}

func measure(p listed) (count, error) {
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range append(p.GoFiles, p.CgoFiles...) {
		f, err := parser.ParseFile(fset, filepath.Join(p.Dir, name), nil, parser.ParseComments)
		if err != nil {
			return count{}, err
		}
		files = append(files, f)
	}
	d, err := doc.NewFromFiles(fset, files, p.ImportPath)
	if err != nil {
		return count{}, err
	}
	c := count{path: p.ImportPath}
	values := func(kind string, vs []*doc.Value) {
		for _, v := range vs {
			c.topLevel++ // go doc -short prints one line per declaration group
			for _, n := range v.Names {
				if token.IsExported(n) {
					c.names++
					c.lines = append(c.lines, kind+" "+n)
				}
			}
		}
	}
	funcs := func(fs []*doc.Func) {
		for _, f := range fs {
			c.topLevel++
			c.names++
			c.lines = append(c.lines, "func "+f.Name)
		}
	}
	values("const", d.Consts)
	values("var", d.Vars)
	funcs(d.Funcs)
	for _, t := range d.Types {
		c.topLevel++
		c.names++
		c.lines = append(c.lines, "type "+t.Name)
		values("const", t.Consts)
		values("var", t.Vars)
		funcs(t.Funcs)
		for _, m := range t.Methods {
			if token.IsExported(m.Name) {
				c.methods++
				c.lines = append(c.lines, "method "+t.Name+"."+m.Name)
			}
		}
	}
	return c, nil
}
