package pricing_test

import (
	"errors"
	"math/big"
	"strings"
	"testing"

	"github.com/tokengate/tokengate/pricing"
)

func TestParseRate(t *testing.T) {
	tests := []struct {
		in   string
		want pricing.Rate
		err  string // part of the error, or "" when valid
	}{
		{"2.50", 2_500_000, ""},
		{"2.5", 2_500_000, ""},
		{"0.075", 75_000, ""},
		{"0.000001", 1, ""},
		{"0", 0, ""},
		{"0.0", 0, ""},
		{"15", 15_000_000, ""},
		{"1000000", pricing.MaxRate, ""},
		{"1000000.000000", pricing.MaxRate, ""},
		{"1000000.000001", 0, "too large: at most 1000000.00"},
		{"99999999999999", 0, "too large"},
		{"0.0000001", 0, "more than 6 decimal places"},
		{"2.5000000", 0, "more than 6 decimal places"},
		{"-1", 0, "must not be negative"},
		{"-0", 0, "must not be negative"},
		{"+1", 0, "without a sign"},
		{"$2.50", 0, "without a currency sign"},
		{"2.50€", 0, "without a currency sign"},
		{"", 0, "empty"},
		{".5", 0, "a digit must come before the decimal point"},
		{"5.", 0, "a digit must follow the decimal point"},
		{"05", 0, "leading zeros"},
		{"00.5", 0, "leading zeros"},
		{"NaN", 0, "not a plain decimal"},
		{"Inf", 0, "not a plain decimal"},
		{"1e3", 0, "not a plain decimal"},
		{"1_000", 0, "not a plain decimal"},
		{"1,5", 0, "not a plain decimal"},
		{" 1", 0, "not a plain decimal"},
		{"1 ", 0, "not a plain decimal"},
		{"1.2.3", 0, "not a plain decimal"},
		{"0x10", 0, "not a plain decimal"},
		{"١", 0, "not a plain decimal"}, // an Arabic-Indic digit
	}
	for _, tt := range tests {
		got, err := pricing.ParseRate(tt.in)
		if tt.err == "" {
			if err != nil || got != tt.want {
				t.Errorf("ParseRate(%q) = %d, %v; want %d", tt.in, got, err, tt.want)
			}
			continue
		}
		if err == nil || !errors.Is(err, pricing.ErrInvalidPrice) || !strings.Contains(err.Error(), tt.err) {
			t.Errorf("ParseRate(%q) = %d, %v; want an ErrInvalidPrice saying %q", tt.in, got, err, tt.err)
		}
	}
}

func TestParseRateErrorNamesTheValue(t *testing.T) {
	_, err := pricing.ParseRate("2.5000001")
	want := `invalid price: price "2.5000001": more than 6 decimal places: the smallest unit is a millionth`
	if err == nil || err.Error() != want {
		t.Errorf("error = %v; want %s", err, want)
	}
}

func TestParseAmount(t *testing.T) {
	tests := []struct {
		in   string
		want pricing.Micros
		ok   bool
	}{
		{"500", 500_000_000, true},
		{"2000.50", 2_000_500_000, true},
		{"0.000001", 1, true},
		{"1000000000", pricing.MaxAmount, true},
		{"1000000000.000001", 0, false},
		{"-5", 0, false},
		{"5e2", 0, false},
	}
	for _, tt := range tests {
		got, err := pricing.ParseAmount(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("ParseAmount(%q) = %d, %v; want %d (ok %v)", tt.in, got, err, tt.want, tt.ok)
		}
	}
}

func TestMoneyString(t *testing.T) {
	tests := []struct {
		v    int64
		want string
	}{
		{0, "0.00"},
		{1, "0.000001"},
		{75_000, "0.075"},
		{100_000, "0.10"},
		{2_500_000, "2.50"},
		{1_234_567_891, "1234.567891"},
		{-500_000, "-0.50"},
		{-9223372036854775808, "-9223372036854.775808"},
	}
	for _, tt := range tests {
		if got := pricing.Micros(tt.v).String(); got != tt.want {
			t.Errorf("Micros(%d) = %s; want %s", tt.v, got, tt.want)
		}
		if got := pricing.Rate(tt.v).String(); got != tt.want {
			t.Errorf("Rate(%d) = %s; want %s", tt.v, got, tt.want)
		}
	}
}

// FuzzParseRate checks ParseRate against math/big: whatever it accepts is
// exactly the decimal's value in millionths, prints back to the same rate,
// and lies in [0, MaxRate]; whatever it refuses wraps ErrInvalidPrice.
func FuzzParseRate(f *testing.F) {
	for _, s := range []string{"2.50", "0.075", "0", "1000000", "1000000.000001", "-1", "1e3", ".5", "NaN", "0.0000001", "007"} {
		f.Add(s)
	}
	million := big.NewRat(1_000_000, 1)
	f.Fuzz(func(t *testing.T, s string) {
		r, err := pricing.ParseRate(s)
		if err != nil {
			if !errors.Is(err, pricing.ErrInvalidPrice) {
				t.Fatalf("ParseRate(%q) error %v does not wrap ErrInvalidPrice", s, err)
			}
			return
		}
		if r < 0 || r > pricing.MaxRate {
			t.Fatalf("ParseRate(%q) = %d, out of range", s, r)
		}
		exact, ok := new(big.Rat).SetString(s)
		if !ok {
			t.Fatalf("ParseRate(%q) accepted what math/big cannot read", s)
		}
		exact.Mul(exact, million)
		if !exact.IsInt() || exact.Num().Int64() != int64(r) {
			t.Fatalf("ParseRate(%q) = %d; exact value in millionths is %s", s, r, exact.RatString())
		}
		if back, err := pricing.ParseRate(r.String()); err != nil || back != r {
			t.Fatalf("ParseRate(%q.String() = %q) = %d, %v", s, r.String(), back, err)
		}
	})
}
