// Package statsx sums counters per key, in the order the keys first appear:
// what the metric exporters (components/idemprom, components/idemotel) do
// with the dedup middlewares' counters of each consumer group.
package statsx

// Sum is one key's total.
type Sum[S any] struct {
	Key   string
	Value S
}

// ByKey sums value(item) per key(item) with add, keys in the order they
// first appear in items.
func ByKey[T, S any](items []T, key func(T) string, value func(T) S, add func(S, S) S) []Sum[S] {
	var out []Sum[S]
	index := map[string]int{}
	for _, it := range items {
		k := key(it)
		i, ok := index[k]
		if !ok {
			index[k] = len(out)
			out = append(out, Sum[S]{Key: k, Value: value(it)})
			continue
		}
		out[i].Value = add(out[i].Value, value(it))
	}
	return out
}
