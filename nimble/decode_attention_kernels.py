"""The Triton kernels of :mod:`nimble.decode_attention` (imported on first use, so that no
Triton import happens where no attention runs): ``attend`` reads one stretch of a (sequence,
key-value head)'s cache slots per program, ``join`` (or, with ``LAST_JOINS``, the last program of
a split) joins the parts of a split in split order.  Triton resolves a kernel's callees among
its module's names, so they live at a module's top level."""
import triton
import triton.language as tl


@triton.jit
def join_pair(part_ptr, stat_ptr, out_ptr, pair, groups, kv_heads, splits, sob, soh,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
              CACHE: tl.constexpr):
    """One (sequence, key-value head)'s parts, in split order, as its output."""
    b = pair // kv_heads
    g = pair % kv_heads
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    top = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for s in range(0, splits):
        row = (pair * splits + s) * BLOCK_R + r
        top = tl.maximum(top, tl.load(stat_ptr + row * 2, cache_modifier=CACHE))
    top_use = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for s in range(0, splits):
        row = (pair * splits + s) * BLOCK_R + r
        w = tl.exp(tl.load(stat_ptr + row * 2, cache_modifier=CACHE) - top_use)
        total += w * tl.load(stat_ptr + row * 2 + 1, cache_modifier=CACHE)
        acc += w[:, None] * tl.load(part_ptr + row[:, None] * BLOCK_D + d[None, :],
                                    cache_modifier=CACHE)
    out = acc / total[:, None]
    heads = g * groups + r
    tl.store(out_ptr + b * sob + heads[:, None] * soh + d[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=(r < groups)[:, None] & (d < HEAD_DIM)[None, :])

@triton.jit
def rotated(ptr, row_offsets, row_ok, d, d_ok, cos, sin, HEAD_DIM: tl.constexpr):
    """Rows of head vectors at ``ptr + row_offsets`` with the rotary embedding applied as
    transformers' ``rotate_half`` form applies it (``x * cos + rotate_half(x) * sin``), in
    float32, rounded once to the vector's dtype."""
    half = HEAD_DIM // 2
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    ok = row_ok[:, None] & d_ok[None, :]
    x = tl.load(ptr + row_offsets[:, None] + d[None, :], mask=ok, other=0.0)
    xp = tl.load(ptr + row_offsets[:, None] + partner[None, :], mask=ok, other=0.0)
    y = x.to(tl.float32) * cos[None, :] + sign[None, :] * xp.to(tl.float32) * sin[None, :]
    return y.to(ptr.dtype.element_ty)


@triton.jit
def rotated_vector(ptr, d, d_ok, cos, sin, HEAD_DIM: tl.constexpr):
    """One head vector at ``ptr``, rotated as :func:`rotated` rotates rows."""
    half = HEAD_DIM // 2
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    x = tl.load(ptr + d, mask=d_ok, other=0.0)
    xp = tl.load(ptr + partner, mask=d_ok, other=0.0)
    y = x.to(tl.float32) * cos + sign * xp.to(tl.float32) * sin
    return y.to(ptr.dtype.element_ty)


@triton.jit
def attend(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, part_ptr, stat_ptr, count_ptr, scale,
           slots, groups, kv_heads, splits, slots_per_split,
           sqb, sqh, skb, skh, skl, svb, svh, svl, smb, smh, sml, sob, soh,
           cos_ptr, sin_ptr, kn_ptr, vn_ptr, pos_ptr, scb, ssb, sknb, sknh, svnb, svnh,
           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
           BLOCK_L: tl.constexpr, MASK: tl.constexpr, SPLIT: tl.constexpr,
           IEEE: tl.constexpr, BRANCHLESS: tl.constexpr, LAST_JOINS: tl.constexpr,
           VALUES_EARLY: tl.constexpr, ROPE: tl.constexpr, WAITS: tl.constexpr,
           WHOLE: tl.constexpr, CACHE_EARLY: tl.constexpr):
    pair = tl.program_id(0)  # (sequence, key-value head)
    split = tl.program_id(1)
    b = pair // kv_heads
    g = pair % kv_heads
    r = tl.arange(0, BLOCK_R)
    row_ok = r < groups
    heads = g * groups + r
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lo = split * slots_per_split
    hi = tl.minimum(lo + slots_per_split, slots)
    if WAITS:  # behind a programmatic edge: launched early, it reads nothing before the wait
        tl.extra.cuda.gdc_launch_dependents()
    if CACHE_EARLY:
        # ...but the whole cache's keys and values, whose writes (this step's, at its
        # position) come after this kernel: they stream while the predecessor ends, and the
        # step's new slot is read from the new key and value all the same
        tl.static_assert(WHOLE and ROPE)
        early_at = lo + tl.arange(0, BLOCK_L)
        early_ok = (early_at < hi)[:, None] & d_ok[None, :]
        k_early = tl.load(k_ptr + b * skb + g * skh + early_at[:, None] * skl + d[None, :],
                          mask=early_ok, other=0.0)
        v_early = tl.load(v_ptr + b * svb + g * svh + early_at[:, None] * svl + d[None, :],
                          mask=early_ok, other=0.0)
    if WAITS:
        tl.extra.cuda.gdc_wait()
    if ROPE:
        # the query and the step's new key before their rotary embedding: rotated here, and
        # the new key and value stand in for the cache's slot at the position (which the
        # cache's own write, after this kernel, fills with the same key and value)
        cos = tl.load(cos_ptr + b * scb + d, mask=d_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + b * ssb + d, mask=d_ok, other=0.0).to(tl.float32)
        q = rotated(q_ptr, b * sqb + heads * sqh, row_ok, d, d_ok, cos, sin, HEAD_DIM)
        k_new = rotated_vector(kn_ptr + b * sknb + g * sknh, d, d_ok, cos, sin, HEAD_DIM)
        v_new = tl.load(vn_ptr + b * svnb + g * svnh + d, mask=d_ok, other=0.0)
        pos = tl.load(pos_ptr)
    else:
        q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_L):
        at = start + tl.arange(0, BLOCK_L)
        ok = at < hi
        live = row_ok[:, None] & ok[None, :]
        bias = tl.zeros((BLOCK_R, BLOCK_L), tl.float32)
        if MASK == 1:  # boolean: True attends
            keep = tl.load(mask_ptr + b * smb + heads[:, None] * smh + at[None, :] * sml,
                           mask=live, other=0)
            live = live & (keep != 0)
        if MASK == 2:  # additive
            bias = tl.load(mask_ptr + b * smb + heads[:, None] * smh + at[None, :] * sml,
                           mask=live, other=float("-inf")).to(tl.float32)
            live = live & (bias != float("-inf"))
        # stretches the mask hides entirely (a static cache past the position) read
        # nothing more: by a branch around the block, or (BRANCHLESS) by loads masked to
        # the slots some row attends, which issue no reads for the others and leave the
        # loop free of a branch around its loads (a hidden slot's key and value are then
        # zeros, its weight zero either way: the same values, up to the rounding of other code)
        # (WHOLE: the whole cache is the one block, its every slot asked for beside the mask, not
        # after it; the hidden slots' weights are zero all the same)
        if WHOLE:
            read = ok
            run = True
        elif BRANCHLESS:
            read = tl.max(live.to(tl.int32), 0) > 0
            run = True
        else:
            read = ok
            run = tl.max(live.to(tl.int32)) > 0
        if run:
            if CACHE_EARLY:  # the one tile, asked for before the wait
                k = k_early
            else:
                k = tl.load(k_ptr + b * skb + g * skh + at[:, None] * skl + d[None, :],
                            mask=read[:, None] & d_ok[None, :], other=0.0)
            if ROPE:
                k = tl.where((at == pos)[:, None], k_new[None, :], k)
            if CACHE_EARLY:
                v = v_early
            elif VALUES_EARLY:  # asked for beside the keys: one memory latency, not two
                v = tl.load(v_ptr + b * svb + g * svh + at[:, None] * svl + d[None, :],
                            mask=read[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            # natural exponents: an additive mask of the dtype's least value stays finite
            s = s * scale + bias
            s = tl.where(live, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if not VALUES_EARLY and not CACHE_EARLY:
                v = tl.load(v_ptr + b * svb + g * svh + at[:, None] * svl + d[None, :],
                            mask=read[:, None] & d_ok[None, :], other=0.0)
            if ROPE:
                v = tl.where((at == pos)[:, None], v_new[None, :], v)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    if SPLIT:
        row = (pair * splits + split) * BLOCK_R + r
        tl.store(part_ptr + row[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(stat_ptr + row * 2, m_i)
        tl.store(stat_ptr + row * 2 + 1, l_i)
        if LAST_JOINS:
            # every thread's stores before the count (a release at the GPU's scope); the
            # program that counts last joins the parts, read past the L1, in split order
            # whichever program it is
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if done == splits - 1:
                join_pair(part_ptr, stat_ptr, out_ptr, pair, groups, kv_heads, splits,
                          sob, soh, HEAD_DIM, BLOCK_D, BLOCK_R, ".cg")
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * sob + heads[:, None] * soh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

@triton.jit
def join(part_ptr, stat_ptr, out_ptr, groups, kv_heads, splits, sob, soh,
         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
         WAITS: tl.constexpr):
    if WAITS:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    join_pair(part_ptr, stat_ptr, out_ptr, tl.program_id(0), groups, kv_heads, splits,
              sob, soh, HEAD_DIM, BLOCK_D, BLOCK_R, "")
