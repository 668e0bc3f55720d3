// The demo's services: the provider, the forwarder, the consumers and the auditors, started and stopped.

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"golang.org/x/sync/errgroup"

	"github.com/idemkit/watermill-idempotency/idemkafka"
	"github.com/idemkit/watermill-idempotency/idemkafka/parallel"
	idem "github.com/idemkit/watermill-idempotency/middleware"
	"github.com/idemkit/watermill-idempotency/outbox"
)

// startServices starts the payment provider, the outbox forwarder, the
// billing and notification consumers and the auditors, and waits until the
// routers run.
func (d *demo) startServices(ctx context.Context) error {
	p, err := newPaymentProvider(d.cfg.ProviderLatency)
	if err != nil {
		return err
	}
	p.ignoreKeys = d.cfg.providerIgnoresKeys
	d.provider = p
	d.onClose(ignoreError(p.Close))
	d.progress("payment provider on %s", p.URL())

	d.bg, d.bgCtx = errgroup.WithContext(ctx)
	d.stopBG, d.stopAll = context.WithCancel(d.bgCtx)

	d.fwd, err = outbox.NewForwarder(outbox.ForwarderConfig{DB: d.fwdPool, Outbox: d.ob, Producer: d.producer, PollInterval: 20 * time.Millisecond,
		TracerProvider: d.providers[serviceForwarder]}, d.cfg.Logger)
	if err != nil {
		return err
	}
	d.bg.Go(func() error { return d.fwd.Run(d.stopBG) })

	poison, err := wmw.PoisonQueueWithFilter(d.kafkaPub, d.n.poison, idem.IsPermanent)
	if err != nil {
		return err
	}
	billingCfg := idem.Config{DB: d.billingPool, ConsumerGroup: d.n.billing, Table: d.table, Outbox: d.ob, TracerProvider: d.providers[serviceBilling],
		Concurrency: d.cfg.BillingInstances * d.cfg.BillingInFlight,
		Mode: &idem.LeaseConfig{Duration: d.cfg.LeaseDuration, RenewInterval: d.cfg.leaseRenew(), Concurrency: d.cfg.LeaseConcurrency,
			Owner: fmt.Sprintf("billing (demo, pid %d)", os.Getpid())}}
	if d.cfg.billingTxMode {
		billingCfg.Mode = nil // transaction mode
	}
	billingSvc := NewBillingService(p.URL())
	// Billing runs in lease mode: its provider call holds no transaction
	// and no connection, so its pool does not grow with the charges in
	// flight (2 × LeaseConfig.Concurrency + 1 connections for any MaxInFlight).
	d.billing, err = d.newConsumer("billing", d.cfg.BillingInstances, d.newParallelSubscriber, poison, billingCfg,
		func(r *message.Router, handler string, sub message.Subscriber) *message.Handler {
			// The router closes each handler's publisher on shutdown; the
			// handlers share kafkaPub (closed at the end), so each gets a view
			// whose Close does nothing: watermill-kafka's Close is not safe
			// to call twice concurrently.
			return r.AddHandler(handler, d.n.orders, sub, d.n.charged, sharedPublisher{d.kafkaPub}, billingSvc.Handle)
		})
	if err != nil {
		return err
	}
	d.notification, err = d.newConsumer("notification", 1, d.newWatermillSubscriber, poison,
		idem.Config{DB: d.pool, ConsumerGroup: d.n.notification, Table: d.table, TracerProvider: d.providers[serviceNotification]},
		func(r *message.Router, handler string, sub message.Subscriber) *message.Handler {
			return r.AddConsumerHandler(handler, d.n.orders, sub, NotificationService{}.Handle)
		})
	if err != nil {
		return err
	}
	if err := d.startAuditors(); err != nil {
		return err
	}

	routers := []*message.Router{d.billing.router, d.notification.router}
	for _, r := range routers {
		d.bg.Go(func() error { return r.Run(d.stopBG) })
	}
	for _, r := range routers {
		select {
		case <-r.Running():
		case <-ctx.Done():
			return fmt.Errorf("routers did not start: %w", ctx.Err())
		}
	}
	d.progress("billing (%d instances, group %s) and notification (group %s) running", d.cfg.BillingInstances, d.n.billing, d.n.notification)
	return nil
}

// newConsumer builds one consumer group: a router with one handler per
// instance (each with its own subscriber in the group), every handler behind
// PoisonQueue → counting wrapper → dedup middleware → marker.
func (d *demo) newConsumer(service string, instances int, newSub func(group string) (message.Subscriber, error), poison message.HandlerMiddleware, cfg idem.Config,
	add func(r *message.Router, handler string, sub message.Subscriber) *message.Handler,
) (*consumer, error) {
	// CloseTimeout is a deadline for a busy machine, not an expected
	// duration: closing waits for in-flight handlers and for Sarama to leave
	// the consumer group.
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, d.cfg.Logger)
	if err != nil {
		return nil, err
	}
	dedup, err := idem.NewDedup(cfg, d.cfg.Logger)
	if err != nil {
		return nil, err
	}
	c := &consumer{router: r, dedup: dedup, stats: &groupStats{dedup: dedup}}
	for i := 1; i <= instances; i++ {
		sub, err := newSub(cfg.ConsumerGroup)
		if err != nil {
			return nil, err
		}
		// The handler name starts with the service: the poison topic's
		// handler_poisoned metadata tells the auditor whose rejection it is.
		h := add(r, service+"-"+strconv.Itoa(i), sub)
		h.AddMiddleware(poison, c.stats.outer, dedup.Middleware, inner)
	}
	return c, nil
}

// newParallelSubscriber is billing's subscriber: idemkafka/parallel's, which keeps
// BillingInFlight charges in flight per instance, ordered by order key.
func (d *demo) newParallelSubscriber(group string) (message.Subscriber, error) {
	return parallel.NewSubscriber(parallel.SubscriberConfig{
		Client:              idemkafka.ClientConfig{Brokers: d.brokers},
		ConsumerGroup:       group,
		MaxInFlight:         d.cfg.BillingInFlight,
		NackResendSleep:     20 * time.Millisecond,
		ReconnectRetrySleep: 100 * time.Millisecond,
	}, d.cfg.Logger)
}

// newWatermillSubscriber is a service's subscriber: it keeps the group's
// position in PostgreSQL beside the claims (a failover to an asynchronous
// standby, or a restore, then skips no event).
func (d *demo) newWatermillSubscriber(group string) (message.Subscriber, error) {
	return d.newSubscriberWith(idemkafka.ClientConfig{Brokers: d.brokers, Progress: d.pool, ProgressSchema: d.table.Schema, ProgressTable: d.table.Table}, group)
}

// newSubscriber is an auditor's subscriber (no dedup, no position kept).
func (d *demo) newSubscriber(group string) (*kafka.Subscriber, error) {
	return d.newSubscriberWith(idemkafka.ClientConfig{Brokers: d.brokers}, group)
}

func (d *demo) newSubscriberWith(cc idemkafka.ClientConfig, group string) (*kafka.Subscriber, error) {
	sc, err := idemkafka.WatermillSubscriberConfig(cc, group)
	if err != nil {
		return nil, err
	}
	sc.NackResendSleep = 20 * time.Millisecond
	sc.ReconnectRetrySleep = 100 * time.Millisecond
	return kafka.NewSubscriber(sc, d.cfg.Logger)
}

// startAuditors consumes the poison topic and billing.charged in groups of
// their own, to check what reached them.
func (d *demo) startAuditors() error {
	d.audit = newAuditor()
	for _, a := range []struct{ group, topic string }{{d.n.auditPoison, d.n.poison}, {d.n.auditCharge, d.n.charged}} {
		sub, err := d.newSubscriber(a.group)
		if err != nil {
			return err
		}
		ch, err := sub.Subscribe(d.stopBG, a.topic)
		if err != nil {
			_ = sub.Close()
			return fmt.Errorf("subscribe %s: %w", a.topic, err)
		}
		poison := a.topic == d.n.poison
		d.bg.Go(func() error {
			defer sub.Close()
			for msg := range ch {
				d.audit.record(poison, msg)
				msg.Ack()
			}
			return nil
		})
	}
	return nil
}

// stopServices closes the consumers, so that their counts are final, then
// the auditors and the forwarder. Closing one billing instance hands its
// partitions to the other, which may receive records again whose offsets
// were not committed yet: they are counted like any other delivery.
func (d *demo) stopServices(ctx context.Context) error {
	for _, r := range []*message.Router{d.billing.router, d.notification.router} {
		if err := r.Close(); err != nil {
			return fmt.Errorf("close router: %w", err)
		}
	}
	// Every rejection published one poison record: wait until the auditor
	// has read them all.
	if err := d.waitFor(ctx, "shutdown", func() bool {
		return d.audit.poisoned("billing") >= int(d.billing.stats.rejected.Load()) &&
			d.audit.poisoned("notification") >= int(d.notification.stats.rejected.Load())
	}); err != nil {
		return err
	}
	d.stopAll()
	_ = d.fwd.Close()
	if err := d.bg.Wait(); err != nil && !errors.Is(err, context.Canceled) {
		return fmt.Errorf("background: %w", err)
	}
	return nil
}

// pruneOutbox deletes what the forwarder has sent with
// outbox.DeleteForwarded: the forwarder never prunes the outbox tables
// (docs/operations.md).
func (d *demo) pruneOutbox(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	for _, topic := range []string{d.n.orders, d.n.charged} {
		total := d.count(ctx, `SELECT count(*) FROM `+d.ob.MessagesTable(topic))
		pruned, err := d.ob.DeleteForwarded(ctx, d.pool, &outbox.DeleteForwardedOpts{Topics: []string{topic}})
		if err != nil {
			d.rep.Violations = append(d.rep.Violations, err.Error())
			continue
		}
		d.rep.OutboxPruned += pruned
		d.check(pruned == int64(total), "outbox %s: pruned %d of %d forwarded rows", topic, pruned, total)
	}
}
