module github.com/idemkit/watermill-idempotency/tests/release

go 1.26.0

require golang.org/x/mod v0.31.0
