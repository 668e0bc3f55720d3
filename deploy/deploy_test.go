// Package deploy_test checks the Grafana dashboard and the Prometheus alert
// rules shipped in deploy/ against the metrics components/idemprom exports,
// and runs promtool's checks and unit tests of the rules.
package deploy_test

import (
	"encoding/json"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"gopkg.in/yaml.v3"

	"github.com/idemkit/watermill-idempotency/components/idemprom"
)

// promtoolHint is the one line a run without promtool prints.
const promtoolHint = "promtool checks skipped: no promtool found (apt-get install -y prometheus)"

// exported returns every metric idemprom describes, with its labels.
func exported(t *testing.T) map[string][]string {
	t.Helper()
	ch := make(chan *prometheus.Desc, 100)
	idemprom.NewCollector().Describe(ch)
	close(ch)
	re := regexp.MustCompile(`^Desc\{fqName: "([^"]+)", .*variableLabels: \{([^}]*)\}\}$`)
	out := map[string][]string{}
	for d := range ch {
		m := re.FindStringSubmatch(d.String())
		require.NotNil(t, m, d.String())
		out[m[1]] = nil
		if m[2] != "" {
			out[m[1]] = strings.Split(m[2], ",")
		}
	}
	require.NotEmpty(t, out)
	return out
}

var (
	metricRe  = regexp.MustCompile(`\b(idem_[a-z0-9_]+)(\{[^}]*\})?`)
	matcherRe = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)`)
	byRe      = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
	legendRe  = regexp.MustCompile(`\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}`)
	labelsRe  = regexp.MustCompile(`\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)`)
)

// checkExpr requires every metric expr names to be exported with the
// labels its matchers, its aggregations and shown (legend or annotation
// labels) name; it returns the metrics.
func checkExpr(t *testing.T, metrics map[string][]string, where, expr string, shown []string) []string {
	t.Helper()
	var names []string
	var labels []string // of every metric named
	for _, m := range metricRe.FindAllStringSubmatch(expr, -1) {
		name := m[1]
		have, ok := metrics[name]
		require.True(t, ok, "%s: %s is not exported by idemprom", where, name)
		names = append(names, name)
		labels = append(labels, have...)
		for _, mm := range matcherRe.FindAllStringSubmatch(m[2], -1) {
			require.Contains(t, have, mm[1], "%s: %s has no label %s", where, name, mm[1])
		}
	}
	require.NotEmpty(t, names, "%s: names no idem_ metric: %s", where, expr)
	var kept []string // labels an aggregation keeps
	for _, m := range byRe.FindAllStringSubmatch(expr, -1) {
		for _, l := range strings.Split(m[1], ",") {
			l = strings.TrimSpace(l)
			require.Contains(t, labels, l, "%s: aggregates by %s, which none of %v has", where, l, names)
			kept = append(kept, l)
		}
	}
	for _, l := range shown {
		require.Contains(t, labels, l, "%s: shows label %s, which none of %v has", where, l, names)
		if len(kept) > 0 {
			require.Contains(t, kept, l, "%s: shows label %s, which the aggregation drops", where, l)
		}
	}
	return names
}

func legendLabels(s string) []string {
	var out []string
	for _, m := range legendRe.FindAllStringSubmatch(s, -1) {
		out = append(out, m[1])
	}
	return out
}

// Every query of the dashboard names metrics and labels idemprom exports.
func TestDashboardNamesExportedMetrics(t *testing.T) {
	metrics := exported(t)
	b, err := os.ReadFile("grafana/watermill-idempotency.json")
	require.NoError(t, err)
	var dash struct {
		Panels []struct {
			Type    string `json:"type"`
			Title   string `json:"title"`
			Targets []struct {
				Expr         string `json:"expr"`
				LegendFormat string `json:"legendFormat"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Name       string `json:"name"`
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	require.NoError(t, json.Unmarshal(b, &dash))
	used := map[string]bool{}
	graphs := 0
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		graphs++
		require.NotEmpty(t, p.Targets, p.Title)
		for _, tg := range p.Targets {
			for _, n := range checkExpr(t, metrics, "panel "+p.Title, tg.Expr, legendLabels(tg.LegendFormat)) {
				used[n] = true
			}
		}
	}
	require.Positive(t, graphs)
	labelValues := regexp.MustCompile(`^label_values\((idem_[a-z0-9_]+), ([a-z_]+)\)$`)
	for _, v := range dash.Templating.List {
		if v.Definition == "" {
			continue
		}
		m := labelValues.FindStringSubmatch(v.Definition)
		require.NotNil(t, m, "variable %s: %s", v.Name, v.Definition)
		require.Contains(t, metrics[m[1]], m[2], "variable %s", v.Name)
	}
	for _, want := range []string{"idem_dedup_processed_total", "idem_dedup_duplicates_total", "idem_dedup_rejected_total", "idem_dedup_failed_total",
		"idem_dedup_claim_seconds_total", "idem_outbox_pending_rows", "idem_outbox_oldest_pending_seconds", "idem_outbox_forwarded_total",
		"idem_retry_retried_total", "idem_retry_parked_keys", "idem_dedup_last_clean_timestamp_seconds", "idem_dedup_table_bytes",
		"idem_kafka_in_flight", "idem_kafka_partition_window", "idem_kafka_partition_distance"} {
		require.True(t, used[want], "the dashboard shows no %s", want)
	}
}

type rulesFile struct {
	Groups []struct {
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// Every alert names metrics and labels idemprom exports, and has a unit
// test in alerts_test.yml where it fires.
func TestAlertRulesNameExportedMetrics(t *testing.T) {
	metrics := exported(t)
	var rules rulesFile
	b, err := os.ReadFile("prometheus/alerts.yml")
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(b, &rules))
	var tests struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	b, err = os.ReadFile("prometheus/alerts_test.yml")
	require.NoError(t, err)
	require.NoError(t, yaml.Unmarshal(b, &tests))
	fires := map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			fires[a.Alertname] = fires[a.Alertname] || len(a.ExpAlerts) > 0
		}
	}
	var alerts []string
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			var shown []string
			for _, a := range r.Annotations {
				for _, m := range labelsRe.FindAllStringSubmatch(a, -1) {
					shown = append(shown, m[1])
				}
			}
			checkExpr(t, metrics, "alert "+r.Alert, r.Expr, shown)
			require.True(t, fires[r.Alert], "alert %s has no unit test in which it fires (alerts_test.yml)", r.Alert)
			alerts = append(alerts, r.Alert)
		}
	}
	for _, want := range []string{"IdemOutboxRelayStalled", "IdemParkedKeysOld", "IdemStaleEventBurst", "IdemCleanerNotRun", "IdemCommitMetadataRefused", "IdemPartitionStalled"} {
		require.True(t, slices.Contains(alerts, want), "no alert %s", want)
	}
}

// promtool check rules and test rules pass (CI installs promtool).
func TestPromtool(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip(promtoolHint)
	}
	for _, args := range [][]string{{"check", "rules", "alerts.yml"}, {"test", "rules", "alerts_test.yml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "prometheus"
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "promtool %s:\n%s", strings.Join(args, " "), out)
		require.Contains(t, string(out), "SUCCESS", "promtool %s:\n%s", strings.Join(args, " "), out)
	}
}
