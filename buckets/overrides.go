package buckets

import (
	"context"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync"
)

// Limits as data: an operator gives one identity limits of its own (an
// override) at run time, and every gateway sharing the store applies it
// without a restart. The stores keep overrides as opaque values — what a
// value means, and whether it is valid, is the configuration's business —
// under an OverrideKey, with a version that changes with every write, so
// that a gateway notices a change by reading one small value. The memory
// store's overrides (MemoryOverrides) serve one gateway; the Redis store's
// serve a fleet.

// OverrideKey names a stored override: a rule of a policy, for one
// identity value in the form store keys use (hashed identities hashed: a
// raw API key is never stored). No part may be empty or hold a NUL byte.
type OverrideKey struct{ Policy, Rule, Identity string }

// Validate reports whether k can be stored.
func (k OverrideKey) Validate() error {
	for _, p := range [...]struct{ name, v string }{{"policy", k.Policy}, {"rule", k.Rule}, {"identity", k.Identity}} {
		if p.v == "" || strings.ContainsRune(p.v, 0) {
			return fmt.Errorf("%w: override %s %q is empty or holds a NUL byte", ErrInvalidRequest, p.name, p.v)
		}
	}
	return nil
}

// MaxOverrideBytes bounds one stored override value.
const MaxOverrideBytes = 4 << 10

// CheckOverride reports whether k and value can be stored.
func CheckOverride(k OverrideKey, value []byte) error {
	if err := k.Validate(); err != nil {
		return err
	}
	if len(value) == 0 || len(value) > MaxOverrideBytes {
		return fmt.Errorf("%w: an override value is 1 to %d bytes, got %d", ErrInvalidRequest, MaxOverrideBytes, len(value))
	}
	return nil
}

// OverrideSet is every stored override at one version. Version is opaque:
// equal versions mean equal contents; "" is the version of a store that
// was never written.
type OverrideSet struct {
	Version string
	Values  map[OverrideKey][]byte
}

// MemoryOverrides keeps overrides in this process, for one gateway. It is
// safe for concurrent use. The zero value is an empty store.
type MemoryOverrides struct {
	mu      sync.Mutex
	version int64
	values  map[OverrideKey][]byte
}

func (m *MemoryOverrides) versionLocked() string {
	if m.version == 0 {
		return ""
	}
	return "m:" + strconv.FormatInt(m.version, 10)
}

// Put stores value under k, replacing what was there, and returns the new
// version.
func (m *MemoryOverrides) Put(ctx context.Context, k OverrideKey, value []byte) (string, error) {
	if err := CheckOverride(k, value); err != nil {
		return "", err
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.values == nil {
		m.values = map[OverrideKey][]byte{}
	}
	m.values[k] = append([]byte(nil), value...)
	m.version++
	return m.versionLocked(), nil
}

// Get returns the value stored under k; ok is false when there is none.
func (m *MemoryOverrides) Get(ctx context.Context, k OverrideKey) (value []byte, ok bool, err error) {
	if err := ctx.Err(); err != nil {
		return nil, false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	v, ok := m.values[k]
	return append([]byte(nil), v...), ok, nil
}

// Delete removes the value under k; deleted is false when there was none
// (the version then stays). It returns the version after it.
func (m *MemoryOverrides) Delete(ctx context.Context, k OverrideKey) (deleted bool, version string, err error) {
	if err := ctx.Err(); err != nil {
		return false, "", err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.values[k]; ok {
		delete(m.values, k)
		m.version++
		deleted = true
	}
	return deleted, m.versionLocked(), nil
}

// Version returns the current version.
func (m *MemoryOverrides) Version(ctx context.Context) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.versionLocked(), nil
}

// Load returns every override with the version they are at. The map is
// the caller's; the values must not be modified.
func (m *MemoryOverrides) Load(ctx context.Context) (OverrideSet, error) {
	if err := ctx.Err(); err != nil {
		return OverrideSet{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	set := OverrideSet{Version: m.versionLocked(), Values: maps.Clone(m.values)}
	if set.Values == nil {
		set.Values = map[OverrideKey][]byte{}
	}
	return set, nil
}
