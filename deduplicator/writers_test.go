package deduplicator_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// One writer of processed_event: package deduplicator. It keeps the SQL text
// in internal packages (claimsql, leasesql, dedupsql); the functions there
// that bind a statement writing the claim table to a table and a group are
// called by deduplicator alone, and no other package holds SQL that writes
// it. The middleware's lease mode runs the lease protocol deduplicator built
// (leasesql.Of), never one of its own.
var (
	// ownerOnly are the internal functions that write the claim table, or
	// build the value whose methods do: only deduplicator calls them.
	ownerOnly = map[string][]string{
		"internal/claimsql": {"Claim", "ClaimBatch"},
		"internal/leasesql": {"New"},
		"internal/dedupsql": {"RenameGroup", "ForgetGroup"},
	}
	// ownerTypes are the internal types whose methods write the claim
	// table; their constructors are in ownerOnly.
	ownerTypes = map[string][]string{"internal/leasesql": {"Protocol"}}
	// otherTables are the internal functions that write one of the claim
	// table's companions, not the claim table: anyone may call them.
	otherTables = map[string]map[string]string{
		"internal/dedupsql": {"SetRetention": "<table>_setting: idemctl retention set"},
		"internal/leasesql": {"ForceRelease": "<table>_lease: an operator's release of a lease"},
	}
)

// writeSQL matches a string that starts (or holds) a write statement.
var writeSQL = regexp.MustCompile(`(?i)\b(INSERT\s+INTO|DELETE\s+FROM|UPDATE|TRUNCATE|MERGE\s+INTO)\b`)

// claimTableWrite matches SQL text that writes processed_event itself (not
// one of its companions, processed_event_lease and the like).
var claimTableWrite = regexp.MustCompile(`(?is)\b(INSERT\s+INTO|DELETE\s+FROM|UPDATE|TRUNCATE(\s+TABLE)?|MERGE\s+INTO)\s+(ONLY\s+)?("?\w+"?\.)?"?processed_event"?([^\w]|$)`)

type goFile struct {
	rel  string // relative to the module root, slashes
	pkg  string // its directory, relative to the module root
	test bool   // test code: a _test.go file, internal/testkit, tests/
	ast  *ast.File
}

func TestProcessedEventHasOneWriter(t *testing.T) {
	t.Parallel()
	const module = "github.com/idemkit/watermill-idempotency/"
	files := moduleFiles(t)
	calledByOwner := map[string]bool{}
	for _, f := range files {
		if f.test {
			continue
		}
		owner := f.pkg == "deduplicator"
		names := importNames(f.ast)
		ast.Inspect(f.ast, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.SelectorExpr:
				id, ok := n.X.(*ast.Ident)
				if !ok {
					return true
				}
				path, ok := names[id.Name]
				if !ok || !strings.HasPrefix(path, module) {
					return true
				}
				pkg := strings.TrimPrefix(path, module)
				if !slices.Contains(ownerOnly[pkg], n.Sel.Name) {
					return true
				}
				if owner {
					calledByOwner[pkg+"."+n.Sel.Name] = true
				} else {
					t.Errorf("%s: %s.%s writes processed_event: only package deduplicator may call it (add what you need to deduplicator)", f.rel, pkg, n.Sel.Name)
				}
			case *ast.AssignStmt:
				for _, l := range n.Lhs {
					if sel, ok := l.(*ast.SelectorExpr); ok && !owner && sel.Sel.Name == "Of" {
						if id, ok := sel.X.(*ast.Ident); ok && names[id.Name] == module+"internal/leasesql" {
							t.Errorf("%s: sets leasesql.Of: only package deduplicator hands out its lease protocol", f.rel)
						}
					}
				}
			case *ast.BasicLit:
				if n.Kind != token.STRING || owner || ownerOnly[f.pkg] != nil {
					return true
				}
				if s, err := strconv.Unquote(n.Value); err == nil && claimTableWrite.MatchString(s) {
					t.Errorf("%s: SQL that writes processed_event outside package deduplicator: %.80q", f.rel, s)
				}
			}
			return true
		})
	}
	for pkg, fns := range ownerOnly {
		for _, fn := range fns {
			if !calledByOwner[pkg+"."+fn] {
				t.Errorf("deduplicator does not call %s.%s: is the scan broken, or is the list out of date?", pkg, fn)
			}
		}
	}
	checkClassified(t, files)
}

// checkClassified fails on an exported function of the internal SQL
// packages that holds a write statement and is in neither ownerOnly nor
// otherTables, and on a method holding one whose type is not in
// ownerTypes: a new writer has to say which table it writes.
func checkClassified(t *testing.T, files []goFile) {
	t.Helper()
	for _, f := range files {
		if f.test || ownerOnly[f.pkg] == nil {
			continue
		}
		for _, d := range f.ast.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if !ok || fd.Body == nil || !holdsWrite(fd.Body) {
				continue
			}
			if fd.Recv != nil {
				if typ := recvType(fd.Recv); ast.IsExported(typ) && !slices.Contains(ownerTypes[f.pkg], typ) {
					t.Errorf("%s: (%s).%s writes: name its type in ownerTypes (claim table) or make it a function in otherTables", f.rel, typ, fd.Name.Name)
				}
				continue
			}
			name := fd.Name.Name
			if !ast.IsExported(name) || slices.Contains(ownerOnly[f.pkg], name) || otherTables[f.pkg][name] != "" {
				continue
			}
			t.Errorf("%s: %s holds a write statement: list it in ownerOnly (it writes processed_event) or otherTables (say which table)", f.rel, name)
		}
	}
}

func holdsWrite(body *ast.BlockStmt) bool {
	found := false
	ast.Inspect(body, func(n ast.Node) bool {
		if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING {
			if s, err := strconv.Unquote(lit.Value); err == nil && writeSQL.MatchString(s) {
				found = true
			}
		}
		return !found
	})
	return found
}

func recvType(recv *ast.FieldList) string {
	e := recv.List[0].Type
	if st, ok := e.(*ast.StarExpr); ok {
		e = st.X
	}
	if id, ok := e.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

// importNames maps the names a file refers to its imports by to their paths.
func importNames(f *ast.File) map[string]string {
	out := map[string]string{}
	for _, imp := range f.Imports {
		path, _ := strconv.Unquote(imp.Path.Value)
		name := path[strings.LastIndex(path, "/")+1:]
		if imp.Name != nil {
			name = imp.Name.Name
		}
		out[name] = path
	}
	return out
}

// moduleFiles parses the module's Go files (third_party, hidden and
// generated directories left out).
func moduleFiles(t *testing.T) []goFile {
	t.Helper()
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("module root: %v", err)
	}
	var out []goFile
	fset := token.NewFileSet()
	err = filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		if d.IsDir() {
			if rel != "." && (strings.HasPrefix(d.Name(), ".") || strings.HasPrefix(d.Name(), "_") || d.Name() == "testdata" || rel == "third_party") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(rel, ".go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		pkg := filepath.ToSlash(filepath.Dir(rel))
		test := strings.HasSuffix(rel, "_test.go") || strings.HasPrefix(pkg, "internal/testkit") || pkg == "tests" || strings.HasPrefix(pkg, "tests/")
		out = append(out, goFile{rel: rel, pkg: pkg, test: test, ast: f})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(out) < 100 {
		t.Fatalf("%d Go files in the module: is the walk broken?", len(out))
	}
	return out
}
