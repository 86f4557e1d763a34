/* torch's CPU Bernoulli draws, reproduced bit for bit and faster (no per-element dispatch).
 *
 * torch 2.13's `t.bernoulli_(p)` on a CPU tensor (and so F.dropout, `empty_like(t).bernoulli_(1 - p)`)
 * draws one `at::bernoulli_distribution<double>` per element, serially, from the default generator:
 * an MT19937 (`at::mt19937`), two 32-bit outputs r1, r2 per element, u = ((r1 << 32 | r2) & (2^53 - 1))
 * * 2^-53, kept when u < p. `torch.get_rng_state()` exposes the generator as CPUGeneratorImplState's
 * legacy_pod: uint64 the_initial_seed, int32 left, int32 seeded, uint64 next, uint64 state[624], ...
 * This kernel runs the same generator over that state (advanced in place, as torch's would be) and
 * writes out[i] = kept ? scale : 0 (the dropout multipliers). u < p is tested as the integer
 * (r1 << 32 | r2) & (2^53 - 1) < keep_below, keep_below = ceil(p * 2^53): the same comparison, exact.
 * The Python side checks once per process that it matches torch's own draws before using it. */

#define CO_MT_N 624
#define CO_MT_M 397
#define CO_MT_STATE_OFFSET 24
#define CO_MT_STATE_BYTES (CO_MT_STATE_OFFSET + 8 * CO_MT_N)

#ifndef CO_MT_HELPERS
#define CO_MT_HELPERS
static inline uint32_t co_mt_twist(uint32_t u, uint32_t v)
{
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

/* at::mt19937::next_state: the 624 words regenerated in place */
static void co_mt_regen(uint32_t *s)
{
    int i = 0;
    for (; i < CO_MT_N - CO_MT_M; ++i) s[i] = s[i + CO_MT_M] ^ co_mt_twist(s[i], s[i + 1]);
    for (; i < CO_MT_N - 1; ++i) s[i] = s[i + CO_MT_M - CO_MT_N] ^ co_mt_twist(s[i], s[i + 1]);
    s[CO_MT_N - 1] = s[CO_MT_M - 1] ^ co_mt_twist(s[CO_MT_N - 1], s[0]);
}

static inline uint32_t co_mt_temper(uint32_t y)
{
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}
#endif


#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
static inline __m256i KFN(co_mt_twist8)(__m256i u, __m256i v)
{
    __m256i y = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32((int)0x80000000u)),
                                _mm256_and_si256(v, _mm256_set1_epi32(0x7fffffff)));
    __m256i odd = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_and_si256(v, _mm256_set1_epi32(1)));
    return _mm256_xor_si256(_mm256_srli_epi32(y, 1), _mm256_and_si256(odd, _mm256_set1_epi32((int)0x9908b0dfu)));
}

/* co_mt_regen, 8 words at a time where every word read is the one the serial loop would read */
static void KFN(co_mt_regen8)(uint32_t *s)
{
    int i = 0;
    for (; i + 8 <= CO_MT_N - CO_MT_M; i += 8) {  /* s[i + 397 ..] and s[i + 1 .. i + 8] not yet rewritten */
        __m256i t = KFN(co_mt_twist8)(_mm256_loadu_si256((const __m256i *)(s + i)),
                                      _mm256_loadu_si256((const __m256i *)(s + i + 1)));
        _mm256_storeu_si256((__m256i *)(s + i),
                            _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(s + i + CO_MT_M)), t));
    }
    for (; i < CO_MT_N - CO_MT_M; ++i) s[i] = s[i + CO_MT_M] ^ co_mt_twist(s[i], s[i + 1]);
    for (; i + 8 <= CO_MT_N - 1; i += 8) {  /* s[i - 227 ..] already rewritten, s[i + 1 .. i + 8] not yet */
        __m256i t = KFN(co_mt_twist8)(_mm256_loadu_si256((const __m256i *)(s + i)),
                                      _mm256_loadu_si256((const __m256i *)(s + i + 1)));
        _mm256_storeu_si256((__m256i *)(s + i),
                            _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(s + i + CO_MT_M - CO_MT_N)), t));
    }
    for (; i < CO_MT_N - 1; ++i) s[i] = s[i + CO_MT_M - CO_MT_N] ^ co_mt_twist(s[i], s[i + 1]);
    s[CO_MT_N - 1] = s[CO_MT_M - 1] ^ co_mt_twist(s[CO_MT_N - 1], s[0]);
}

static inline __m256i KFN(co_mt_temper8)(__m256i y)
{
    y = _mm256_xor_si256(y, _mm256_srli_epi32(y, 11));
    y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_slli_epi32(y, 7), _mm256_set1_epi32((int)0x9d2c5680u)));
    y = _mm256_xor_si256(y, _mm256_and_si256(_mm256_slli_epi32(y, 15), _mm256_set1_epi32((int)0xefc60000u)));
    return _mm256_xor_si256(y, _mm256_srli_epi32(y, 18));
}
#endif

int64_t KFN(bernoulli_mt19937_f32)(void *state, int64_t state_bytes, int64_t n, uint64_t keep_below,
                                   float scale, float *out)
{
    if (!state || state_bytes < CO_MT_STATE_BYTES || n < 0 || (n > 0 && !out)) return CO_ERR_BAD_ARGUMENT;
    unsigned char *b = (unsigned char *)state;
    int32_t left;
    uint64_t next;
    memcpy(&left, b + 8, sizeof left);
    memcpy(&next, b + 16, sizeof next);
    /* torch keeps left + next == 625 once running (left 1, next 0 right after seeding) */
    if (left < 1 || left > CO_MT_N || next > CO_MT_N || (next > 0 && left + (int64_t)next != CO_MT_N + 1))
        return CO_ERR_BAD_ARGUMENT;
    uint32_t s[CO_MT_N];
    for (int i = 0; i < CO_MT_N; ++i) {
        uint64_t w;
        memcpy(&w, b + CO_MT_STATE_OFFSET + 8 * (size_t)i, sizeof w);
        s[i] = (uint32_t)w;
    }
    /* the words not yet handed out are s[next .. 623] (left - 1 of them); then a regeneration */
    int pos = (int)next, avail = left - 1;
    uint32_t buf[CO_MT_N];
    const uint64_t mask53 = (UINT64_C(1) << 53) - 1;
    int have_hi = 0;
    uint32_t hi = 0;
    uint32_t scale_bits;
    memcpy(&scale_bits, &scale, sizeof scale_bits);
    uint32_t *o = (uint32_t *)out; /* branch-free: kept -> scale's bits, dropped -> +0.0f */
    int64_t i = 0;
    while (i < n) {
        if (avail == 0) {
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
            KFN(co_mt_regen8)(s);
#else
            co_mt_regen(s);
#endif
            pos = 0;
            avail = CO_MT_N;
        }
        /* temper the words this round uses, then pair them up */
        int take = avail;
        int64_t want = 2 * (n - i) - have_hi;
        if (want < take) take = (int)want;
        int t0 = 0;
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
        for (; t0 + 8 <= take; t0 += 8)
            _mm256_storeu_si256((__m256i *)(buf + t0),
                                KFN(co_mt_temper8)(_mm256_loadu_si256((const __m256i *)(s + pos + t0))));
#endif
        for (int j = t0; j < take; ++j) buf[j] = co_mt_temper(s[pos + j]);
        int j = 0;
        if (have_hi && take > 0) {
            uint64_t v = (((uint64_t)hi << 32) | buf[0]) & mask53;
            o[i++] = scale_bits & (0u - (uint32_t)(v < keep_below));
            have_hi = 0;
            j = 1;
        }
#if defined(CO_VARIANT_AVX2) || defined(CO_VARIANT_AVX512)
        {   /* 4 draws at a time: word pairs (hi, lo) as 64-bit lanes, compared with keep_below */
            const __m256i m53 = _mm256_set1_epi64x((long long)mask53), kb = _mm256_set1_epi64x((long long)keep_below);
            const __m256i lows = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
            const __m128i sb = _mm_set1_epi32((int)scale_bits);
            for (; j + 8 <= take; j += 8) {
                __m256i w = _mm256_loadu_si256((const __m256i *)(buf + j));
                __m256i v = _mm256_and_si256(_mm256_shuffle_epi32(w, 0xB1), m53); /* hi << 32 | lo */
                __m256i keep = _mm256_cmpgt_epi64(kb, v);  /* v < keep_below, both below 2^63 */
                __m128i k4 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(keep, lows));
                _mm_storeu_si128((__m128i *)(o + i), _mm_and_si128(k4, sb));
                i += 4;
            }
        }
#endif
        for (; j + 1 < take; j += 2) {
            uint64_t v = (((uint64_t)buf[j] << 32) | buf[j + 1]) & mask53;
            o[i++] = scale_bits & (0u - (uint32_t)(v < keep_below));
        }
        if (j < take) { /* an element's first word at the end of the block */
            hi = buf[j];
            have_hi = 1;
        }
        pos += take;
        avail -= take;
    }
    /* write the state back: left/next as torch's operator() leaves them */
    int32_t new_left = avail + 1;
    uint64_t new_next = (uint64_t)pos;
    if (n == 0) return CO_OK;
    memcpy(b + 8, &new_left, sizeof new_left);
    memcpy(b + 16, &new_next, sizeof new_next);
    for (int k = 0; k < CO_MT_N; ++k) {
        uint64_t w = s[k];
        memcpy(b + CO_MT_STATE_OFFSET + 8 * (size_t)k, &w, sizeof w);
    }
    return CO_OK;
}
