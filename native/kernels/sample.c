/* Uniform k-hop neighbour sampling over CSR (see api.h, "neighbour sampling"): what PyG's
 * NeighborLoader asks of pyg-lib's neighbor_sample, for homogeneous graphs.
 *
 * Per hop, three passes over the frontier (the nodes found at the previous hop):
 *   1. (parallel) each frontier node's row is checked and its number of draws bounded
 *      (min(fanout, degree), fanout with replacement, the degree for -1); a prefix sum gives
 *      every node its own slice of the hop's draw buffer;
 *   2. (parallel, dynamic schedule: degrees are power-law) each node draws its neighbours into its
 *      slice from a splitmix64 stream keyed by (rng_seed, hop, node, subgraph) -- so the draws do
 *      not depend on which thread runs the node or how many threads there are;
 *   3. (serial, in frontier order) the draws are relabelled through an open-addressing hash map
 *      (global id, or subgraph * n_nodes + global id when disjoint -> local id): first seen, next
 *      local id. Serial, hence the same output whatever the thread count.
 * Without replacement a node draws a uniform k-subset of its (valid) neighbours: Floyd's
 * algorithm for small k (no buffer), a partial Fisher-Yates shuffle otherwise. Bounded integers
 * are Lemire's multiply-shift with rejection (exactly uniform).
 * Every index is checked before it is used to address memory: rows (rowptr[v] .. rowptr[v + 1]
 * inside [0, nnz]) as they are expanded, col entries as they are drawn. */

#ifndef CO_SAMPLE_ONCE
#define CO_SAMPLE_ONCE
#define CO_SAMPLE_FLOYD_MAX 16 /* Floyd's algorithm up to this many draws (or k * k <= 2 * degree) */
#define CO_SAMPLE_PF 16        /* how many nodes / draws ahead the passes prefetch (the graph is random access) */
#endif

static inline uint64_t KFN(sm_mix)(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static inline uint64_t KFN(sm_next)(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ULL;
    return KFN(sm_mix)(*s);
}

/* uniform in [0, range), range >= 1 (Lemire 2019, with rejection: exact) */
static inline uint64_t KFN(sm_below)(uint64_t *s, uint64_t range)
{
    uint64_t x = KFN(sm_next)(s);
    __uint128_t m = (__uint128_t)x * range;
    uint64_t l = (uint64_t)m;
    if (l < range) {
        const uint64_t t = (0 - range) % range;
        while (l < t) {
            x = KFN(sm_next)(s);
            m = (__uint128_t)x * range;
            l = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

/* the stream of one node's draws at one hop */
static inline uint64_t KFN(sm_key)(uint64_t seed, int64_t hop, int64_t node, int64_t sub)
{
    uint64_t s = KFN(sm_mix)(seed ^ (0x632be59bd9b4e019ULL * (uint64_t)(hop + 1)));
    s = KFN(sm_mix)(s ^ (uint64_t)node);
    return KFN(sm_mix)(s ^ (0xd6e8feb86659fd93ULL * (uint64_t)(sub + 1)));
}

/* ---- open-addressing hash map int64 key (>= 0) -> int64 value, linear probing ---- */
typedef struct {
    int64_t *slot; /* pairs (key, value); key -1: empty */
    int64_t mask;  /* capacity - 1, capacity a power of two */
} KFN(smap);

static inline uint64_t KFN(smap_hash)(int64_t key)
{
    return KFN(sm_mix)((uint64_t)key + 0x9e3779b97f4a7c15ULL);
}

/* capacity for at least `want` keys at load <= 1/2, rehashing what is there; 0 or -1 (no memory) */
static int KFN(smap_reserve)(KFN(smap) *m, int64_t want)
{
    int64_t cap = 16;
    while (cap < 2 * want) cap *= 2;
    if (m->slot && cap <= m->mask + 1) return 0;
    int64_t *slot = (int64_t *)malloc((size_t)cap * 2 * sizeof(int64_t));
    if (!slot) return -1;
    memset(slot, 0xff, (size_t)cap * 2 * sizeof(int64_t)); /* every key -1: empty */
    if (m->slot) {
        for (int64_t i = 0; i <= m->mask; ++i) {
            const int64_t key = m->slot[2 * i];
            if (key < 0) continue;
            uint64_t h = KFN(smap_hash)(key) & (uint64_t)(cap - 1);
            while (slot[2 * h] >= 0) h = (h + 1) & (uint64_t)(cap - 1);
            slot[2 * h] = key;
            slot[2 * h + 1] = m->slot[2 * i + 1];
        }
        free(m->slot);
    }
    m->slot = slot;
    m->mask = cap - 1;
    return 0;
}

/* the value of key, inserting `value` when absent (*inserted = 1); room must have been reserved */
static inline int64_t KFN(smap_insert)(KFN(smap) *m, int64_t key, int64_t value, int *inserted)
{
    uint64_t h = KFN(smap_hash)(key) & (uint64_t)m->mask;
    for (;;) {
        const int64_t k = m->slot[2 * h];
        if (k == key) { *inserted = 0; return m->slot[2 * h + 1]; }
        if (k < 0) {
            m->slot[2 * h] = key;
            m->slot[2 * h + 1] = value;
            *inserted = 1;
            return value;
        }
        h = (h + 1) & (uint64_t)m->mask;
    }
}

static inline int64_t KFN(smap_find)(const KFN(smap) *m, int64_t key)
{
    uint64_t h = KFN(smap_hash)(key) & (uint64_t)m->mask;
    for (;;) {
        const int64_t k = m->slot[2 * h];
        if (k == key) return m->slot[2 * h + 1];
        if (k < 0) return -1;
        h = (h + 1) & (uint64_t)m->mask;
    }
}

/* grow *p (elements of `elem` bytes) to hold `need`; 0 or -1 (no memory) */
static int KFN(sample_grow)(void **p, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap && *p) return 0;
    int64_t c = *cap > 0 ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * elem);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* k distinct uniform draws from [0, d) (k < d) into dst as lo + draw; scratch holds d entries when
 * the shuffle is used (NULL: Floyd's algorithm only). Returns k. */
static inline int64_t KFN(sample_distinct)(uint64_t *s, int64_t lo, int64_t d, int64_t k, int64_t *dst,
                                           int64_t *scratch)
{
    if (!scratch) { /* Floyd: for r = d-k .. d-1 draw x in [0, r]; take x unless taken, else r */
        int64_t c = 0;
        for (int64_t r = d - k; r < d; ++r) {
            const int64_t x = lo + (int64_t)KFN(sm_below)(s, (uint64_t)r + 1);
            int taken = 0;
            for (int64_t q = 0; q < c; ++q) taken |= dst[q] == x;
            dst[c++] = taken ? lo + r : x;
        }
        return c;
    }
    for (int64_t q = 0; q < d; ++q) scratch[q] = q;
    for (int64_t q = 0; q < k; ++q) {
        const int64_t r = q + (int64_t)KFN(sm_below)(s, (uint64_t)(d - q));
        const int64_t t = scratch[q];
        scratch[q] = scratch[r];
        scratch[r] = t;
        dst[q] = lo + scratch[q];
    }
    return k;
}

static inline int KFN(sample_use_floyd)(int64_t k, int64_t d)
{
    return k <= CO_SAMPLE_FLOYD_MAX || (double)k * (double)k <= 2.0 * (double)d;
}

#define CO_TT int64_t
#define CO_TSUF i64
#include "sample_tmpl.h"
#undef CO_TT
#undef CO_TSUF
#define CO_TT double
#define CO_TSUF f64
#include "sample_tmpl.h"
#undef CO_TT
#undef CO_TSUF
