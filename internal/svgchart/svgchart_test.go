package svgchart_test

import (
	"encoding/xml"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemkit/watermill-idempotency/internal/svgchart"
)

// A known series is drawn as well-formed SVG: its values in data-values,
// one point each, the largest at the top, zero on the baseline, and the
// title escaped.
func TestRender(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 12, 4, 23, 0, 0, 0, time.UTC)
	svg := svgchart.Render(svgchart.Chart{Title: `processed <per> "minute"`, Width: 100, Height: 50, Points: []svgchart.Point{
		{t0, 0}, {t0.Add(time.Minute), 10}, {t0.Add(2 * time.Minute), 5},
	}})
	var doc struct {
		Values   string `xml:"data-values,attr"`
		Max      string `xml:"data-max,attr"`
		Polyline struct {
			Points string `xml:"points,attr"`
		} `xml:"polyline"`
		Circles []struct {
			Title string `xml:"title"`
		} `xml:"circle"`
	}
	require.NoError(t, xml.Unmarshal([]byte(svg), &doc), svg)
	require.Equal(t, "0,10,5", doc.Values)
	require.Equal(t, "10", doc.Max)
	require.Equal(t, "4,34 50,18 96,26", doc.Polyline.Points) // baseline 34, top 18
	require.Len(t, doc.Circles, 3)
	require.Equal(t, "23:01: 10", doc.Circles[1].Title)
	require.NotContains(t, svg, "<per>")
	require.Contains(t, svg, "&lt;per&gt;")

	empty := svgchart.Render(svgchart.Chart{Title: "failed"})
	require.NoError(t, xml.Unmarshal([]byte(empty), new(struct{})))
	require.True(t, strings.Contains(empty, "no samples"))
}
