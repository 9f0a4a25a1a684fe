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
//     packed double followed by the tag of the quota's unit
//     (buckets.Quota.Tag: "t" for tokens, "$USD" for money in USD); a
//     missing key is nothing spent. A value of another unit's tag is
//     nothing spent in the quota's unit: a reserve that admits replaces it
//     (the window starts afresh in the new unit), while a settlement,
//     replay, added spend or extension, which change what a reservation
//     charged in its own unit, leave it alone. A value of the double alone
//     (8 bytes, as releases before the tag wrote it) is the spend of
//     whatever unit the quota has, and the next write tags it: an upgrade
//     keeps every window's spend. Comparing tags costs a string.sub and a
//     string comparison, no table. Windows are calendar arithmetic in a
//     time zone, which Lua cannot do: the gateway names the window in the
//     key and passes its TTL (until the window's end and a slack), so each
//     window starts from zero and then vanishes. A TTL of zero or less (a
//     settlement arriving after the slack) writes nothing.
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
// nqk quota keys, then slot, record and marker keys.
// ARGV: now, struct format and packed numbers, then one reservation ID per
// operation, then the strings of the batch, each once: the unit tags of
// its quotas and, in decimal, the TTLs (ms) it may pass to SET as they are
// (a number passed to redis.call costs Redis a printf of 17 digits, which
// is dearer than the SET; a string costs nothing). Numbers: nops, nbk, nqk,
// maxInline, the repeat window (µs); then per operation its kind, nb, ns,
// nq, record key index (0 for none), and
//   - reserve (kind 1): cost, max wait (s), lifetime (µs); per bucket key
//     index, capacity, rate, low, TTL from low (a string's index), hard
//     (1/0), reserve (the headroom it must leave); per quota key index,
//     limit, amount, TTL (ms), tag (a string's index); per slot key index,
//     max, lease (µs);
//   - settle (kind 2 plus 1 to leave a tombstone, plus 2 for a replay, plus
//     4 for a replay of a settlement that may have applied, plus 8 for a
//     charge, plus 16 for a replay of a charge whose call went unanswered):
//     for a replay or a charge its marker key index and the marker's TTL
//     (a string's index); for a replay of a charge, the index of the
//     marker key of the call that went unanswered, the TTL of that
//     marker, and 1 when the call was sent within half the repeat window
//     (else 0); per
//     bucket key index, capacity, rate, low, TTL from low (a string's
//     index), floor (-inf for none), delta
//     (charged minus used; positive refunds); per quota key index, delta
//     (used minus charged: the change of the spend), TTL (ms), tag (a
//     string's index); per slot key index.
//
// A reserve that admits takes cost from every bucket, its amount from every
// quota, a lease from every slot, and writes the reservation's record: in
// its first bucket, or in the record key when that is full or the group
// has no bucket (S3-S5, S11, S12, S19). A quota refuses an amount above
// its limit (never admissible) or above what its window has left (over
// quota). A settle with a record key applies only if it finds the record
// unexpired, and removes it, so it runs once per reservation and a settled
// request leaves nothing behind (S8). Debits stop at the floor; what they
// would take below it is forgiven (S9, S14). A quota's spend has no floor
// but zero. A quota's spend in another unit than the operation's is
// nothing spent for a reserve, which replaces it when it takes, and is
// left alone by a settle (see the conventions above).
//
// Every operation is safe to repeat (its reply lost, the gateway sends it
// again; both copies may run, in either order):
//
//   - A reserve whose record exists ran already: it takes nothing and
//     answers admitted, with the levels as they are. One that finds a
//     tombstone (see below) takes nothing and answers never admissible.
//     Looking costs one string.find over the holder's records; the record
//     key is asked (one ZMSCORE) only for groups without a bucket, or when
//     the holder's spill mark says that records or tombstones of its
//     reserves went there within the repeat window: a record of length 0
//     at the head of its records, whose expiry is when that stops.
//   - A settle is once-only through its record. A tombstone, member
//     "%t" .. ID of the record key for the repeat window, keeps a copy of
//     the reserve that comes after it from taking; settles leave one only
//     when two copies of the reserve may run (its reply was lost once).
//   - A replay (an outage's settlement, kept and sent later) also applies
//     when the record is gone, once, by its marker key; when an earlier
//     copy may have applied, a replay without the record applies only
//     debits: what charges more, never a refund. A settle without a
//     record key is a replay (AddSpend).
//   - A charge (a settlement never reserved) applies once by its call's
//     marker, one for all charges of the batch: the batch's first run
//     sets it to 1 and applies them, a copy finds it and applies none. A
//     replay of a charge whose call went unanswered asks that call's
//     marker, setting it to 0 when it is missing: 1 says the call ran (the
//     replay applies nothing); 0 or missing says it did not, and now never
//     will (a copy of it still on its way finds the marker and applies
//     none of its charges, each of which is replayed in its turn), so the
//     replay applies in full — but debits only when the marker may have
//     expired (the call was sent longer than half the repeat window ago).
//
// Returns one packed string of doubles, per operation: for a reserve its
// status (0 admitted, 1 short of tokens, 2 concurrency full, 3 never
// admissible, 4 over quota), the 1-based index of the full slot, the level
// (after the take when admitted) and hold (µs) of every bucket, and the
// spend of every quota (likewise); for a settle 1 when there was nothing
// to settle (else 0), 0, and the level, hold and forgiven tokens of every
// bucket.
const batchLua = luaNow + `
local p = {struct.unpack(ARGV[2], ARGV[3])}
local nops, nbk, nqk, maxinline, window = p[1], p[2], p[3], p[4], p[5]
-- Per bucket key index k, in one table B from 8k-7 on (one table, sized
-- at once, allocates less than one per field): level (+0) and refill
-- instant (+1); the parameters of its last write (+2, an index into p);
-- for a holder a string (+3) that holds its records from an offset (+7)
-- on (at first the key's value, so reading copies nothing, and dropping
-- the first record moves the offset), the latest record's expiry (+4)
-- and its number of records (+5, counted once it matters); whether its
-- write must set the TTL (+6): a take, a debit, a record or a mark added
-- can need a later expiry, while a key that only got tokens back or lost
-- records keeps its TTL (KEEPTTL), which covers its refill to full and its
-- records as they are. Expired
-- records are dropped when all are, or when a holder is full; until then
-- the latest expiry may be later than needed, which only keeps the key a
-- little longer. Every string a script makes costs Redis a hash of all
-- its bytes: records are cut and joined only where they change.
local B = {false, false, false, false, false, false, false, false, false, false, false, false,
  false, false, false, false, false, false, false, false, false, false, false, false}
-- Per quota key index, when the batch has quotas: the spend (S), its
-- unit's tag (T: '' for a missing key and for a value without tag, which
-- every unit reads as its own), whether the key exists (E: its TTL, the
-- window's end, stays), and the TTL of its write (QW). The batch's
-- strings (tags, TTLs) are ARGV[tg0 + i].
local S, T, E, QW
local tg0 = 3 + nops
if nbk + nqk == 1 then
  local v = redis.call('GET', KEYS[1])
  if v and nbk == 1 then
    B[1], B[2] = struct.unpack('<dd', v)
    if #v > 16 then B[4], B[5], B[8] = v, (struct.unpack('<d', v, 17)), 25 end
  elseif nbk == 0 then
    S, T, E, QW = {0}, {''}, {}, {}
    if v then
      S[1], E[1] = struct.unpack('<d', v), true
      if #v > 8 then T[1] = string.sub(v, 9) end
    end
  end
elseif nbk + nqk > 0 then
  local vs = redis.call('MGET', unpack(KEYS, 1, nbk + nqk))
  for i = 1, nbk do
    local v = vs[i]
    if v then
      local b = 8 * i - 7
      B[b], B[b + 1] = struct.unpack('<dd', v)
      if #v > 16 then B[b + 3], B[b + 4], B[b + 7] = v, (struct.unpack('<d', v, 17)), 25 end
    end
  end
  if nqk > 0 then
    S, T, E, QW = {}, {}, {}, {}
    for i = nbk + 1, nbk + nqk do
      local v = vs[i]
      if v then S[i], E[i] = struct.unpack('<d', v), true else S[i] = 0 end
      if v and #v > 8 then T[i] = string.sub(v, 9) else T[i] = '' end
    end
  end
end
-- Records in record keys, once the batch needs one: per record key, the
-- open reservations (and tombstones) this batch has looked up or added
-- there, by member: their expiry, or false once settled; and whether the
-- key had them (found).
local open, found
local function opened(rec)
  open = open or {}
  found = found or {}
  open[rec] = open[rec] or {}
  found[rec] = found[rec] or {}
  return open[rec], found[rec]
end
-- spill marks holder h (an index into B) as having records or tombstones
-- in the record key until u: its record of length 0, at the head.
local function spill(h, u)
  local r, off = B[h + 3] or '', B[h + 7] or 1
  if off <= #r and string.byte(r, off + 8) == 0 then
    if struct.unpack('<d', r, off) >= u then return end
    r = struct.pack('<d', u) .. string.sub(r, off + 8)
  else
    r = struct.pack('<dB', u, 0) .. string.sub(r, off)
    if B[h + 5] then B[h + 5] = B[h + 5] + 1 end
  end
  B[h + 3], B[h + 7], B[h + 6] = r, 1, true
  if not B[h + 4] or u > B[h + 4] then B[h + 4] = u end
end
-- unmark drops holder h's spill mark once it has expired.
local function unmark(h)
  local r, off = B[h + 3], B[h + 7]
  if r and off <= #r and string.byte(r, off + 8) == 0 and struct.unpack('<d', r, off) <= now then
    B[h + 7] = off + 9
    if B[h + 5] then B[h + 5] = B[h + 5] - 1 end
  end
end
-- once: per charge marker key, whether this run set it (see charge).
local once
local vals, nv = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, 0
local a = 6
for o = 1, nops do
  local kind, nb, ns, nq, rec = p[a], p[a + 1], p[a + 2], p[a + 3], p[a + 4]
  local id = ARGV[3 + o]
  if kind == 1 then
    local cost, maxwait, life = p[a + 5], p[a + 6], p[a + 7]
    local b0 = a + 8
    local q0 = b0 + 7 * nb
    local s0 = q0 + 5 * nq
    a = s0 + 3 * ns
    -- Has a copy of this reserve run (seen 1), or has it been cancelled
    -- (seen 2)? See the conventions above.
    local seen, spilled = 0, nb == 0
    if rec > 0 and nb > 0 then
      local h = 8 * p[b0] - 7
      local r = B[h + 3]
      if r and B[h + 4] > now then
        local off, n = B[h + 7], #id
        if off <= #r and string.byte(r, off + 8) == 0 and struct.unpack('<d', r, off) > now then spilled = true end
        local f = string.find(r, id, off + 9, true)
        while f do
          local pos = off
          while pos + 9 < f do pos = pos + 9 + string.byte(r, pos + 8) end
          if pos + 9 == f and string.byte(r, pos + 8) == n then
            if struct.unpack('<d', r, pos) > now then seen = 1 end
            break
          end
          f = string.find(r, id, f + 1, true)
        end
      end
    end
    if seen == 0 and spilled and rec > 0 then
      local op = opened(rec)
      local e, te = op[id], op['%t' .. id]
      if e == nil and te == nil then
        local sc = redis.call('ZMSCORE', KEYS[rec], id, '%t' .. id)
        e, te = sc[1] and tonumber(sc[1]), sc[2] and tonumber(sc[2])
      end
      if te and te > now then seen = 2 elseif e and e > now then seen = 1 end
    end
    local status, worst, hard = 0, 0, false
    for i = 0, nb - 1 do
      local q = b0 + 7 * i
      local cap, rate, res = p[q + 1], p[q + 2], p[q + 6]
      local b = 8 * p[q] - 7
      local l, t = B[b], B[b + 1]
      if not l then l, t, B[b + 6] = cap, now, true end -- no key: no TTL to keep
      if now > t then
        l = l + rate * ((now - t) / 1e6)
        if l > cap then l = cap end
        t = now
      end
      B[b], B[b + 1] = l, t
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
      local q = q0 + 5 * j
      local k, lim, amt = p[q], p[q + 1], p[q + 2]
      local s = S[k]
      if T[k] ~= '' and T[k] ~= ARGV[tg0 + p[q + 4]] then s = 0 end
      if amt > lim then
        status = 3
      elseif s + amt > lim then
        over = true
      end
    end
    if status == 0 and over then status = 4 end
    if status == 0 and worst > 0 and (hard or worst > maxwait) then status = 1 end
    if seen == 1 then status = 0 elseif seen == 2 then status = 3 end
    local full = 0
    if status == 0 and seen == 0 then
      for j = 0, ns - 1 do
        local q = s0 + 3 * j
        local k, mx = KEYS[p[q]], p[q + 1]
        if redis.call('ZCARD', k) >= mx then
          redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
          if redis.call('ZCARD', k) >= mx then status, full = 2, j + 1; break end
        end
      end
    end
    local take = status == 0 and seen == 0
    vals[nv + 1], vals[nv + 2] = status, full
    nv = nv + 2
    for i = 0, nb - 1 do
      local q = b0 + 7 * i
      local b = 8 * p[q] - 7
      local l, t = B[b], B[b + 1]
      if take then
        l = l - cost
        B[b], B[b + 2], B[b + 6] = l, q, true
      end
      vals[nv + 1] = l
      if t > now then vals[nv + 2] = t - now else vals[nv + 2] = 0 end
      nv = nv + 2
    end
    for j = 0, nq - 1 do
      local q = q0 + 5 * j
      local k, tag = p[q], ARGV[tg0 + p[q + 4]]
      local s = S[k]
      if T[k] ~= '' and T[k] ~= tag then s = 0 end
      if take then
        s = s + p[q + 2]
        S[k], QW[k] = s, p[q + 3]
        if s > 0 then T[k] = tag else T[k] = '' end
      end
      nv = nv + 1
      vals[nv] = s
    end
    if take then
      for j = 0, ns - 1 do
        local q = s0 + 3 * j
        local lease = p[q + 2]
        local ms = lease / 1000 + 1001
        redis.call('ZADD', KEYS[p[q]], now + lease, id)
        redis.call('PEXPIRE', KEYS[p[q]], ms - ms % 1)
      end
      if rec > 0 then
        local h, exp = 8 * p[b0] - 7, now + life
        if nb > 0 and not B[h + 5] then
          -- Count the holder's records, dropping them all when all have
          -- expired, and the expired ones when it is full.
          unmark(h)
          local r, m, off = B[h + 3] or '', B[h + 4], B[h + 7] or 1
          if not m or m <= now then r, m, off = '', 0, 1 end
          local n, pos = 0, off
          while pos <= #r do n = n + 1; pos = pos + 9 + string.byte(r, pos + 8) end
          if n >= maxinline then
            local keep = {}
            n, m, pos = 0, 0, off
            while pos <= #r do
              local e, len = struct.unpack('<dB', r, pos)
              if e > now then
                n = n + 1
                keep[n] = string.sub(r, pos, pos + 8 + len)
                if e > m then m = e end
              end
              pos = pos + 9 + len
            end
            r, off = table.concat(keep), 1
          end
          B[h + 3], B[h + 4], B[h + 5], B[h + 7] = r, m, n, off
        end
        if nb > 0 and B[h + 5] < maxinline then
          local r, off, add = B[h + 3], B[h + 7], struct.pack('<dBc0', exp, #id, id)
          if off > #r then
            r = add
          elseif off > 1 then
            r = string.sub(r, off) .. add
          else
            r = r .. add
          end
          B[h + 3], B[h + 7], B[h + 6] = r, 1, true
          if exp > B[h + 4] then B[h + 4] = exp end
          B[h + 5] = B[h + 5] + 1
        else
          opened(rec)[id] = exp
          if nb > 0 then spill(h, now + window) end
        end
      end
    end
  else
    local f = kind - 2
    local tomb, replay, maybe, charge, prior = f % 2 == 1, f % 4 >= 2, f % 8 >= 4, f % 16 >= 8, f >= 16
    local b0 = a + 5
    local mk, mttl
    if replay or charge then mk, mttl, b0 = p[a + 5], ARGV[tg0 + p[a + 6]], a + 7 end
    local pk, pttl, fresh
    if prior then pk, pttl, fresh, b0 = p[b0], ARGV[tg0 + p[b0 + 1]], p[b0 + 2] == 1, b0 + 3 end
    local q0 = b0 + 7 * nb
    local s0 = q0 + 4 * nq
    a = s0 + ns
    -- apply: 2 all of it, 1 its debits only, 0 nothing.
    local apply = 2
    if charge then
      -- The batch's marker, set by its first charge (SET NX GET answers
      -- false when it set it), decides for all of its charges.
      once = once or {}
      local first = once[mk]
      if first == nil then
        first = not redis.call('SET', KEYS[mk], '1', 'PX', mttl, 'NX', 'GET')
        once[mk] = first
      end
      if not first then apply = 0 end
    elseif replay and rec == 0 then
      -- Without a record to consult (a spend) the marker alone decides:
      -- set as it is looked at, one call.
      if not redis.call('SET', KEYS[mk], '1', 'PX', mttl, 'NX') then apply = 0 end
    elseif replay and redis.call('EXISTS', KEYS[mk]) == 1 then
      apply = 0
    end
    if prior and apply > 0 then
      local ran = redis.call('SET', KEYS[pk], '0', 'PX', pttl, 'NX', 'GET')
      if ran == '1' then apply = 0 elseif ran or fresh then maybe = false end
    end
    if rec > 0 and apply > 0 then
      local h, exp = 8 * p[b0] - 7, nil
      local r = nb > 0 and B[h + 3]
      if r then
        -- Find the record: per record its expiry, its ID's length, its ID.
        local off, n = B[h + 7], #id
        local pos = off
        while pos <= #r do
          local len = string.byte(r, pos + 8)
          if len == n and string.find(r, id, pos + 9, true) == pos + 9 then
            exp = struct.unpack('<d', r, pos)
            if pos == off then
              B[h + 7] = pos + 9 + len
            else
              B[h + 3], B[h + 7] = string.sub(r, off, pos - 1) .. string.sub(r, pos + 9 + len), 1
            end
            if B[h + 5] then B[h + 5] = B[h + 5] - 1 end
            B[h + 2] = B[h + 2] or b0
            unmark(h)
            break
          end
          pos = pos + 9 + len
        end
      end
      if not exp then
        local op, fd = opened(rec)
        exp = op[id]
        if exp == nil then
          exp = redis.call('ZSCORE', KEYS[rec], id)
          if exp then exp = tonumber(exp) end
          fd[id] = exp and true
        end
        if exp then op[id] = false end
      end
      if not exp or exp <= now then
        if not replay then apply = 0 elseif maybe then apply = 1 end
      end
    end
    if tomb and rec > 0 then
      opened(rec)['%t' .. id] = now + window
      if nb > 0 then
        local h = 8 * p[b0] - 7
        spill(h, now + window)
        B[h + 2] = B[h + 2] or b0
      end
    end
    if replay and rec > 0 and apply > 0 then redis.call('SET', KEYS[mk], '1', 'PX', mttl) end
    vals[nv + 1], vals[nv + 2] = apply == 0 and 1 or 0, 0
    nv = nv + 2
    for i = 0, nb - 1 do
      local q = b0 + 7 * i
      local cap, rate, floor = p[q + 1], p[q + 2], p[q + 5]
      local b = 8 * p[q] - 7
      local l, t = B[b], B[b + 1]
      if not l then l, t, B[b + 6] = cap, now, true end -- no key: no TTL to keep
      if now > t then
        l = l + rate * ((now - t) / 1e6)
        if l > cap then l = cap end
        t = now
      end
      local forgiven = 0
      if apply > 0 then
        local delta = p[q + 6]
        if apply == 1 and delta > 0 then delta = 0 end
        if delta < 0 then B[b + 6] = true end
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
        B[b + 2] = q
      end
      B[b], B[b + 1] = l, t
      vals[nv + 1] = l
      if t > now then vals[nv + 2] = t - now else vals[nv + 2] = 0 end
      vals[nv + 3] = forgiven
      nv = nv + 3
    end
    if apply > 0 then
      for j = 0, nq - 1 do
        local q = q0 + 4 * j
        local k, d, tag = p[q], p[q + 1], ARGV[tg0 + p[q + 3]]
        if T[k] == '' or T[k] == tag then
          if apply == 1 and d < 0 then d = 0 end
          local sp = S[k] + d
          if sp < 0 then sp = 0 end
          S[k], QW[k] = sp, p[q + 2]
          if sp > 0 then T[k] = tag else T[k] = '' end
        end
      end
      for j = 0, ns - 1 do redis.call('ZREM', KEYS[p[s0 + j]], id) end
    end
  end
end
if QW then
  for k, ttl in pairs(QW) do
    if ttl > 0 then
      if S[k] > 0 and E[k] then
        redis.call('SET', KEYS[k], struct.pack('<d', S[k]) .. T[k], 'KEEPTTL')
      elseif S[k] > 0 then
        redis.call('SET', KEYS[k], struct.pack('<d', S[k]) .. T[k], 'PX', string.format('%d', ttl))
      else
        redis.call('DEL', KEYS[k])
      end
    end
  end
end
-- Write every bucket that changed, with its TTL: the caller's from low
-- (its string, ts), or, below low or while paused, the exact time to full
-- (ttl); a holder lives at least until its latest record expires. A key
-- that existed keeps its TTL unless something in this batch can need a
-- later one (+6, also set for a key that did not exist: it has none). A TTL the batch works out goes to SET as a string of
-- its whole milliseconds: string.format's integer costs less than the 17
-- digits Redis would print of a number.
for k = 1, nbk do
  local b = 8 * k - 7
  local q = B[b + 2]
  if q then
    local l, t, r, m, off = B[b], B[b + 1], B[b + 3], B[b + 4], B[b + 7]
    local cap, rate = p[q + 1], p[q + 2]
    local keep = l and not B[b + 6]
    if not l then l, t = cap, now end
    local ts, ttl = ARGV[tg0 + p[q + 4]], nil
    if t > now or l < p[q + 3] then
      ttl = (t - now + (cap - l) / rate * 1e6) / 1000 + 1001
      if ttl > 1e12 then ttl = 1e12 end
    end
    local v
    if r and off <= #r then
      if m > now then
        local mt = (m - now) / 1000 + 1001
        if mt > (ttl or tonumber(ts)) then ttl = mt end
      end
      if off > 1 then r = string.sub(r, off) end
      v = struct.pack('<dddc0', l, t, m, r)
    else
      v = struct.pack('<dd', l, t)
    end
    if keep then
      redis.call('SET', KEYS[k], v, 'KEEPTTL')
    else
      if ttl then ts = string.format('%d', ttl - ttl % 1) end
      redis.call('SET', KEYS[k], v, 'PX', ts)
    end
  end
end
if open then
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
end
-- The reply is never longer than the arguments: their struct format,
-- cut, is its format.
return struct.pack(string.sub(ARGV[2], 1, nv + 1), unpack(vals, 1, nv))
`

// extendLua debits an amount from every (hard) bucket and quota, all or
// none: a bucket never below zero and not while paused, a quota never past
// its limit (S14); or undoes that debit. It applies each extension once:
// the marker key holds the number of the reservation's last extension in
// this group and what became of it (1 debited, 0 refused, -1 undone), so a
// copy of an extension that has run, or of an older one, changes nothing,
// and a copy that runs after its undo neither.
//
// KEYS: n bucket keys, then nq quota keys, then the marker key. ARGV: now,
// n, amount; per bucket capacity, rate, low, TTL from low (ms); nq; per
// quota limit, amount, TTL (ms), unit tag; the extension's number, 1 to
// debit or 2 to undo, the marker's TTL (ms). A quota whose spend is in
// another unit is checked as nothing spent and not written, by a debit
// and by its undo alike (see the conventions above).
// Returns 1 when debited (or undone), 0 when refused.
const extendLua = luaPrelude + `
local n, amt = ARGV[2] + 0, ARGV[3] + 0
local q0 = 4 * n + 4
local nq = ARGV[q0] + 0
local x = q0 + 4 * nq + 1
local seq, mode, mk = ARGV[x] + 0, ARGV[x + 1], KEYS[n + nq + 1]
local last, res = 0, 0
local mv = redis.call('GET', mk)
if mv then last, res = struct.unpack('<dd', mv) end
local function mark(r)
  redis.call('SET', mk, struct.pack('<dd', seq, r), 'PX', ARGV[x + 2])
end
if mode == '2' then
  if last > seq then return 0 end
  if last == seq and res == 1 then
    for i = 1, n do
      local a = 4 * i
      local cap = ARGV[a] + 0
      local l, t, r, m = get(KEYS[i], cap, ARGV[a + 1] + 0)
      l = l + amt
      if l > cap then l = cap end
      put(KEYS[i], l, t, r, m, cap, ARGV[a + 1] + 0, ARGV[a + 2] + 0, ARGV[a + 3])
    end
    for j = 1, nq do
      local a = q0 + 4 * j - 3
      local v = redis.call('GET', KEYS[n + j])
      if v and (#v == 8 or string.sub(v, 9) == ARGV[a + 3]) then
        local s = struct.unpack('<d', v) - ARGV[a + 1]
        if s > 0 then
          redis.call('SET', KEYS[n + j], struct.pack('<d', s) .. ARGV[a + 3], 'KEEPTTL')
        else
          redis.call('DEL', KEYS[n + j])
        end
      end
    end
  end
  mark(-1)
  return 1
end
if last >= seq then
  if last == seq and res == 1 then return 1 end
  return 0
end
local lv, ts = {}, {}
local rs, ms = {}, {}
for i = 1, n do
  local l, t, r, m = get(KEYS[i], ARGV[4 * i] + 0, ARGV[4 * i + 1] + 0)
  if l - amt < 0 or t > now then mark(0); return 0 end
  lv[i], ts[i], rs[i], ms[i] = l, t, r, m
end
local sp = {}
for j = 1, nq do
  local v = redis.call('GET', KEYS[n + j])
  local a = q0 + 4 * j - 3
  local s, mine = 0, true
  if v then
    if #v == 8 or string.sub(v, 9) == ARGV[a + 3] then s = struct.unpack('<d', v) else mine = false end
  end
  if s + ARGV[a + 1] > ARGV[a] + 0 then mark(0); return 0 end
  sp[j] = mine and s
end
for i = 1, n do
  local a = 4 * i
  put(KEYS[i], lv[i] - amt, ts[i], rs[i], ms[i], ARGV[a] + 0, ARGV[a + 1] + 0, ARGV[a + 2] + 0, ARGV[a + 3])
end
for j = 1, nq do
  local a = q0 + 4 * j - 3
  if sp[j] and ARGV[a + 2] + 0 > 0 then
    redis.call('SET', KEYS[n + j], struct.pack('<d', sp[j] + ARGV[a + 1]) .. ARGV[a + 3], 'PX', ARGV[a + 2])
  end
end
mark(1)
return 1
`

// inspectLua reads buckets, brought up to now, and quotas' spend, writing
// nothing.
//
// KEYS: n bucket keys, then quota keys. ARGV: now, n; per bucket capacity,
// rate; per quota its unit tag.
// Returns one packed string of doubles: per bucket its level and hold
// (µs), then per quota its spend (0 for a spend in another unit).
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
  if v and (#v == 8 or string.sub(v, 9) == ARGV[n + 2 + j]) then
    out[#out + 1] = struct.unpack('<d', v)
  else
    out[#out + 1] = 0
  end
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
