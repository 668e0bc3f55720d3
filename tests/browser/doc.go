// Package browser holds the console's browser tests: `idemctl serve`
// driven by a headless chromium (chromedp) against a real database, and
// `make screenshots`, which rewrites docs/console-*.png from them. It is a
// module of its own, so the library's go.mod does not require chromedp or
// cdproto; go.work at the repository root ties it to the library in
// development. Without chromium (or CHROME_PATH) the tests skip.
package browser
