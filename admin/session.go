package admin

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"sync"
	"time"
)

// Sign-in sessions of the budget page. A browser gives the admin token
// once, in the sign-in form, and carries a session cookie afterwards: a
// random ID, 256 bits, that means something only to the process that made
// it. The process keeps the IDs' digests with their expiry, so a copy of
// its memory holds no usable cookie, and keeps at most maxSessions: past
// that, signing in ends the session that expires first. A restart signs
// everyone out.
const (
	// sessionTTL is how long a session lasts from sign-in.
	sessionTTL = 8 * time.Hour
	// maxSessions bounds the sessions kept.
	maxSessions = 64
)

// sessions is the set of live sign-in sessions. It is safe for concurrent
// use.
type sessions struct {
	now func() time.Time
	mu  sync.Mutex
	m   map[[sha256.Size]byte]time.Time // digest of the ID → expiry
}

func newSessions(now func() time.Time) *sessions {
	return &sessions{now: now, m: make(map[[sha256.Size]byte]time.Time)}
}

// start opens a session and returns its ID and expiry.
func (ss *sessions) start() (string, time.Time) {
	var b [32]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	id := base64.RawURLEncoding.EncodeToString(b[:])
	ss.mu.Lock()
	defer ss.mu.Unlock()
	now := ss.now()
	ss.sweepLocked(now)
	if len(ss.m) >= maxSessions {
		var first [sha256.Size]byte
		var at time.Time
		for k, exp := range ss.m {
			if at.IsZero() || exp.Before(at) {
				first, at = k, exp
			}
		}
		delete(ss.m, first)
	}
	exp := now.Add(sessionTTL)
	ss.m[sha256.Sum256([]byte(id))] = exp
	return id, exp
}

// valid reports whether id names a session that has not expired.
func (ss *sessions) valid(id string) bool {
	if id == "" {
		return false
	}
	k := sha256.Sum256([]byte(id))
	ss.mu.Lock()
	defer ss.mu.Unlock()
	exp, ok := ss.m[k]
	if ok && !ss.now().Before(exp) {
		delete(ss.m, k)
		return false
	}
	return ok
}

// end closes the session id, if it is open.
func (ss *sessions) end(id string) {
	k := sha256.Sum256([]byte(id))
	ss.mu.Lock()
	defer ss.mu.Unlock()
	delete(ss.m, k)
}

// sweepLocked drops the sessions that have expired by now.
func (ss *sessions) sweepLocked(now time.Time) {
	for k, exp := range ss.m {
		if !now.Before(exp) {
			delete(ss.m, k)
		}
	}
}
