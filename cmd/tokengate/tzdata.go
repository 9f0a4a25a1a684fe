package main

// Quota windows end at midnight in a named time zone: the zone database is
// compiled in, so that a container without /usr/share/zoneinfo resolves
// the zones a configuration names, and every gateway of a fleet agrees on
// where a window ends.
import _ "time/tzdata"
