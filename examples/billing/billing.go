package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	idem "github.com/idemkit/watermill-idempotency/middleware"
)

// Errors of the charge call. ErrProviderBusy and ErrChargeOutcomeUnknown are
// transient: the handler fails, nothing is written (its lease is released;
// in transaction mode its transaction and claim roll back), the message is
// redelivered and the call is repeated with the same Idempotency-Key.
var (
	ErrProviderBusy         = errors.New("payment provider: a request with this key is still in progress (409)")
	ErrChargeOutcomeUnknown = errors.New("payment provider: charge outcome unknown (response lost)")
	ErrChargeRejected       = errors.New("payment provider: charge rejected")
)

// BillingService charges confirmed orders. Its handler runs inside the dedup
// middleware of group billing-order-confirmed, in lease mode
// (idem.Config.Mode = &idem.LeaseConfig{}): the provider call runs with no transaction and no
// database connection held, so a slow provider holds neither.
//
//  1. the middleware takes a lease on (event, group) in a short transaction
//     of its own and commits it;
//  2. the handler decodes and validates order.confirmed.v1 (bad payload:
//     permanent error, poison topic);
//  3. it POSTs /charges to the payment provider through a client whose
//     transport sets Idempotency-Key from the event (operation "charge"):
//     the same key on every attempt, whoever makes it;
//  4. it registers the ledger row with idem.Complete and returns
//     billing.charged.v1: the middleware's completing transaction checks
//     the lease is still this delivery's, inserts the claim, runs the
//     registered write and writes the returned message to the outbox, and
//     commits, all or nothing.
//
// If anything fails after the provider charged (lost response, crash,
// lease lost to a takeover, failed COMMIT), nothing is written and the
// redelivered event calls the provider again with the same key: the
// provider answers with the first charge instead of charging twice.
// Handle works unchanged in transaction mode: idem.Complete then runs the
// write at once on the message's transaction.
type BillingService struct {
	ProviderURL string
	Client      *http.Client // its Transport is an idem.IdempotencyKeyTransport
}

// NewBillingService returns a service that charges through providerURL.
func NewBillingService(providerURL string) *BillingService {
	return &BillingService{
		ProviderURL: providerURL,
		Client: &http.Client{
			Transport: idem.NewIdempotencyKeyTransport(http.DefaultTransport, "charge"),
			Timeout:   10 * time.Second,
		},
	}
}

// Handle is the Watermill handler.
func (s *BillingService) Handle(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	ev, err := decodeOrderConfirmed(msg)
	if err != nil {
		return nil, err
	}
	charge, err := s.charge(msg, ev)
	if err != nil {
		return nil, err
	}
	// The ledger row is written by the transaction that completes the
	// event, after the call: none is open now.
	if err := idem.Complete(ctx, func(ctx context.Context, tx pgx.Tx) error {
		eventID, _ := idem.EventIDFromContext(ctx)
		if _, err := tx.Exec(ctx,
			`INSERT INTO ledger (order_id, customer_id, amount, currency, charge_id, event_id)
			 VALUES ($1, $2, $3::numeric, $4, $5, $6)`,
			ev.OrderID, ev.CustomerID, ev.TotalAmount, ev.Currency, charge.ChargeID, eventID); err != nil {
			return fmt.Errorf("ledger: %w", err)
		}
		return nil
	}); err != nil {
		return nil, err
	}

	out, err := billingChargedV1.Message(ctx, BillingCharged{
		OccurredAt: time.Now().UTC(), AggregateType: "Order",
		OrderID: ev.OrderID, ChargeID: charge.ChargeID, Amount: charge.Amount, Currency: charge.Currency,
	})
	if err != nil {
		return nil, err
	}
	// To the outbox, in the completing transaction (idem.Config.Outbox).
	return []*message.Message{out}, nil
}

func (s *BillingService) charge(msg *message.Message, ev OrderConfirmed) (chargeResponse, error) {
	// The body must be byte-identical on every attempt: the provider answers
	// 422 to a key reused with a different body.
	body, err := json.Marshal(chargeRequest{OrderID: ev.OrderID, CustomerID: ev.CustomerID, Amount: ev.TotalAmount, Currency: ev.Currency})
	if err != nil {
		return chargeResponse{}, err
	}
	req, err := http.NewRequestWithContext(msg.Context(), http.MethodPost, s.ProviderURL+"/charges", bytes.NewReader(body))
	if err != nil {
		return chargeResponse{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := s.Client.Do(req)
	if err != nil {
		return chargeResponse{}, withCause(req.Context(), fmt.Errorf("%w: %w", ErrChargeOutcomeUnknown, err))
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	switch {
	case err != nil:
		// Status line received, body cut: the charge may have happened.
		return chargeResponse{}, withCause(req.Context(), fmt.Errorf("%w: reading the response: %w", ErrChargeOutcomeUnknown, err))
	case resp.StatusCode == http.StatusConflict:
		return chargeResponse{}, ErrProviderBusy
	case resp.StatusCode >= 500:
		return chargeResponse{}, fmt.Errorf("%w: status %d", ErrChargeOutcomeUnknown, resp.StatusCode)
	case resp.StatusCode == http.StatusUnprocessableEntity, resp.StatusCode >= 400:
		// A key reused with another body, or a request the provider refuses:
		// retrying cannot help. Poison queue, with the provider's reason.
		return chargeResponse{}, idem.Permanent(fmt.Errorf("%w: status %d: %s", ErrChargeRejected, resp.StatusCode, bytes.TrimSpace(raw)))
	}
	var cr chargeResponse
	if err := json.Unmarshal(raw, &cr); err != nil || cr.ChargeID == "" {
		return chargeResponse{}, fmt.Errorf("%w: undecodable %d response", ErrChargeOutcomeUnknown, resp.StatusCode)
	}
	return cr, nil
}

// withCause adds to err why ctx was cancelled, when its cause says more
// than context.Canceled: in lease mode, idem.ErrLeaseLost (a renewal found
// the lease taken over, and cancelled the call).
func withCause(ctx context.Context, err error) error {
	if c := context.Cause(ctx); c != nil && !errors.Is(c, context.Canceled) && !errors.Is(err, c) {
		return fmt.Errorf("%w (call cancelled: %w)", err, c)
	}
	return err
}

// NotificationService sends an "order confirmed" notification once per
// order. It consumes the same topic as billing in its own group
// (notification-order-confirmed): the dedup key is (event id, group), so
// each service applies every event once, independently.
type NotificationService struct{}

// Handle is the Watermill handler.
func (NotificationService) Handle(msg *message.Message) error {
	ctx := msg.Context()
	ev, err := decodeOrderConfirmed(msg)
	if err != nil {
		return err
	}
	eventID, _ := idem.EventIDFromContext(ctx)
	// A real service would enqueue the e-mail here, on this transaction
	// (e.g. a River job), so it is sent only if the claim commits.
	if _, err := idem.MustTxFromContext(ctx).Exec(ctx,
		`INSERT INTO notifications (order_id, customer_id, kind, event_id) VALUES ($1, $2, 'order_confirmed_email', $3)`,
		ev.OrderID, ev.CustomerID, eventID); err != nil {
		return fmt.Errorf("notification: %w", err)
	}
	return nil
}
