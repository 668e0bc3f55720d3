//go:build race

package browser_test

// The binary under test is built with -race when the tests are.
func init() { buildFlags = append(buildFlags, "-race") }
