# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Flatten one scheduling step into the arrays the model runner feeds to attention (contract C).

All sequences of a step form one token batch. Built in C loops from the scheduler's per-request lists, so
no Python code runs per token, and every array is a fresh copy: the plan stays valid while the scheduler
already prepares the next step.
"""

import numpy as np

from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy


def build_step_arrays(int32_t[:, ::1] tables, int block_size, list rows, list starts, list counts,
                      list prompts, list outputs, list samples):
    """Arrays for requests ``i`` computing tokens ``[starts[i], starts[i] + counts[i])`` of their sequence
    (``prompts[i] + outputs[i]``) with block table ``tables[rows[i]]``.

    Returns ``(input_ids int64[T], positions int64[T], slot_mapping int64[T], query_start_loc int32[S+1],
    seq_lens int32[S], block_tables int32[S, B], sample_indices int64[K])``. Positions past the known tokens
    get input id -1 (a token sampled by a step whose result is still in flight; the runner fills it in).
    ``block_tables`` holds the blocks covering each ``seq_lens[i]`` (B = the largest count), padded with 0.
    ``sample_indices`` are the token rows whose logits are sampled: the last row of each request with
    ``samples[i]`` true, in request order.
    """
    cdef Py_ssize_t S = len(rows)
    if not (len(starts) == len(counts) == len(prompts) == len(outputs) == len(samples) == S):
        raise ValueError("build_step_arrays: per-request lists differ in length")
    qsl_arr = np.empty(S + 1, dtype=np.int32)
    seq_arr = np.empty(S, dtype=np.int32)
    cdef int32_t[::1] qsl = qsl_arr
    cdef int32_t[::1] seq = seq_arr
    cdef Py_ssize_t i
    cdef int64_t total = 0, start, count, num_known, p, pos
    cdef int32_t max_blocks = 0, nb
    cdef int num_sampled = 0
    qsl[0] = 0
    for i in range(S):
        start = starts[i]
        count = counts[i]
        if count <= 0 or start < 0:
            raise ValueError(f"request {i}: start {start}, count {count}; a scheduled request needs tokens")
        total += count
        qsl[i + 1] = <int32_t>total
        seq[i] = <int32_t>(start + count)
        nb = <int32_t>((start + count + block_size - 1) // block_size)
        if nb > tables.shape[1]:
            raise ValueError(f"request {i} needs {nb} blocks, a block table row holds {tables.shape[1]}")
        if nb > max_blocks:
            max_blocks = nb
        if samples[i]:
            num_sampled += 1

    ids_arr = np.empty(total, dtype=np.int64)
    pos_arr = np.empty(total, dtype=np.int64)
    slot_arr = np.empty(total, dtype=np.int64)
    bt_arr = np.zeros((S, max_blocks), dtype=np.int32)
    smp_arr = np.empty(num_sampled, dtype=np.int64)
    cdef int64_t[::1] ids = ids_arr
    cdef int64_t[::1] pos_v = pos_arr
    cdef int64_t[::1] slots = slot_arr
    cdef int32_t[:, ::1] bt = bt_arr
    cdef int64_t[::1] smp = smp_arr
    cdef list prompt, output
    cdef Py_ssize_t p_len, o_len
    cdef int row
    cdef int64_t t = 0
    cdef int k = 0
    for i in range(S):
        row = rows[i]
        if row < 0 or row >= tables.shape[0]:
            raise ValueError(f"request {i}: KV row {row} is outside the block tables")
        start = starts[i]
        count = counts[i]
        prompt = prompts[i]
        output = outputs[i]
        p_len = len(prompt)
        o_len = len(output)
        num_known = p_len + o_len
        nb = <int32_t>((start + count + block_size - 1) // block_size)
        if nb > 0:
            memcpy(&bt[i, 0], &tables[row, 0], nb * sizeof(int32_t))
        for p in range(count):
            pos = start + p
            pos_v[t] = pos
            if pos < p_len:
                ids[t] = <int64_t>prompt[pos]
            elif pos < num_known:
                ids[t] = <int64_t>output[pos - p_len]
            else:
                ids[t] = -1
            slots[t] = <int64_t>tables[row, pos // block_size] * block_size + pos % block_size
            t += 1
        if samples[i]:
            smp[k] = t - 1
            k += 1
    return ids_arr, pos_arr, slot_arr, qsl_arr, seq_arr, bt_arr, smp_arr
