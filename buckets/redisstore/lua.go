package redisstore

// The scripts below are the whole Redis side of the store. Each operation is
// one script call, so refill, check and debit happen in one atomic step
// (S20). Conventions shared by all of them:
//
//   - ARGV[1] is empty in production: time is the Redis server's TIME (S2),
//     in microseconds. Tests of this package alone can pass an instant.
//   - A bucket is one string key holding two little-endian doubles packed
//     with Redis's struct library: its level in tokens and the instant
//     refill resumes from (µs; later than now while paused, S18). A missing
//     key is a full bucket. Reserve and settle read all buckets with one
//     MGET and write each with one SET: every redis.call costs about as
//     much as the arithmetic of a whole script.
//   - Doubles cross the script boundary only in binary: Redis truncates Lua
//     numbers in replies, tostring keeps only 14 digits, and formatting 17
//     digits costs more than the rest of a script. Levels and holds are
//     returned as one packed string, so nothing is lost and nothing printed.
//   - Every write sets the TTL in the same SET. The caller passes, per
//     bucket, a level "low" (its floor, but not below -capacity) and the
//     time to refill from low to full; a level below low or a paused bucket
//     gets its exact time to full. Once a key expires the bucket is full
//     anyway, so idle buckets vanish without changing any answer.
const luaNow = `
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
`

// luaPrelude adds the bucket functions for the scripts off the hot path;
// reserve and settle inline them, since making closures costs on every
// call.
const luaPrelude = luaNow + `
local function get(k, cap, rate)
  local v = redis.call('GET', k)
  if not v then return cap, now end
  local l, t = struct.unpack('<dd', v)
  if now > t then
    l = l + rate * ((now - t) / 1e6)
    if l > cap then l = cap end
    t = now
  end
  return l, t
end
local function put(k, l, t, cap, rate, low, ttl)
  if t > now or l < low then
    local ms = (t - now + (cap - l) / rate * 1e6) / 1000 + 1001
    if ms > 1e12 then ms = 1e12 end
    ttl = string.format('%d', ms)
  end
  redis.call('SET', k, struct.pack('<dd', l, t), 'PX', ttl)
end
local function hold(t) if t > now then return t - now end return 0 end
`

// reserveLua takes cost from every bucket and a lease from every slot, all
// or none (S3–S5, S11, S12, S19).
//
// KEYS: n bucket keys, then m slot keys (sorted sets of reservation IDs
// scored by lease expiry).
// ARGV: now, reservation ID, struct format and packed numbers — n, m, cost,
// max wait (s); per bucket capacity, rate, hard (1/0), reserve (headroom the
// request must leave), low; per slot max, lease (µs) — the struct format of
// the reply, then per bucket the TTL from low (ms). Numbers travel packed: parsing decimal arguments costs
// more than unpacking them.
// Returns status (0 admitted, 1 short of tokens, 2 concurrency full, 3 never
// admissible), the 1-based index of the full slot, and the packed level
// (after the take when admitted) and hold (µs) of every bucket.
const reserveLua = luaNow + `
local p = {struct.unpack(ARGV[3], ARGV[4])}
local n, m, cost, maxwait = p[1], p[2], p[3], p[4]
local lv, ts = {}, {}
local status, worst, hard = 0, 0, false
local vs = {}
if n > 0 then vs = redis.call('MGET', unpack(KEYS, 1, n)) end
for i = 1, n do
  local a = 5 * i
  local cap, rate, res = p[a], p[a + 1], p[a + 3]
  local l, t = cap, now
  local v = vs[i]
  if v then
    l, t = struct.unpack('<dd', v)
    if now > t then
      l = l + rate * ((now - t) / 1e6)
      if l > cap then l = cap end
      t = now
    end
  end
  lv[i], ts[i] = l, t
  if cost > cap - res then
    status = 3
  elseif l < cost + res or t > now then
    local need = cost + res - l
    if need < 0 then need = 0 end
    local w = (t - now) / 1e6 + need / rate
    if p[a + 2] == 1 then hard = true end
    if w > worst then worst = w end
  end
end
if status == 0 and worst > 0 and (hard or worst > maxwait) then status = 1 end
local full = 0
local s0 = 5 * n + 3
if status == 0 then
  for j = 1, m do
    local k, mx = KEYS[n + j], p[s0 + 2 * j]
    if redis.call('ZCARD', k) >= mx then
      redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
      if redis.call('ZCARD', k) >= mx then status, full = 2, j; break end
    end
  end
end
local vals = {}
for i = 1, n do
  local l, t = lv[i], ts[i]
  if status == 0 then
    local a = 5 * i
    l = l - cost
    local ttl = ARGV[5 + i]
    if t > now or l < p[a + 4] then
      local ms = (t - now + (p[a] - l) / p[a + 1] * 1e6) / 1000 + 1001
      if ms > 1e12 then ms = 1e12 end
      ttl = string.format('%d', ms)
    end
    redis.call('SET', KEYS[i], struct.pack('<dd', l, t), 'PX', ttl)
  end
  vals[2 * i - 1] = l
  if t > now then vals[2 * i] = t - now else vals[2 * i] = 0 end
end
if status == 0 then
  for j = 1, m do
    local lease = p[s0 + 2 * j + 1]
    local ms = lease / 1000 + 1001
    redis.call('ZADD', KEYS[n + j], now + lease, ARGV[2])
    redis.call('PEXPIRE', KEYS[n + j], ms - ms % 1)
  end
end
return {status, full, struct.pack(ARGV[5], unpack(vals))}
`

// settleLua adds delta (charged minus used) to every bucket, refunds capped
// at capacity and debits floored (S8, S9, S14), and releases the slots.
// With a marker key it runs once per reservation ID: a second call reports
// the state and changes nothing.
//
// KEYS: n bucket keys, m slot keys, then the marker key when ARGV[3] is set.
// ARGV: now, reservation ID, marker TTL (ms, or empty for none), struct
// format and packed numbers — n, m; per bucket capacity, rate, floor
// (-inf for none), low, delta — the struct format of the reply, then per
// bucket the TTL from low (ms).
// Returns 1 when it had already been settled (else 0), and the packed
// level, hold (µs) and forgiven tokens (what the floor kept from being
// debited) of every bucket.
const settleLua = luaNow + `
local p = {struct.unpack(ARGV[4], ARGV[5])}
local n, m = p[1], p[2]
local done = false
if ARGV[3] ~= '' then
  done = not redis.call('SET', KEYS[n + m + 1], '1', 'NX', 'PX', ARGV[3])
end
local vals = {}
local vs = {}
if n > 0 then vs = redis.call('MGET', unpack(KEYS, 1, n)) end
for i = 1, n do
  local a = 5 * i - 2
  local cap, rate, floor = p[a], p[a + 1], p[a + 2]
  local l, t = cap, now
  local forgiven = 0
  local v = vs[i]
  if v then
    l, t = struct.unpack('<dd', v)
    if now > t then
      l = l + rate * ((now - t) / 1e6)
      if l > cap then l = cap end
      t = now
    end
  end
  if not done then
    local delta = p[a + 4]
    if delta >= 0 then
      l = l + delta
      if l > cap then l = cap end
    elseif l + delta >= floor then
      l = l + delta
    elseif l > floor then
      forgiven = floor - (l + delta)
      l = floor
    else
      forgiven = -delta
    end
    local ttl = ARGV[6 + i]
    if t > now or l < p[a + 3] then
      local ms = (t - now + (cap - l) / rate * 1e6) / 1000 + 1001
      if ms > 1e12 then ms = 1e12 end
      ttl = string.format('%d', ms)
    end
    redis.call('SET', KEYS[i], struct.pack('<dd', l, t), 'PX', ttl)
  end
  vals[3 * i - 2] = l
  if t > now then vals[3 * i - 1] = t - now else vals[3 * i - 1] = 0 end
  vals[3 * i] = forgiven
end
if not done then
  for j = 1, m do redis.call('ZREM', KEYS[n + j], ARGV[2]) end
end
return {done and 1 or 0, struct.pack(ARGV[6], unpack(vals))}
`

// extendLua debits an amount from every (hard) bucket, all or none, never
// below zero and not while paused (S14).
//
// KEYS: n bucket keys. ARGV: now, n, amount; per bucket capacity, rate,
// low, TTL from low (ms).
// Returns 1 when debited, 0 when refused.
const extendLua = luaPrelude + `
local n, amt = ARGV[2] + 0, ARGV[3] + 0
local lv, ts = {}, {}
for i = 1, n do
  local l, t = get(KEYS[i], ARGV[4 * i] + 0, ARGV[4 * i + 1] + 0)
  if l - amt < 0 or t > now then return 0 end
  lv[i], ts[i] = l, t
end
for i = 1, n do
  local a = 4 * i
  put(KEYS[i], lv[i] - amt, ts[i], ARGV[a] + 0, ARGV[a + 1] + 0, ARGV[a + 2] + 0, ARGV[a + 3])
end
return 1
`

// pauseLua empties a bucket, keeping any debt, and holds its refill for a
// duration (S18).
//
// KEYS: the bucket key. ARGV: now, capacity, rate, hold (µs), low, TTL from
// low (ms).
const pauseLua = luaPrelude + `
local cap, rate = ARGV[2] + 0, ARGV[3] + 0
local l, t = get(KEYS[1], cap, rate)
if l > 0 then l = 0 end
local until_ = now + ARGV[4]
if until_ > t then t = until_ end
put(KEYS[1], l, t, cap, rate, ARGV[5] + 0, ARGV[6])
return 1
`

// renewLua extends a reservation's slot leases that have not expired (S11).
//
// KEYS: slot keys. ARGV: now, reservation ID; per slot the lease (µs).
const renewLua = luaNow + `
for j = 1, #KEYS do
  local exp = redis.call('ZSCORE', KEYS[j], ARGV[2])
  if exp and exp + 0 > now then
    local lease = ARGV[2 + j] + 0
    local ms = lease / 1000 + 1001
    redis.call('ZADD', KEYS[j], 'XX', now + lease, ARGV[2])
    redis.call('PEXPIRE', KEYS[j], ms - ms % 1)
  end
end
return 1
`
