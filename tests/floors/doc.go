// Package floors holds the test that holds the module's import graph to the
// floor table of docs/floors.md: no package imports a package on a higher
// floor. It has no API.
package floors
