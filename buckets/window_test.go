package buckets_test

import (
	"errors"
	"fmt"
	"testing"
	"time"
	_ "time/tzdata" // the historical DST cases must not depend on the host's zone files

	"github.com/tokengate/tokengate/buckets"
)

func mustWindow(t testing.TB, period, zone string) buckets.Window {
	t.Helper()
	w, err := buckets.ParseWindow(period, zone)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func utc(s string) time.Time {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		panic(err)
	}
	return t
}

func TestParseWindow(t *testing.T) {
	tests := []struct {
		period, zone string
		want         string // String() of the window, or "" for an error
	}{
		{"day", "UTC", "day in UTC"},
		{"week", "Europe/Amsterdam", "week in Europe/Amsterdam"},
		{"month", "America/Santiago", "month in America/Santiago"},
		{"Day", "UTC", ""},
		{"daily", "UTC", ""},
		{"", "UTC", ""},
		{"month", "", ""},
		{"month", "Local", ""},
		{"month", " UTC", ""},
		{"month", "Mars/Olympus_Mons", ""},
		{"month", "europe/amsterdam", ""},
	}
	for _, tt := range tests {
		w, err := buckets.ParseWindow(tt.period, tt.zone)
		if tt.want == "" {
			if !errors.Is(err, buckets.ErrInvalidWindow) {
				t.Errorf("ParseWindow(%q, %q) = %v, %v; want ErrInvalidWindow", tt.period, tt.zone, w, err)
			}
			continue
		}
		if err != nil || w.String() != tt.want {
			t.Errorf("ParseWindow(%q, %q) = %v, %v; want %s", tt.period, tt.zone, w, err, tt.want)
		}
	}
}

func TestParseWindowErrorsExplain(t *testing.T) {
	tests := []struct{ period, zone, want string }{
		{"fortnight", "UTC", `invalid quota window: window "fortnight": want day, week or month`},
		{"day", "", "invalid quota window: timezone is required: an IANA name such as Europe/Amsterdam, or UTC"},
		{"day", "Local", `invalid quota window: timezone "Local" depends on the host; name the zone, such as Europe/Amsterdam, or UTC`},
		{"day", "CEST", `invalid quota window: timezone "CEST" is not a known IANA zone name (such as Europe/Amsterdam or UTC)`},
	}
	for _, tt := range tests {
		_, err := buckets.ParseWindow(tt.period, tt.zone)
		if err == nil || err.Error() != tt.want {
			t.Errorf("ParseWindow(%q, %q) error = %v; want %s", tt.period, tt.zone, err, tt.want)
		}
	}
}

// TestMonthlyQuotaAmsterdamWorkedExample is the worked example for calendar
// quotas: a budget of 1000 per month in Europe/Amsterdam, on a simulated
// clock, across the DST start of 2026-03-29 (02:00 CET -> 03:00 CEST), the
// month end of 2026-03-31 (local midnight is 2026-03-31T22:00Z), the DST end
// of 2026-10-25 (03:00 CEST -> 02:00 CET) and the month end of 2026-10-31
// (local midnight is 2026-10-31T23:00Z). Spend is keyed by Window.ID, the
// way a store keys a quota, so the test shows that a quota resets exactly at
// local midnight and not an hour early or late.
func TestMonthlyQuotaAmsterdamWorkedExample(t *testing.T) {
	w := mustWindow(t, "month", "Europe/Amsterdam")
	const budget = 1000
	spent := map[string]int{}
	steps := []struct {
		now       string // the simulated clock, UTC
		spend     int    // what the request spends, if it fits
		id        string
		start     string
		end       string
		retry     int64 // Retry-After seconds
		remaining int   // after the step
	}{
		// t0: the first instant of March in Amsterdam is 23:00Z on Feb 28.
		{"2026-02-28T22:59:59.999999999Z", 900, "2026-02", "2026-01-31T23:00:00Z", "2026-02-28T23:00:00Z", 1, 100},
		{"2026-02-28T23:00:00Z", 600, "2026-03", "2026-02-28T23:00:00Z", "2026-03-31T22:00:00Z", 2674800, 400},
		// t2, t3: across the DST start nothing resets.
		{"2026-03-29T00:59:59Z", 100, "2026-03", "2026-02-28T23:00:00Z", "2026-03-31T22:00:00Z", 248401, 300},
		{"2026-03-29T01:00:00Z", 100, "2026-03", "2026-02-28T23:00:00Z", "2026-03-31T22:00:00Z", 248400, 200},
		// t4: 23:59:59 CEST on March 31, one second before the reset: a
		// request of 500 cannot fit, and is told to retry in 1 second.
		{"2026-03-31T21:59:59Z", 500, "2026-03", "2026-02-28T23:00:00Z", "2026-03-31T22:00:00Z", 1, 200},
		{"2026-03-31T21:59:59.5Z", 0, "2026-03", "2026-02-28T23:00:00Z", "2026-03-31T22:00:00Z", 1, 200},
		// t5: 00:00 CEST on April 1 = 22:00Z on March 31: the quota is whole.
		{"2026-03-31T22:00:00Z", 500, "2026-04", "2026-03-31T22:00:00Z", "2026-04-30T22:00:00Z", 2592000, 500},
		// October: 31 days and one hour long.
		{"2026-09-30T22:00:00Z", 700, "2026-10", "2026-09-30T22:00:00Z", "2026-10-31T23:00:00Z", 2682000, 300},
		{"2026-10-25T00:59:59Z", 100, "2026-10", "2026-09-30T22:00:00Z", "2026-10-31T23:00:00Z", 597601, 200},
		{"2026-10-25T01:00:00Z", 100, "2026-10", "2026-09-30T22:00:00Z", "2026-10-31T23:00:00Z", 597600, 100},
		// 23:30 CET on Oct 31 is 22:30Z: an hour later in UTC than in March.
		{"2026-10-31T22:30:00Z", 200, "2026-10", "2026-09-30T22:00:00Z", "2026-10-31T23:00:00Z", 1800, 100},
		{"2026-10-31T23:00:00Z", 200, "2026-11", "2026-10-31T23:00:00Z", "2026-11-30T23:00:00Z", 2592000, 800},
	}
	for i, s := range steps {
		now := utc(s.now)
		id := w.ID(now)
		start, end := w.Bounds(now)
		if id != s.id || !start.Equal(utc(s.start)) || !end.Equal(utc(s.end)) {
			t.Errorf("t%d %s: ID, Bounds = %s, [%s, %s); want %s, [%s, %s)", i, s.now,
				id, start.UTC().Format(time.RFC3339), end.UTC().Format(time.RFC3339), s.id, s.start, s.end)
		}
		if got := w.RetryAfterSeconds(now); got != s.retry {
			t.Errorf("t%d %s: RetryAfterSeconds = %d; want %d", i, s.now, got, s.retry)
		}
		if spent[id]+s.spend <= budget {
			spent[id] += s.spend
		}
		if got := budget - spent[id]; got != s.remaining {
			t.Errorf("t%d %s: remaining = %d; want %d", i, s.now, got, s.remaining)
		}
	}
}

func TestWindowDayLengthsAcrossDST(t *testing.T) {
	tests := []struct {
		zone, day string // the local day, as YYYY-MM-DD
		start     string
		hours     float64
		clock     string // the local clock at the window's start
	}{
		{"Europe/Amsterdam", "2026-03-29", "2026-03-28T23:00:00Z", 23, "00:00"},
		{"Europe/Amsterdam", "2026-10-25", "2026-10-24T22:00:00Z", 25, "00:00"},
		// America/Havana skips midnight in March (00:00 -> 01:00): the day
		// starts at the transition, which the clock shows as 01:00.
		{"America/Havana", "2026-03-08", "2026-03-08T05:00:00Z", 23, "01:00"},
		// ... and repeats the hour after midnight in November (01:00 -> 00:00):
		// the day starts at the first midnight.
		{"America/Havana", "2026-11-01", "2026-11-01T04:00:00Z", 25, "00:00"},
		// Asia/Beirut skips midnight in March and falls back from 00:00 to
		// 23:00 of the day before in October.
		{"Asia/Beirut", "2026-03-29", "2026-03-28T22:00:00Z", 23, "01:00"},
		{"Asia/Beirut", "2026-10-24", "2026-10-23T21:00:00Z", 25, "00:00"},
		{"Asia/Beirut", "2026-10-25", "2026-10-24T22:00:00Z", 24, "00:00"},
		// America/Santiago changes at 24:00 on Saturday.
		{"America/Santiago", "2026-09-06", "2026-09-06T04:00:00Z", 23, "01:00"},
		{"America/Santiago", "2026-04-04", "2026-04-04T03:00:00Z", 25, "00:00"},
		{"America/Santiago", "2026-04-05", "2026-04-05T04:00:00Z", 24, "00:00"},
		// Lord Howe Island shifts by 30 minutes.
		{"Australia/Lord_Howe", "2026-10-04", "2026-10-03T13:30:00Z", 23.5, "00:00"},
		// Pacific/Apia skipped 2011-12-30 entirely: the 29th ends when the
		// 31st begins.
		{"Pacific/Apia", "2011-12-29", "2011-12-29T10:00:00Z", 24, "00:00"},
		{"Pacific/Apia", "2011-12-31", "2011-12-30T10:00:00Z", 24, "00:00"},
	}
	for _, tt := range tests {
		w := mustWindow(t, "day", tt.zone)
		start := utc(tt.start)
		gotStart, gotEnd := w.Bounds(start.Add(time.Hour))
		if !gotStart.Equal(start) {
			t.Errorf("%s %s: start %s; want %s", tt.zone, tt.day, gotStart.UTC().Format(time.RFC3339), tt.start)
			continue
		}
		if got := gotEnd.Sub(gotStart).Hours(); got != tt.hours {
			t.Errorf("%s %s: %v hours long; want %v", tt.zone, tt.day, got, tt.hours)
		}
		if got := w.ID(start); got != tt.day {
			t.Errorf("%s %s: ID at the start = %s", tt.zone, tt.day, got)
		}
		if got := gotStart.In(w.Location).Format("15:04"); got != tt.clock {
			t.Errorf("%s %s: the clock shows %s at the start; want %s", tt.zone, tt.day, got, tt.clock)
		}
		if prevStart, prevEnd := w.Bounds(start.Add(-time.Nanosecond)); !prevEnd.Equal(start) || !prevStart.Before(start) {
			t.Errorf("%s %s: the window before is [%s, %s); want it to end at %s", tt.zone, tt.day, prevStart, prevEnd, tt.start)
		}
	}
}

// TestWindowClockFallsBackAcrossMidnight covers St. John's, Newfoundland,
// which until 2011 fell back at 00:01 to 23:01 of the day before. The new
// day starts at its first midnight; the minutes the clock then shows as
// Saturday again belong to Sunday's window.
func TestWindowClockFallsBackAcrossMidnight(t *testing.T) {
	w := mustWindow(t, "day", "America/St_Johns")
	sunday := utc("2010-11-07T02:30:00Z") // 00:00 NDT (-02:30)
	repeated := utc("2010-11-07T03:00:00Z")
	if got := repeated.In(w.Location).Format("2006-01-02 15:04"); got != "2010-11-06 23:30" {
		t.Fatalf("zone data: %s shows %s; want 2010-11-06 23:30", repeated, got)
	}
	start, end := w.Bounds(repeated)
	if !start.Equal(sunday) || !end.Equal(utc("2010-11-08T03:30:00Z")) {
		t.Errorf("Bounds(%s) = [%s, %s); want [%s, 2010-11-08T03:30:00Z)", repeated, start.UTC(), end.UTC(), sunday)
	}
	if got := w.ID(repeated); got != "2010-11-07" {
		t.Errorf("ID(%s) = %s; want 2010-11-07", repeated, got)
	}
	if _, end := w.Bounds(sunday.Add(-time.Nanosecond)); !end.Equal(sunday) {
		t.Errorf("Saturday ends at %s; want %s", end.UTC(), sunday)
	}
}

func TestWindowWeeksAreISO(t *testing.T) {
	w := mustWindow(t, "week", "Europe/Amsterdam")
	tests := []struct{ now, id, start, end string }{
		// 2026-03-29 is a Sunday: the week started on Monday the 23rd.
		{"2026-03-29T12:00:00Z", "2026-W13", "2026-03-22T23:00:00Z", "2026-03-29T22:00:00Z"},
		{"2026-03-29T22:00:00Z", "2026-W14", "2026-03-29T22:00:00Z", "2026-04-05T22:00:00Z"},
		// ISO week years: 2026-01-01 (Thursday) is in 2026-W01, which began
		// in December; 2027-01-01 (Friday) is in 2026-W53.
		{"2025-12-29T00:00:00Z", "2026-W01", "2025-12-28T23:00:00Z", "2026-01-04T23:00:00Z"},
		{"2027-01-01T12:00:00Z", "2026-W53", "2026-12-27T23:00:00Z", "2027-01-03T23:00:00Z"},
	}
	for _, tt := range tests {
		now := utc(tt.now)
		start, end := w.Bounds(now)
		if id := w.ID(now); id != tt.id || !start.Equal(utc(tt.start)) || !end.Equal(utc(tt.end)) {
			t.Errorf("%s: %s [%s, %s); want %s [%s, %s)", tt.now, id, start.UTC(), end.UTC(), tt.id, tt.start, tt.end)
		}
		if got := start.In(w.Location).Weekday(); got != time.Monday {
			t.Errorf("%s: the week starts on %s", tt.now, got)
		}
	}
}

func TestWindowNilLocationIsUTC(t *testing.T) {
	w := buckets.Window{Period: buckets.Day}
	start, end := w.Bounds(utc("2026-05-01T12:00:00Z"))
	if !start.Equal(utc("2026-05-01T00:00:00Z")) || !end.Equal(utc("2026-05-02T00:00:00Z")) {
		t.Errorf("Bounds = [%s, %s)", start, end)
	}
	if w.String() != "day in UTC" {
		t.Errorf("String = %s", w)
	}
}

func TestWindowRetryAfter(t *testing.T) {
	w := mustWindow(t, "day", "UTC")
	tests := []struct {
		now   string
		want  time.Duration
		whole int64
	}{
		{"2026-05-01T00:00:00Z", 24 * time.Hour, 86400},
		{"2026-05-01T23:59:59Z", time.Second, 1},
		{"2026-05-01T23:59:59.000000001Z", time.Second - 1, 1},
		{"2026-05-01T23:59:58.5Z", 1500 * time.Millisecond, 2},
	}
	for _, tt := range tests {
		now := utc(tt.now)
		if got := w.RetryAfter(now); got != tt.want {
			t.Errorf("RetryAfter(%s) = %v; want %v", tt.now, got, tt.want)
		}
		if got := w.RetryAfterSeconds(now); got != tt.whole {
			t.Errorf("RetryAfterSeconds(%s) = %d; want %d", tt.now, got, tt.whole)
		}
	}
}

func TestWindowInvalidPeriodPanics(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("Bounds of a Window with the zero Period did not panic")
		}
	}()
	buckets.Window{}.Bounds(time.Unix(0, 0))
}

// dstZones are zones with unusual transitions: midnight skipped or repeated,
// a fall back across midnight, 30-minute shifts, a skipped date, far offsets.
var dstZones = []string{
	"UTC", "Europe/Amsterdam", "America/Santiago", "America/Havana", "Asia/Beirut",
	"America/Sao_Paulo", "America/St_Johns", "Australia/Lord_Howe", "Pacific/Apia",
	"Pacific/Kiritimati", "America/Adak", "Asia/Kathmandu", "Antarctica/Troll",
	"America/Asuncion", "Asia/Tehran",
}

// firstInstantOnOrAfter finds, by scanning minute by minute, the first
// instant whose local date in loc is d or later. Every transition in these
// zones falls on a whole minute, so the scan is exact.
func firstInstantOnOrAfter(loc *time.Location, y int, m time.Month, d int) time.Time {
	day := time.Date(y, m, d, 0, 0, 0, 0, time.UTC)
	for t := day.Add(-27 * time.Hour); ; t = t.Add(time.Minute) {
		ly, lm, ld := t.In(loc).Date()
		if !time.Date(ly, lm, ld, 0, 0, 0, 0, time.UTC).Before(day) {
			return t
		}
	}
}

// TestWindowDayStartsMatchBruteForce checks every day window around every
// transition of dstZones in several years against a minute-by-minute scan.
func TestWindowDayStartsMatchBruteForce(t *testing.T) {
	years := []int{2010, 2011, 2018, 2019, 2026}
	if testing.Short() {
		years = []int{2011, 2026}
	}
	checked := 0
	for _, zone := range dstZones {
		w := mustWindow(t, "day", zone)
		for _, year := range years {
			for _, tr := range transitions(w.Location, year) {
				ty, tm, td := tr.In(w.Location).Date()
				for delta := -1; delta <= 1; delta++ {
					want := firstInstantOnOrAfter(w.Location, ty, tm, td+delta)
					next := firstInstantOnOrAfter(w.Location, ty, tm, td+delta+1)
					if want.Equal(next) {
						continue // a date the zone skips has no window
					}
					for _, now := range []time.Time{want, next.Add(-time.Nanosecond)} {
						start, end := w.Bounds(now)
						if !start.Equal(want) || !end.Equal(next) {
							t.Errorf("%s: Bounds(%s) = [%s, %s); want [%s, %s)", zone, now.UTC(), start.UTC(), end.UTC(), want.UTC(), next.UTC())
						}
					}
					checked++
				}
			}
		}
	}
	if checked < 100 {
		t.Errorf("checked only %d days; the zone data lacks transitions", checked)
	}
}

// transitions returns the instants in year at which loc changes offset.
func transitions(loc *time.Location, year int) []time.Time {
	var out []time.Time
	end := time.Date(year+1, 1, 1, 0, 0, 0, 0, time.UTC)
	for t := time.Date(year, 1, 1, 0, 0, 0, 0, time.UTC); t.Before(end); {
		_, next := t.In(loc).ZoneBounds()
		if next.IsZero() || !next.Before(end) {
			break
		}
		out = append(out, next)
		t = next
	}
	return out
}

// checkWindowInvariants asserts what every window must satisfy at now.
func checkWindowInvariants(t *testing.T, w buckets.Window, now time.Time) {
	t.Helper()
	start, end := w.Bounds(now)
	if now.Before(start) || !now.Before(end) {
		t.Fatalf("%v: %s not in its window [%s, %s)", w, now.UTC(), start.UTC(), end.UTC())
	}
	if s, e := w.Bounds(start); !s.Equal(start) || !e.Equal(end) {
		t.Fatalf("%v: the window of its own start %s is [%s, %s)", w, start.UTC(), s.UTC(), e.UTC())
	}
	if s, _ := w.Bounds(end); !s.Equal(end) {
		t.Fatalf("%v: the next window starts at %s, not at the end %s", w, s.UTC(), end.UTC())
	}
	if _, e := w.Bounds(start.Add(-time.Nanosecond)); !e.Equal(start) {
		t.Fatalf("%v: the previous window ends at %s, not at the start %s", w, e.UTC(), start.UTC())
	}
	if w.ID(now) != w.ID(start) || w.ID(now) != w.ID(end.Add(-time.Nanosecond)) || w.ID(now) == w.ID(end) {
		t.Fatalf("%v: IDs at %s: %s; start %s; end-1ns %s; end %s", w, now.UTC(), w.ID(now), w.ID(start),
			w.ID(end.Add(-time.Nanosecond)), w.ID(end))
	}
	if ra := w.RetryAfter(now); ra <= 0 || !now.Add(ra).Equal(end) {
		t.Fatalf("%v: RetryAfter(%s) = %v, window ends %s", w, now.UTC(), ra, end.UTC())
	}
	hours := end.Sub(start).Hours()
	var lo, hi float64
	switch w.Period {
	case buckets.Day:
		lo, hi = 22, 26 // a day can lose or gain up to two hours (Antarctica/Troll)
	case buckets.Week:
		lo, hi = 7*24-2, 7*24+2
	case buckets.Month:
		lo, hi = 28*24-2, 31*24+2
	}
	if hours < lo || hours > hi {
		// Pacific/Apia's 2011-12-30 is the one date a zone skipped entirely.
		if !(w.Location.String() == "Pacific/Apia" && hours >= lo-24 && hours <= hi-24) {
			t.Fatalf("%v: window [%s, %s) is %v hours long", w, start.UTC(), end.UTC(), hours)
		}
	}
}

func FuzzWindowBounds(f *testing.F) {
	// Seconds count from 1971 (lo below); zone indexes dstZones; period 0, 1,
	// 2 is day, week, month. More seeds are in testdata/fuzz.
	f.Add(int64(1743379200), uint8(1), uint8(2)) // 2026-03-31T00:00Z, Amsterdam, month
	f.Add(int64(1257561000), uint8(6), uint8(0)) // 2010-11-07T02:30Z, St_Johns, day
	f.Add(int64(1293703200), uint8(8), uint8(1)) // 2011-12-30T10:00Z, Apia, week
	windows := map[[2]uint8]buckets.Window{}
	f.Fuzz(func(t *testing.T, seconds int64, zone, period uint8) {
		// Years 1971 to 2099: the range the zone database describes well.
		const lo, span = 31536000, 4070908800 - 31536000
		u := uint64(seconds)
		now := time.Unix(lo+int64(u%span), int64(u%1e9))
		key := [2]uint8{zone % uint8(len(dstZones)), period%3 + 1}
		w, ok := windows[key]
		if !ok {
			w = mustWindow(t, buckets.Period(key[1]).String(), dstZones[key[0]])
			windows[key] = w
		}
		checkWindowInvariants(t, w, now)
	})
}

// TestWindowInvariantsAcrossYears walks two years, which hold every kind of
// transition in dstZones, 36 hours and 7 minutes at a time, so the instants
// drift through every time of day.
func TestWindowInvariantsAcrossYears(t *testing.T) {
	for _, zone := range dstZones {
		for _, period := range []string{"day", "week", "month"} {
			w := mustWindow(t, period, zone)
			for now := utc("2009-12-25T00:00:00Z"); now.Before(utc("2012-01-10T00:00:00Z")); now = now.Add(36*time.Hour + 7*time.Minute) {
				checkWindowInvariants(t, w, now)
			}
		}
	}
}

func ExampleWindow_Bounds() {
	w, err := buckets.ParseWindow("month", "Europe/Amsterdam")
	if err != nil {
		panic(err)
	}
	now := time.Date(2026, 3, 31, 21, 59, 59, 0, time.UTC) // 23:59:59 CEST
	start, end := w.Bounds(now)
	fmt.Println(w.ID(now), start.UTC().Format(time.RFC3339), end.UTC().Format(time.RFC3339))
	fmt.Println("Retry-After:", w.RetryAfterSeconds(now))
	fmt.Println(w.ID(end))
	// Output:
	// 2026-03 2026-02-28T23:00:00Z 2026-03-31T22:00:00Z
	// Retry-After: 1
	// 2026-04
}

// BenchmarkWindowBounds measures what a quota costs per request in window
// arithmetic: Bounds and ID, against time.Date as a yardstick.
func BenchmarkWindowBounds(b *testing.B) {
	w := mustWindow(b, "month", "Europe/Amsterdam")
	now := utc("2026-03-29T01:30:00Z")
	b.Run("Bounds+ID", func(b *testing.B) {
		for b.Loop() {
			start, _ := w.Bounds(now)
			if start.IsZero() || w.ID(now) == "" {
				b.Fatal("no window")
			}
		}
	})
	b.Run("time.Date", func(b *testing.B) {
		for b.Loop() {
			if time.Date(2026, 3, 1, 0, 0, 0, 0, w.Location).IsZero() {
				b.Fatal("zero")
			}
		}
	})
}
