package buckets

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// ErrInvalidWindow is wrapped by every error about a quota window that cannot
// be used: an unknown period, a time zone that is not an IANA name.
var ErrInvalidWindow = errors.New("invalid quota window")

// Period is the calendar length of a quota window.
type Period int

// The periods a quota window can have. The zero Period is invalid.
const (
	// Day starts at local midnight.
	Day Period = iota + 1
	// Week starts at local midnight on Monday (ISO 8601 weeks).
	Week
	// Month starts at local midnight on the first day of the month.
	Month
)

// ParsePeriod reads a period as written in configuration: "day", "week" or
// "month".
func ParsePeriod(s string) (Period, error) {
	switch s {
	case "day":
		return Day, nil
	case "week":
		return Week, nil
	case "month":
		return Month, nil
	}
	return 0, fmt.Errorf("%w: window %q: want day, week or month", ErrInvalidWindow, s)
}

// String returns the configuration spelling of p.
func (p Period) String() string {
	switch p {
	case Day:
		return "day"
	case Week:
		return "week"
	case Month:
		return "month"
	}
	return "Period(" + strconv.Itoa(int(p)) + ")"
}

// Window is a calendar quota window: a day, an ISO week or a month as the
// wall clock of Location shows it. Unlike a bucket it does not refill: a
// quota's spend resets to zero at the window's end, which is the next
// window's start.
//
// A window starts at the first instant at which Location's clock shows its
// first date (the day; Monday for weeks, ISO 8601; the 1st for months) or a
// later one, and ends where the next window starts, so consecutive windows
// tile time without gap or overlap. Days are therefore 23 or 25 hours long
// across a daylight saving change. Where a zone skips local midnight (clocks
// go from 23:59:59 to 01:00, as America/Santiago, America/Havana and
// Asia/Beirut do), the day starts at the transition, which the clock shows
// as 01:00. Where midnight happens twice (clocks fall back from 01:00 to
// 00:00, as in America/Havana), the day starts at the first midnight. Where
// the clock falls back across midnight (from 00:01 to 23:01 of the previous
// day, as America/St_Johns did until 2011), the repeated minutes belong to
// the window that holds them by instant, the new day, not to the date the
// clock shows. A date a zone skips entirely (Pacific/Apia, 2011-12-30) has
// no window of its own.
//
// All methods take the current time as a parameter and never read the
// clock; the wall clock matters only through Location. The zero value is not
// usable: Period must be Day, Week or Month, and a nil Location means UTC.
// A Window is a plain value, safe to copy and to use from many goroutines.
type Window struct {
	Period   Period
	Location *time.Location
}

// MarshalJSON writes the window as configuration names it:
// {"period":"day","timezone":"Europe/Amsterdam"}.
func (w Window) MarshalJSON() ([]byte, error) {
	return json.Marshal(windowJSON{Period: w.Period.String(), Timezone: w.location().String()})
}

// UnmarshalJSON reads what MarshalJSON writes, as ParseWindow does.
func (w *Window) UnmarshalJSON(b []byte) error {
	var j windowJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	v, err := ParseWindow(j.Period, j.Timezone)
	if err != nil {
		return err
	}
	*w = v
	return nil
}

type windowJSON struct {
	Period   string `json:"period"`
	Timezone string `json:"timezone"`
}

// ParseWindow reads a window as written in configuration: a period ("day",
// "week", "month") and an IANA time zone name such as "Europe/Amsterdam" or
// "UTC". The zone is required, and "Local" is refused, because gateways of
// one fleet must agree on where a window ends whatever their host's zone.
func ParseWindow(period, timezone string) (Window, error) {
	p, err := ParsePeriod(period)
	if err != nil {
		return Window{}, err
	}
	loc, err := LoadZone(timezone)
	if err != nil {
		return Window{}, err
	}
	return Window{Period: p, Location: loc}, nil
}

// LoadZone loads an IANA time zone by name for a quota window, refusing the
// empty name and "Local" with an explanation. Zones come from the system's
// zone database, or from the one compiled into the binary when the program
// imports time/tzdata.
func LoadZone(name string) (*time.Location, error) {
	switch {
	case name == "":
		return nil, fmt.Errorf("%w: timezone is required: an IANA name such as Europe/Amsterdam, or UTC", ErrInvalidWindow)
	case name == "Local":
		return nil, fmt.Errorf("%w: timezone %q depends on the host; name the zone, such as Europe/Amsterdam, or UTC", ErrInvalidWindow, name)
	case strings.TrimSpace(name) != name:
		return nil, fmt.Errorf("%w: timezone %q has surrounding spaces", ErrInvalidWindow, name)
	}
	loc, err := time.LoadLocation(name)
	if err != nil {
		return nil, fmt.Errorf("%w: timezone %q is not a known IANA zone name (such as Europe/Amsterdam or UTC)", ErrInvalidWindow, name)
	}
	return loc, nil
}

// String describes the window, as in "month in Europe/Amsterdam".
func (w Window) String() string {
	return w.Period.String() + " in " + w.location().String()
}

// Bounds returns the window that contains now: start <= now < end.
// Bounds panics if w.Period is not Day, Week or Month.
func (w Window) Bounds(now time.Time) (start, end time.Time) {
	_, start, end = w.span(now)
	return start, end
}

// ID names the window that contains now, for keying a quota's spend in a
// store: "2026-03-29" for a day, "2026-W13" for an ISO week (the ISO
// year, which differs from the calendar year around New Year), "2026-03"
// for a month. The date is the window's first date in its own zone, so every
// gateway names a window alike whatever its host's zone. A store keys spend
// by rule and ID and may let the key expire some slack after the window's
// end. ID panics if w.Period is not Day, Week or Month.
func (w Window) ID(now time.Time) string {
	first, _, _ := w.span(now)
	return w.idOf(first)
}

// idOf names the window whose first date is first.
func (w Window) idOf(first date) string {
	switch w.Period {
	case Day:
		return fmt.Sprintf("%04d-%02d-%02d", first.year, int(first.month), first.day)
	case Week:
		y, wk := first.midday().ISOWeek()
		return fmt.Sprintf("%04d-W%02d", y, wk)
	default:
		return fmt.Sprintf("%04d-%02d", first.year, int(first.month))
	}
}

// RetryAfter is how long a caller refused by a quota should wait: the time
// from now to the end of the window that contains now. It is always positive.
func (w Window) RetryAfter(now time.Time) time.Duration {
	_, end := w.Bounds(now)
	return end.Sub(now)
}

// RetryAfterSeconds is RetryAfter in whole seconds, rounded up, for the
// Retry-After header: a client that waits that long finds the new window.
func (w Window) RetryAfterSeconds(now time.Time) int64 {
	d := w.RetryAfter(now)
	s := int64(d / time.Second)
	if d%time.Second != 0 {
		s++
	}
	return s
}

func (w Window) location() *time.Location {
	if w.Location == nil {
		return time.UTC
	}
	return w.Location
}

// span returns the window that contains now: its first date, start and end.
func (w Window) span(now time.Time) (first date, start, end time.Time) {
	y, m, d := now.In(w.location()).Date()
	first = w.align(date{y, m, d})
	start, end = w.startOf(first), w.startOf(w.next(first))
	// The clock can fall back across midnight (00:01 to 23:01 of the
	// previous day): for those minutes it shows a date whose window has
	// ended. Instants belong to windows by instant, so move on to the window
	// that holds now. One step suffices for every real zone; the bound keeps
	// corrupt zone data from looping.
	for i := 0; i < 3 && !now.Before(end); i++ {
		first = w.next(first)
		start, end = end, w.startOf(w.next(first))
	}
	return first, start, end
}

// align returns the first date of the window that holds the date d.
func (w Window) align(d date) date {
	switch w.Period {
	case Day:
		return d
	case Week:
		// ISO weeks start on Monday; time.Weekday counts from Sunday.
		back := (int(d.midday().Weekday()) + 6) % 7
		return d.addDays(-back)
	case Month:
		return date{d.year, d.month, 1}
	}
	panic(fmt.Sprintf("buckets: Window with invalid %v", w.Period))
}

// next returns the first date of the window after the one starting at d.
func (w Window) next(d date) date {
	switch w.Period {
	case Day:
		return d.addDays(1)
	case Week:
		return d.addDays(7)
	case Month:
		t := time.Date(d.year, d.month+1, 1, 12, 0, 0, 0, time.UTC)
		return date{t.Year(), t.Month(), 1}
	}
	panic(fmt.Sprintf("buckets: Window with invalid %v", w.Period))
}

// startOf returns the first instant at which the window's clock shows the
// date d or a later one.
//
// time.Date does not settle this alone: for a local midnight that does not
// exist, or exists twice, it returns "a time that is correct in one of the
// two zones involved in the transition", which may be the last hour of the
// previous day or the second of two midnights. So look at every zone period
// (a stretch of time with one UTC offset) around d, in order: within one,
// the clock runs without jumps, so the first instant that shows d or later
// is the instant the clock shows d's midnight or, if the period starts
// after that, the period's start. The first period that has such an instant
// gives the answer.
func (w Window) startOf(d date) time.Time {
	loc := w.location()
	guess := time.Date(d.year, d.month, d.day, 0, 0, 0, 0, loc)
	// The common case: guess shows d's midnight, and the zone period holding
	// it began long enough before that no earlier period can show d (offsets
	// differ by less than 25 hours). Days after a transition take the slow
	// path.
	if y, mo, day := guess.Date(); y == d.year && mo == d.month && day == d.day && guess.Hour() == 0 && guess.Minute() == 0 && guess.Second() == 0 {
		if begin, _ := guess.ZoneBounds(); begin.IsZero() || !begin.After(guess.Add(-25*time.Hour)) {
			return guess
		}
	}
	// UTC offsets stay within a day of UTC, so the answer lies within two
	// days of guess.
	midnight := time.Date(d.year, d.month, d.day, 0, 0, 0, 0, time.UTC).Unix()
	for t := guess.Add(-48 * time.Hour); ; {
		local := t.In(loc)
		begin, end := local.ZoneBounds()
		_, offset := local.Zone()
		if begin.IsZero() || begin.Before(t) {
			begin = t
		}
		candidate := time.Unix(midnight-int64(offset), 0)
		if candidate.Before(begin) {
			candidate = begin
		}
		if (end.IsZero() || candidate.Before(end)) && !before(candidate.In(loc), d) {
			return candidate
		}
		if end.IsZero() || end.After(guess.Add(48*time.Hour)) {
			// Unreachable for any zone whose offsets stay within a day of UTC.
			panic(fmt.Sprintf("buckets: no instant near %04d-%02d-%02d in %s", d.year, int(d.month), d.day, loc))
		}
		t = end
	}
}

// date is a calendar date without a zone.
type date struct {
	year  int
	month time.Month
	day   int
}

// midday is d at noon UTC, for calendar arithmetic free of DST.
func (d date) midday() time.Time {
	return time.Date(d.year, d.month, d.day, 12, 0, 0, 0, time.UTC)
}

func (d date) addDays(n int) date {
	t := d.midday().AddDate(0, 0, n)
	return date{t.Year(), t.Month(), t.Day()}
}

// before reports whether the date t shows is earlier than d.
func before(t time.Time, d date) bool {
	y, m, day := t.Date()
	if y != d.year {
		return y < d.year
	}
	if m != d.month {
		return m < d.month
	}
	return day < d.day
}
