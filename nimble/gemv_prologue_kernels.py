"""The Triton kernels of :mod:`nimble.gemv_prologues` (imported on first use, so that no Triton
import happens where no GEMV runs): the GEMV whose input is an RMS norm or a gated activation
computed as it is read, and the GEMV whose input is a split attention joined as it is read.
Triton resolves a kernel's callees among its module's names, so they live at a module's top
level."""
import triton
import triton.language as tl


@triton.jit
def weight_tile(w_ptr, rows, row_ok, cols, col_ok, stride_w):
    """The weight's rows ``rows`` at columns ``cols``, read once: past the L1 and first out of
    the L2."""
    return tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :],
                   mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def prologue_value(a, b_ptr, b_at, ok, nw_ptr, cols, col_ok, rs, PROLOGUE: tl.constexpr):
    """A prologue's input from ``a`` (the first input's values; ``b_ptr + b_at`` the second's
    at the same places, ``ok`` their mask) at columns ``cols``, ``rs`` the norm's scale: rounded
    to the input's dtype where the model's own code rounds it.  A vector of the GEMV's, or rows
    of a GEMM of rows (``rs`` a column of the rows' scales, the norm's weight broadcast)."""
    dt = a.dtype
    if PROLOGUE == 2:  # silu(gate) * up
        g = a.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt)
        up = tl.load(b_ptr + b_at, mask=ok, other=0.0)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(dt)
    else:
        if PROLOGUE == 1:  # the residual's sum first
            a = (a.to(tl.float32) + tl.load(b_ptr + b_at, mask=ok,
                                            other=0.0).to(tl.float32)).to(dt)
        normed = (a.to(tl.float32) * rs).to(dt)
        nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0)
        x = (nw.to(tl.float32) * normed.to(tl.float32)).to(dt)
    return x


@triton.jit
def prologue_input(a_ptr, b_ptr, nw_ptr, cols, col_ok, rs, PROLOGUE: tl.constexpr):
    """The GEMV's input at ``cols``, rounded to the input's dtype where the model's own code
    rounds it."""
    a = tl.load(a_ptr + cols, mask=col_ok, other=0.0)
    return prologue_value(a, b_ptr, cols, col_ok, nw_ptr, cols, col_ok, rs, PROLOGUE)


@triton.jit
def gemv_prologue_kernel(a_ptr, b_ptr, nw_ptr, w_ptr, y_ptr, sum_ptr, N, K, stride_w, eps,
                         PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         NORM_BLOCK: tl.constexpr, WAITS: tl.constexpr,
                         LATE: tl.constexpr, AHEAD: tl.constexpr = 1):
    dt = a_ptr.dtype.element_ty
    if WAITS and not LATE:  # behind a programmatic edge: the next kernel may launch now
        tl.extra.cuda.gdc_launch_dependents()
    programs = tl.num_programs(0)
    blocks = tl.cdiv(N, BLOCK_N)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    # each program's first weight tile is asked for before the norm's pass over the input, so
    # that the DRAM's latency and the L2's overlap; from then on every step asks for the
    # next one's tile (this block's next columns, else the next block's first) before it
    # sums its own
    rows = tl.program_id(0) * BLOCK_N + r
    w = weight_tile(w_ptr, rows, rows < N, c, c < K, stride_w)
    steps = tl.cdiv(K, BLOCK_K)
    if AHEAD == 2:  # the walk's second tile too: this block's next columns, else the next block
        rows1 = rows + (1 // steps) * programs * BLOCK_N
        cols1 = (1 % steps) * BLOCK_K + c
        w1 = weight_tile(w_ptr, rows1, rows1 < N, cols1, cols1 < K, stride_w)
    if WAITS:  # the weight is a constant of the graph; the inputs are the predecessor's
        tl.extra.cuda.gdc_wait()
    rs = 1.0
    if PROLOGUE != 2:
        # the norm's sum of squares over the whole input, once per program (the programs walk
        # the row blocks grid-stride, so it is not paid again per wave of programs)
        squares = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
        for k in range(0, K, NORM_BLOCK):
            cols = k + tl.arange(0, NORM_BLOCK)
            col_ok = cols < K
            a = tl.load(a_ptr + cols, mask=col_ok, other=0.0)
            if PROLOGUE == 1:
                a = (a.to(tl.float32) + tl.load(b_ptr + cols, mask=col_ok,
                                                other=0.0).to(tl.float32)).to(dt)
                if tl.program_id(0) == 0:
                    tl.store(sum_ptr + cols, a, mask=col_ok)
            a32 = a.to(tl.float32)
            squares += a32 * a32
        rs = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    for block in range(tl.program_id(0), blocks, programs):
        rows = block * BLOCK_N + r
        row_ok = rows < N
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + c
            col_ok = cols < K
            if AHEAD == 2:  # the tile two steps on in the walk, wherever it falls
                step = k // BLOCK_K + 2
                next_rows = rows + (step // steps) * programs * BLOCK_N
                next_cols = (step % steps) * BLOCK_K + c
            else:
                ahead = k + BLOCK_K < K
                next_rows = tl.where(ahead, rows, rows + programs * BLOCK_N)
                next_cols = tl.where(ahead, k + BLOCK_K, 0) + c
            w_next = weight_tile(w_ptr, next_rows, next_rows < N, next_cols, next_cols < K,
                                 stride_w)
            x = prologue_input(a_ptr, b_ptr, nw_ptr, cols, col_ok, rs, PROLOGUE)
            acc += w.to(tl.float32) * x[None, :].to(tl.float32)
            if AHEAD == 2:
                w = w1
                w1 = w_next
            else:
                w = w_next
        if WAITS and LATE:  # kernel_waits.LAUNCH_DEPENDENTS_LATE: at its last block, once
            if block + programs >= blocks:  # its weight is read
                tl.extra.cuda.gdc_launch_dependents()
        tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def joined_input(part_ptr, stat_ptr, cols, col_ok, groups, splits, HEAD_DIM: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """The attention's output at ``cols`` (query head ``h``, element ``d``), joined from its
    split's parts in split order as the join kernel joins them (batch 1), in float32 before
    the join kernel's rounding to the output's dtype."""
    h = cols // HEAD_DIM
    d = cols % HEAD_DIM
    first = (h // groups) * splits * BLOCK_R + h % groups
    top = tl.full((BLOCK_K,), float("-inf"), tl.float32)
    for part in range(0, splits):
        row = first + part * BLOCK_R
        top = tl.maximum(top, tl.load(stat_ptr + row * 2, mask=col_ok, other=float("-inf")))
    top_use = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((BLOCK_K,), tl.float32)
    joined = tl.zeros((BLOCK_K,), tl.float32)
    for part in range(0, splits):
        row = first + part * BLOCK_R
        weight = tl.exp(tl.load(stat_ptr + row * 2, mask=col_ok, other=float("-inf"))
                        - top_use)
        total += weight * tl.load(stat_ptr + row * 2 + 1, mask=col_ok, other=0.0)
        joined += weight * tl.load(part_ptr + row * BLOCK_D + d, mask=col_ok, other=0.0)
    return tl.where(col_ok, joined / tl.where(col_ok, total, 1.0), 0.0)


@triton.jit
def gemv_joined_kernel(part_ptr, stat_ptr, w_ptr, y_ptr, N, K, stride_w, groups, splits,
                       HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAITS: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    if WAITS:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        w = weight_tile(w_ptr, rows, row_ok, cols, col_ok, stride_w)
        x = joined_input(part_ptr, stat_ptr, cols, col_ok, groups, splits, HEAD_DIM,
                         BLOCK_R, BLOCK_D, BLOCK_K).to(dt)
        acc += w.to(tl.float32) * x[None, :].to(tl.float32)
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(dt), mask=row_ok)
