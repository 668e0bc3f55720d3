package middleware

import (
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/watermill-idempotency/internal/eventid"
)

var _ EventIDFunc = HeaderFirstEventIDFunc

// HeaderFirstEventIDFunc is the opt-out from the payload check of
// [DefaultEventIDFunc]: it reads the metadata key "event_id" and, only when
// that key is absent, the top-level JSON payload field "eventId". When the
// key is present the payload is not read, so a payload eventId that differs
// from it (or is not a UUID at all) is ignored instead of refused with
// [ErrEventIDMismatch]. Use it for producers whose payload eventId is not
// the event's id (for example, an upstream event's id copied into a new
// event). Ids must be canonical 36-character UUIDs, as for
// DefaultEventIDFunc.
//
//	cfg := idem.Config{EventIDFunc: idem.HeaderFirstEventIDFunc, …}
func HeaderFirstEventIDFunc(msg *message.Message) (uuid.UUID, error) {
	return eventid.FromMessageHeaderFirst(msg)
}
