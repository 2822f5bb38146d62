"""KVCacheManager: ref counts, all-or-nothing allocation, prefix hits, LRU eviction, the collision guard and the
cached-free cap, checked against plain-Python models of what must hold."""

from __future__ import annotations

import random

import pytest

from candle_vllm.pyengine.kv_cache import KVCacheManager


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def filled_row(m: KVCacheManager, toks: list[int], key: int = 0) -> int:
    """A row holding ``toks`` with all its full blocks published (as after computing them)."""
    row = m.open_row(key)
    assert m.allocate(row, len(toks))
    m.publish(row, toks, [], len(toks))
    return row


def test_allocate_free_and_ref_counts() -> None:
    m = KVCacheManager(num_blocks=20, block_size=4, max_rows=4, max_blocks_per_row=10)
    a, b = m.open_row(), m.open_row()
    assert m.allocate(a, 9) and m.allocate(b, 16)
    blocks_a, blocks_b = m.row_blocks(a), m.row_blocks(b)
    assert len(blocks_a) == 3 and len(blocks_b) == 4
    assert not set(blocks_a) & set(blocks_b)
    assert all(m.ref_count(x) == 1 for x in blocks_a + blocks_b)
    assert m.num_free_blocks == 13
    assert m.usage == pytest.approx(7 / 20)
    assert m.allocate(a, 12) and m.row_num_blocks(a) == 3  # still fits in 3 blocks
    assert m.allocate(a, 13) and m.row_num_blocks(a) == 4

    child = m.fork_row(a, 3)
    assert m.row_blocks(child) == m.row_blocks(a)[:3]
    assert [m.ref_count(x) for x in m.row_blocks(a)] == [2, 2, 2, 1]
    m.free_row(a)
    assert [m.ref_count(x) for x in m.row_blocks(child)] == [1, 1, 1]
    m.free_row(child)
    m.free_row(b)
    assert m.num_free_blocks == 20 and m.num_open_rows == 0
    assert m.usage == 0.0


def test_allocation_is_all_or_nothing() -> None:
    m = KVCacheManager(num_blocks=5, block_size=8, max_rows=2, max_blocks_per_row=8)
    a, b = m.open_row(), m.open_row()
    assert m.allocate(a, 24)
    assert not m.allocate(b, 24)  # needs 3, only 2 free
    assert m.row_num_blocks(b) == 0 and m.num_free_blocks == 2
    with pytest.raises(ValueError, match="more than a row holds"):
        m.allocate(b, 65)
    m.free_row(b)
    with pytest.raises(ValueError, match="not open"):
        m.allocate(b, 8)


def test_full_prefix_hit_recomputes_last_token() -> None:
    m = KVCacheManager(num_blocks=200, block_size=16, max_rows=4, max_blocks_per_row=100)
    shared = tokens(1, 1000)
    first = filled_row(m, shared)
    m.free_row(first)
    # Same prompt: 1000 known tokens, at most 999 may come from the cache, in whole blocks -> 62 blocks.
    same = m.open_row()
    assert m.match_prefix(same, shared, [], len(shared) - 1) == 992
    # Shared prefix plus a different tail: the 62 full blocks of the prefix hit.
    other = m.open_row()
    assert m.match_prefix(other, shared + tokens(2, 300), [], 1299) == 992
    assert m.row_blocks(same) == m.row_blocks(other)
    assert all(m.ref_count(x) == 2 for x in m.row_blocks(same))


def test_prompt_and_output_tokens_form_one_chain() -> None:
    m = KVCacheManager(num_blocks=40, block_size=4, max_rows=4, max_blocks_per_row=20)
    seq = tokens(3, 30)
    row = m.open_row()
    assert m.allocate(row, 30)
    m.publish(row, seq[:10], seq[10:], 30)  # prompt 10 + 20 generated
    probe = m.open_row()
    assert m.match_prefix(probe, seq[:22], seq[22:], 29) == 28
    assert m.row_blocks(probe) == m.row_blocks(row)[:7]


def test_prefix_key_separates_chains() -> None:
    m = KVCacheManager(num_blocks=40, block_size=4, max_rows=4, max_blocks_per_row=20)
    seq = tokens(4, 17)
    filled_row(m, seq, key=7)
    assert m.match_prefix(m.open_row(8), seq, [], 16) == 0
    assert m.match_prefix(m.open_row(7), seq, [], 16) == 16


def test_lru_eviction_order_of_cached_free_blocks() -> None:
    bs = 4
    m = KVCacheManager(num_blocks=12, block_size=bs, max_rows=4, max_blocks_per_row=12)
    seqs = [tokens(10 + i, 3 * bs) for i in range(3)]
    rows = [filled_row(m, s) for s in seqs]
    for r in rows:  # freed A, then B, then C: A is least recently used
        m.free_row(r)
    assert m.num_cached_free_blocks == 9 and m.num_free_blocks == 12
    grab = m.open_row()
    assert m.allocate(grab, 3 * bs + 2 * bs)  # 3 uncached + 2 evicted from A (its tail blocks first)
    probe = m.open_row()
    assert m.match_prefix(probe, seqs[0], [], 3 * bs) == bs  # A keeps only its first block
    m.free_row(probe)
    probe = m.open_row()
    assert m.match_prefix(probe, seqs[1], [], 3 * bs) == 3 * bs  # B untouched
    m.free_row(probe)
    # LRU order is now C3 C2 C1 A1 B3 B2 B1 (B was touched after C was freed): 4 more evict C and A1.
    assert m.allocate(grab, 9 * bs)
    assert m.match_prefix(m.open_row(), seqs[2], [], 3 * bs) == 0
    assert m.match_prefix(m.open_row(), seqs[0], [], 3 * bs) == 0
    assert m.match_prefix(m.open_row(), seqs[1], [], 3 * bs) == 3 * bs


@pytest.mark.parametrize("mask", [2**64 - 1, 0b11, 0])
def test_hits_are_exact_prefixes_under_forced_collisions(monkeypatch: pytest.MonkeyPatch, mask: int) -> None:
    """Every hit block must hold exactly the query's prefix, however weak the hash; with the full hash the
    hit must also be the longest cached prefix. Small alphabets make shared prefixes (and reuse) common."""
    bs = 4
    m = KVCacheManager(num_blocks=6000, block_size=bs, max_rows=4, max_blocks_per_row=64)
    monkeypatch.setattr(m, "hash_mask", mask)
    rng = random.Random(5)
    identity: dict[int, tuple[int, ...]] = {}  # cached block -> the whole prefix it ends
    total_hits = 0
    for _ in range(300):
        seq = [rng.randrange(2) for _ in range(rng.randrange(1, 60))]
        row = m.open_row()
        hit = m.match_prefix(row, seq, [], len(seq) - 1)
        total_hits += hit
        for j, b in enumerate(m.row_blocks(row)):
            assert identity[b] == tuple(seq[:(j + 1) * bs])
        if mask == 2**64 - 1:
            longest = 0
            while longest + bs <= len(seq) - 1 and tuple(seq[:longest + bs]) in identity.values():
                longest += bs
            assert hit == longest
        assert m.allocate(row, len(seq))
        m.publish(row, seq, [], len(seq))
        for j, b in enumerate(m.row_blocks(row)[:len(seq) // bs]):
            if m.is_cached(b):
                identity.setdefault(b, tuple(seq[:(j + 1) * bs]))
        m.free_row(row)
    assert total_hits > 0


def test_disabled_prefix_cache_never_hits() -> None:
    m = KVCacheManager(num_blocks=40, block_size=4, max_rows=4, max_blocks_per_row=20,
                       enable_prefix_caching=False)
    seq = tokens(30, 20)
    m.free_row(filled_row(m, seq))
    assert m.num_cached_blocks == 0
    assert m.match_prefix(m.open_row(), seq, [], 19) == 0


def test_prefix_cache_max_tokens_caps_cached_free_blocks() -> None:
    bs = 4
    m = KVCacheManager(num_blocks=40, block_size=bs, max_rows=4, max_blocks_per_row=20,
                       prefix_cache_max_tokens=5 * bs)
    seqs = [tokens(40 + i, 4 * bs) for i in range(3)]
    for s in seqs:
        m.free_row(filled_row(m, s))
        assert m.num_cached_free_blocks <= 5
    assert m.num_free_blocks == 40
    # The newest sequence survives whole; the oldest is gone.
    assert m.match_prefix(m.open_row(), seqs[2], [], 4 * bs) == 4 * bs
    assert m.match_prefix(m.open_row(), seqs[0], [], 4 * bs) == 0


def test_in_use_block_is_shared_not_duplicated() -> None:
    m = KVCacheManager(num_blocks=20, block_size=4, max_rows=4, max_blocks_per_row=10)
    seq = tokens(50, 12)
    a = filled_row(m, seq)
    b = m.open_row()
    assert m.match_prefix(b, seq, [], 11) == 8
    assert m.row_blocks(b) == m.row_blocks(a)[:2]
    assert m.num_free_blocks == 17
    assert m.allocate(b, 12)
    m.publish(b, seq, [], 12)  # its 3rd block duplicates a's cached one: stays private
    assert m.num_cached_blocks == 3
    m.free_row(a)
    m.free_row(b)
    assert m.num_free_blocks == 20 and m.num_cached_free_blocks == 3
