"""The Triton kernels of :mod:`nimble.gemm_rows` (imported on first use, so that no Triton
import happens where no GEMM of rows runs): the GEMM of a few rows, its prologues' arithmetic
shared with the single-row GEMV's (:func:`nimble.gemv_prologue_kernels.prologue_value`), and
the reduction of a split's parts.  Triton resolves a kernel's callees among its module's
names, so they live at a module's top level."""
import triton
import triton.language as tl

from .gemv_prologue_kernels import prologue_value, summed_input  # noqa: F401  (callees)


@triton.jit
def rows_input(x_ptr, b_ptr, c_ptr, m, m_ok, cols, K, stride_x, stride_b,
               PROLOGUE: tl.constexpr, HAS_C: tl.constexpr):
    """The rows ``m`` of a prologue's input at ``cols`` (with the residual, its sum), and their
    mask."""
    col_ok = cols < K
    ok = m_ok[:, None] & col_ok[None, :]
    a = tl.load(x_ptr + m[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if PROLOGUE == 1 or PROLOGUE == 4:
        a = summed_input(a, b_ptr, m[:, None] * stride_b + cols[None, :], ok, c_ptr, cols,
                         col_ok, HAS_C)
    return a, ok


@triton.jit
def rows_stats(x_ptr, b_ptr, c_ptr, sum_ptr, m, m_ok, M_PAD: tl.constexpr, K, stride_x,
               stride_b, eps, stores, NORM_BLOCK: tl.constexpr, PROLOGUE: tl.constexpr,
               HAS_C: tl.constexpr):
    """Each row's norm centre and scale over all its columns (whatever part this program
    sums), as :func:`nimble.gemv_prologue_kernels.vector_stats` computes a vector's: columns
    of ``M_PAD``; with the residual, its sum written where ``stores`` (the first program)."""
    total = tl.zeros((M_PAD, NORM_BLOCK), dtype=tl.float32)
    for kk in range(0, K, NORM_BLOCK):
        cols = kk + tl.arange(0, NORM_BLOCK)
        a, ok = rows_input(x_ptr, b_ptr, c_ptr, m, m_ok, cols, K, stride_x, stride_b,
                           PROLOGUE, HAS_C)
        if (PROLOGUE == 1 or PROLOGUE == 4) and stores:
            tl.store(sum_ptr + m[:, None] * K + cols[None, :], a, mask=ok)
        a32 = a.to(tl.float32)
        if PROLOGUE <= 1:
            total += a32 * a32
        else:
            total += a32
    mean = tl.zeros((M_PAD,), dtype=tl.float32)
    if PROLOGUE >= 3:
        mean = tl.sum(total, axis=1) / K
        total = tl.zeros((M_PAD, NORM_BLOCK), dtype=tl.float32)
        for kk in range(0, K, NORM_BLOCK):
            cols = kk + tl.arange(0, NORM_BLOCK)
            a, ok = rows_input(x_ptr, b_ptr, c_ptr, m, m_ok, cols, K, stride_x, stride_b,
                               PROLOGUE, HAS_C)
            d = tl.where(ok, a.to(tl.float32) - mean[:, None], 0.0)
            total += d * d
    return mean, tl.rsqrt(tl.sum(total, axis=1) / K + eps)


@triton.jit
def gemm_rows_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, b_ptr, nw_ptr, sum_ptr, c_ptr,
                     nb_ptr, M, N,
                     K, stride_w, stride_x, stride_b, K_CHUNK, eps, M_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                     LAST_JOINS: tl.constexpr, WAITS: tl.constexpr, LATE: tl.constexpr,
                     PROLOGUE: tl.constexpr = -1, NORM_BLOCK: tl.constexpr = 16,
                     HAS_C: tl.constexpr = False, HAS_NB: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    # this program's part of the columns: all of them, or the split's K_CHUNK
    k_start = tl.program_id(1) * K_CHUNK
    k_end = tl.minimum(k_start + K_CHUNK, K)
    c = k_start + tl.arange(0, BLOCK_K)
    if WAITS and not LATE:  # behind a programmatic edge: the next kernel may launch now
        tl.extra.cuda.gdc_launch_dependents()
    # the first weight tile is asked for before the wait for the input (the weight is a
    # constant of the graph); its product is the loop's first, so the bits are the same
    w = tl.load(w_ptr + rows[:, None] * stride_w + c[None, :],
                mask=row_ok[:, None] & (c < k_end)[None, :], other=0.0,
                eviction_policy="evict_first")
    if WAITS:
        tl.extra.cuda.gdc_wait()
    mean = tl.zeros((M_PAD,), dtype=tl.float32)
    rs = tl.full((M_PAD,), 1.0, tl.float32)
    if PROLOGUE == 0 or PROLOGUE == 1 or PROLOGUE == 3 or PROLOGUE == 4:
        mean, rs = rows_stats(x_ptr, b_ptr, c_ptr, sum_ptr, m, m_ok, M_PAD, K, stride_x,
                              stride_b, eps, (tl.program_id(0) == 0) & (tl.program_id(1) == 0),
                              NORM_BLOCK, PROLOGUE, HAS_C)
    if BLOCK_N >= 16:
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    else:  # each lane's products summed across the steps, reduced once at the end
        lanes = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, k_end - k_start, BLOCK_K):
        cols = k + c
        x_ok = m_ok[:, None] & (cols < k_end)[None, :]
        x = tl.load(x_ptr + m[:, None] * stride_x + cols[None, :], mask=x_ok, other=0.0)
        if PROLOGUE >= 0:  # a prologue's input computed as it is read, as the GEMV's is
            x = prologue_value(x, b_ptr, m[:, None] * stride_b + cols[None, :], x_ok, c_ptr,
                               nw_ptr, nb_ptr, cols, cols < k_end, mean[:, None], rs[:, None],
                               PROLOGUE, HAS_C, HAS_NB)
        if BLOCK_N >= 16:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            lanes += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        next_cols = cols + BLOCK_K
        w = tl.load(w_ptr + rows[:, None] * stride_w + next_cols[None, :],
                    mask=row_ok[:, None] & (next_cols < k_end)[None, :], other=0.0,
                    eviction_policy="evict_first")
    if BLOCK_N < 16:
        acc = tl.sum(lanes, axis=2)
    if WAITS and LATE:  # kernel_waits.LAUNCH_DEPENDENTS_LATE: its weight is read
        tl.extra.cuda.gdc_launch_dependents()
    out = m_ok[:, None] & row_ok[None, :]
    at = m[:, None] * N + rows[None, :]
    if PARTIAL:  # the split's float32 sums, at its place in the (splits, M, N) workspace
        tl.store(part_ptr + tl.program_id(1) * M * N + at, acc, mask=out)
        if LAST_JOINS:
            # every thread's stores before the count (a release at the GPU's scope); the
            # program that counts last adds the parts, read past the L1, in split order
            # whichever program it is: the bits of the second kernel's sum
            tl.debug_barrier()
            splits = tl.num_programs(1)
            done = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel",
                                 scope="gpu")
            if done == splits - 1:
                total = tl.load(part_ptr + at, mask=out, other=0.0, cache_modifier=".cg")
                for s in range(1, splits):
                    total += tl.load(part_ptr + s * M * N + at, mask=out, other=0.0,
                                     cache_modifier=".cg")
                tl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=out)
    else:
        tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=out)

@triton.jit
def gemm_rows_reduce_kernel(parts_ptr, y_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                            WAITS: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = at < MN
    if WAITS:
        tl.extra.cuda.gdc_wait()
    # the splits summed in their order: the same bits at every call
    acc = tl.load(parts_ptr + at, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(parts_ptr + s * MN + at, mask=ok, other=0.0)
    tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=ok)
