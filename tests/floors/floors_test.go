package floors

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const module = "github.com/idemkit/watermill-idempotency"

// floorPattern is one package pattern of the table: a package path relative
// to the module, or such a path followed by /... for it and its subtree.
type floorPattern struct {
	path    string
	subtree bool
	floor   int
}

// match reports how long a match rel is (0: none), so the longest wins.
func (p floorPattern) match(rel string) int {
	switch {
	case rel == p.path:
		return len(p.path) + 1
	case p.subtree && strings.HasPrefix(rel, p.path+"/"):
		return len(p.path)
	}
	return 0
}

// readFloors parses docs/floors.md's table: rows "| N | `pattern`, … | … |".
func readFloors(t *testing.T, path string) []floorPattern {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	row := regexp.MustCompile(`^\|\s*(\d+)\s*\|([^|]*)\|`)
	quoted := regexp.MustCompile("`([^`]+)`")
	var out []floorPattern
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		m := row.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		floor, err := strconv.Atoi(m[1])
		require.NoError(t, err)
		for _, q := range quoted.FindAllStringSubmatch(m[2], -1) {
			p := floorPattern{path: q[1], floor: floor}
			if rest, ok := strings.CutSuffix(p.path, "/..."); ok {
				p.path, p.subtree = rest, true
			}
			out = append(out, p)
		}
	}
	require.NoError(t, sc.Err())
	require.NotEmpty(t, out, "%s has no floor table", path)
	return out
}

// floorOf places rel (a package path relative to the module) on its floor.
func floorOf(patterns []floorPattern, rel string) (int, bool) {
	best, floor := 0, -1
	for _, p := range patterns {
		if n := p.match(rel); n > best {
			best, floor = n, p.floor
		}
	}
	return floor, best > 0
}

// moduleRoot is the directory of the library's go.mod, above this test's.
func moduleRoot(t *testing.T) string {
	t.Helper()
	dir, err := os.Getwd()
	require.NoError(t, err)
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && bytes.HasPrefix(b, []byte("module "+module+"\n")) {
			return dir
		}
		parent := filepath.Dir(dir)
		require.NotEqual(t, dir, parent, "no go.mod of %s above the test", module)
		dir = parent
	}
}

// imports lists each package of the module with its own (non-test)
// imports inside the module, both relative to the module path.
func imports(t *testing.T, root string) map[string][]string {
	t.Helper()
	cmd := exec.Command("go", "list", "-e", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", "./...")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	require.NoError(t, err, "go list: %s", stderr.String())
	graph := map[string][]string{}
	for line := range strings.Lines(string(out)) {
		fields := strings.Fields(line)
		if len(fields) == 0 || !strings.HasPrefix(fields[0], module+"/") {
			continue // the module root has no package; another module's are not placed
		}
		var own []string
		for _, imp := range fields[1:] {
			if rel, ok := strings.CutPrefix(imp, module+"/"); ok {
				own = append(own, rel)
			}
		}
		graph[strings.TrimPrefix(fields[0], module+"/")] = own
	}
	return graph
}

// climbs returns "a (floor 3) imports b (floor 5)" for every import of
// graph that climbs a floor, and the packages no pattern places.
func climbs(patterns []floorPattern, graph map[string][]string) (up, unplaced []string) {
	for pkg, imps := range graph {
		from, ok := floorOf(patterns, pkg)
		if !ok {
			unplaced = append(unplaced, pkg)
			continue
		}
		for _, imp := range imps {
			if to, ok := floorOf(patterns, imp); ok && to > from {
				up = append(up, fmt.Sprintf("%s (floor %d) imports %s (floor %d)", pkg, from, imp, to))
			}
		}
	}
	return up, unplaced
}

// No import of the module climbs a floor of docs/floors.md, and every
// package of the module stands on one.
func TestNoImportClimbsAFloor(t *testing.T) {
	root := moduleRoot(t)
	patterns := readFloors(t, filepath.Join(root, "docs", "floors.md"))
	graph := imports(t, root)
	require.Contains(t, graph, "middleware", "go list found the module's packages")
	up, unplaced := climbs(patterns, graph)
	require.Empty(t, unplaced, "packages on no floor of docs/floors.md: place them in its table")
	require.Empty(t, up, "imports that climb a floor of docs/floors.md")
}

// The check itself: an import up a floor is found, one down or level is
// not, the longest pattern places a package, and an unplaced one is named.
func TestClimbsFindsAnImportUp(t *testing.T) {
	patterns := []floorPattern{
		{path: "internal", subtree: true, floor: 0},
		{path: "contract", floor: 6},
		{path: "middleware", subtree: true, floor: 7},
		{path: "internal/console", floor: 9},
	}
	up, unplaced := climbs(patterns, map[string][]string{
		"contract":               {"middleware", "internal/payloaderr"},
		"middleware/idemtest":    {"contract", "middleware"},
		"internal/console":       {"middleware"},
		"internal/leasesql":      {"internal/dbx"},
		"somewhere/else":         nil,
		"middleware/retrytopic2": nil,
	})
	require.Equal(t, []string{"contract (floor 6) imports middleware (floor 7)"}, up)
	require.Equal(t, []string{"somewhere/else"}, unplaced)
}
