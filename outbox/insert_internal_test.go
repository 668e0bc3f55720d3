package outbox

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
)

// The outbox writes its rows as watermill-sql's PostgreSQL publisher would:
// the same statement, the same arguments.
func TestInsertMatchesWatermillSQL(t *testing.T) {
	t.Parallel()
	o, err := New(Config{Schema: "s"}, nil)
	require.NoError(t, err)
	for n := 1; n <= 3; n++ {
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = message.NewMessage(string(rune('a'+i)), []byte(`{"amount":1}`))
			msgs[i].Metadata.Set("event_id", "0190a0a0-0000-7000-8000-00000000000"+string(rune('1'+i)))
			msgs[i].Metadata.Set("note", `<"escaped">`[:i*4])
		}
		want, err := o.schema.InsertQuery(wsql.InsertQueryParams{Topic: "orders", Msgs: msgs})
		require.NoError(t, err)
		require.Equal(t, want.Query, insertQuery(o.MessagesTable("orders"), n))
		args, err := insertArgs(msgs)
		require.NoError(t, err)
		require.Equal(t, want.Args, args)
	}
}
