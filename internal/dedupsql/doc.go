// Package dedupsql holds the statements on a processed_event table's
// companion tables and catalog that the deduplicator and the operator's
// tools share: the recorded retention (<table>_setting: [ReadSetting],
// [SetRetention]), the consumer-group registry (<table>_group: [Groups],
// [RenameGroup], [ForgetGroup]) and the table's view from the catalog
// ([Inspect]). deduplicator reads the setting and the registry on a
// consumer's path and in the Cleaner; idemctl, its console and idemprom
// run the rest, which no service needs.
//
// Functions take the table's schema and name ("" for the defaults,
// public.processed_event) and return PostgreSQL's errors wrapped with %w:
// a missing companion table is SQLSTATE 42P01 (pgerr.UndefinedTable names
// it); deduplicator turns it into its typed error.
package dedupsql
