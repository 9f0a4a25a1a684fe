package redisstore

// The scripts below are the whole Redis side of the store. Each operation is
// one script call, so refill, check and debit happen in one atomic step
// (S20). Conventions shared by all of them:
//
//   - ARGV[1] is empty in production: time is the Redis server's TIME (S2),
//     in microseconds. Tests of this package alone can pass an instant.
//   - Only KEYS name keys, and a script's keys share one cluster hash slot:
//     the store batches per slot.
//   - A bucket is one string key holding little-endian doubles packed with
//     Redis's struct library: its level in tokens and the instant refill
//     resumes from (µs; later than now while paused, S18). A missing key is
//     a full bucket. A batch reads all its buckets with one MGET and writes
//     each with one SET: every redis.call costs more than the arithmetic of
//     a whole operation.
//   - The records of open reservations live in the value of the first
//     bucket of their group (its holder), after a third double, the latest
//     record's expiry: per record its expiry, a length byte and the ID. So
//     reserving and settling add no call. Past maxInline records a holder
//     is full, and further records go to the record key, a sorted set of IDs
//     scored by expiry (also for groups without a bucket). Every script that
//     rewrites a bucket keeps its records.
//   - Doubles cross the script boundary only in binary: Redis truncates Lua
//     numbers in replies, tostring keeps only 14 digits, and formatting 17
//     digits costs more than the rest of a script. Levels and holds are
//     returned as one packed string, so nothing is lost and nothing printed.
//   - Every write sets the TTL in the same SET. The caller passes, per
//     bucket, a level "low" (its floor, but not below -capacity) and the
//     time to refill from low to full; a level below low or a paused bucket
//     gets its exact time to full, and a holder lives at least as long as
//     its latest record. Once a key expires the bucket is full anyway, so
//     idle buckets vanish without changing any answer.
//   - A quota's spend in one calendar window is one string key holding one
//     packed double; a missing key is nothing spent. Windows are calendar
//     arithmetic in a time zone, which Lua cannot do: the gateway names
//     the window in the key and passes its TTL (until the window's end and
//     a slack), so each window starts from zero and then vanishes. A TTL of
//     zero or less (a settlement arriving after the slack) writes nothing.
const luaNow = `
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
end
`

// luaRecords finds, adds and drops records in a holder's record string r
// (its value from byte 25 on, see the conventions above) without building
// tables: most holders have one or two records.
const luaRecords = `
local function findrec(r, id)
  local pos, n = 1, #id
  while pos <= #r do
    local len = string.byte(r, pos + 8)
    if len == n and string.find(r, id, pos + 9, true) == pos + 9 then
      return pos, (struct.unpack('<d', r, pos))
    end
    pos = pos + 9 + len
  end
end
local function droprec(r, pos)
  return string.sub(r, 1, pos - 1) .. string.sub(r, pos + 9 + string.byte(r, pos + 8))
end
local function prune(r)
  local keep, last, pos = {}, 0, 1
  while pos <= #r do
    local len = string.byte(r, pos + 8)
    local exp = struct.unpack('<d', r, pos)
    if exp > now then
      keep[#keep + 1] = string.sub(r, pos, pos + 8 + len)
      if exp > last then last = exp end
    end
    pos = pos + 9 + len
  end
  return table.concat(keep), last
end
local function bucketvalue(l, t, r, last)
  if not r or r == '' then return struct.pack('<dd', l, t) end
  return struct.pack('<ddd', l, t, last) .. r
end
local function ttlms(l, t, cap, rate, low, ttl, last)
  if t > now or l < low then
    ttl = (t - now + (cap - l) / rate * 1e6) / 1000 + 1001
    if ttl > 1e12 then ttl = 1e12 end
  end
  if last and last > now then
    local m = (last - now) / 1000 + 1001
    if m > ttl then ttl = m end
  end
  return string.format('%d', ttl)
end
`

// maxInline is how many records a holder bucket keeps in its value; it
// bounds the cost of rewriting a bucket that many requests share.
const maxInline = 16

// luaPrelude adds the bucket functions for the scripts off the hot path.
const luaPrelude = luaNow + luaRecords + `
local function get(k, cap, rate)
  local v = redis.call('GET', k)
  if not v then return cap, now, '', 0 end
  local l, t = struct.unpack('<dd', v)
  if now > t then
    l = l + rate * ((now - t) / 1e6)
    if l > cap then l = cap end
    t = now
  end
  if #v <= 16 then return l, t, '', 0 end
  return l, t, string.sub(v, 25), (struct.unpack('<d', v, 17))
end
local function put(k, l, t, r, last, cap, rate, low, ttl)
  redis.call('SET', k, bucketvalue(l, t, r, last), 'PX', ttlms(l, t, cap, rate, low, tonumber(ttl), last))
end
`

// batchLua runs a batch of reserve and settle operations in order, each
// atomic and all or none for itself, exactly as if each were a script call
// of its own: group commit. Calling less is what makes a fleet cheap for
// Redis — the fixed cost of a script call and of its round trip is paid
// once per batch, and a bucket that several operations touch (the
// provider's, the team's, a user's reserve and the settlement before it) is
// read once and written once.
//
// KEYS: every key of the batch once: first the nbk bucket keys, then the
// nqk quota keys, then slot and record keys.
// ARGV: now, struct format and packed numbers, then one reservation ID per
// operation. Numbers: nops, nbk, nqk, maxInline; then per operation kind
// (1 reserve, 2 settle), nb, ns, nq, record key index (0 for none), and
//   - reserve: cost, max wait (s), lifetime (µs); per bucket key index,
//     capacity, rate, low, TTL from low (ms), hard (1/0), reserve (the
//     headroom it must leave); per quota key index, limit, amount, TTL
//     (ms); per slot key index, max, lease (µs);
//   - settle: per bucket key index, capacity, rate, low, TTL from low (ms),
//     floor (-inf for none), delta (charged minus used; positive refunds);
//     per quota key index, delta (used minus charged: the change of the
//     spend), TTL (ms); per slot key index.
//
// A reserve that admits takes cost from every bucket, its amount from every
// quota, a lease from every slot, and writes the reservation's record: in
// its first bucket, or in the record key when that is full or the group
// has no bucket (S3-S5, S11, S12, S19). A quota refuses an amount above
// its limit (never admissible) or above what its window has left (over
// quota). A settle with a record key applies only if it finds the record
// unexpired, and removes it, so it runs once per reservation and a settled
// request leaves nothing behind (S8); one without (a refund of a partly
// taken chain) always applies. Debits stop at the floor; what they would
// take below it is forgiven (S9, S14). A quota's spend has no floor but
// zero.
//
// Returns one packed string of doubles, per operation: for a reserve its
// status (0 admitted, 1 short of tokens, 2 concurrency full, 3 never
// admissible, 4 over quota), the 1-based index of the full slot, the level
// (after the take when admitted) and hold (µs) of every bucket, and the
// spend of every quota (likewise); for a settle 1 when there was nothing
// to settle (else 0), 0, and the level, hold and forgiven tokens of every
// bucket.
const batchLua = luaNow + luaRecords + `
local p = {struct.unpack(ARGV[2], ARGV[3])}
local nops, nbk, nqk, maxinline = p[1], p[2], p[3], p[4]
-- Per bucket key index: level, refill instant, the parameters of its last
-- write (W), and, for a holder, its record string (R), the latest record's
-- expiry (M), its number of records (RN, counted once it matters) and
-- whether a record was dropped (D). Expired records are dropped when all
-- are, or when a holder is full; until then M may be later than needed,
-- which only keeps the key a little longer.
local L, T, W, R, M, RN, D = {}, {}, {}, {}, {}, {}, {}
-- Per quota key index: the spend (S), whether the key exists (E: its TTL,
-- the window's end, stays), and the TTL of its write (QW).
local S, E, QW = {}, {}, {}
if nbk + nqk > 0 then
  local vs = redis.call('MGET', unpack(KEYS, 1, nbk + nqk))
  for i = 1, nbk do
    local v = vs[i]
    if v then
      L[i], T[i] = struct.unpack('<dd', v)
      if #v > 16 then R[i], M[i] = string.sub(v, 25), (struct.unpack('<d', v, 17)) end
    end
  end
  for i = nbk + 1, nbk + nqk do
    local v = vs[i]
    if v then S[i], E[i] = struct.unpack('<d', v), true else S[i] = 0 end
  end
end
-- Records in record keys: per record key, the open reservations this batch
-- has looked up or added there, by ID: their expiry, or false once settled;
-- and whether the key had them (found).
local open, found = {}, {}
local vals, nv = {}, 0
local a = 5
for o = 1, nops do
  local kind, nb, ns, nq, rec = p[a], p[a + 1], p[a + 2], p[a + 3], p[a + 4]
  local id = ARGV[3 + o]
  if kind == 1 then
    local cost, maxwait, life = p[a + 5], p[a + 6], p[a + 7]
    local b0 = a + 8
    local q0 = b0 + 7 * nb
    local s0 = q0 + 4 * nq
    a = s0 + 3 * ns
    local status, worst, hard = 0, 0, false
    for i = 0, nb - 1 do
      local q = b0 + 7 * i
      local k, cap, rate, res = p[q], p[q + 1], p[q + 2], p[q + 6]
      local l, t = L[k], T[k]
      if not l then l, t = cap, now end
      if now > t then
        l = l + rate * ((now - t) / 1e6)
        if l > cap then l = cap end
        t = now
      end
      L[k], T[k] = l, t
      if cost > cap - res then
        status = 3
      elseif l < cost + res or t > now then
        local need = cost + res - l
        if need < 0 then need = 0 end
        local w = (t - now) / 1e6 + need / rate
        if p[q + 5] == 1 then hard = true end
        if w > worst then worst = w end
      end
    end
    local over = false
    for j = 0, nq - 1 do
      local q = q0 + 4 * j
      local lim, amt = p[q + 1], p[q + 2]
      if amt > lim then
        status = 3
      elseif S[p[q]] + amt > lim then
        over = true
      end
    end
    if status == 0 and over then status = 4 end
    if status == 0 and worst > 0 and (hard or worst > maxwait) then status = 1 end
    local full = 0
    if status == 0 then
      for j = 0, ns - 1 do
        local q = s0 + 3 * j
        local k, mx = KEYS[p[q]], p[q + 1]
        if redis.call('ZCARD', k) >= mx then
          redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
          if redis.call('ZCARD', k) >= mx then status, full = 2, j + 1; break end
        end
      end
    end
    vals[nv + 1], vals[nv + 2] = status, full
    nv = nv + 2
    for i = 0, nb - 1 do
      local q = b0 + 7 * i
      local k = p[q]
      local l, t = L[k], T[k]
      if status == 0 then
        l = l - cost
        L[k], W[k] = l, q
      end
      vals[nv + 1] = l
      if t > now then vals[nv + 2] = t - now else vals[nv + 2] = 0 end
      nv = nv + 2
    end
    for j = 0, nq - 1 do
      local q = q0 + 4 * j
      local k = p[q]
      if status == 0 then
        S[k], QW[k] = S[k] + p[q + 2], p[q + 3]
      end
      nv = nv + 1
      vals[nv] = S[k]
    end
    if status == 0 then
      for j = 0, ns - 1 do
        local q = s0 + 3 * j
        local lease = p[q + 2]
        local ms = lease / 1000 + 1001
        redis.call('ZADD', KEYS[p[q]], now + lease, id)
        redis.call('PEXPIRE', KEYS[p[q]], ms - ms % 1)
      end
      if rec > 0 then
        local h, exp = p[b0], now + life
        if nb > 0 and not RN[h] then
          local r = R[h] or ''
          if not M[h] or M[h] <= now then r, M[h] = '', 0 end
          local n, pos = 0, 1
          while pos <= #r do n = n + 1; pos = pos + 9 + string.byte(r, pos + 8) end
          if n >= maxinline then
            r, M[h] = prune(r)
            n, pos = 0, 1
            while pos <= #r do n = n + 1; pos = pos + 9 + string.byte(r, pos + 8) end
          end
          R[h], RN[h] = r, n
        end
        if nb > 0 and RN[h] < maxinline then
          R[h] = R[h] .. struct.pack('<d', exp) .. string.char(#id) .. id
          if exp > M[h] then M[h] = exp end
          RN[h] = RN[h] + 1
        else
          open[rec] = open[rec] or {}
          found[rec] = found[rec] or {}
          open[rec][id] = exp
        end
      end
    end
  else
    local b0 = a + 5
    local q0 = b0 + 7 * nb
    local s0 = q0 + 3 * nq
    a = s0 + ns
    local done = false
    if rec > 0 then
      local h, pos, exp = p[b0], nil, nil
      if nb > 0 and R[h] then pos, exp = findrec(R[h], id) end
      if pos then
        R[h] = droprec(R[h], pos)
        if RN[h] then RN[h] = RN[h] - 1 end
        W[h], D[h] = W[h] or b0, true
      else
        open[rec] = open[rec] or {}
        found[rec] = found[rec] or {}
        exp = open[rec][id]
        if exp == nil then
          exp = redis.call('ZSCORE', KEYS[rec], id)
          if exp then exp = tonumber(exp) end
          found[rec][id] = exp and true
        end
        if exp then open[rec][id] = false end
      end
      done = not exp or exp <= now
    end
    vals[nv + 1], vals[nv + 2] = done and 1 or 0, 0
    nv = nv + 2
    for i = 0, nb - 1 do
      local q = b0 + 7 * i
      local k, cap, rate, floor = p[q], p[q + 1], p[q + 2], p[q + 5]
      local l, t = L[k], T[k]
      if not l then l, t = cap, now end
      if now > t then
        l = l + rate * ((now - t) / 1e6)
        if l > cap then l = cap end
        t = now
      end
      local forgiven = 0
      if not done then
        local delta = p[q + 6]
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
        W[k] = q
      end
      L[k], T[k] = l, t
      vals[nv + 1] = l
      if t > now then vals[nv + 2] = t - now else vals[nv + 2] = 0 end
      vals[nv + 3] = forgiven
      nv = nv + 3
    end
    if not done then
      for j = 0, nq - 1 do
        local q = q0 + 3 * j
        local k = p[q]
        local sp = S[k] + p[q + 1]
        if sp < 0 then sp = 0 end
        S[k], QW[k] = sp, p[q + 2]
      end
      for j = 0, ns - 1 do redis.call('ZREM', KEYS[p[s0 + j]], id) end
    end
  end
end
for k, ttl in pairs(QW) do
  if ttl > 0 then
    if S[k] > 0 and E[k] then
      redis.call('SET', KEYS[k], struct.pack('<d', S[k]), 'KEEPTTL')
    elseif S[k] > 0 then
      redis.call('SET', KEYS[k], struct.pack('<d', S[k]), 'PX', string.format('%d', ttl))
    else
      redis.call('DEL', KEYS[k])
    end
  end
end
for k, q in pairs(W) do
  local l, t = L[k], T[k]
  if not l then l, t = p[q + 1], now end
  if D[k] and R[k] == '' then M[k] = nil end
  redis.call('SET', KEYS[k], bucketvalue(l, t, R[k], M[k]), 'PX', ttlms(l, t, p[q + 1], p[q + 2], p[q + 3], p[q + 4], M[k]))
end
for rec, o in pairs(open) do
  local add, del, last = {}, {}, 0
  for id, exp in pairs(o) do
    if exp and not found[rec][id] then
      add[#add + 1] = exp
      add[#add + 1] = id
      if exp > last then last = exp end
    elseif not exp and found[rec][id] then
      del[#del + 1] = id
    end
  end
  local k = KEYS[rec]
  if #del > 0 then redis.call('ZREM', k, unpack(del)) end
  if #add > 0 then
    -- Records of reservations never settled expire by score: drop them.
    redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
    redis.call('ZADD', k, unpack(add))
    local ms = (last - now) / 1000 + 1001
    ms = ms - ms % 1
    if redis.call('PEXPIRE', k, ms, 'GT') == 0 and redis.call('PTTL', k) == -1 then
      redis.call('PEXPIRE', k, ms)
    end
  end
end
return struct.pack('<' .. string.rep('d', nv), unpack(vals, 1, nv))
`

// extendLua debits an amount from every (hard) bucket and quota, all or
// none: a bucket never below zero and not while paused, a quota never past
// its limit (S14).
//
// KEYS: n bucket keys, then nq quota keys. ARGV: now, n, amount; per
// bucket capacity, rate, low, TTL from low (ms); nq; per quota limit,
// amount, TTL (ms).
// Returns 1 when debited, 0 when refused.
const extendLua = luaPrelude + `
local n, amt = ARGV[2] + 0, ARGV[3] + 0
local lv, ts = {}, {}
local rs, ms = {}, {}
for i = 1, n do
  local l, t, r, m = get(KEYS[i], ARGV[4 * i] + 0, ARGV[4 * i + 1] + 0)
  if l - amt < 0 or t > now then return 0 end
  lv[i], ts[i], rs[i], ms[i] = l, t, r, m
end
local q0 = 4 * n + 4
local nq = ARGV[q0] + 0
local sp = {}
for j = 1, nq do
  local v = redis.call('GET', KEYS[n + j])
  local s = 0
  if v then s = struct.unpack('<d', v) end
  local a = q0 + 3 * j - 2
  if s + ARGV[a + 1] > ARGV[a] + 0 then return 0 end
  sp[j] = s
end
for i = 1, n do
  local a = 4 * i
  put(KEYS[i], lv[i] - amt, ts[i], rs[i], ms[i], ARGV[a] + 0, ARGV[a + 1] + 0, ARGV[a + 2] + 0, ARGV[a + 3])
end
for j = 1, nq do
  local a = q0 + 3 * j - 2
  if ARGV[a + 2] + 0 > 0 then
    redis.call('SET', KEYS[n + j], struct.pack('<d', sp[j] + ARGV[a + 1]), 'PX', ARGV[a + 2])
  end
end
return 1
`

// inspectLua reads buckets, brought up to now, and quotas' spend, writing
// nothing.
//
// KEYS: n bucket keys, then quota keys. ARGV: now, n; per bucket capacity,
// rate.
// Returns one packed string of doubles: per bucket its level and hold
// (µs), then per quota its spend.
const inspectLua = luaPrelude + `
local n = ARGV[2] + 0
local out = {}
for i = 1, n do
  local l, t = get(KEYS[i], ARGV[2 * i + 1] + 0, ARGV[2 * i + 2] + 0)
  out[#out + 1] = l
  if t > now then out[#out + 1] = t - now else out[#out + 1] = 0 end
end
for j = n + 1, #KEYS do
  local v = redis.call('GET', KEYS[j])
  if v then out[#out + 1] = struct.unpack('<d', v) else out[#out + 1] = 0 end
end
return struct.pack('<' .. string.rep('d', #out), unpack(out))
`

// pauseLua empties a bucket, keeping any debt, and holds its refill for a
// duration (S18).
//
// KEYS: the bucket key. ARGV: now, capacity, rate, hold (µs), low, TTL from
// low (ms).
const pauseLua = luaPrelude + `
local cap, rate = ARGV[2] + 0, ARGV[3] + 0
local l, t, r, m = get(KEYS[1], cap, rate)
if l > 0 then l = 0 end
local until_ = now + ARGV[4]
if until_ > t then t = until_ end
put(KEYS[1], l, t, r, m, cap, rate, ARGV[5] + 0, ARGV[6])
return 1
`

// renewLua extends a reservation's record and slot leases, where they have
// not expired (S11).
//
// KEYS: the record key, the holder bucket when ARGV[4] is 1, then slot
// keys. ARGV: now, reservation ID, lifetime (µs), 1 when there is a holder
// (else 0); per slot the lease (µs).
const renewLua = luaNow + luaRecords + `
local id, life = ARGV[2], ARGV[3] + 0
local s0 = 2
if ARGV[4] == '1' then
  s0 = 3
  local v = redis.call('GET', KEYS[2])
  if v and #v > 16 then
    local r = string.sub(v, 25)
    local pos, exp = findrec(r, id)
    if pos and exp > now then
      local e = now + life
      r = droprec(r, pos) .. struct.pack('<d', e) .. string.char(#id) .. id
      local last = struct.unpack('<d', v, 17)
      if e > last then last = e end
      local l, t = struct.unpack('<dd', v)
      local ttl = redis.call('PTTL', KEYS[2])
      local m = (last - now) / 1000 + 1001
      if m > ttl then ttl = m end
      redis.call('SET', KEYS[2], bucketvalue(l, t, r, last), 'PX', string.format('%d', ttl))
    end
  end
end
local exp = redis.call('ZSCORE', KEYS[1], id)
if exp and exp + 0 > now then
  redis.call('ZADD', KEYS[1], 'XX', now + life, id)
  local ms = life / 1000 + 1001
  ms = ms - ms % 1
  if redis.call('PTTL', KEYS[1]) < ms then redis.call('PEXPIRE', KEYS[1], ms) end
end
for j = s0, #KEYS do
  local exp = redis.call('ZSCORE', KEYS[j], id)
  if exp and exp + 0 > now then
    local lease = ARGV[5 + j - s0] + 0
    local ms = lease / 1000 + 1001
    redis.call('ZADD', KEYS[j], 'XX', now + lease, id)
    redis.call('PEXPIRE', KEYS[j], ms - ms % 1)
  end
end
return 1
`
