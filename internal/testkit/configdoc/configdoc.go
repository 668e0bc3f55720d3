// Package configdoc holds a config struct's stated defaults to the code: a
// package's test applies its defaults to a zero config and hands the result
// to [Check], which reads each field's doc comment ("Defaults to X", or
// "Required") from the package's Go files and the field's row in
// docs/configuration.md, and fails for every statement that disagrees with
// the value the code gives.
//
// A stated default is read as a value: a duration ("10 s", "500 ms",
// "10 minutes", "1 hour"), a number ("10,000", "0.2"), a quoted string,
// true, false, nil, or a name the test lists in [Spec.Names] (a constant, a
// function). A name followed by a value ("[DefaultStaleMargin] (1 hour)",
// "`deduplicator.DefaultStaleMargin` = 1 hour") is checked on both. A
// default that is described rather than stated as a value is listed in
// [Spec.Described] with the reason; its comment and row must still exist.
package configdoc

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Spec names a config struct and how its stated defaults are read.
type Spec struct {
	// Value is the config after its defaults were applied to a zero value.
	Value any
	// Section is a text that only the heading of the struct's section in
	// docs/configuration.md contains, for example "`deduplicator.CleanerConfig`".
	Section string
	// RowPrefix is prepended to the field's name in the section's rows, for
	// sections that describe several structs ("TableConfig.").
	RowPrefix string
	// Names are the values of the names the comments and rows use
	// ("LayoutPlain", "time.Now").
	Names map[string]any
	// Described lists the fields whose default is described rather than
	// stated as a value, with the reason.
	Described map[string]string
	// Skip lists the fields checked elsewhere (an embedded config), with
	// the reason.
	Skip map[string]string
}

// Check fails t for each field of spec.Value whose doc comment (in the Go
// files of the test's working directory) or row in docs/configuration.md
// states no default, or one that differs from the field's value.
func Check(t testing.TB, spec Spec) {
	t.Helper()
	v := reflect.ValueOf(spec.Value)
	typ := v.Type()
	comments, err := fieldComments(".", typ.Name())
	if err != nil {
		t.Fatal(err)
	}
	rows, err := docRows(spec.Section)
	if err != nil {
		t.Fatal(err)
	}
	for i := range typ.NumField() {
		f := typ.Field(i)
		if !f.IsExported() || spec.Skip[f.Name] != "" {
			continue
		}
		comment, ok := comments[f.Name]
		if !ok {
			t.Errorf("%s.%s: no doc comment found", typ.Name(), f.Name)
			continue
		}
		row, ok := rows[spec.RowPrefix+f.Name]
		if !ok {
			t.Errorf("%s.%s: no row `%s` in the section %s of docs/configuration.md", typ.Name(), f.Name, spec.RowPrefix+f.Name, spec.Section)
			continue
		}
		if spec.Described[f.Name] != "" {
			continue
		}
		stated := map[string]string{"doc comment": commentDefault(comment), "docs/configuration.md": row}
		for where, text := range stated {
			if err := spec.agrees(text, v.Field(i)); err != nil {
				t.Errorf("%s.%s: %s: %v", typ.Name(), f.Name, where, err)
			}
		}
	}
}

// fieldComments returns the doc comment of each field of the struct type
// name, from the Go files (tests excluded) of dir.
func fieldComments(dir, name string) (map[string]string, error) {
	fset := token.NewFileSet()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		return nil, err
	}
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		var st *ast.StructType
		ast.Inspect(f, func(n ast.Node) bool {
			if ts, ok := n.(*ast.TypeSpec); ok && ts.Name.Name == name {
				st, _ = ts.Type.(*ast.StructType)
			}
			return st == nil
		})
		if st == nil {
			continue
		}
		out := map[string]string{}
		for _, field := range st.Fields.List {
			text := field.Doc.Text()
			for _, n := range field.Names {
				out[n.Name] = text
			}
			if len(field.Names) == 0 { // embedded
				out[fmt.Sprint(field.Type)] = text
			}
		}
		return out, nil
	}
	return nil, fmt.Errorf("configdoc: no struct type %s in the Go files of %s", name, dir)
}

var defaultsTo = regexp.MustCompile(`(?s)\bDefaults?(?: to)?\s+(.*)`)
var required = regexp.MustCompile(`(?i)\brequired\b`)

// commentDefault returns what a doc comment states as the default: the text
// after "Defaults to" up to the end of its sentence, "required", or "".
func commentDefault(doc string) string {
	doc = strings.Join(strings.Fields(doc), " ")
	if m := defaultsTo.FindStringSubmatch(doc); m != nil {
		s := m[1]
		for i := 0; i < len(s); i++ {
			if s[i] == '.' && (i+1 == len(s) || s[i+1] == ' ') {
				return s[:i]
			}
		}
		return s
	}
	if required.MatchString(doc) {
		return "required"
	}
	return ""
}

// docRows returns the default column of each row of the table under the
// heading that contains section, keyed by the row's first `name`.
func docRows(section string) (map[string]string, error) {
	path, err := configurationMD()
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	rows := map[string]string{}
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "#") {
			if in {
				break
			}
			in = strings.Contains(line, section)
			continue
		}
		if !in || !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(line, " | ")
		if len(cells) < 3 {
			continue
		}
		name := strings.SplitN(strings.TrimPrefix(cells[0], "| `"), "`", 2)[0]
		rows[name] = cells[1]
	}
	if !in && len(rows) == 0 {
		return nil, fmt.Errorf("configdoc: no section %s in %s", section, path)
	}
	return rows, nil
}

// configurationMD finds docs/configuration.md above the working directory.
func configurationMD() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return filepath.Join(dir, "docs", "configuration.md"), nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("configdoc: no go.mod above the working directory")
		}
		dir = parent
	}
}

// agrees checks that text, a stated default, names v's value.
func (s Spec) agrees(text string, v reflect.Value) error {
	text = strings.TrimSpace(strings.ReplaceAll(strings.ReplaceAll(text, "**", ""), "`", ""))
	if text == "" {
		return fmt.Errorf("states no default (want %s)", show(v))
	}
	if required.MatchString(cut(text)) {
		if !v.IsZero() {
			return fmt.Errorf("says required, but the default is %s", show(v))
		}
		return nil
	}
	head, value := split(text)
	checked := false
	if name := strings.Trim(head, "[]"); name != "" {
		if want, ok := s.lookup(name); ok {
			if !same(want, v) {
				return fmt.Errorf("%q is %v, the default is %s", head, want, show(v))
			}
			checked = true
		} else if value == "" {
			value = head
		}
	}
	if value == "" {
		if checked {
			return nil
		}
		return fmt.Errorf("cannot read %q as a value (name it in Spec.Names or Spec.Described)", text)
	}
	want, err := parseValue(value, v.Type())
	if err != nil && checked {
		return nil // the name was the value; the parenthesis explains it
	}
	if err != nil {
		return fmt.Errorf("%q: %w (name it in Spec.Names or Spec.Described)", text, err)
	}
	if !same(want, v) {
		return fmt.Errorf("states %q, the default is %s", text, show(v))
	}
	return nil
}

// split cuts a stated default into a leading name and the value after
// it ("X (1 hour)", "X = 1 hour"), dropping explanations after ": " or " (".
func split(text string) (head, value string) {
	if strings.HasPrefix(text, `"`) {
		if end := strings.Index(text[1:], `"`); end >= 0 {
			return "", text[:end+2]
		}
	}
	if i := strings.Index(text, ": "); i >= 0 {
		text = text[:i]
	}
	eq, paren := strings.Index(text, " = "), strings.Index(text, " (")
	if eq >= 0 && (paren < 0 || eq < paren) {
		return text[:eq], cut(text[eq+3:])
	}
	if i := paren; i >= 0 {
		head = text[:i]
		if _, err := parseValue(head, nil); err == nil {
			return "", head
		}
		return head, strings.SplitN(text[i+2:], ")", 2)[0]
	}
	return cut(text), ""
}

func cut(text string) string {
	for _, sep := range []string{": ", " (", "; ", ", "} {
		if i := strings.Index(text, sep); i >= 0 {
			text = text[:i]
		}
	}
	return strings.TrimSpace(text)
}

func (s Spec) lookup(name string) (any, bool) {
	if v, ok := s.Names[name]; ok {
		return v, true
	}
	if i := strings.LastIndex(name, "."); i >= 0 {
		v, ok := s.Names[name[i+1:]]
		return v, ok
	}
	return nil, false
}

var durationRe = regexp.MustCompile(`^([0-9.]+)\s*(ns|µs|us|ms|s|sec|seconds?|min|minutes?|h|hours?|days?)$`)

var bytesRe = regexp.MustCompile(`^([0-9]+)\s*(KiB|MiB)$`)

var units = map[string]time.Duration{
	"ns": time.Nanosecond, "µs": time.Microsecond, "us": time.Microsecond, "ms": time.Millisecond,
	"s": time.Second, "sec": time.Second, "second": time.Second, "seconds": time.Second,
	"min": time.Minute, "minute": time.Minute, "minutes": time.Minute,
	"h": time.Hour, "hour": time.Hour, "hours": time.Hour, "day": 24 * time.Hour, "days": 24 * time.Hour,
}

// parseValue reads text as a value (of type t when t is not nil).
func parseValue(text string, t reflect.Type) (any, error) {
	switch {
	case text == "nil" || text == "none":
		return nil, nil
	case text == "true" || text == "false":
		return text == "true", nil
	case strings.HasPrefix(text, `"`):
		return strconv.Unquote(text)
	}
	if m := durationRe.FindStringSubmatch(text); m != nil {
		f, err := strconv.ParseFloat(m[1], 64)
		if err != nil {
			return nil, err
		}
		return time.Duration(f * float64(units[m[2]])), nil
	}
	if m := bytesRe.FindStringSubmatch(text); m != nil {
		n, err := strconv.ParseFloat(m[1], 64)
		return n * map[string]float64{"KiB": 1 << 10, "MiB": 1 << 20}[m[2]], err
	}
	f, err := strconv.ParseFloat(strings.ReplaceAll(text, ",", ""), 64)
	if err != nil {
		return nil, fmt.Errorf("not a value")
	}
	if t != nil && t == reflect.TypeOf(time.Duration(0)) && f != 0 {
		return nil, fmt.Errorf("a duration without a unit")
	}
	return f, nil
}

// same reports whether want (a parsed or named value) equals v.
func same(want any, v reflect.Value) bool {
	if want == nil {
		switch v.Kind() {
		case reflect.Func, reflect.Pointer, reflect.Interface, reflect.Map, reflect.Slice:
			return v.IsNil()
		}
		return false
	}
	if v.Kind() == reflect.Interface && !v.IsNil() {
		v = v.Elem()
	}
	w := reflect.ValueOf(want)
	if w.Kind() == reflect.Func && v.Kind() == reflect.Func {
		return !v.IsNil() && w.Pointer() == v.Pointer()
	}
	if f, ok := want.(float64); ok {
		switch v.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
			return float64(v.Int()) == f
		case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			return float64(v.Uint()) == f
		case reflect.Float32, reflect.Float64:
			return v.Float() == f
		}
		return false
	}
	if d, ok := want.(time.Duration); ok && v.Kind() == reflect.Int64 {
		return time.Duration(v.Int()) == d
	}
	if w.Type().ConvertibleTo(v.Type()) && w.Kind() == v.Kind() {
		return reflect.DeepEqual(w.Convert(v.Type()).Interface(), v.Interface())
	}
	return false
}

func show(v reflect.Value) string {
	if v.Kind() == reflect.Func {
		if v.IsNil() {
			return "nil"
		}
		return "a func"
	}
	if d, ok := v.Interface().(time.Duration); ok {
		return d.String()
	}
	return fmt.Sprintf("%#v", v.Interface())
}
