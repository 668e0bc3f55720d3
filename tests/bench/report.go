package bench

import (
	"bufio"
	"encoding/json"
	"regexp"
	"strconv"
	"strings"
)

// Report is docs/benchmarks.json: every cell of every table of
// docs/benchmarks.md, one [Cell] per cell, so that scripts read the figures
// without parsing markdown. It is derived from the markdown (see
// [ParseReport]), so the two cannot disagree. Its field names are stable:
// add fields, never rename or remove one.
type Report struct {
	// Generated is the report's "- date:" line (RFC 3339, UTC).
	Generated string `json:"generated"`
	// Mode is "full" or "short", Load the load average at start.
	Mode string `json:"mode"`
	Load string `json:"load"`
	// Cells lists every table cell, section by section, row by row.
	Cells []Cell `json:"cells"`
}

// Cell is one table cell of the report.
type Cell struct {
	// Section is the title of the section ("Dedup overhead: ...").
	Section string `json:"section"`
	// Table numbers the tables of the section from 0.
	Table int `json:"table"`
	// Index numbers the rows of the table from 0.
	Index int `json:"index"`
	// Row is the row's label: its first cell and the cells after it up to
	// the first figure, joined by " | " (such as "8 | group, defaults").
	// Section, Table and Index identify a row; Row is for reading.
	Row string `json:"row"`
	// Column is the column's header.
	Column string `json:"column"`
	// Text is the cell as printed.
	Text string `json:"text"`
	// Median, Min and Max are set when the cell is a figure: a number, or
	// "median (min–max)" over rounds, then Min and Max too. A unit after
	// the number (ms, µs, ×) is dropped; Unit keeps it.
	Median *float64 `json:"median,omitempty"`
	Min    *float64 `json:"min,omitempty"`
	Max    *float64 `json:"max,omitempty"`
	Unit   string   `json:"unit,omitempty"`
}

var (
	// figureRe is a figure cell: "0.92 (0.87–0.97)", "2254", "4.5ms",
	// "−67µs", "1.12× the first row's ...".
	figureRe = regexp.MustCompile(`^([−-]?[0-9]+(?:\.[0-9]+)?)(ms|µs|s|×|%)?(?:\s*\(([−-]?[0-9]+(?:\.[0-9]+)?)–([−-]?[0-9]+(?:\.[0-9]+)?)\))?`)
	dateRe   = regexp.MustCompile(`^- date: (\S+)`)
	modeRe   = regexp.MustCompile(`^- mode: (\w+)`)
	loadRe   = regexp.MustCompile(`load average at start: (.+)$`)
)

// ParseReport reads the markdown report that cmd/bench writes and returns
// its tables as a [Report].
func ParseReport(markdown string) Report {
	r := Report{Cells: []Cell{}}
	var section string
	table, index := -1, -1
	var header []string
	inTable := false
	sc := bufio.NewScanner(strings.NewReader(markdown))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "## "):
			section, table, inTable = strings.TrimPrefix(line, "## "), -1, false
			continue
		case dateRe.MatchString(line) && r.Generated == "":
			r.Generated = dateRe.FindStringSubmatch(line)[1]
		case modeRe.MatchString(line) && r.Mode == "":
			r.Mode = modeRe.FindStringSubmatch(line)[1]
		case loadRe.MatchString(line) && r.Load == "":
			r.Load = loadRe.FindStringSubmatch(line)[1]
		}
		if !strings.HasPrefix(line, "|") {
			inTable = false
			continue
		}
		cells := splitRow(line)
		if !inTable {
			inTable, header, index = true, cells, -1
			table++
			continue
		}
		if isRule(cells) {
			continue
		}
		label := rowLabel(cells)
		index++
		for i, text := range cells {
			c := Cell{Section: section, Table: table, Index: index, Row: label, Text: text}
			if i < len(header) {
				c.Column = header[i]
			}
			parseFigure(&c)
			r.Cells = append(r.Cells, c)
		}
	}
	return r
}

// JSON renders r as docs/benchmarks.json: indented, ending in a newline.
func (r Report) JSON() ([]byte, error) {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

func splitRow(line string) []string {
	line = strings.TrimSpace(line)
	line = strings.TrimPrefix(line, "|")
	line = strings.TrimSuffix(line, "|")
	parts := strings.Split(line, "|")
	for i := range parts {
		parts[i] = strings.TrimSpace(parts[i])
	}
	return parts
}

func isRule(cells []string) bool {
	for _, c := range cells {
		if strings.Trim(c, "-: ") != "" {
			return false
		}
	}
	return true
}

// rowLabel is the row's first cell and the cells after it up to the first
// figure.
func rowLabel(cells []string) string {
	n := 1
	for n < len(cells) && !figureRe.MatchString(cells[n]) {
		n++
	}
	return strings.Join(cells[:min(n, len(cells))], " | ")
}

func parseFigure(c *Cell) {
	m := figureRe.FindStringSubmatch(c.Text)
	if m == nil {
		return
	}
	num := func(s string) *float64 {
		if s == "" {
			return nil
		}
		v, err := strconv.ParseFloat(strings.ReplaceAll(s, "−", "-"), 64)
		if err != nil {
			return nil
		}
		return &v
	}
	c.Median, c.Min, c.Max, c.Unit = num(m[1]), num(m[3]), num(m[4]), m[2]
}
