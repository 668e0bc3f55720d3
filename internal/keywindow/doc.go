// Package keywindow is a Kafka partition's window of records in flight,
// independent of the client library: the rules both of idemkafka's
// subscribers (parallel on Sarama, franz on franz-go) hand records out and
// commit by.
//
//   - Key order: a record is handed out only when no earlier record of its
//     key (with [ByPartition], of its partition) is not done: the records
//     of a key form a chain, whose head alone may be in flight
//     ([Window.Add] reports a head, [Window.Done] the next one).
//   - The committable offset is the lowest record not done
//     ([Window.CommitOffset]): every offset below it is done.
//   - Bounded memory: the window holds at most Size records not done
//     ([Window.Full]); done records leave it (those at its front at once,
//     the others in batches), so its length is bounded by what is not done,
//     not by the span of offsets.
//   - Head-of-line isolation: a full window whose handlers starve
//     ([Starved]) drops the payloads of the records waiting behind blocked
//     heads ([Window.Spill]), so that reading can go on for the other keys;
//     a spilled record is read again from Kafka when it becomes its key's
//     head ([Window.Refill]).
//
// The engine embeds an [Entry] in its record type and keeps everything
// about its client (claims, sessions, fetches, pauses, timers, the ready
// queue) itself. A Window is not safe for concurrent use: its engine
// guards it with its own lock.
package keywindow
