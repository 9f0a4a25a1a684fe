package pricing

import (
	"errors"
	"fmt"
	"strings"
)

// ErrInvalidPrice is wrapped by every error about a price or an amount that
// cannot be used: not a plain decimal, negative, more precise than a
// micro-unit, too large.
var ErrInvalidPrice = errors.New("invalid price")

// Micros is an amount of money in micro-units of the table's currency:
// 1 USD is 1,000,000 Micros. Costs are whole Micros, rounded up (see
// Price.Cost), so sums of costs are exact and never drift.
type Micros int64

// MaxAmount is the largest amount ParseAmount accepts: one billion units
// of the currency. It keeps every sum of budgets and costs far from int64's
// limit.
const MaxAmount Micros = 1_000_000_000 * 1_000_000

// ParseAmount reads an amount of money written as a plain decimal in units
// of the currency, such as "500" or "2000.50", exactly: no floating point
// is involved. It refuses signs, exponents, currency symbols, separators,
// more than 6 decimal places and amounts above MaxAmount.
func ParseAmount(s string) (Micros, error) {
	v, err := parseMicros(s, int64(MaxAmount))
	if err != nil {
		return 0, fmt.Errorf("%w: amount %q: %s", ErrInvalidPrice, s, err)
	}
	return Micros(v), nil
}

// String formats m in units of the currency with at least two decimals and
// no trailing zeros beyond them: "0.000075", "2.50", "1234.567891".
func (m Micros) String() string {
	return formatMicros(int64(m))
}

// Rate is a price per million tokens in micro-units: $2.50 per million
// tokens is Rate(2_500_000), $0.075 is Rate(75_000). One token at Rate r
// costs r/1,000,000 Micros, usually a fraction: Price.Cost sums the exact
// products and rounds once.
type Rate int64

// MaxRate is the largest Rate ParseRate accepts, a million units of the
// currency per million tokens: a thousand times the dearest model priced
// today. The bound keeps every cost computation exact (see Price.Cost).
const MaxRate Rate = 1_000_000 * 1_000_000

// ParseRate reads a price per million tokens written as a plain decimal in
// units of the currency, such as "2.50" or "0.075", exactly: no floating
// point is involved. It refuses signs, exponents, NaN, currency symbols,
// separators, more than 6 decimal places (the unit is a micro-unit) and
// prices above MaxRate.
func ParseRate(s string) (Rate, error) {
	v, err := parseMicros(s, int64(MaxRate))
	if err != nil {
		return 0, fmt.Errorf("%w: price %q: %s", ErrInvalidPrice, s, err)
	}
	return Rate(v), nil
}

// String formats r per million tokens in units of the currency, as
// ParseRate reads it: "2.50", "0.075".
func (r Rate) String() string {
	return formatMicros(int64(r))
}

// parseMicros reads a non-negative decimal with at most six decimal places
// as an integer count of millionths, refusing values above max. The error
// text says what is wrong in words an operator can act on.
func parseMicros(s string, max int64) (int64, error) {
	if s == "" {
		return 0, errors.New("empty; write a decimal such as 2.50")
	}
	switch {
	case s[0] == '-':
		return 0, errors.New("must not be negative")
	case s[0] == '+':
		return 0, errors.New("write the number without a sign")
	case strings.ContainsAny(s, "$€£¥"):
		return 0, errors.New("write the number without a currency sign")
	}
	whole, frac, dot := strings.Cut(s, ".")
	if !digits(whole) || !digits(frac) {
		return 0, errors.New("not a plain decimal: digits with an optional decimal point, such as 2.50 (no exponent, separators or spaces)")
	}
	switch {
	case whole == "":
		return 0, errors.New("a digit must come before the decimal point, as in 0.5")
	case dot && frac == "":
		return 0, errors.New("a digit must follow the decimal point")
	case len(whole) > 1 && whole[0] == '0':
		return 0, errors.New("leading zeros are not allowed")
	case len(frac) > 6:
		return 0, errors.New("more than 6 decimal places: the smallest unit is a millionth")
	case len(whole) > 13:
		return 0, fmt.Errorf("too large: at most %s", formatMicros(max))
	}
	var v int64
	for _, c := range whole + frac + strings.Repeat("0", 6-len(frac)) {
		v = v*10 + int64(c-'0')
	}
	if v > max {
		return 0, fmt.Errorf("too large: at most %s", formatMicros(max))
	}
	return v, nil
}

// digits reports whether s is made of ASCII digits only (or is empty).
func digits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

func formatMicros(v int64) string {
	sign := ""
	u := uint64(v)
	if v < 0 {
		sign, u = "-", -u
	}
	frac := fmt.Sprintf("%06d", u%1_000_000)
	frac = strings.TrimRight(frac, "0")
	for len(frac) < 2 {
		frac += "0"
	}
	return fmt.Sprintf("%s%d.%s", sign, u/1_000_000, frac)
}
