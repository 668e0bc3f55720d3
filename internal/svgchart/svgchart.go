// Package svgchart draws a time series as a small inline SVG line chart,
// on the server: the console's history charts need no JavaScript and load
// nothing from outside the binary (its Content-Security-Policy allows inline
// SVG markup, not scripts).
//
// The chart carries its values in data-values (and each point a <title>
// with its time and value), so a test or a screen reader reads what was
// drawn.
package svgchart

import (
	"fmt"
	"html"
	"strconv"
	"strings"
	"time"
)

// Point is one value of a series at a time.
type Point struct {
	At    time.Time
	Value float64
}

// Chart is what [Render] draws.
type Chart struct {
	// Title names the series ("processed per minute").
	Title string
	// Points are the series, oldest first.
	Points []Point
	// Width and Height are the SVG's size in pixels; 0 means 320 × 80.
	Width, Height int
}

const pad = 4

// Render returns the chart as an <svg> element. Text is escaped; the
// markup is safe to embed in HTML as is.
func Render(c Chart) string {
	w, h := c.Width, c.Height
	if w <= 0 {
		w = 320
	}
	if h <= 0 {
		h = 80
	}
	top, bottom := pad+14, h-pad-12 // room for the title above, the times below
	var maxV float64
	for _, p := range c.Points {
		maxV = max(maxV, p.Value)
	}
	vals := make([]string, len(c.Points))
	coords := make([]string, len(c.Points))
	var dots strings.Builder
	for i, p := range c.Points {
		x := float64(pad)
		if len(c.Points) > 1 {
			x += float64(i) * float64(w-2*pad) / float64(len(c.Points)-1)
		}
		y := float64(bottom)
		if maxV > 0 {
			y -= p.Value / maxV * float64(bottom-top)
		}
		vals[i] = num(p.Value)
		coords[i] = num(round1(x)) + "," + num(round1(y))
		fmt.Fprintf(&dots, `<circle cx="%s" cy="%s" r="1.5"><title>%s: %s</title></circle>`,
			num(round1(x)), num(round1(y)), p.At.UTC().Format("15:04"), num(p.Value))
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" width="%d" height="%d" viewBox="0 0 %d %d" data-title="%s" data-values="%s" data-max="%s">`,
		w, h, w, h, html.EscapeString(c.Title), strings.Join(vals, ","), num(maxV))
	fmt.Fprintf(&b, `<title>%s</title>`, html.EscapeString(c.Title))
	fmt.Fprintf(&b, `<text x="%d" y="%d" font-size="11">%s (max %s)</text>`, pad, pad+10, html.EscapeString(c.Title), num(maxV))
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#999" stroke-width="0.5"/>`, pad, bottom, w-pad, bottom)
	if len(c.Points) > 0 {
		fmt.Fprintf(&b, `<polyline fill="none" stroke="#2b6cb0" stroke-width="1.5" points="%s"/>`, strings.Join(coords, " "))
		b.WriteString(dots.String())
		first, last := c.Points[0].At.UTC(), c.Points[len(c.Points)-1].At.UTC()
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-size="9">%s</text>`, pad, h-pad, first.Format("15:04"))
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-size="9" text-anchor="end">%s UTC</text>`, w-pad, h-pad, last.Format("15:04"))
	} else {
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-size="10">no samples</text>`, pad, (top+bottom)/2)
	}
	b.WriteString(`</svg>`)
	return b.String()
}

func round1(f float64) float64 { return float64(int64(f*10+0.5)) / 10 }

func num(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }
