package docsnippets_test

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/doc/comment"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

const module = "github.com/idemkit/watermill-idempotency"

// knownImports maps the package names a snippet without an import block may
// use to their import paths.
var knownImports = map[string]string{
	"context":      "context",
	"errors":       "errors",
	"fmt":          "fmt",
	"http":         "net/http",
	"log":          "log",
	"os":           "os",
	"strings":      "strings",
	"time":         "time",
	"sarama":       "github.com/IBM/sarama",
	"watermill":    "github.com/ThreeDotsLabs/watermill",
	"message":      "github.com/ThreeDotsLabs/watermill/message",
	"middleware":   "github.com/ThreeDotsLabs/watermill/message/router/middleware",
	"kafka":        "github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka",
	"pgx":          "github.com/jackc/pgx/v5",
	"pgxpool":      "github.com/jackc/pgx/v5/pgxpool",
	"prometheus":   "github.com/prometheus/client_golang/prometheus",
	"otel":         "go.opentelemetry.io/otel",
	"propagation":  "go.opentelemetry.io/otel/propagation",
	"sdktrace":     "go.opentelemetry.io/otel/sdk/trace",
	"contract":     module + "/contract",
	"idem":         module + "/middleware",
	"idemtest":     module + "/middleware/idemtest",
	"retrytopic":   module + "/middleware/retrytopic",
	"deduplicator": module + "/deduplicator",
	"outbox":       module + "/outbox",
	"migrate":      module + "/migrate",
	"publisher":    module + "/publisher",
	"idemkafka":    module + "/idemkafka",
	"parallel":     module + "/idemkafka/parallel",
	"franz":        module + "/idemkafka/franz",
	"poison":       module + "/components/poison",
	"idemprom":     module + "/components/idemprom",
	"idemotel":     module + "/components/idemotel",
	"heartbeat":    module + "/components/heartbeat",
}

// givenSource declares, at package level of the generated package, what a
// snippet may use without declaring it: what a service has at hand where
// the snippet would go.
const givenSource = `package gen

import (
	"context"
	"database/sql"
	"io"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/deduplicator"
	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/middleware/retrytopic"
	"github.com/idemkit/watermill-idempotency/outbox"
)

var (
	ctx           context.Context
	pool          *pgxpool.Pool
	logger        watermill.LoggerAdapter
	brokers       []string
	kc            idemkafka.ClientConfig
	subCfg        kafka.SubscriberConfig
	sub, retrySub message.Subscriber
	kafkaPub      message.Publisher
	producer      sarama.SyncProducer
	router        *message.Router
	dedup         *idem.Dedup
	table         deduplicator.TableConfig
	ob            *outbox.Outbox
	fwd           *outbox.Forwarder
	msg           *message.Message
	charge        message.NoPublishHandlerFunc
	payload       []byte
	orderID       string
	amount        int64
	providerURL   string
	body          io.Reader
	incidentStart time.Time
	tracer        trace.Tracer
	tp            *sdktrace.TracerProvider
	exporter      sdktrace.SpanExporter
	res           *resource.Resource
	meterProvider metric.MeterProvider
	// What the packages' doc comments use besides.
	t            *testing.T
	tx           pgx.Tx
	pub          message.Publisher
	handler      message.HandlerFunc
	forwarder    *outbox.Forwarder
	rt           *retrytopic.RetryTopic
	psub         *parallel.Subscriber
	outboxCfg    outbox.Config
	eventID      uuid.UUID
	since        time.Time
	payment      any
	applyPayment func(context.Context, pgx.Tx, any) error
	sqlDB        *sql.DB // a database/sql user's (pgx's stdlib driver)
)
`

type snippet struct {
	file string // relative to the module root
	line int    // of the snippet's first line
	code string
}

func (s snippet) String() string { return fmt.Sprintf("%s:%d", s.file, s.line) }

// extract returns the ```go blocks of a Markdown file.
func extract(root, rel string) ([]snippet, error) {
	data, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		return nil, err
	}
	var out []snippet
	var cur *snippet
	for i, line := range strings.Split(string(data), "\n") {
		trimmed := strings.TrimSpace(line)
		switch {
		case cur == nil && (trimmed == "```go" || trimmed == "```golang"):
			cur = &snippet{file: rel, line: i + 2}
		case cur != nil && strings.HasPrefix(trimmed, "```"):
			out = append(out, *cur)
			cur = nil
		case cur != nil:
			cur.code += line + "\n"
		}
	}
	if cur != nil {
		return nil, fmt.Errorf("%s: unterminated ```go block", cur)
	}
	return out, nil
}

// splitImports separates a leading import block (or import lines) from the
// rest. It returns the import text, the rest, and how many lines the import
// part took.
func splitImports(code string) (imports, rest string, lines int) {
	ls := strings.SplitAfter(code, "\n")
	i := 0
	inBlock := false
	for i < len(ls) {
		t := strings.TrimSpace(ls[i])
		switch {
		case inBlock:
			if t == ")" {
				inBlock = false
			}
		case strings.HasPrefix(t, "import ("):
			inBlock = true
		case strings.HasPrefix(t, "import "), t == "" && i > 0 && imports != "":
		default:
			return imports, strings.Join(ls[i:], ""), i
		}
		imports += ls[i]
		i++
	}
	return imports, "", i
}

// generate turns one snippet into the source of a file of package gen (or,
// for a whole-file snippet, into a file of a package of its own: sub is
// true).
func generate(root string, s snippet, n int) (src string, sub bool, err error) {
	lineDirective := func(line int) string { return fmt.Sprintf("//line %s:%d\n", filepath.Join(root, s.file), line) }
	imports, rest, importLines := splitImports(s.code)
	if strings.HasPrefix(strings.TrimSpace(rest), "package ") {
		return lineDirective(s.line) + s.code, true, nil
	}
	restLine := s.line + importLines
	if imports != "" {
		imports = lineDirective(s.line) + imports
	}

	// Declarations: they parse as a file.
	decls := "package gen\n" + imports + lineDirective(restLine) + rest
	if _, err := parser.ParseFile(token.NewFileSet(), s.file, decls, parser.SkipObjectResolution); err == nil {
		if imports == "" {
			if imports, err = inferImports(decls); err != nil {
				return "", false, err
			}
			decls = "package gen\n" + imports + lineDirective(restLine) + rest
		}
		return decls, false, nil
	}

	// Statements: they run in a function.
	fn := fmt.Sprintf("func snippet%02d() {\n%s%s", n, lineDirective(restLine), rest)
	f, err := parser.ParseFile(token.NewFileSet(), s.file, "package gen\n"+fn+"}\n", parser.SkipObjectResolution)
	if err != nil {
		return "", false, fmt.Errorf("%s: not a file, declarations or statements: %v", s, err)
	}
	if imports == "" {
		if imports, err = inferImports("package gen\n" + fn + "}\n"); err != nil {
			return "", false, err
		}
	}
	// A snippet may declare what it does not use again (err, a result):
	// use each name its top-level statements declare.
	var uses strings.Builder
	for _, name := range topLevelNames(f) {
		fmt.Fprintf(&uses, "\t_ = %s\n", name)
	}
	return "package gen\n" + imports + fn + "//line generated:1\n" + uses.String() + "}\n", false, nil
}

// topLevelNames lists the names the statements of the file's only function
// declare at its top level.
func topLevelNames(f *ast.File) []string {
	var names []string
	add := func(id *ast.Ident) {
		if id.Name != "_" && !slices.Contains(names, id.Name) {
			names = append(names, id.Name)
		}
	}
	for _, stmt := range f.Decls[0].(*ast.FuncDecl).Body.List {
		switch st := stmt.(type) {
		case *ast.AssignStmt:
			if st.Tok == token.DEFINE {
				for _, e := range st.Lhs {
					if id, ok := e.(*ast.Ident); ok {
						add(id)
					}
				}
			}
		case *ast.DeclStmt:
			if gd, ok := st.Decl.(*ast.GenDecl); ok && gd.Tok == token.VAR {
				for _, spec := range gd.Specs {
					for _, id := range spec.(*ast.ValueSpec).Names {
						add(id)
					}
				}
			}
		}
	}
	return names
}

// inferImports returns an import block for the known package names that src
// uses as the left side of a selector and does not declare itself.
func inferImports(src string) (string, error) {
	f, err := parser.ParseFile(token.NewFileSet(), "", src, parser.SkipObjectResolution)
	if err != nil {
		return "", err
	}
	declared := map[string]bool{}
	used := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.AssignStmt:
			if n.Tok == token.DEFINE {
				for _, e := range n.Lhs {
					if id, ok := e.(*ast.Ident); ok {
						declared[id.Name] = true
					}
				}
			}
		case *ast.ValueSpec:
			for _, id := range n.Names {
				declared[id.Name] = true
			}
		case *ast.Field:
			for _, id := range n.Names {
				declared[id.Name] = true
			}
		case *ast.SelectorExpr:
			if id, ok := n.X.(*ast.Ident); ok {
				used[id.Name] = true
			}
		}
		return true
	})
	var paths []string
	for name := range used {
		if path, ok := knownImports[name]; ok && !declared[name] {
			paths = append(paths, fmt.Sprintf("\t%s %q\n", name, path))
		}
	}
	if len(paths) == 0 {
		return "", nil
	}
	slices.Sort(paths)
	return "import (\n" + strings.Join(paths, "") + ")\n", nil
}

// docComments returns, for every public package (outside internal/, cmd/,
// tests/, examples/ and third_party/), the code blocks of its doc.go's
// package comment, joined into one snippet: a package's example reads as
// one piece (an import block, then the statements that use it).
func docComments(t *testing.T, root string) []snippet {
	t.Helper()
	var out []snippet
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch first := strings.Split(filepath.ToSlash(rel), "/")[0]; {
			case rel != "." && (strings.HasPrefix(d.Name(), ".") || strings.HasPrefix(d.Name(), "_") || d.Name() == "testdata" || d.Name() == "internal"),
				first == "cmd", first == "tests", first == "examples", first == "third_party":
				return filepath.SkipDir
			}
			return nil
		}
		if d.Name() != "doc.go" {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, src, parser.ParseComments|parser.PackageClauseOnly)
		if err != nil || f.Doc == nil {
			return err
		}
		var code []string
		for _, b := range new(comment.Parser).Parse(f.Doc.Text()).Content {
			if c, ok := b.(*comment.Code); ok {
				code = append(code, c.Text)
			}
		}
		if len(code) == 0 {
			return nil
		}
		// The line of the first block's first line, for the errors.
		first := strings.SplitN(code[0], "\n", 2)[0]
		line := 1 + bytes.Count(src[:max(bytes.Index(src, []byte(first)), 0)], []byte("\n"))
		out = append(out, snippet{file: rel, line: line, code: strings.Join(code, "\n")})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// markdownFiles returns README.md and docs/*.md, relative to root.
func markdownFiles(t *testing.T, root string) []string {
	t.Helper()
	docs, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files := []string{"README.md"}
	for _, d := range docs {
		files = append(files, filepath.Join("docs", filepath.Base(d)))
	}
	return files
}

func moduleRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root: %v", err)
	}
	return root
}

// TestSnippetsCompile writes every Go snippet of README.md, docs/*.md and the
// public packages' doc comments into one generated package inside the
// module and builds it with one go build.
func TestSnippetsCompile(t *testing.T) {
	root := moduleRoot(t)
	var snippets []snippet
	perFile := map[string]int{}
	for _, rel := range markdownFiles(t, root) {
		s, err := extract(root, rel)
		if err != nil {
			t.Fatal(err)
		}
		perFile[rel] = len(s)
		snippets = append(snippets, s...)
	}
	pkgDocs := docComments(t, root)
	if len(pkgDocs) < 10 {
		t.Fatalf("%d package doc comments with code, want at least 10: is the extraction broken?", len(pkgDocs))
	}
	perFile["doc.go comments"] = len(pkgDocs)
	snippets = append(snippets, pkgDocs...)
	if perFile["README.md"] < 3 {
		t.Fatalf("README.md has %d Go snippets, want at least 3 (consumer, producer, money): is the extraction broken?", perFile["README.md"])
	}

	// Inside the module (so that go.mod resolves every import from the
	// module cache), under a name the ./... pattern skips.
	dir, err := os.MkdirTemp(filepath.Join(root, "tests", "docsnippets"), "_gen")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	write := func(name, src string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("given.go", givenSource)
	// Each package by its directory (the ./... pattern skips _gen*), from
	// the module root, so that errors name README.md and docs/*.md.
	gen, err := filepath.Rel(root, dir)
	if err != nil {
		t.Fatal(err)
	}
	pkgs := []string{"./" + filepath.ToSlash(gen)}
	for i, s := range snippets {
		src, sub, err := generate(root, s, i)
		if err != nil {
			t.Error(strings.ReplaceAll(err.Error(), root+string(filepath.Separator), ""))
			continue
		}
		if sub {
			write(fmt.Sprintf("file%02d/main.go", i), src)
			pkgs = append(pkgs, fmt.Sprintf("./%s/file%02d", filepath.ToSlash(gen), i))
		} else {
			write(fmt.Sprintf("snippet%02d.go", i), src)
		}
	}
	if t.Failed() {
		return
	}

	cmd := exec.Command("go", append([]string{"build"}, pkgs...)...)
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the documentation's Go snippets do not compile (go build: %v):\n%s", err, bytes.ReplaceAll(out, []byte(root+string(filepath.Separator)), nil))
	}
	t.Logf("%d snippets compiled: %v", len(snippets), perFile)
}

var benchLink = regexp.MustCompile(`benchmarks\.md#([^)\s>"]+)`)

// TestBenchmarkLinks checks that every link to a section of
// docs/benchmarks.md, in the Markdown files and the Go sources, names a
// heading that page has.
func TestBenchmarkLinks(t *testing.T) {
	root := moduleRoot(t)
	page, err := os.ReadFile(filepath.Join(root, "docs", "benchmarks.md"))
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(page), "\n") {
		if strings.HasPrefix(line, "#") {
			anchors[anchor(strings.TrimSpace(strings.TrimLeft(line, "#")))] = true
		}
	}
	var files []string
	err = filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != root && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(name, ".md") || strings.HasSuffix(name, ".go") {
			files = append(files, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	links := 0
	for _, path := range files {
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range bytes.Split(data, []byte("\n")) {
			for _, m := range benchLink.FindAllSubmatch(line, -1) {
				links++
				if !anchors[string(m[1])] {
					rel, _ := filepath.Rel(root, path)
					t.Errorf("%s:%d: docs/benchmarks.md has no section #%s", rel, i+1, m[1])
				}
			}
		}
	}
	if links == 0 {
		t.Error("no link to a section of docs/benchmarks.md found: is the search broken?")
	}
}

// anchor is GitHub's anchor for a heading: lower case, letters, digits,
// '-' and '_' kept, spaces turned into '-', everything else dropped.
func anchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(r), unicode.IsDigit(r), r == '-', r == '_':
			b.WriteRune(r)
		case r == ' ':
			b.WriteByte('-')
		}
	}
	return b.String()
}
