"""The Triton kernels of :mod:`nimble.gemv_prologues` (imported on first use, so that no Triton
import happens where no GEMV runs): the GEMV whose input is an RMS norm, a layer norm, a gated
activation or a GELU computed as it is read, and the GEMV whose input is a split attention
joined as it is read.
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
def with_bias(a, c_ptr, cols, col_ok, HAS_C: tl.constexpr):
    """``a`` plus the bias at ``c_ptr`` (the projection's before it) where ``HAS_C``, rounded
    to ``a``'s dtype as the model's code rounds the projection's output."""
    if HAS_C:
        a = (a.to(tl.float32) + tl.load(c_ptr + cols, mask=col_ok,
                                        other=0.0).to(tl.float32)).to(a.dtype)
    return a


@triton.jit
def summed_input(a, b_ptr, b_at, ok, c_ptr, cols, col_ok, HAS_C: tl.constexpr):
    """A residual sum's value from ``a`` (its first operand's values, with the bias
    ``c_ptr`` added first where ``HAS_C``) and the second operand at ``b_ptr + b_at``, each sum
    rounded to the input's dtype as the model's code rounds it."""
    a = with_bias(a, c_ptr, cols, col_ok, HAS_C)
    return (a.to(tl.float32) + tl.load(b_ptr + b_at, mask=ok, other=0.0).to(tl.float32)
            ).to(a.dtype)


@triton.jit
def activated(a, c_ptr, cols, col_ok, PROLOGUE: tl.constexpr, HAS_C: tl.constexpr):
    """GELU of ``a`` (plus the bias ``c_ptr`` where ``HAS_C``, rounded first): the tanh
    approximation (``PROLOGUE`` 5) or the error function's (6), in float32, rounded once, as
    Inductor's kernel computes it."""
    g = with_bias(a, c_ptr, cols, col_ok, HAS_C).to(tl.float32)
    if PROLOGUE == 5:
        u = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        # tanh(u) as 1 - 2 / (exp(2u) + 1): exact at both ends (exp overflows to inf: 1)
        t = 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)
    else:
        t = tl.erf(g * 0.7071067811865476)
    return (0.5 * g * (1.0 + t)).to(a.dtype)


@triton.jit
def prologue_value(a, b_ptr, b_at, ok, c_ptr, nw_ptr, nb_ptr, cols, col_ok, mean, rs,
                   PROLOGUE: tl.constexpr, HAS_C: tl.constexpr, HAS_NB: tl.constexpr):
    """A prologue's input from ``a`` (the first input's values; ``b_ptr + b_at`` the second's
    at the same places, ``ok`` their mask) at columns ``cols``, ``mean`` and ``rs`` the norm's
    centre and scale: rounded to the input's dtype where the model's own code rounds it.  A
    vector of the GEMV's, or rows of a GEMM of rows (``mean`` and ``rs`` columns of the rows',
    the norm's weight and bias broadcast)."""
    dt = a.dtype
    if PROLOGUE == 2:  # silu(gate) * up
        g = a.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt)
        up = tl.load(b_ptr + b_at, mask=ok, other=0.0)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(dt)
    elif PROLOGUE >= 5:
        x = activated(a, c_ptr, cols, col_ok, PROLOGUE, HAS_C)
    else:
        if PROLOGUE == 1 or PROLOGUE == 4:  # the residual's sum first
            a = summed_input(a, b_ptr, b_at, ok, c_ptr, cols, col_ok, HAS_C)
        nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0)
        if PROLOGUE <= 1:  # RMS norm: rounded, then scaled and rounded again
            normed = (a.to(tl.float32) * rs).to(dt)
            x = (nw.to(tl.float32) * normed.to(tl.float32)).to(dt)
        else:  # layer norm: centred, scaled, shifted in float32, rounded once
            y = (a.to(tl.float32) - mean) * rs * nw.to(tl.float32)
            if HAS_NB:
                y += tl.load(nb_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            x = y.to(dt)
    return x


@triton.jit
def prologue_input(a_ptr, b_ptr, c_ptr, nw_ptr, nb_ptr, cols, col_ok, mean, rs,
                   PROLOGUE: tl.constexpr, HAS_C: tl.constexpr, HAS_NB: tl.constexpr):
    """The GEMV's input at ``cols``, rounded to the input's dtype where the model's own code
    rounds it."""
    a = tl.load(a_ptr + cols, mask=col_ok, other=0.0)
    return prologue_value(a, b_ptr, cols, col_ok, c_ptr, nw_ptr, nb_ptr, cols, col_ok, mean,
                          rs, PROLOGUE, HAS_C, HAS_NB)


@triton.jit
def vector_input(a_ptr, b_ptr, c_ptr, cols, K, PROLOGUE: tl.constexpr, HAS_C: tl.constexpr):
    """A norm's input vector at ``cols`` (with the residual, its sum), and their mask."""
    col_ok = cols < K
    a = tl.load(a_ptr + cols, mask=col_ok, other=0.0)
    if PROLOGUE == 1 or PROLOGUE == 4:
        a = summed_input(a, b_ptr, cols, col_ok, c_ptr, cols, col_ok, HAS_C)
    return a, col_ok


@triton.jit
def vector_stats(a_ptr, b_ptr, c_ptr, sum_ptr, K, eps, stores, NORM_BLOCK: tl.constexpr,
                 PROLOGUE: tl.constexpr, HAS_C: tl.constexpr, ONE_BLOCK: tl.constexpr):
    """A norm's centre and scale over the whole input vector (of its residual sum, which is
    written to ``sum_ptr`` where ``stores``: the first program): ``(0, rsqrt(mean(x^2) +
    eps))`` for an RMS norm (``PROLOGUE`` 0, 1), ``(mean, rsqrt(var + eps))`` for a layer norm
    (3, 4), its variance about the mean of the first pass: from the registers where the input
    is one block (``ONE_BLOCK``), else from a second pass over it (read from the L2)."""
    adds = PROLOGUE == 1 or PROLOGUE == 4
    if PROLOGUE >= 3 and ONE_BLOCK:
        cols = tl.arange(0, NORM_BLOCK)
        a, col_ok = vector_input(a_ptr, b_ptr, c_ptr, cols, K, PROLOGUE, HAS_C)
        if adds and stores:
            tl.store(sum_ptr + cols, a, mask=col_ok)
        a32 = a.to(tl.float32)
        mean = tl.sum(a32, axis=0) / K
        d = tl.where(col_ok, a32 - mean, 0.0)
        total = d * d
    else:
        total = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
        for k in range(0, K, NORM_BLOCK):
            cols = k + tl.arange(0, NORM_BLOCK)
            a, col_ok = vector_input(a_ptr, b_ptr, c_ptr, cols, K, PROLOGUE, HAS_C)
            if adds and stores:
                tl.store(sum_ptr + cols, a, mask=col_ok)
            a32 = a.to(tl.float32)
            if PROLOGUE <= 1:
                total += a32 * a32
            else:
                total += a32
        mean = 0.0
        if PROLOGUE >= 3:
            mean = tl.sum(total, axis=0) / K
            total = tl.zeros((NORM_BLOCK,), dtype=tl.float32)
            for k in range(0, K, NORM_BLOCK):
                cols = k + tl.arange(0, NORM_BLOCK)
                a, col_ok = vector_input(a_ptr, b_ptr, c_ptr, cols, K, PROLOGUE, HAS_C)
                d = tl.where(col_ok, a.to(tl.float32) - mean, 0.0)
                total += d * d
    return mean, tl.rsqrt(tl.sum(total, axis=0) / K + eps)


@triton.jit
def gemv_prologue_kernel(a_ptr, b_ptr, nw_ptr, w_ptr, y_ptr, sum_ptr, c_ptr, nb_ptr, N, K,
                         stride_w, eps, PROLOGUE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, WAITS: tl.constexpr,
                         LATE: tl.constexpr, AHEAD: tl.constexpr = 1,
                         HAS_C: tl.constexpr = False, HAS_NB: tl.constexpr = False,
                         ONE_BLOCK: tl.constexpr = False):
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
    mean = 0.0
    rs = 1.0
    if PROLOGUE <= 1 or PROLOGUE == 3 or PROLOGUE == 4:
        # the norm over the whole input, once per program (the programs walk the row blocks
        # grid-stride, so it is not paid again per wave of programs)
        mean, rs = vector_stats(a_ptr, b_ptr, c_ptr, sum_ptr, K, eps, tl.program_id(0) == 0,
                                NORM_BLOCK, PROLOGUE, HAS_C, ONE_BLOCK)
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
            x = prologue_input(a_ptr, b_ptr, c_ptr, nw_ptr, nb_ptr, cols, col_ok, mean, rs,
                               PROLOGUE, HAS_C, HAS_NB)
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
