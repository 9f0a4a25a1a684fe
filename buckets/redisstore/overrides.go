package redisstore

import (
	"context"
	"fmt"
	"strings"

	"github.com/tokengate/tokengate/buckets"
)

// Overrides is the Redis store's override store (see buckets.OverrideKey):
// one hash, <prefix>o:{overrides}, whose fields are an override's policy,
// rule and identity joined by NUL bytes, and a version string beside it,
// <prefix>o:{overrides}:v, that every write changes in the same script
// call. Both share one hash tag, so a Redis Cluster keeps them on one
// node. The version is a random epoch and a counter: a Redis that lost its
// data and was written again cannot come back to a version a gateway
// already saw. Overrides have no TTL; a Redis that evicts keys must not
// evict them (maxmemory-policy noeviction or volatile-*, which evicts only
// keys with a TTL: buckets, never overrides).
//
// Overrides is safe for concurrent use. Get one from Store.Overrides.
type Overrides struct {
	s             *Store
	hash, version string
}

// Overrides returns the override store that shares s's connection and key
// prefix.
func (s *Store) Overrides() *Overrides {
	h := s.prefix + "o:{overrides}"
	return &Overrides{s: s, hash: h, version: h + ":v"}
}

// luaBump advances the version: ARGV[1] is the epoch of a first version.
const luaBump = `
local function bump()
  local v = redis.call('GET', KEYS[2])
  local epoch, n = ARGV[1], 0
  if v then
    local i = string.find(v, ':', 1, true)
    epoch, n = string.sub(v, 1, i - 1), tonumber(string.sub(v, i + 1))
  end
  v = epoch .. ':' .. string.format('%d', n + 1)
  redis.call('SET', KEYS[2], v)
  return v
end
`

var (
	putOverrideScript = newScript(luaBump + `
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return {bump()}
`)
	deleteOverrideScript = newScript(luaBump + `
if redis.call('HDEL', KEYS[1], ARGV[2]) == 0 then
  return {0, redis.call('GET', KEYS[2]) or ''}
end
return {1, bump()}
`)
	getOverrideScript = newScript(`
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return {0} end
return {1, v}
`)
	loadOverridesScript = newScript(`
return {redis.call('GET', KEYS[2]) or '', redis.call('HGETALL', KEYS[1])}
`)
	overridesVersionScript = newScript(`
return {redis.call('GET', KEYS[1]) or ''}
`)
)

func overrideField(k buckets.OverrideKey) string {
	return k.Policy + "\x00" + k.Rule + "\x00" + k.Identity
}

func (o *Overrides) keys() []string { return []string{o.hash, o.version} }

// Put stores value under k, replacing what was there, and returns the new
// version.
func (o *Overrides) Put(ctx context.Context, k buckets.OverrideKey, value []byte) (string, error) {
	if err := buckets.CheckOverride(k, value); err != nil {
		return "", err
	}
	ctx, cancel, err := o.s.start(ctx, "put override")
	if err != nil {
		return "", err
	}
	defer cancel()
	out, err := o.s.run(ctx, putOverrideScript, o.keys(), []any{newID()[:16], overrideField(k), value})
	if err != nil {
		return "", fmt.Errorf("redisstore: put override: %w", err)
	}
	v, _ := out[0].(string)
	return v, nil
}

// Get returns the value stored under k; ok is false when there is none.
func (o *Overrides) Get(ctx context.Context, k buckets.OverrideKey) (value []byte, ok bool, err error) {
	if err := k.Validate(); err != nil {
		return nil, false, err
	}
	ctx, cancel, err := o.s.start(ctx, "get override")
	if err != nil {
		return nil, false, err
	}
	defer cancel()
	out, err := o.s.run(ctx, getOverrideScript, o.keys()[:1], []any{overrideField(k)})
	if err != nil {
		return nil, false, fmt.Errorf("redisstore: get override: %w", err)
	}
	if n, _ := out[0].(int64); n == 0 || len(out) < 2 {
		return nil, false, nil
	}
	v, _ := out[1].(string)
	return []byte(v), true, nil
}

// Delete removes the value under k; deleted is false when there was none
// (the version then stays). It returns the version after it.
func (o *Overrides) Delete(ctx context.Context, k buckets.OverrideKey) (deleted bool, version string, err error) {
	if err := k.Validate(); err != nil {
		return false, "", err
	}
	ctx, cancel, err := o.s.start(ctx, "delete override")
	if err != nil {
		return false, "", err
	}
	defer cancel()
	out, err := o.s.run(ctx, deleteOverrideScript, o.keys(), []any{newID()[:16], overrideField(k)})
	if err != nil {
		return false, "", fmt.Errorf("redisstore: delete override: %w", err)
	}
	if len(out) < 2 {
		return false, "", fmt.Errorf("%w: delete override: unexpected reply %v", buckets.ErrStore, out)
	}
	n, _ := out[0].(int64)
	version, _ = out[1].(string)
	return n == 1, version, nil
}

// Version returns the current version: one small read, what gateways poll.
func (o *Overrides) Version(ctx context.Context) (string, error) {
	ctx, cancel, err := o.s.start(ctx, "overrides version")
	if err != nil {
		return "", err
	}
	defer cancel()
	out, err := o.s.run(ctx, overridesVersionScript, o.keys()[1:], nil)
	if err != nil {
		return "", fmt.Errorf("redisstore: overrides version: %w", err)
	}
	v, _ := out[0].(string)
	return v, nil
}

// Load returns every override with the version they are at, read in one
// atomic step. A field that is not a well-formed key (written by something
// other than this store) is an error.
func (o *Overrides) Load(ctx context.Context) (buckets.OverrideSet, error) {
	ctx, cancel, err := o.s.start(ctx, "load overrides")
	if err != nil {
		return buckets.OverrideSet{}, err
	}
	defer cancel()
	out, err := o.s.run(ctx, loadOverridesScript, o.keys(), nil)
	if err != nil {
		return buckets.OverrideSet{}, fmt.Errorf("redisstore: load overrides: %w", err)
	}
	version, _ := out[0].(string)
	var fields []any
	if len(out) > 1 {
		fields, _ = out[1].([]any)
	}
	set := buckets.OverrideSet{Version: version, Values: make(map[buckets.OverrideKey][]byte, len(fields)/2)}
	for i := 0; i+1 < len(fields); i += 2 {
		f, _ := fields[i].(string)
		v, _ := fields[i+1].(string)
		parts := strings.Split(f, "\x00")
		if len(parts) != 3 {
			return buckets.OverrideSet{}, fmt.Errorf("%w: load overrides: field %q of %s is not policy, rule and identity", buckets.ErrStore, f, o.hash)
		}
		set.Values[buckets.OverrideKey{Policy: parts[0], Rule: parts[1], Identity: parts[2]}] = []byte(v)
	}
	return set, nil
}
