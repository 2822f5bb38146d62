# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Paged KV-cache bookkeeping: ref-counted blocks, LRU free lists, prefix cache, per-request block tables.

Everything lives in preallocated C arrays so a scheduling step allocates no Python objects except the dict
keys of newly cached blocks (once per filled block):

* Free blocks sit in one of two intrusive doubly linked lists (``prev``/``next`` arrays, two sentinels):
  *uncached* free blocks (nothing to lose, taken first) and *cached* free blocks in LRU order (a block that
  holds a published prefix stays reusable until its slot is needed; the least recently freed goes first).
* The prefix cache maps a chained 64-bit hash (parent hash, the block's token ids; the chain's root mixes
  the request's ``prefix_key``) to a block. Collision guard, exact rather than probabilistic: a cached block
  stores its token ids and the identity of its parent (parent block id and that block's incarnation number,
  or the ``prefix_key`` for a first block), and a lookup hits only when both equal what the walk verified at
  the previous level. By induction a hit's whole prefix is identical, whatever the hash quality; the hash
  only finds the candidate (``hash_mask`` narrows it in tests to force collisions).
* A *row* is one request's block table: ``tables[row, :row_len[row]]``. ``row_hashed[row]`` counts its
  leading blocks already hashed (published or matched); the row's chain tip (hash, canonical cached block,
  incarnation) is where hashing continues. A block whose content is already cached under another block
  stays private, and the chain continues from the cached one (its canonical block).
"""

import numpy as np

from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

cdef uint64_t _GOLDEN = 0x9E3779B97F4A7C15ULL
# Chain-tip markers: before the first block; after a block whose content could not be cached (unreachable).
cdef int _ROOT = -1
cdef int _UNREACHABLE = -2


cdef inline uint64_t _fmix64(uint64_t x) noexcept nogil:
    # MurmurHash3's 64-bit finalizer: a bijection with full avalanche.
    x ^= x >> 33
    x *= 0xFF51AFD7ED558CCDULL
    x ^= x >> 33
    x *= 0xC4CEB9FE1A85EC53ULL
    x ^= x >> 33
    return x


cdef inline uint64_t _hash_block(uint64_t parent, const int32_t* toks, int n) noexcept nogil:
    cdef uint64_t h = _fmix64(parent + _GOLDEN)
    cdef int i
    for i in range(n):
        h = _fmix64(h ^ (<uint64_t><uint32_t>toks[i] + _GOLDEN))
    return h


cdef inline void _gather(list prompt, list output, int64_t start, int n, int32_t* out) except *:
    cdef Py_ssize_t p_len = len(prompt)
    cdef int64_t p
    cdef int i
    for i in range(n):
        p = start + i
        out[i] = <int32_t>(prompt[p] if p < p_len else output[p - p_len])


cdef class KVCacheManager:
    """Owns the block ids of a paged KV cache; the tensors live elsewhere (``cache_tensors.py``).

    ``max_rows`` bounds the requests holding blocks at once (the scheduler's ``max_num_seqs``);
    ``max_blocks_per_row`` bounds one request's context (``cdiv(max_model_len, block_size)``).
    ``prefix_cache_max_tokens`` caps the tokens held by cached-but-free blocks (None: no cap).
    """

    cdef readonly int num_blocks
    cdef readonly int block_size
    cdef readonly int max_rows
    cdef readonly int max_blocks_per_row
    cdef readonly bint prefix_caching
    cdef readonly int64_t max_cached_free_blocks
    # ANDed into every hash; tests narrow it to force collisions and exercise the guard.
    cdef public uint64_t hash_mask

    cdef int32_t[::1] _ref
    cdef int32_t[::1] _prev
    cdef int32_t[::1] _next
    cdef uint64_t[::1] _hash
    cdef int32_t[::1] _parent_id
    cdef uint64_t[::1] _parent_tag
    cdef uint64_t[::1] _incarnation
    cdef uint64_t _next_incarnation
    cdef uint8_t[::1] _cached
    cdef int32_t[:, ::1] _tokens
    cdef int32_t[::1] _scratch
    cdef dict _lookup
    cdef int _uncached_head
    cdef int _cached_head
    cdef int _num_uncached_free
    cdef int _num_cached_free

    cdef object _tables_array
    cdef int32_t[:, ::1] _tables
    cdef int32_t[::1] _row_len
    cdef int32_t[::1] _row_hashed
    cdef uint64_t[::1] _row_key
    cdef uint64_t[::1] _tip_hash
    cdef int32_t[::1] _tip_block
    cdef uint64_t[::1] _tip_tag
    cdef uint8_t[::1] _row_open
    cdef int32_t[::1] _free_rows
    cdef int _num_free_rows

    def __init__(self, int num_blocks, int block_size, int max_rows, int max_blocks_per_row,
                 bint enable_prefix_caching=True, prefix_cache_max_tokens=None):
        if num_blocks < 1 or block_size < 1 or max_rows < 1 or max_blocks_per_row < 1:
            raise ValueError(
                f"KVCacheManager needs positive sizes, got num_blocks={num_blocks} block_size={block_size} "
                f"max_rows={max_rows} max_blocks_per_row={max_blocks_per_row}")
        if prefix_cache_max_tokens is not None and prefix_cache_max_tokens < 0:
            raise ValueError(f"prefix_cache_max_tokens must be >= 0, got {prefix_cache_max_tokens}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_blocks_per_row = max_blocks_per_row
        self.prefix_caching = enable_prefix_caching
        self.max_cached_free_blocks = (
            -1 if prefix_cache_max_tokens is None else prefix_cache_max_tokens // block_size)
        self.hash_mask = 0xFFFFFFFFFFFFFFFFULL

        self._ref = np.zeros(num_blocks, dtype=np.int32)
        self._prev = np.empty(num_blocks + 2, dtype=np.int32)
        self._next = np.empty(num_blocks + 2, dtype=np.int32)
        self._hash = np.zeros(num_blocks, dtype=np.uint64)
        self._parent_id = np.zeros(num_blocks, dtype=np.int32)
        self._parent_tag = np.zeros(num_blocks, dtype=np.uint64)
        self._incarnation = np.zeros(num_blocks, dtype=np.uint64)
        self._next_incarnation = 1
        self._cached = np.zeros(num_blocks, dtype=np.uint8)
        self._tokens = np.zeros((num_blocks if enable_prefix_caching else 0, block_size), dtype=np.int32)
        self._scratch = np.zeros(block_size, dtype=np.int32)
        self._lookup = {}
        self._uncached_head = num_blocks
        self._cached_head = num_blocks + 1
        cdef int s
        for s in (self._uncached_head, self._cached_head):
            self._prev[s] = s
            self._next[s] = s
        self._num_uncached_free = 0
        self._num_cached_free = 0
        cdef int b
        for b in range(num_blocks):
            self._link_tail(self._uncached_head, b)
        self._num_uncached_free = num_blocks

        self._tables_array = np.zeros((max_rows, max_blocks_per_row), dtype=np.int32)
        self._tables = self._tables_array
        self._row_len = np.zeros(max_rows, dtype=np.int32)
        self._row_hashed = np.zeros(max_rows, dtype=np.int32)
        self._row_key = np.zeros(max_rows, dtype=np.uint64)
        self._tip_hash = np.zeros(max_rows, dtype=np.uint64)
        self._tip_block = np.zeros(max_rows, dtype=np.int32)
        self._tip_tag = np.zeros(max_rows, dtype=np.uint64)
        self._row_open = np.zeros(max_rows, dtype=np.uint8)
        self._free_rows = np.arange(max_rows - 1, -1, -1, dtype=np.int32)
        self._num_free_rows = max_rows

    # ---- free lists -------------------------------------------------------------------------------------

    cdef inline void _link_tail(self, int head, int b) noexcept:
        cdef int last = self._prev[head]
        self._next[last] = b
        self._prev[b] = last
        self._next[b] = head
        self._prev[head] = b

    cdef inline void _unlink(self, int b) noexcept:
        self._next[self._prev[b]] = self._next[b]
        self._prev[self._next[b]] = self._prev[b]

    cdef void _uncache(self, int b) except *:
        del self._lookup[self._hash[b]]
        self._cached[b] = 0

    cdef int _take_free(self) except -1:
        """Pop a free block: uncached ones first, else evict the least recently freed cached block."""
        cdef int b = self._next[self._uncached_head]
        if b != self._uncached_head:
            self._unlink(b)
            self._num_uncached_free -= 1
        else:
            b = self._next[self._cached_head]
            self._unlink(b)
            self._num_cached_free -= 1
            self._uncache(b)
        self._ref[b] = 1
        return b

    cdef void _acquire_cached(self, int b) noexcept:
        if self._ref[b] == 0:
            self._unlink(b)
            self._num_cached_free -= 1
        self._ref[b] += 1

    cdef void _release(self, int b) except *:
        self._ref[b] -= 1
        if self._ref[b] > 0:
            return
        if self._cached[b]:
            self._link_tail(self._cached_head, b)
            self._num_cached_free += 1
            if self.max_cached_free_blocks >= 0:
                while self._num_cached_free > self.max_cached_free_blocks:
                    b = self._next[self._cached_head]
                    self._unlink(b)
                    self._num_cached_free -= 1
                    self._uncache(b)
                    self._link_tail(self._uncached_head, b)
                    self._num_uncached_free += 1
        else:
            self._link_tail(self._uncached_head, b)
            self._num_uncached_free += 1

    # ---- rows -------------------------------------------------------------------------------------------

    cdef int _check_row(self, int row) except -1:
        if row < 0 or row >= self.max_rows or not self._row_open[row]:
            raise ValueError(f"KV row {row} is not open")
        return 0

    cdef void _reset_tip(self, int row) noexcept:
        self._row_hashed[row] = 0
        self._tip_hash[row] = _fmix64(self._row_key[row] ^ _GOLDEN) & self.hash_mask
        self._tip_block[row] = _ROOT
        self._tip_tag[row] = self._row_key[row]

    cdef bint _is_child(self, int b, int row, const int32_t* toks) noexcept:
        """Whether cached block ``b`` holds ``toks`` right after the row's verified chain tip."""
        if self._parent_id[b] != self._tip_block[row] or self._parent_tag[b] != self._tip_tag[row]:
            return False
        cdef int i
        for i in range(self.block_size):
            if self._tokens[b, i] != toks[i]:
                return False
        return True

    cdef inline void _advance_tip(self, int row, uint64_t h, int canonical) noexcept:
        self._tip_hash[row] = h
        self._tip_block[row] = canonical
        self._tip_tag[row] = self._incarnation[canonical] if canonical >= 0 else 0

    def open_row(self, uint64_t prefix_key=0) -> int:
        """Start an empty block table for a request; ``prefix_key`` seeds its hash chain."""
        if self._num_free_rows == 0:
            raise RuntimeError(f"all {self.max_rows} KV rows are in use; free a row before opening another")
        self._num_free_rows -= 1
        cdef int row = self._free_rows[self._num_free_rows]
        self._row_open[row] = 1
        self._row_len[row] = 0
        self._row_key[row] = prefix_key
        self._reset_tip(row)
        return row

    def match_prefix(self, int row, list prompt, list output, int64_t max_tokens) -> int:
        """Append to an empty row the cached blocks matching the leading tokens (prompt then output), up to
        ``max_tokens`` tokens in whole blocks; returns the number of tokens hit. Callers pass the known token
        count minus one, so a full hit still recomputes the last token (its logits are needed)."""
        self._check_row(row)
        if self._row_len[row] != 0:
            raise ValueError(f"match_prefix needs an empty row, row {row} holds {self._row_len[row]} blocks")
        if not self.prefix_caching or max_tokens < self.block_size:
            return 0
        cdef int bs = self.block_size
        cdef int n_full = <int>min(max_tokens // bs, self.max_blocks_per_row)
        cdef int32_t[::1] buf = self._scratch
        cdef uint64_t h
        cdef int j, b
        for j in range(n_full):
            _gather(prompt, output, <int64_t>j * bs, bs, &buf[0])
            h = _hash_block(self._tip_hash[row], &buf[0], bs) & self.hash_mask
            found = self._lookup.get(h)
            if found is None:
                break
            b = found
            if not self._is_child(b, row, &buf[0]):
                break
            self._acquire_cached(b)
            self._tables[row, j] = b
            self._row_len[row] = j + 1
            self._row_hashed[row] = j + 1
            self._advance_tip(row, h, b)
        return <int64_t>self._row_len[row] * bs

    def fork_row(self, int src, int num_blocks, uint64_t prefix_key=0) -> int:
        """Open a row sharing the first ``num_blocks`` blocks of row ``src`` (ref counts, no copies)."""
        self._check_row(src)
        if num_blocks < 0 or num_blocks > self._row_len[src]:
            raise ValueError(f"fork of {num_blocks} blocks from row {src}, which holds {self._row_len[src]}")
        cdef int row = self.open_row(prefix_key)
        cdef int j, b
        for j in range(num_blocks):
            b = self._tables[src, j]
            self._ref[b] += 1
            self._tables[row, j] = b
        self._row_len[row] = num_blocks
        return row  # its chain is re-walked by publish(): lookups find the shared blocks, no new entries

    def allocate(self, int row, int64_t num_tokens) -> bool:
        """Grow the row to hold ``num_tokens`` tokens. All or nothing: False (and no change) when too few
        blocks are free; cached free blocks count as free and are evicted LRU as needed."""
        self._check_row(row)
        cdef int64_t need_total = (num_tokens + self.block_size - 1) // self.block_size
        if need_total > self.max_blocks_per_row:
            raise ValueError(
                f"{num_tokens} tokens need {need_total} blocks, more than a row holds ({self.max_blocks_per_row})")
        cdef int need = <int>need_total - self._row_len[row]
        if need <= 0:
            return True
        if need > self._num_uncached_free + self._num_cached_free:
            return False
        cdef int n = self._row_len[row]
        cdef int j
        for j in range(n, n + need):
            self._tables[row, j] = self._take_free()
        self._row_len[row] = n + need
        return True

    def publish(self, int row, list prompt, list output, int64_t num_tokens) -> None:
        """Hash the row's full blocks within the first ``num_tokens`` tokens (their KV written or being
        written by an earlier step) and enter them in the prefix cache. A block whose hash is already cached
        by another block stays private (it is freed, not cached, later)."""
        if not self.prefix_caching:
            return
        self._check_row(row)
        cdef int bs = self.block_size
        cdef int upto = <int>min(num_tokens // bs, self._row_len[row])
        cdef int j = self._row_hashed[row]
        if j >= upto:
            return
        cdef uint64_t h
        cdef int b, i, canonical
        cdef int32_t[::1] buf = self._scratch
        while j < upto:
            b = self._tables[row, j]
            _gather(prompt, output, <int64_t>j * bs, bs, &buf[0])
            h = _hash_block(self._tip_hash[row], &buf[0], bs) & self.hash_mask
            canonical = _UNREACHABLE
            if self._tip_block[row] != _UNREACHABLE:
                found = self._lookup.get(h)
                if found is not None:
                    if self._is_child(<int>found, row, &buf[0]):
                        canonical = found
                elif not self._cached[b]:
                    self._lookup[h] = b
                    self._cached[b] = 1
                    self._hash[b] = h
                    self._parent_id[b] = self._tip_block[row]
                    self._parent_tag[b] = self._tip_tag[row]
                    self._incarnation[b] = self._next_incarnation
                    self._next_incarnation += 1
                    for i in range(bs):
                        self._tokens[b, i] = buf[i]
                    canonical = b
            self._advance_tip(row, h, canonical)
            j += 1
        self._row_hashed[row] = upto

    def free_row(self, int row) -> None:
        """Release the row's blocks, last block first, so a prefix outlives its continuations in the LRU."""
        self._check_row(row)
        cdef int j
        for j in range(self._row_len[row] - 1, -1, -1):
            self._release(self._tables[row, j])
        self._row_len[row] = 0
        self._row_open[row] = 0
        self._free_rows[self._num_free_rows] = row
        self._num_free_rows += 1

    # ---- introspection ----------------------------------------------------------------------------------

    @property
    def tables(self):
        """``int32 [max_rows, max_blocks_per_row]`` block tables (live view; copy what must outlive a step)."""
        return self._tables_array

    def row_blocks(self, int row) -> list:
        self._check_row(row)
        return [self._tables[row, j] for j in range(self._row_len[row])]

    def row_num_blocks(self, int row) -> int:
        self._check_row(row)
        return self._row_len[row]

    def ref_count(self, int block) -> int:
        return self._ref[block]

    def is_cached(self, int block) -> bool:
        return bool(self._cached[block])

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (uncached free plus evictable cached free)."""
        return self._num_uncached_free + self._num_cached_free

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or free)."""
        return len(self._lookup)

    @property
    def num_open_rows(self) -> int:
        return self.max_rows - self._num_free_rows

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - <double>(self._num_uncached_free + self._num_cached_free) / self.num_blocks
