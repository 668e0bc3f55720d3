package outboxsql

import (
	"encoding/json"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

func FuzzDecodeMetadata(f *testing.F) {
	for _, s := range []string{
		`{}`, `{"a":"b"}`, `{"event_id":"0190a0a0-0000-7000-8000-000000000000","partition_key":"order-1"}`,
		`{"a":"\"quoted\""}`, `{"a":"<&>"}`, `{"a": "spaced"}`, `{"a":1}`, `null`, `{"a":"b",}`, `{"a":"b"}x`,
		`{"a":"b","a":"c"}`, `{"k":"é"}`, `{"a":"b"`, `{"":""}`, `[]`, `{"a":"\u0000"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var want message.Metadata
		wantErr := json.Unmarshal(b, &want)
		if md, ok := decodeFlat(b); ok {
			require.NoError(t, wantErr, "fast path accepted invalid JSON %q", b)
			if want == nil {
				want = message.Metadata{}
			}
			require.Equal(t, want, md, "input %q", b)
		}
		got, err := decodeMetadata(b)
		if wantErr != nil {
			require.Error(t, err, "input %q", b)
			return
		}
		require.NoError(t, err)
		if want == nil {
			want = message.Metadata{}
		}
		require.Equal(t, want, got, "input %q", b)
	})
}

func TestDecodeMetadataMatchesEncodingJSON(t *testing.T) {
	t.Parallel()
	for _, md := range []message.Metadata{
		{}, {"event_id": "x", "partition_key": "order-1"}, {"a": `"q"`, "b": "<tag>&", "c": "line\nbreak", "d": "é\u2028"},
	} {
		b, err := json.Marshal(md)
		require.NoError(t, err)
		got, err := decodeMetadata(b)
		require.NoError(t, err)
		require.Equal(t, md, got)
	}
}

func FuzzEncodeMetadata(f *testing.F) {
	for _, kv := range [][2]string{
		{"event_id", "0190a0a0-0000-7000-8000-000000000000"}, {"a", `"q"`}, {"b", "<tag>&"}, {"c", "line\nbreak"},
		{"d", "é\u2028"}, {"", ""}, {"k\\", "v"}, {"x", "\xff"}, {"~", "\x7f"},
	} {
		f.Add(kv[0], kv[1], "partition_key", "order-1")
	}
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string) {
		for _, md := range []message.Metadata{nil, {}, {k1: v1}, {k1: v1, k2: v2}} {
			want, err := json.Marshal(md)
			require.NoError(t, err)
			got, err := EncodeMetadata(md)
			require.NoError(t, err)
			require.Equal(t, string(want), string(got), "metadata %q", md)
		}
	})
}
