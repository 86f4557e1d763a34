/* Template of neighbor_sample (see sample.c). Parameters: CO_TT (the time type), CO_TSUF. */

int64_t KFN(CO_N2(neighbor_sample, CO_TSUF))(
    const int64_t *rowptr, int64_t n_nodes, const int64_t *col, int64_t nnz, const int64_t *seeds,
    int64_t n_seeds, const int64_t *fanouts, int64_t n_hops, int replace, int directed, int disjoint,
    const CO_TT *node_time, const CO_TT *edge_time, const CO_TT *seed_time, int strategy, uint64_t rng_seed,
    int64_t **out_node, int64_t **out_batch, int64_t **out_row, int64_t **out_col, int64_t **out_edge,
    int64_t *out_counts, int64_t *nodes_per_hop, int64_t *edges_per_hop, int nthreads, int64_t *bad_pos)
{
    if (!out_node || !out_batch || !out_row || !out_col || !out_edge) return CO_ERR_BAD_ARGUMENT;
    *out_node = *out_batch = *out_row = *out_col = *out_edge = NULL;
    if (!rowptr || n_nodes < 0 || nnz < 0 || (nnz > 0 && !col) || n_seeds < 0 || (n_seeds > 0 && !seeds) ||
        n_hops < 0 || (n_hops > 0 && (!fanouts || !edges_per_hop)) || !out_counts || !nodes_per_hop ||
        nthreads < 1 || strategy < 0 || strategy > 1)
        return CO_ERR_BAD_ARGUMENT;
    const int temporal = node_time != NULL || edge_time != NULL;
    if ((temporal && !disjoint) || (edge_time && !seed_time && n_seeds > 0)) return CO_ERR_BAD_ARGUMENT;
    for (int64_t h = 0; h < n_hops; ++h)
        if (fanouts[h] < -1) { if (bad_pos) *bad_pos = h; return CO_ERR_BAD_ARGUMENT; }
    if (disjoint && n_nodes > 0 && n_seeds > INT64_MAX / n_nodes) return CO_ERR_BAD_ARGUMENT;
    if (rowptr[0] != 0) { if (bad_pos) *bad_pos = 0; return CO_ERR_UNSORTED; }
    if (rowptr[n_nodes] != nnz) { if (bad_pos) *bad_pos = n_nodes; return CO_ERR_UNSORTED; }

    int64_t status = CO_OK, bad = -1;
    int64_t *node = NULL, *batch = NULL, *erow = NULL, *ecol = NULL, *eedge = NULL;
    int64_t ncap = 0, bcap = 0, ecap_r = 0, ecap_c = 0, ecap_e = 0;
    CO_TT *tseed = NULL;
    int64_t *off = NULL, *cnt = NULL, *pos = NULL;
    KFN(smap) map = {NULL, 0};
    int64_t N = 0, E = 0;
#define CO_FAIL(st_, bad_) do { status = (st_); bad = (bad_); goto done; } while (0)
#define CO_NEED(p_, cap_, n_) do { \
        if (KFN(sample_grow)((void **)&(p_), &(cap_), (n_), sizeof(*(p_)))) CO_FAIL(CO_ERR_NO_MEMORY, -1); \
    } while (0)

    /* ---- the seeds: local ids 0 .. n_seeds - 1 */
    CO_NEED(node, ncap, n_seeds + 1);
    if (disjoint) CO_NEED(batch, bcap, n_seeds + 1);
    if (KFN(smap_reserve)(&map, n_seeds)) CO_FAIL(CO_ERR_NO_MEMORY, -1);
    if (temporal && n_seeds > 0) {
        tseed = (CO_TT *)malloc((size_t)n_seeds * sizeof(CO_TT));
        if (!tseed) CO_FAIL(CO_ERR_NO_MEMORY, -1);
    }
    for (int64_t i = 0; i < n_seeds; ++i) {
        const int64_t v = seeds[i];
        if (v < 0 || v >= n_nodes) CO_FAIL(CO_ERR_INDEX_OUT_OF_RANGE, i);
        int ins;
        KFN(smap_insert)(&map, disjoint ? i * n_nodes + v : v, i, &ins);
        if (!ins) CO_FAIL(CO_ERR_DUPLICATE, i);
        node[i] = v;
        if (disjoint) batch[i] = i;
        if (temporal) tseed[i] = seed_time ? seed_time[i] : node_time[v];
    }
    N = n_seeds;
    nodes_per_hop[0] = n_seeds;

    /* a neighbour (nonzero e, node w) is valid for subgraph b when its times are <= the seed's */
#define CO_VALID(e_, w_, b_) ((!edge_time || edge_time[(e_)] <= tseed[(b_)]) && \
                              (!node_time || node_time[(w_)] <= tseed[(b_)]))

    int64_t begin = 0, end = N;
    for (int64_t h = 0; h < n_hops; ++h) {
        const int64_t k = fanouts[h], F = end - begin;
        off = (int64_t *)malloc((size_t)(F + 1) * sizeof(int64_t));
        cnt = (int64_t *)malloc((size_t)(F > 0 ? F : 1) * sizeof(int64_t));
        if (!off || !cnt) CO_FAIL(CO_ERR_NO_MEMORY, -1);
        /* 1. rows checked, draws bounded */
        int64_t bad_row = INT64_MAX;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(min:bad_row) if (nthreads > 1 && F > 4096)
        for (int64_t j = 0; j < F; ++j) {
            if (j + CO_SAMPLE_PF < F) __builtin_prefetch(rowptr + node[begin + j + CO_SAMPLE_PF]);
            const int64_t v = node[begin + j];
            const int64_t lo = rowptr[v], hi = rowptr[v + 1];
            int64_t c = 0;
            if (lo < 0 || hi < lo || hi > nnz) {
                if (v < bad_row) bad_row = v;
            } else {
                const int64_t d = hi - lo;
                c = k < 0 ? d : replace ? (d > 0 ? k : 0) : (d < k ? d : k);
            }
            off[j + 1] = c;
        }
        if (bad_row != INT64_MAX) CO_FAIL(CO_ERR_UNSORTED, bad_row);
        off[0] = 0;
        for (int64_t j = 0; j < F; ++j) off[j + 1] += off[j];
        const int64_t T = off[F];
        /* pos: the drawn nonzeros; nbr: their col entries (read once here, so the relabelling
         * below streams through them and can prefetch its hash slots) */
        pos = (int64_t *)malloc((size_t)(T > 0 ? 2 * T : 1) * sizeof(int64_t));
        if (!pos) CO_FAIL(CO_ERR_NO_MEMORY, -1);
        int64_t *const nbr = pos + T;

        /* 2. the draws, each node from its own stream */
        int64_t bad_e = INT64_MAX;
        int oom = 0;
#pragma omp parallel num_threads(nthreads) reduction(min:bad_e) reduction(|:oom) if (nthreads > 1 && T > 4096)
        {
            int64_t *scratch = NULL, scap = 0;
#pragma omp for schedule(dynamic, 64)
            for (int64_t j = 0; j < F; ++j) {
                const int64_t i = begin + j, v = node[i];
                if (j + CO_SAMPLE_PF < F) { /* the next rows' first neighbours */
                    const int64_t vn = node[i + CO_SAMPLE_PF];
                    __builtin_prefetch(col + rowptr[vn]);
                }
                const int64_t lo = rowptr[v], d = rowptr[v + 1] - lo;
                const int64_t sub = disjoint ? batch[i] : 0;
                int64_t *dst = pos + off[j];
                int64_t c = 0;
                cnt[j] = 0;
#define CO_SKIP_NODE() do { for (int64_t q_ = 0; q_ < off[j + 1] - off[j]; ++q_) dst[q_] = -1; } while (0)
                if (off[j + 1] == off[j]) continue;
                if (oom) { CO_SKIP_NODE(); continue; }
                uint64_t s = KFN(sm_key)(rng_seed, h, v, sub);
                if (!temporal) {
                    if (k < 0 || (!replace && k >= d)) {
                        for (int64_t e = lo; e < lo + d; ++e) dst[c++] = e;
                    } else if (replace) {
                        for (int64_t q = 0; q < k; ++q) dst[c++] = lo + (int64_t)KFN(sm_below)(&s, (uint64_t)d);
                    } else {
                        int64_t *sc = NULL;
                        if (!KFN(sample_use_floyd)(k, d)) {
                            if (KFN(sample_grow)((void **)&scratch, &scap, d, sizeof(int64_t))) { oom = 1; CO_SKIP_NODE(); continue; }
                            sc = scratch;
                        }
                        c = KFN(sample_distinct)(&s, lo, d, k, dst, sc);
                    }
                } else {
                    /* the valid neighbours, in CSR order */
                    if (KFN(sample_grow)((void **)&scratch, &scap, d > 0 ? d : 1, sizeof(int64_t))) { oom = 1; CO_SKIP_NODE(); continue; }
                    int64_t nv = 0;
                    for (int64_t e = lo; e < lo + d; ++e) {
                        const int64_t w = col[e];
                        if (w < 0 || w >= n_nodes) { if (e < bad_e) bad_e = e; continue; }
                        if (CO_VALID(e, w, sub)) scratch[nv++] = e;
                    }
                    if (strategy == 1) { /* last: the latest k valid neighbours */
                        const int64_t take = (k < 0 || k > nv) ? nv : k;
                        for (int64_t q = nv - take; q < nv; ++q) dst[c++] = scratch[q];
                    } else if (k < 0 || (!replace && k >= nv)) {
                        for (int64_t q = 0; q < nv; ++q) dst[c++] = scratch[q];
                    } else if (replace) {
                        if (nv > 0)
                            for (int64_t q = 0; q < k; ++q) dst[c++] = scratch[KFN(sm_below)(&s, (uint64_t)nv)];
                    } else { /* partial Fisher-Yates over the valid list itself */
                        for (int64_t q = 0; q < k; ++q) {
                            const int64_t r = q + (int64_t)KFN(sm_below)(&s, (uint64_t)(nv - q));
                            const int64_t t = scratch[q];
                            scratch[q] = scratch[r];
                            scratch[r] = t;
                            dst[c++] = scratch[q];
                        }
                    }
                }
                for (int64_t q = 0; q < c; ++q) __builtin_prefetch(col + dst[q]); /* read in the pass below */
                for (int64_t q = c; q < off[j + 1] - off[j]; ++q) dst[q] = -1; /* unused (temporal) */
                cnt[j] = c;
            }
#undef CO_SKIP_NODE
            free(scratch);
            /* the drawn neighbours' ids, checked, in one streaming pass (prefetching ahead) */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < T; ++p) {
                if (p + CO_SAMPLE_PF < T && pos[p + CO_SAMPLE_PF] >= 0) __builtin_prefetch(col + pos[p + CO_SAMPLE_PF]);
                const int64_t e = pos[p];
                if (e < 0) { nbr[p] = 0; continue; }
                const int64_t w = col[e];
                if ((w < 0 || w >= n_nodes) && e < bad_e) bad_e = e;
                nbr[p] = w;
            }
        }
        if (oom) CO_FAIL(CO_ERR_NO_MEMORY, -1);
        if (bad_e != INT64_MAX) CO_FAIL(CO_ERR_INDEX_OUT_OF_RANGE, -2 - bad_e);

        /* 3. relabel, in frontier order */
        CO_NEED(node, ncap, N + T + 1);
        if (disjoint) CO_NEED(batch, bcap, N + T + 1);
        if (directed) {
            CO_NEED(erow, ecap_r, E + T + 1);
            CO_NEED(ecol, ecap_c, E + T + 1);
            CO_NEED(eedge, ecap_e, E + T + 1);
        }
        if (KFN(smap_reserve)(&map, N + T)) CO_FAIL(CO_ERR_NO_MEMORY, -1);
        const int64_t E0 = E;
        for (int64_t j = 0; j < F; ++j) {
            const int64_t i = begin + j, sub = disjoint ? batch[i] : 0;
            const int64_t *src = pos + off[j], *nb = nbr + off[j];
            for (int64_t q = 0; q < cnt[j]; ++q) {
                const int64_t e = src[q], w = nb[q];
                const int64_t ahead = off[j] + q + CO_SAMPLE_PF;
                if (ahead < T) {
                    const int64_t wa = nbr[ahead];
                    const int64_t ka = disjoint ? sub * n_nodes + wa : wa; /* a hint: the next node may be another subgraph */
                    __builtin_prefetch(map.slot + 2 * (int64_t)(KFN(smap_hash)(ka) & (uint64_t)map.mask));
                }
                int ins;
                const int64_t local = KFN(smap_insert)(&map, disjoint ? sub * n_nodes + w : w, N, &ins);
                if (ins) {
                    node[N] = w;
                    if (disjoint) batch[N] = sub;
                    ++N;
                }
                if (directed) {
                    erow[E] = i;
                    ecol[E] = local;
                    eedge[E] = e;
                    ++E;
                }
            }
        }
        nodes_per_hop[h + 1] = N - end;
        edges_per_hop[h] = E - E0;
        free(off); free(cnt); free(pos);
        off = cnt = pos = NULL;
        begin = end;
        end = N;
    }

    if (!directed && N > 0) {
        /* the induced subgraph: every edge of the graph between two sampled nodes (of one
         * subgraph), grouped by row; count, prefix sum, fill -- the map is only read */
        off = (int64_t *)malloc((size_t)(N + 1) * sizeof(int64_t));
        if (!off) CO_FAIL(CO_ERR_NO_MEMORY, -1);
        int64_t bad_row = INT64_MAX, bad_e = INT64_MAX;
#pragma omp parallel for schedule(dynamic, 256) num_threads(nthreads) reduction(min:bad_row, bad_e) if (nthreads > 1 && N > 1024)
        for (int64_t i = 0; i < N; ++i) {
            const int64_t v = node[i], lo = rowptr[v], hi = rowptr[v + 1];
            const int64_t sub = disjoint ? batch[i] : 0;
            int64_t c = 0;
            if (lo < 0 || hi < lo || hi > nnz) {
                if (v < bad_row) bad_row = v;
            } else {
                for (int64_t e = lo; e < hi; ++e) {
                    const int64_t w = col[e];
                    if (w < 0 || w >= n_nodes) { if (e < bad_e) bad_e = e; continue; }
                    if ((!temporal || CO_VALID(e, w, sub)) &&
                        KFN(smap_find)(&map, disjoint ? sub * n_nodes + w : w) >= 0)
                        ++c;
                }
            }
            off[i + 1] = c;
        }
        if (bad_row != INT64_MAX) CO_FAIL(CO_ERR_UNSORTED, bad_row);
        if (bad_e != INT64_MAX) CO_FAIL(CO_ERR_INDEX_OUT_OF_RANGE, -2 - bad_e);
        off[0] = 0;
        for (int64_t i = 0; i < N; ++i) off[i + 1] += off[i];
        E = off[N];
        CO_NEED(erow, ecap_r, E + 1);
        CO_NEED(ecol, ecap_c, E + 1);
        CO_NEED(eedge, ecap_e, E + 1);
#pragma omp parallel for schedule(dynamic, 256) num_threads(nthreads) if (nthreads > 1 && N > 1024)
        for (int64_t i = 0; i < N; ++i) {
            const int64_t v = node[i], sub = disjoint ? batch[i] : 0;
            int64_t p = off[i];
            for (int64_t e = rowptr[v]; e < rowptr[v + 1]; ++e) {
                const int64_t w = col[e];
                if (temporal && !CO_VALID(e, w, sub)) continue;
                const int64_t local = KFN(smap_find)(&map, disjoint ? sub * n_nodes + w : w);
                if (local < 0) continue;
                erow[p] = i;
                ecol[p] = local;
                eedge[p] = e;
                ++p;
            }
        }
        free(off);
        off = NULL;
        for (int64_t h = 0; h < n_hops; ++h) edges_per_hop[h] = 0;
    }
#undef CO_VALID

    out_counts[0] = N;
    out_counts[1] = E;
    *out_node = node;
    *out_batch = batch;
    *out_row = erow;
    *out_col = ecol;
    *out_edge = eedge;
    node = batch = erow = ecol = eedge = NULL;
done:
    if (status != CO_OK && bad_pos) *bad_pos = bad;
    free(node); free(batch); free(erow); free(ecol); free(eedge);
    free(tseed); free(off); free(cnt); free(pos); free(map.slot);
    return status;
#undef CO_FAIL
#undef CO_NEED
}
