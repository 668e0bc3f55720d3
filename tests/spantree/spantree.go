// Package spantree renders one trace, as the OpenTelemetry SDK's in-memory
// exporter (sdk/trace/tracetest) holds it, as a small indented tree: the
// otelchain tests log it, and the billing demo (examples/billing) prints one
// order's trace with it.
package spantree

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/watermill-idempotency/internal/otelx"
)

// Minimum widths of the name and service columns.
const (
	nameWidth    = 48
	serviceWidth = 14
)

// Tree renders the spans of one trace as an indented tree (children in
// start order), each line with the span's name, its service, its duration,
// and the dedup outcome and Idempotency-Key when the span has them
// (otelx.AttrOutcome, otelx.AttrIdempotencyKey). The service is the
// resource's service.name when the TracerProvider was given one, else the
// last element of the span's instrumentation scope (the package that made
// it). Spans of other traces that link into the trace (the forwarder's
// batch spans) are listed under the span they link to, marked "linked:".
// Spans whose parent is not among spans start trees of their own.
func Tree(spans tracetest.SpanStubs, traceID trace.TraceID) string {
	type line struct {
		depth   int
		prefix  string
		span    tracetest.SpanStub
		service string
	}
	present := map[trace.SpanID]bool{}
	for _, s := range spans {
		if s.SpanContext.TraceID() == traceID {
			present[s.SpanContext.SpanID()] = true
		}
	}
	byParent := map[trace.SpanID]tracetest.SpanStubs{}
	linkedTo := map[trace.SpanID]tracetest.SpanStubs{}
	var roots tracetest.SpanStubs
	for _, s := range spans {
		switch {
		case s.SpanContext.TraceID() != traceID:
			for _, l := range s.Links {
				if l.SpanContext.TraceID() == traceID {
					linkedTo[l.SpanContext.SpanID()] = append(linkedTo[l.SpanContext.SpanID()], s)
				}
			}
		case !s.Parent.IsValid() || s.Parent.TraceID() != traceID || !present[s.Parent.SpanID()]:
			roots = append(roots, s)
		default:
			byParent[s.Parent.SpanID()] = append(byParent[s.Parent.SpanID()], s)
		}
	}
	byStart := func(ss tracetest.SpanStubs) {
		sort.SliceStable(ss, func(i, j int) bool { return ss[i].StartTime.Before(ss[j].StartTime) })
	}
	var lines []line
	var walk func(depth int, s tracetest.SpanStub)
	walk = func(depth int, s tracetest.SpanStub) {
		lines = append(lines, line{depth: depth, span: s, service: Service(s)})
		linked := linkedTo[s.SpanContext.SpanID()]
		byStart(linked)
		for _, l := range linked {
			lines = append(lines, line{depth: depth + 1, prefix: "linked: ", span: l, service: Service(l)})
		}
		kids := byParent[s.SpanContext.SpanID()]
		byStart(kids)
		for _, k := range kids {
			walk(depth+1, k)
		}
	}
	byStart(roots)
	for _, r := range roots {
		walk(0, r)
	}

	nw, sw := nameWidth, serviceWidth
	for _, l := range lines {
		nw = max(nw, len(strings.Repeat("  ", l.depth)+l.prefix+l.span.Name))
		sw = max(sw, len(l.service))
	}
	var b strings.Builder
	for _, l := range lines {
		s := l.span
		fmt.Fprintf(&b, "%-*s %-*s %8s", nw, strings.Repeat("  ", l.depth)+l.prefix+s.Name, sw, l.service, s.EndTime.Sub(s.StartTime).Round(10*time.Microsecond))
		if o := attr(s, otelx.AttrOutcome).AsString(); o != "" {
			fmt.Fprintf(&b, " outcome=%s", o)
		}
		if k := attr(s, otelx.AttrIdempotencyKey).AsString(); k != "" {
			fmt.Fprintf(&b, " idempotency_key=%s", k)
		}
		b.WriteString("\n")
	}
	return b.String()
}

// Service returns the service.name of s's resource, or, when the provider
// had none (the SDK's default "unknown_service:…"), the last element of
// s's instrumentation scope.
func Service(s tracetest.SpanStub) string {
	if s.Resource != nil {
		if v, ok := s.Resource.Set().Value("service.name"); ok && v.AsString() != "" && !strings.HasPrefix(v.AsString(), "unknown_service") {
			return v.AsString()
		}
	}
	return s.InstrumentationScope.Name[strings.LastIndex(s.InstrumentationScope.Name, "/")+1:]
}

func attr(s tracetest.SpanStub, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}
