"""Lua scripts that make the queue's multi-command steps atomic on Redis >= 7.0.

Each script does all of its checks before its first write, because Redis does not roll
back a script that fails half way. A refusal is an error reply that starts with the
refusal's wire code in capitals (`LEASE_LOST ...`, see `protocol.wire.errors.REFUSALS`).

Trimming: on Redis 7.0 `XTRIM`/`MAXLEN` delete entries still pending in a consumer group,
and trimming by `MINID` below the oldest pending entry lets one stuck lease hold the
whole stream. So the scripts delete exactly the entries they acknowledge (`XACK` then
`XDEL`, in one script; the learner's acknowledgement in one MULTI/EXEC): a stream holds
its pending and undelivered entries and nothing else, and no unacknowledged entry is ever
deleted.
"""

from __future__ import annotations

_HELPERS = r"""
local function field(flat, name)
  if not flat then return nil end
  for i = 1, #flat, 2 do
    if flat[i] == name then return flat[i + 1] end
  end
  return nil
end

-- A run whose keys expire (`expire_run`, after it completed) keeps expiring: a key this
-- script creates or re-creates (a set emptied and deleted, a first dead letter) gets the
-- time to live left on `ref`, a key of the run that exists throughout.
local function follow_ttl(ref, ...)
  local ttl = redis.call('PTTL', ref)
  if ttl > 0 then
    for _, key in ipairs({...}) do
      if redis.call('PTTL', key) == -1 then redis.call('PEXPIRE', key, ttl) end
    end
  end
end

local function pending_entry(key, group, id)
  return redis.call('XPENDING', key, group, id, id, 1)[1]
end

-- The group ids of a batch's prompts not yet stored, from the entry's expected-groups
-- field `g` ("<group id>:<prompt digest>;" per prompt, see ADD_PROMPTS).
local function missing_groups(expected, seen)
  local out = {}
  if not expected then return out end
  for gid in string.gmatch(expected, '(%x+):') do
    if redis.call('SISMEMBER', seen, gid) == 0 then table.insert(out, gid) end
  end
  return out
end

-- Moves entry `id` of `stream` (named `source` in the record) to the dead letters.
-- For a prompt batch, `seen` (the groups-seen set) lets the record name the group ids
-- still missing: exactly the prompts lost with it.
-- `private` (the private-prompts hash) loses the records of those lost prompts.
local function dead_letter(stream, source, dead, group, id, flat, deliveries, worker, reason, now, seen, private)
  local record = {'source', source, 'lease', id, 'm', field(flat, 'm') or '',
                  'deliveries', deliveries, 'worker', worker, 'reason', reason, 'at', now}
  if seen and field(flat, 'g') then
    local missing = missing_groups(field(flat, 'g'), seen)
    table.insert(record, 'missing')
    table.insert(record, table.concat(missing, ' '))
    if private and #missing > 0 then redis.call('HDEL', private, unpack(missing)) end
  end
  redis.call('XADD', dead, '*', unpack(record))
  redis.call('XACK', stream, group, id)
  redis.call('XDEL', stream, id)
end
"""

ADD_PROMPTS = (
    _HELPERS
    + r"""
-- KEYS: prompts, batches_seen, private
-- ARGV: (batch_id, payload, num_generations, max_tokens, expected, scoring, k, (group_id, record)*k)*
-- `expected` lists "<group id>:<prompt digest>;" for each prompt: what SUBMIT checks
-- groups against without decoding the batch. `scoring` (actors | trusted) decides where
-- SUBMIT stores the groups; a trusted batch's full prompts go to the private hash.
local added = 0
local i = 1
while i <= #ARGV do
  local k = tonumber(ARGV[i + 6])
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[1], '*', 'b', ARGV[i], 'm', ARGV[i + 1], 'n', ARGV[i + 2],
               't', ARGV[i + 3], 'g', ARGV[i + 4], 's', ARGV[i + 5])
    for j = i + 7, i + 6 + 2 * k, 2 do
      redis.call('HSET', KEYS[3], ARGV[j], ARGV[j + 1])
    end
    added = added + 1
  end
  i = i + 7 + 2 * k
end
follow_ttl(KEYS[1], KEYS[2], KEYS[3])
return added
"""
)

CLAIM_EXPIRED = (
    _HELPERS
    + r"""
-- KEYS: prompts, dead, groups_seen, private, quarantined, over
-- ARGV: group, worker, lease_ms, max_deliveries, count, now
-- Takes over leases idle longer than lease_ms; dead-letters batches delivered
-- max_deliveries times already. Returns {{id, deliveries, payload}...}, or the reason
-- (a string) when the learner quarantined the worker: it claims nothing. A run the
-- learner finished refuses every other claim with `RUN_OVER <its words>`.
local group, worker, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local why = redis.call('HGET', KEYS[5], worker)
if why and why ~= '' then
  return why
end
local over = redis.call('GET', KEYS[6])
if over then
  return redis.error_reply('RUN_OVER ' .. over)
end
local max_deliveries, count, now = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local out = {}
local dead = 0
for _, p in ipairs(redis.call('XPENDING', KEYS[1], group, 'IDLE', lease_ms, '-', '+', count)) do
  local id, owner, n = p[1], p[2], tonumber(p[4])
  if n >= max_deliveries then
    local entry = redis.call('XRANGE', KEYS[1], id, id)[1]
    dead_letter(KEYS[1], 'prompts', KEYS[2], group, id, entry and entry[2], n, owner,
                'max_deliveries', now, KEYS[3], KEYS[4])
    dead = dead + 1
  else
    local entry = redis.call('XCLAIM', KEYS[1], group, worker, lease_ms, id)[1]
    local payload = entry and field(entry[2], 'm')
    if payload then
      table.insert(out, {id, n + 1, payload})
    else
      -- the payload was deleted behind our back (not by us): account for it, never drop it
      dead_letter(KEYS[1], 'prompts', KEYS[2], group, id, nil, n, owner, 'missing', now, nil, nil)
      dead = dead + 1
    end
  end
end
if dead > 0 then follow_ttl(KEYS[1], KEYS[2]) end
return out
"""
)

DEAD_LETTER = (
    _HELPERS
    + r"""
-- KEYS: stream, dead   ARGV: group, id, source, reason, now
-- Moves one pending entry that cannot be read out of the way, keeping its bytes.
local p = pending_entry(KEYS[1], ARGV[1], ARGV[2])
if not p then return 0 end
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])[1]
dead_letter(KEYS[1], ARGV[3], KEYS[2], ARGV[1], ARGV[2], entry and entry[2], p[4],
            p[2], ARGV[4], ARGV[5], nil, nil)
follow_ttl(KEYS[1], KEYS[2])
return 1
"""
)

DEAD_LETTER_UNSCORED = (
    _HELPERS
    + r"""
-- KEYS: unscored, dead, private   ARGV: group, id, reason, now
-- An unscored entry the tier cannot score or store (unreadable, or its scored copy breaks
-- a limit) leaves the stream for the dead letters, pending or not (a dispatched entry is
-- no longer pending), naming its group and batch so the learner can account for it.
-- 0 if the entry is gone (stored, or dead-lettered before).
local entry = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])[1]
if not entry then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  return 0
end
local flat = entry[2]
local gid = field(flat, 'g') or ''
redis.call('XADD', KEYS[2], '*', 'source', 'unscored', 'lease', ARGV[2], 'm', field(flat, 'm') or '',
           'deliveries', 0, 'worker', '', 'reason', ARGV[3], 'at', ARGV[4], 'g', gid, 'b', field(flat, 'b') or '')
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if gid ~= '' then redis.call('HDEL', KEYS[3], gid) end
follow_ttl(KEYS[1], KEYS[2])
return 1
"""
)

HEARTBEAT = (
    _HELPERS
    + r"""
-- KEYS: prompts   ARGV: group, worker, id*
-- Resets the idle time of each lease the worker still owns; returns those ids.
local held = {}
for i = 3, #ARGV do
  local p = pending_entry(KEYS[1], ARGV[1], ARGV[i])
  if p and p[2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    table.insert(held, ARGV[i])
  end
end
return held
"""
)

SUBMIT = (
    _HELPERS
    + r"""
-- KEYS: prompts, rollouts, groups_seen, unscored, gate, alias, quarantined
-- One submission is one MULTI/EXEC (`RedisQueue.submit`) in which this script opens a
-- gate for each group in turn, and a plain `XADD <alias> NOMKSTREAM` after each stores the
-- group's message, so the bytes never enter Lua: Redis's Lua hashes every byte of every
-- string it is given (deps/lua/src/lstring.c, against hash flooding), ~1.2 ns a byte,
-- twice what a raw XADD of the same message costs Redis. The gate is a rename: to store a
-- group, the stream it belongs in (rollouts, or unscored for a trusted batch) is renamed
-- to `alias`, and renamed back before anything else runs. Under MULTI/EXEC no other client
-- sees the stream away; a closed gate leaves no `alias`, and the XADD does nothing.
--   open  ARGV: 'open', group, worker, lease_id, batch_id, (group_id, completions, longest, digest)*
--         Refuses a worker the learner quarantined (`QUARANTINED <reason>`: its groups would
--         be rejected, and its lease goes to another worker when it expires).
--         Checks every group against the lease before the first write (an error names the
--         first failed check, and nothing is written: every gate stays closed), records the
--         submission in `gate`, and opens the gate for the first group if it is new.
--   next  ARGV: 'next', group_id     Closes the gate, opens it for this group if it is new.
--   close ARGV: 'close'               Closes the gate; finishes the lease when every prompt of
--         its batch has its group (a partial submission keeps it, its idle time reset).
--         Returns {stored, duplicates, held, finished, missing}, or nil after a refused open.
local mode = ARGV[1]
-- `into`: the stream the gate opens onto (the gate's field t; nil: no submission is open)
local function shut(into)
  if into and redis.call('EXISTS', KEYS[6]) == 1 then redis.call('RENAME', KEYS[6], into) end
end
local function admit(gid, into)
  if redis.call('SADD', KEYS[3], gid) == 1 then
    redis.call('RENAME', into, KEYS[6])
    redis.call('HINCRBY', KEYS[5], 's', 1)
  else
    redis.call('HINCRBY', KEYS[5], 'd', 1)
  end
end
if mode == 'next' then
  local into = redis.call('HGET', KEYS[5], 't')
  if into then
    shut(into)
    admit(ARGV[2], into)
  end
  return 0
end
if mode == 'close' then
  local g = redis.call('HGETALL', KEYS[5])
  if #g == 0 then return nil end
  shut(field(g, 't'))
  redis.call('DEL', KEYS[5])
  local stored, dups = tonumber(field(g, 's')), tonumber(field(g, 'd'))
  if field(g, 'r') then  -- nothing to do (see open)
    return {stored, dups, 0, tonumber(field(g, 'r')), 0}
  end
  local into, lease = field(g, 't'), field(g, 'l')
  local missing = #missing_groups(field(g, 'e'), KEYS[3])
  if missing == 0 then
    redis.call('XACK', KEYS[1], field(g, 'c'), lease)
    redis.call('XDEL', KEYS[1], lease)
  else
    redis.call('XCLAIM', KEYS[1], field(g, 'c'), field(g, 'w'), 0, lease, 'JUSTID')
  end
  follow_ttl(KEYS[1], KEYS[3], into)
  return {stored, dups, 1, missing == 0 and 1 or 0, missing}
end
-- open
shut(redis.call('HGET', KEYS[5], 't'))  -- nothing is left from an earlier transaction, but a gate never outlives one
redis.call('DEL', KEYS[5])
local group, worker, lease, batch = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local why = redis.call('HGET', KEYS[7], worker)
if why and why ~= '' then
  return redis.error_reply('QUARANTINED ' .. why)
end
local function all_stored()
  for i = 6, #ARGV, 4 do
    if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 0 then return false end
  end
  return true
end
local entry = redis.call('XRANGE', KEYS[1], lease, lease)[1]
local p = entry and pending_entry(KEYS[1], group, lease)
if not (p and p[2] == worker) and all_stored() then
  -- a retry whose groups are all in (its answer was lost, or another worker finished
  -- the batch first): nothing to do, and nothing to refuse
  redis.call('HSET', KEYS[5], 's', 0, 'd', (#ARGV - 5) / 4, 'r', p and 0 or 1)
  return 0
end
if not entry then
  return redis.error_reply('LEASE_LOST lease ' .. lease ..
                           ' is not outstanding: never issued, finished or dead-lettered')
end
if field(entry[2], 'b') ~= batch then
  return redis.error_reply('LEASE_MISMATCH lease ' .. lease .. ' holds batch ' ..
                           tostring(field(entry[2], 'b')) .. ', not ' .. batch)
end
if not p then
  return redis.error_reply('LEASE_LOST lease ' .. lease .. ' is not claimed by anyone')
end
if p[2] ~= worker then
  return redis.error_reply('LEASE_LOST lease ' .. lease .. ' is held by another worker')
end
local expected, n, longest = field(entry[2], 'g') or '', field(entry[2], 'n'), tonumber(field(entry[2], 't'))
local seen_here = {}
for i = 6, #ARGV, 4 do
  local gid = ARGV[i]
  local at = string.find(expected, gid .. ':', 1, true)
  if not at then
    return redis.error_reply('SUBMISSION_REJECTED group ' .. gid .. ' answers no prompt of batch ' .. batch)
  end
  if seen_here[gid] then
    return redis.error_reply('SUBMISSION_REJECTED group ' .. gid .. ' appears twice')
  end
  seen_here[gid] = true
  if ARGV[i + 1] ~= n then
    return redis.error_reply('SUBMISSION_REJECTED group ' .. gid .. ' has ' .. ARGV[i + 1] ..
                             ' completions; the batch asks for ' .. n)
  end
  if tonumber(ARGV[i + 2]) > longest then
    return redis.error_reply('SUBMISSION_REJECTED group ' .. gid .. ' has a completion of ' .. ARGV[i + 2] ..
                             ' tokens; the batch allows ' .. longest)
  end
  local digest = string.sub(expected, at + #gid + 1, at + #gid + #ARGV[i + 3])
  if digest ~= string.rep('-', #digest) and digest ~= ARGV[i + 3] then
    return redis.error_reply('SUBMISSION_REJECTED group ' .. gid .. ' has prompt tokens other than the issued ones')
  end
end
local into = field(entry[2], 's') == 'trusted' and KEYS[4] or KEYS[2]
if redis.call('EXISTS', into) == 0 then
  -- the stream (and its consumer group) is gone: the caller recreates both and tries again
  return redis.error_reply('NOGROUP the stream ' .. into .. ' is missing')
end
redis.call('HSET', KEYS[5], 't', into, 's', 0, 'd', 0, 'l', lease, 'c', group, 'w', worker, 'e', expected)
admit(ARGV[6], into)
return 0
"""
)

RELEASE = (
    _HELPERS
    + r"""
-- KEYS: prompts   ARGV: group, worker, id, idle_ms
-- Makes the lease look expired at once, without counting this delivery as a failure.
local p = pending_entry(KEYS[1], ARGV[1], ARGV[3])
if not p or p[2] ~= ARGV[2] then return 0 end
local retries = math.max(tonumber(p[4]) - 1, 0)
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4],
           'RETRYCOUNT', retries, 'JUSTID')
return 1
"""
)

STORE_SCORED = (
    _HELPERS
    + r"""
-- KEYS: rollouts, scored_seen, unscored, private   ARGV: group, entry_id, group_id, payload
-- The scoring tier's one write: a scored (or rejected) group enters the rollouts stream
-- once however often it is scored; its unscored entry is deleted (and acknowledged, if
-- the dispatcher had not yet), and its private prompt dropped. Returns 1 if stored, 0 if it
-- was stored before. A group whose unscored entry is gone (scored, or dead-lettered) is
-- never stored: the entry, not only the scored-seen set, says it is still to be scored,
-- so a late duplicate job cannot bring back a group the learner has finished with.
local stored = 0
if not redis.call('XRANGE', KEYS[3], ARGV[2], ARGV[2])[1] then
  redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])
  return 0
end
if redis.call('SADD', KEYS[2], ARGV[3]) == 1 then
  redis.call('XADD', KEYS[1], '*', 'g', ARGV[3], 'm', ARGV[4])
  stored = 1
end
follow_ttl(KEYS[3], KEYS[1], KEYS[2])
redis.call('XACK', KEYS[3], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[3], ARGV[2])
redis.call('HDEL', KEYS[4], ARGV[3])
return stored
"""
)

ANNOUNCE = r"""
-- KEYS: adapter_latest, adapter_events   ARGV: version, payload, channel, maxlen
-- The latest version only moves forward; announcing the current one again with the
-- same manifest is a no-op (a retried call), anything else older is refused.
local v = tonumber(ARGV[1])
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if v == cur and redis.call('HGET', KEYS[1], 'm') == ARGV[2] then
  return redis.call('HGET', KEYS[1], 'event')
end
if v <= cur then
  return redis.error_reply('VERSION_CONFLICT version ' .. ARGV[1] ..
                           ' is not above the latest announced version ' .. tostring(cur))
end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'v', ARGV[1], 'm', ARGV[2])
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'm', ARGV[2], 'event', id)
redis.call('PUBLISH', ARGV[3], ARGV[2])
return id
"""

PROMPTS_WAITING = (
    _HELPERS
    + r"""
-- KEYS: prompts, groups_seen   The prompts of the batches in the stream whose groups are
-- not stored yet: what is still to be generated. A batch's entry leaves the stream once all
-- of its groups are in, and groups go in one by one, so its size alone over-counts.
local n, after = 0, '-'
while true do
  local entries = redis.call('XRANGE', KEYS[1], after, '+', 'COUNT', 256)
  if #entries == 0 then return n end
  for _, e in ipairs(entries) do n = n + #missing_groups(field(e[2], 'g'), KEYS[2]) end
  after = '(' .. entries[#entries][1]
end
"""
)

COUNT_AFTER = r"""
-- KEYS: stream   ARGV: id   The number of entries after id (the waiting ones).
return #redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+')
"""

REPORT_STATUS = (
    _HELPERS
    + r"""
-- KEYS: workers, prompts, owner's workers (zset: name -> last report), owners (set)
-- ARGV: worker, payload, now, max_age_s, cap (0: no cap)
-- A report from a worker new to its owner (a token) is refused (0) while the owner has
-- `cap` workers that reported within max_age_s: one token cannot grow the fleet view.
local cap = tonumber(ARGV[5])
if cap > 0 then
  local now = tonumber(ARGV[3])
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. tostring(now - tonumber(ARGV[4])))
  if not redis.call('ZSCORE', KEYS[3], ARGV[1]) and redis.call('ZCARD', KEYS[3]) >= cap then
    return 0
  end
  redis.call('ZADD', KEYS[3], now, ARGV[1])
  redis.call('SADD', KEYS[4], KEYS[3])
  follow_ttl(KEYS[2], KEYS[3], KEYS[4])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
follow_ttl(KEYS[2], KEYS[1])
return 1
"""
)

LEAVE = r"""
-- KEYS: workers, owner's workers (zset)   ARGV: worker
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('HDEL', KEYS[1], ARGV[1])
"""

QUARANTINE = (
    _HELPERS
    + r"""
-- KEYS: quarantined (hash), prompts   ARGV: worker, reason
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
follow_ttl(KEYS[2], KEYS[1])
return 1
"""
)

RECORD_AUDITS = (
    _HELPERS
    + r"""
-- KEYS: audits (hash), prompts   ARGV: (worker, passed, failed)*
-- Adds each worker's audits to its "<passed> <failed>" tally.
for i = 1, #ARGV, 3 do
  local old = redis.call('HGET', KEYS[1], ARGV[i]) or '0 0'
  local p, f = string.match(old, '^(%d+) (%d+)$')
  redis.call('HSET', KEYS[1], ARGV[i], (tonumber(p or 0) + tonumber(ARGV[i + 1])) .. ' ' ..
                                       (tonumber(f or 0) + tonumber(ARGV[i + 2])))
end
follow_ttl(KEYS[2], KEYS[1])
return 1
"""
)

LIFT_QUARANTINE = r"""
-- KEYS: quarantined (hash)   ARGV: worker
-- 1 if it was quarantined; its reason becomes '' until the learner has seen the lift.
local why = redis.call('HGET', KEYS[1], ARGV[1])
if not why or why == '' then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], '')
return 1
"""

FORGET_LIFTED = r"""
-- KEYS: quarantined (hash)   ARGV: workers whose lift the learner has seen
for _, worker in ipairs(ARGV) do
  if redis.call('HGET', KEYS[1], worker) == '' then
    redis.call('HDEL', KEYS[1], worker)
  end
end
return 1
"""
