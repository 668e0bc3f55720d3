package contract

import (
	"reflect"
	"regexp"
	"strconv"
	"sync"

	"github.com/go-playground/validator/v10"
)

// validate returns the package's validator: one instance, which caches each
// struct's tags and is safe for concurrent use.
var validate = sync.OnceValue(func() *validator.Validate {
	v := validator.New(validator.WithRequiredStructEnabled())
	// Errors name fields by their JSON names, the names producers see.
	// An embedded struct's fields are the outer object's in JSON: its
	// name is marked, and fieldPath drops it.
	v.RegisterTagNameFunc(func(f reflect.StructField) string {
		if f.Anonymous && f.Tag.Get("json") == "" {
			return embeddedMark
		}
		return jsonName(f)
	})
	for tag, fn := range map[string]validator.Func{"decimal": isDecimal, "positive": isPositiveDecimal} {
		if err := v.RegisterValidation(tag, fn); err != nil {
			panic(err) // a constant tag name: cannot happen
		}
	}
	return v
})

// embeddedMark names an embedded struct in validator's namespaces.
const embeddedMark = "\x00embedded"

// decimalRe is a decimal string: an optional minus, an integer part without
// leading zeros, an optional fraction. No exponent, no '+', no bare ".5".
var decimalRe = regexp.MustCompile(`^-?(0|[1-9][0-9]*)(\.([0-9]+))?$`)

// isDecimal is the "decimal" and "decimal=N" tag: a string field holding a
// decimal number, with at most N fraction digits when N is given.
func isDecimal(fl validator.FieldLevel) bool {
	f := fl.Field()
	if f.Kind() != reflect.String {
		return false
	}
	m := decimalRe.FindStringSubmatch(f.String())
	if m == nil {
		return false
	}
	if p := fl.Param(); p != "" {
		n, err := strconv.Atoi(p)
		return err == nil && len(m[3]) <= n
	}
	return true
}

// isPositiveDecimal is the "positive" tag: a decimal string above zero
// ("0.01", not "0.00" or "-1").
func isPositiveDecimal(fl validator.FieldLevel) bool {
	f := fl.Field()
	if f.Kind() != reflect.String {
		return false
	}
	s := f.String()
	if !decimalRe.MatchString(s) || s[0] == '-' {
		return false
	}
	for _, r := range s {
		if r >= '1' && r <= '9' {
			return true
		}
	}
	return false
}
