package outbox

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// rowInsert matches SQL text that inserts rows into an outbox messages
// table (watermill-sql's columns).
var rowInsert = regexp.MustCompile(`(?is)\bINSERT\s+INTO\b.*\(\s*"?uuid"?\s*,.*"?transaction_id"?\s*\)`)

// One writer of the outbox's rows: Outbox.write, through insert (at once,
// insertRows) or rowBatch.Queue (a dedup group's rows, in the pipeline
// before its COMMIT), the two users of the INSERT (insertQuery). No other
// package holds SQL inserting rows, except the operator's retry of dead
// rows, which moves rows written here back (internal/outboxsql's dead.go).
func TestOutboxRowsHaveOneWriter(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	// callers are the only functions allowed to name each writer function.
	callers := map[string][]string{
		"insertQuery": {"insertRows", "Queue"},
		"insertRows":  {"insert"},
		"insert":      {"write"},
		"addRows":     {"write"},
	}
	allowedSQL := map[string]bool{"internal/outboxsql/dead.go": true}
	files := 0
	fset := token.NewFileSet()
	err = filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			if rel != "." && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || rel == "third_party" || rel == "tests" || rel == "internal/testkit") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(rel, ".go") || strings.HasSuffix(rel, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		files++
		inOutbox := filepath.ToSlash(filepath.Dir(rel)) == "outbox"
		for _, decl := range f.Decls {
			fd, ok := decl.(*ast.FuncDecl)
			ast.Inspect(decl, func(n ast.Node) bool {
				switch n := n.(type) {
				case *ast.BasicLit:
					if s, err := strconv.Unquote(n.Value); n.Kind == token.STRING && err == nil && rowInsert.MatchString(s) && !allowedSQL[rel] {
						t.Errorf("%s: SQL inserting outbox rows outside Outbox.write: %.80q", rel, s)
					}
				case *ast.CallExpr:
					if !inOutbox || !ok {
						return true
					}
					name := ""
					switch fn := n.Fun.(type) {
					case *ast.Ident:
						name = fn.Name
					case *ast.SelectorExpr:
						name = fn.Sel.Name
					}
					if allowed, listed := callers[name]; listed && !contains(allowed, fd.Name.Name) {
						t.Errorf("%s: %s calls %s: the outbox's rows are written by Outbox.write alone", rel, fd.Name.Name, name)
					}
				}
				return true
			})
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 100 {
		t.Fatalf("%d Go files: is the walk broken?", files)
	}
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
