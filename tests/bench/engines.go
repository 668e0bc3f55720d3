package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

func init() { Register("engines", engines) }

// engineRound is one variant of the engines section: a pipeline round's
// forwarded rate and CPU per event (this process's and the PostgreSQL
// backends'), 0 when the round was not forwarded in full.
type engineRound struct {
	name             string
	spec             pipelineSpec
	fwd, cpu, server []float64
}

// engines compares the Kafka engines on the end-to-end pipeline (Kafka →
// dedup → outbox → forwarder → Kafka, a fast handler), rounds rotated:
// watermill-kafka's subscriber with one transaction per message, the
// parallel subscriber (Sarama) with group commit and Sarama's forwarder
// producer, and the franz-go engine's subscriber with group commit and its
// forwarder producer.
func engines(ctx context.Context, o Options) (Section, error) {
	// 20,000 events: the group-commit rows forward over 12,000 msg/s, and
	// 6,000 made rounds of half a second, whose ratios one scheduling
	// hiccup swung by 0.2.
	n, rounds, fwdWait := 20000, 5, 20*time.Second
	if o.Short {
		n, rounds, fwdWait = 1500, 2, 5*time.Second
	}
	r, err := newE2ERig(ctx, o, n)
	if err != nil {
		return Section{}, err
	}
	defer r.close()
	// Every subscriber keeps its group's position in PostgreSQL, as
	// docs/guarantees.md recommends: no row pays a position write per
	// transaction.
	// The handler registers its business row with idem.CompleteExec: at
	// once in transaction mode, in the group's pipeline with group commit.
	base := pipelineSpec{in: r.in, n: n, fwdWait: fwdWait, subscriberProgress: true, completeExec: true}
	par := base
	par.parallel, par.groupCommit = parMaxInFlight, &idem.GroupCommitConfig{}
	fz := par
	fz.franz = true
	vs := []*engineRound{
		{name: "watermill-kafka subscriber (Sarama), one transaction per message", spec: base},
		{name: fmt.Sprintf("parallel subscriber (Sarama, MaxInFlight %d), group commit", parMaxInFlight), spec: par},
		{name: fmt.Sprintf("franz-go subscriber (MaxInFlight %d), group commit, franz-go forwarder producer", parMaxInFlight), spec: fz},
	}
	fns := make([]func() (float64, error), len(vs))
	for i, v := range vs {
		fns[i] = func() (float64, error) {
			res, err := r.pipelineWith(ctx, v.spec)
			if err != nil {
				return 0, fmt.Errorf("%s: %w", v.name, err)
			}
			if !res.complete {
				o.Logf("  engines, %s: only %d of %d forwarded within %s", v.name, res.forwardedNum, n, fwdWait)
				v.fwd, v.cpu, v.server = append(v.fwd, 0), append(v.cpu, 0), append(v.server, 0)
				return res.consumed, nil
			}
			o.Logf("  engines, %s: consumed %.0f msg/s, forwarded %.0f msg/s", v.name, res.consumed, res.forwarded)
			v.fwd = append(v.fwd, res.forwarded)
			v.cpu = append(v.cpu, float64(res.cpuPerEvent)/float64(time.Microsecond))
			v.server = append(v.server, float64(res.serverCPUPerEvent)/float64(time.Microsecond))
			return res.forwarded, nil
		}
	}
	if _, err := Rotate(rounds, fns...); err != nil {
		return Section{}, err
	}
	rows := make([][]string, 0, len(vs))
	for _, v := range vs {
		rows = append(rows, []string{v.name, fmtRate(nonZero(v.fwd)), Summarise(pairRatios(vs[0].fwd, v.fwd)).String(),
			Summarise(pairRatios(vs[1].fwd, v.fwd)).String(), fmtMicros(nonZero(v.cpu)), fmtMicros(nonZero(v.server))})
	}
	fzVsWK, fzVsPar := Summarise(pairRatios(vs[0].fwd, vs[2].fwd)), Summarise(pairRatios(vs[1].fwd, vs[2].fwd))
	o.Logf("  engines: franz-go/watermill-kafka %s (target ≥ 4×), franz-go/parallel %s (target ≥ 1.2×)", fzVsWK, fzVsPar)
	md := fmt.Sprintf("%d events per round, %d rounds rotated; the rate is from the first event handled to the last forwarded record read back; "+
		"CPU per event is this process's (pipeline, forwarder, reader, in-process broker) and the PostgreSQL backends'. "+
		"Every subscriber keeps its group's position in PostgreSQL (its `Progress` setting, as docs/guarantees.md recommends). "+
		"The handler registers its business row with `idem.CompleteExec` (run at once in transaction mode; with group commit sent with the group's outbox rows in one pipeline before its COMMIT) and returns one message for the outbox. "+
		"Targets (issue 48): franz-go ≥ 4× watermill-kafka: %s (median %.2f×); franz-go ≥ 1.2× the parallel subscriber: %s (median %.2f×).\n\n",
		n, rounds, pass(fzVsWK.Median >= 4), fzVsWK.Median, pass(fzVsPar.Median >= 1.2), fzVsPar.Median)
	md += Table([]string{"consumer", "forwarded msg/s", "× watermill-kafka", "× parallel (Sarama)", "CPU µs/event (process)", "CPU µs/event (PostgreSQL)"}, rows)
	fast, err := enginesFast(ctx, o)
	if err != nil {
		return Section{}, err
	}
	return Section{Title: "Kafka engines: Sarama against franz-go, end to end", Markdown: md + "\n" + fast}, nil
}

// enginesFast is issue 48's fast-handler row: the parallel section's fast
// handler (business row + outbox row, no forwarder) with group commit on
// the parallel subscriber (Sarama) and on the franz-go subscriber, rounds
// rotated, steady rates.
func enginesFast(ctx context.Context, o Options) (string, error) {
	n, rounds := 16000, 5
	if o.Short {
		n, rounds = 2000, 2
	}
	r, err := newParRig(ctx, o)
	if err != nil {
		return "", err
	}
	defer r.close()
	if err := r.warm(ctx); err != nil {
		return "", err
	}
	in, err := r.topic("bench-engines-fast")
	if err != nil {
		return "", err
	}
	if err := r.produce(in, n, 0); err != nil {
		return "", err
	}
	cs := []parConsumer{
		{name: fmt.Sprintf("parallel subscriber (Sarama, MaxInFlight %d), group commit (defaults)", parMaxInFlight), parallel: true, groupCommit: &idem.GroupCommitConfig{}, progress: true},
		{name: fmt.Sprintf("franz-go subscriber (MaxInFlight %d), group commit (defaults)", parMaxInFlight), franz: true, groupCommit: &idem.GroupCommitConfig{}, progress: true},
		// The ceiling: the same messages from memory, no Kafka client.
		{name: fmt.Sprintf("no Kafka: the same messages from memory (MaxInFlight %d), group commit (defaults)", parMaxInFlight), memory: true, groupCommit: &idem.GroupCommitConfig{}},
	}
	fns := make([]func() (float64, error), len(cs))
	for i, c := range cs {
		fns[i] = func() (float64, error) {
			res, err := r.run(ctx, c, parRun{topic: in, count: n, handler: r.fastExecHandler, steady: true})
			if err != nil {
				return 0, fmt.Errorf("engines, fast handler, %s: %w", c.name, err)
			}
			return res.rate, nil
		}
	}
	rates, err := Rotate(rounds, fns...)
	if err != nil {
		return "", err
	}
	st, ceil := Summarise(Ratios(rates[0], rates[1])), Summarise(Ratios(rates[0], rates[2]))
	// What each engine reaches of the ceiling, in the same round.
	franzOf, saramaOf := Summarise(Ratios(rates[2], rates[1])), Summarise(Ratios(rates[2], rates[0]))
	o.Logf("  engines, fast handler: franz-go/parallel %s (target ≥ 1.2×); no Kafka/parallel %s; of the no-Kafka ceiling: franz-go %s, Sarama %s", st, ceil, franzOf, saramaOf)
	rows := [][]string{
		{cs[0].name, fmtRate(rates[0]), "1", "–"},
		{cs[1].name, fmtRate(rates[1]), st.String(), fmt.Sprintf("≥ 1.2×: %s", pass(st.Median >= 1.2))},
		{cs[2].name, fmtRate(rates[2]), ceil.String(), "– (the ceiling)"},
	}
	md := fmt.Sprintf("The fast handler alone (issue 48's fast-handler target): the parallel section's workload (%d partitions, %d keys; "+
		"the business row registered with `idem.CompleteExec` and one outbox row, as in the table above; no forwarder), %d events per run, group commit on both engines, "+
		"each keeping its position in PostgreSQL; %d rounds rotated, steady rates (the commits between the 10th and the 90th percentile), ratios of the same round. "+
		"The last row is the ceiling of any engine: the same messages built in memory and handed to the same router, middleware and database, "+
		"at most %d unacked, with no Kafka client and no broker (nor key order, nor a position kept in PostgreSQL: a little above what even a free client could reach). Of that ceiling, in the same round, franz-go reaches %s and Sarama's parallel subscriber %s.\n\n",
		parPartitions, parKeys, n, rounds, parMaxInFlight, franzOf, saramaOf)
	return md + Table([]string{"consumer", "msg/s (median)", "× parallel (Sarama)", "target"}, rows), nil
}

// nonZero is xs without its zeros (rounds not measured).
func nonZero(xs []float64) []float64 {
	var out []float64
	for _, x := range xs {
		if x > 0 {
			out = append(out, x)
		}
	}
	return out
}

// pairRatios are subj[i]/base[i] for the rounds where both were measured.
func pairRatios(base, subj []float64) []float64 {
	var out []float64
	for i := range min(len(base), len(subj)) {
		if base[i] > 0 && subj[i] > 0 {
			out = append(out, subj[i]/base[i])
		}
	}
	return out
}

// fastExecHandler is fastHandler with the business row registered with
// idem.CompleteExec (gathered into the group's pipeline with group
// commit) and the outbox row published on the message's transaction.
func (r *parRig) fastExecHandler(msg *message.Message) error {
	ctx := msg.Context()
	if err := idem.CompleteExec(ctx, businessSQL, msg.UUID, int64(len(msg.Payload))); err != nil {
		return err
	}
	p, err := r.ob.PublisherFromContext(ctx)
	if err != nil {
		return err
	}
	return p.Publish(r.outT, message.NewMessage(watermill.NewUUID(), msg.Payload))
}
