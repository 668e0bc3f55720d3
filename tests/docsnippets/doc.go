// Package docsnippets holds the test that compiles every Go snippet of
// README.md and docs/*.md, and checks that the links into
// docs/benchmarks.md name one of its sections. It has no API.
//
// A snippet is either a whole file (it starts with a package clause), or
// declarations, or statements, optionally after an import block. The test
// puts the statements in a function of a generated package inside this
// module, so they resolve the module's packages and go.mod's dependencies
// from the module cache. A snippet with an import block must import exactly
// what it uses; one without gets the imports of the package names it uses
// (see knownImports in the test). The names a snippet may use without
// declaring them (ctx, pool, logger, …) are listed in givenSource, with
// their types. Compile errors point at the Markdown file and line.
package docsnippets
