/* Both ends of a layer call through a shared-memory mailbox (transport/mailbox.py), in C.
 *
 * Measured on a 2-core host (docs/design.md, "One layer call"): with a rank and its FfnAgent on
 * one CPU and attention work between calls, the Python versions of these loops cost ~110 us per
 * call against a 10 us round trip when nothing else runs: after each layer's compute the
 * interpreter's state is out of the caches. Here a call is a few hundred instructions. The
 * layout (word indices, offsets) is mailbox.py's: it is passed in when a channel is built.
 *
 * RankChannel: an Instance rank's end. call() copies the rows in, publishes the call, rings the
 * doorbells of the layer's FfnAgents, waits for every shard's reply (the GIL released) and copies
 * the result out (shards added in shard order in fp32, rounded once). It returns a status code;
 * the Python caller turns a failure into its typed error.
 *
 * AgentChannel: an FfnAgent's end. next_call() waits on the doorbell (the GIL released) and
 * claims the oldest published call among its mailboxes; reply() answers it. Calls between lanes
 * are serialised by the GIL: claim and reply never release it.
 *
 * x86-64 (TSO): stores are not reordered with other stores, loads not with other loads; release
 * stores and acquire loads keep the compiler from reordering payload and sequence words.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <semaphore.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum {
    OK = 0, FENCED = 1, PEER_EXITED = 2, TIMEOUT = 3, AGENT_ERROR = 4, DISAGREE = 5, SIGNALLED = 6, ROWS_DIFFER = 7,
    ROWS_UNOWNED = 8
};
#define RECEIVE_ONLY 0x80000000u /* in a local-row index: a row this rank gets back but another rank sends */
enum { MAX_SHARDS = 8, MAX_TP = 4, MAX_AGENTS = 64, N_BUCKETS = 15, PROBE_LAYER_ID = -1 };

typedef struct {
    /* word indices (u32) */
    Py_ssize_t req_seq, layer, rows, submit_lo, submit_hi, digest_lo, digest_hi, row_verdict, fence, resp_seq, status, ack,
        stride;
    /* byte offsets */
    Py_ssize_t reply_sems, ack_sems, sem_size, max_tp, reader_stats, reader_words, data;
    /* u64 indices within a reader's counters (mailbox), and within an agent's (inbox) */
    Py_ssize_t r_calls, r_call_ns, r_buckets, c_executed, c_execute_ns, c_queue_ns, c_claimed;
    uint32_t probe_layer, status_ok;
} Layout;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint32_t load(volatile uint32_t *w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
static inline void store(volatile uint32_t *w, uint32_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

static int parse_layout(PyObject *d, Layout *l) {
#define FIELD(name)                                                      \
    do {                                                                 \
        PyObject *v = PyDict_GetItemString(d, #name);                    \
        if (v == NULL) {                                                 \
            PyErr_SetString(PyExc_KeyError, "layout lacks " #name);      \
            return -1;                                                   \
        }                                                                \
        l->name = PyLong_AsSsize_t(v);                                   \
        if (l->name == -1 && PyErr_Occurred()) return -1;                \
    } while (0)
    FIELD(req_seq); FIELD(layer); FIELD(rows); FIELD(submit_lo); FIELD(submit_hi); FIELD(digest_lo); FIELD(digest_hi);
    FIELD(row_verdict); FIELD(fence);
    FIELD(resp_seq); FIELD(status); FIELD(ack); FIELD(stride);
    FIELD(reply_sems); FIELD(ack_sems); FIELD(sem_size); FIELD(max_tp); FIELD(reader_stats);
    FIELD(reader_words); FIELD(data); FIELD(r_calls); FIELD(r_call_ns); FIELD(r_buckets);
#undef FIELD
    l->c_executed = l->c_execute_ns = l->c_queue_ns = l->c_claimed = -1;
    PyObject *c[4] = {PyDict_GetItemString(d, "c_executed"), PyDict_GetItemString(d, "c_execute_ns"),
                      PyDict_GetItemString(d, "c_queue_ns"), PyDict_GetItemString(d, "c_claimed")};
    if (c[0] && c[1] && c[2] && c[3]) { /* an agent's end counts in its inbox */
        l->c_executed = PyLong_AsSsize_t(c[0]);
        l->c_execute_ns = PyLong_AsSsize_t(c[1]);
        l->c_queue_ns = PyLong_AsSsize_t(c[2]);
        l->c_claimed = PyLong_AsSsize_t(c[3]);
    }
    PyObject *v = PyDict_GetItemString(d, "probe_layer");
    PyObject *s = PyDict_GetItemString(d, "status_ok");
    if (v == NULL || s == NULL) {
        PyErr_SetString(PyExc_KeyError, "layout lacks probe_layer or status_ok");
        return -1;
    }
    l->probe_layer = (uint32_t)PyLong_AsUnsignedLong(v);
    l->status_ok = (uint32_t)PyLong_AsUnsignedLong(s);
    return PyErr_Occurred() ? -1 : 0;
}

/* bf16 <-> fp32 as torch converts them (c10::BFloat16: round to nearest even, NaN kept quiet). */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    Layout l;
    char *base;
    volatile uint32_t *w;
    uint64_t *stats; /* this reader's counters */
    int reader, readers, bf16;
    Py_ssize_t row_bytes, plane_bytes, hidden, max_rows;
    Py_ssize_t index_offset; /* local-row mailbox: where the readers' row indices are (0: replicated rows) */
    uint8_t *sent;           /* local rows: which invocation rows the layout check has seen sent */
    int n_layers;
    int *group_len;          /* per layer */
    int (*groups)[MAX_SHARDS]; /* per layer: agent indices, shard order */
    int n_agents;
    sem_t *doorbell[MAX_AGENTS];
    int pidfd[MAX_AGENTS];
    uint64_t bound_ns, spin_ns, slice_ns;
    uint32_t seq;
    uint64_t buckets_ns[N_BUCKETS];
    int failed_index;
} RankChannel;

static sem_t *reply_sem(RankChannel *r, int shard) {
    return (sem_t *)(r->base + r->l.reply_sems + (shard * r->l.max_tp + r->reader) * r->l.sem_size);
}
static sem_t *ack_sem(Layout *l, char *base, int follower) {
    return (sem_t *)(base + l->ack_sems + (follower - 1) * l->sem_size);
}

/* Until word `word` reads `target`. The GIL is released while blocked; between slices the fence,
 * the peers of `group` and the bound are looked at, and Python's signal handlers run. */
static int rank_wait(RankChannel *r, sem_t *sem, Py_ssize_t word, uint32_t target, int layer, uint64_t start,
                     int fail_index) {
    volatile uint32_t *w = r->w;
    if (load(&w[word]) == target) return OK;
    if (r->spin_ns) {
        int seen = 0;
        Py_BEGIN_ALLOW_THREADS
        uint64_t end = now_ns() + r->spin_ns;
        while (!(seen = load(&w[word]) == target) && now_ns() < end) sched_yield();
        Py_END_ALLOW_THREADS
        if (seen) return OK;
    }
    for (;;) {
        int woken;
        Py_BEGIN_ALLOW_THREADS
        struct timespec at;
        clock_gettime(CLOCK_MONOTONIC, &at);
        uint64_t ns = (uint64_t)at.tv_nsec + r->slice_ns;
        at.tv_sec += (time_t)(ns / 1000000000ull);
        at.tv_nsec = (long)(ns % 1000000000ull);
        woken = sem_clockwait(sem, CLOCK_MONOTONIC, &at) == 0;
        Py_END_ALLOW_THREADS
        if (load(&w[word]) == target) return OK;
        if (load(&w[r->l.fence])) return FENCED;
        if (woken) continue; /* a count left by an earlier reply */
        int n = (layer == PROBE_LAYER_ID) ? 1 : r->group_len[layer];
        int *group = (layer == PROBE_LAYER_ID) ? r->groups[0] : r->groups[layer];
        for (int i = 0; i < n; i++) {
            struct pollfd p = {.fd = r->pidfd[group[i]], .events = POLLIN};
            if (p.fd < 0 || poll(&p, 1, 0) > 0) {
                r->failed_index = group[i];
                return PEER_EXITED;
            }
        }
        if (now_ns() - start > r->bound_ns) {
            r->failed_index = fail_index;
            return TIMEOUT;
        }
        if (PyErr_CheckSignals() < 0) return SIGNALLED;
    }
}

/* A 64-bit digest of a call's rows. Every reader of a mailbox hands the pool the same rows (the
 * replicated-row layout: attention TP ranks hold identical hidden states); the leader publishes the
 * digest of its rows with the call and a follower checks its own against it, so a follower whose
 * rows differ fails instead of taking the leader's result. Four lanes keep it near memory speed. */
static uint64_t rows_digest(const char *p, size_t n) {
    const uint64_t k = 0x9E3779B97F4A7C15ull;
    uint64_t h[4] = {1, 2, 3, 4};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++) {
            uint64_t v;
            memcpy(&v, p + i + 8 * j, 8);
            h[j] = (h[j] ^ v) * k;
            h[j] ^= h[j] >> 29;
        }
    for (; i < n; i++) h[0] = (h[0] ^ (unsigned char)p[i]) * k;
    uint64_t d = n;
    for (int j = 0; j < 4; j++) d = (d ^ h[j]) * k, d ^= d >> 31;
    return d;
}

static uint32_t *index_slot(RankChannel *r, int reader) {
    return (uint32_t *)(r->base + r->index_offset + (Py_ssize_t)reader * (r->max_rows + 1) * 4);
}

/* Local rows: whether the rows the readers send cover the invocation's `total` rows once each,
 * and every row a reader gets back is one of them. The leader checks once every reader has
 * written its index and rows, before it publishes: no reader touches its slot again before the
 * call is answered. */
static int rows_owned(RankChannel *r, uint32_t total) {
    memset(r->sent, 0, total);
    uint32_t sent = 0;
    for (int q = 0; q < r->readers; q++) {
        const uint32_t *slot = index_slot(r, q);
        if (slot[0] > r->max_rows) return 0;
        for (uint32_t i = 0; i < slot[0]; i++) {
            uint32_t row = slot[1 + i] & ~RECEIVE_ONLY;
            if (row >= total) return 0;
            if (slot[1 + i] & RECEIVE_ONLY) continue;
            if (r->sent[row]) return 0;
            r->sent[row] = 1;
            sent++;
        }
    }
    return sent == total;
}

/* `count` rows of the answer from plane row `from` to `out`: plane 0 as it is, or the `n` shards'
 * partial sums added in shard order in fp32 and rounded once. */
static void copy_answer(RankChannel *r, int n, Py_ssize_t from, char *out, Py_ssize_t count) {
    const char *plane0 = r->base + r->l.data + r->plane_bytes + from * r->row_bytes;
    if (n == 1) {
        memcpy(out, plane0, (size_t)(count * r->row_bytes));
        return;
    }
    Py_ssize_t elems = count * r->hidden;
    for (Py_ssize_t i = 0; i < elems; i++) {
        float total = 0.0f;
        for (int s = 0; s < n; s++) {
            const char *plane = plane0 + s * r->plane_bytes;
            float v = r->bf16 ? bf16_to_f32(((const uint16_t *)plane)[i]) : ((const float *)plane)[i];
            total = s ? total + v : v;
        }
        if (r->bf16)
            ((uint16_t *)out)[i] = f32_to_bf16(total);
        else
            ((float *)out)[i] = total;
    }
}

/* One call. Replicated rows (`index` NULL): the leader copies all `rows` in and publishes; the
 * followers check theirs against its digest. Local rows: every reader writes its index and the
 * rows it sends into the invocation's `total` rows, then arrives (its ack word := seq); the
 * leader publishes once all arrived, and each reader gets back the rows of its index. */
static int rank_round(RankChannel *r, int layer, const char *in, char *out, uint32_t rows, const uint32_t *index,
                      uint32_t total) {
    volatile uint32_t *w = r->w;
    Layout *l = &r->l;
    uint64_t start = now_ns();
    int probe = layer == PROBE_LAYER_ID;
    int n = probe ? 1 : r->group_len[layer];
    int *group = probe ? r->groups[0] : r->groups[layer];
    uint32_t seq = r->seq + 1;
    uint64_t digest = (r->readers > 1 && !probe && !index) ? rows_digest(in, (size_t)rows * r->row_bytes) : 0;
    if (index) {
        uint32_t *slot = index_slot(r, r->reader);
        slot[0] = rows;
        memcpy(slot + 1, index, (size_t)rows * 4);
        for (uint32_t i = 0; i < rows; i++)
            if (!(index[i] & RECEIVE_ONLY) && index[i] < total)
                memcpy(r->base + l->data + index[i] * r->row_bytes, in + i * r->row_bytes, (size_t)r->row_bytes);
        if (r->reader) {
            store(&w[l->ack + l->stride * (r->reader - 1)], seq);
            sem_post(ack_sem(l, r->base, r->reader));
        }
    }
    if (r->reader == 0) {
        if (load(&w[l->fence])) return FENCED;
        /* replicated: the followers have read the previous call's planes; local: they also wrote this one's rows */
        uint32_t arrived = index ? seq : r->seq;
        for (int f = 1; f < r->readers; f++) {
            int rc = rank_wait(r, ack_sem(l, r->base, f), l->ack + l->stride * (f - 1), arrived, layer, start, -f);
            if (rc) return rc;
        }
        if (index)
            w[l->row_verdict] = rows_owned(r, total) ? OK : ROWS_UNOWNED;
        else if (!probe)
            memcpy(r->base + l->data, in, (size_t)rows * r->row_bytes);
        uint64_t t = now_ns();
        w[l->layer] = probe ? l->probe_layer : (uint32_t)layer;
        w[l->rows] = index ? total : rows;
        w[l->digest_lo] = (uint32_t)digest;
        w[l->digest_hi] = (uint32_t)(digest >> 32);
        w[l->submit_lo] = (uint32_t)t;
        w[l->submit_hi] = (uint32_t)(t >> 32);
        store(&w[l->req_seq], seq);
        for (int i = 0; i < n; i++) sem_post(r->doorbell[group[i]]);
    }
    r->seq = seq;
    for (int s = 0; s < n; s++) {
        int rc = rank_wait(r, reply_sem(r, s), l->resp_seq + l->stride * s, seq, layer, start, s);
        if (rc) return rc;
        if (load(&w[l->status + l->stride * s]) != l->status_ok) {
            r->failed_index = s;
            return AGENT_ERROR;
        }
    }
    if (probe) return OK;
    /* A follower whose call differs from the leader's fails, but still acknowledges: it is done
     * with the planes, and the leader's next call must not wait out the bound for it. */
    int verdict = OK;
    if (r->reader && (w[l->layer] != (uint32_t)layer || w[l->rows] != (index ? total : rows)))
        verdict = DISAGREE;
    else if (index)
        verdict = (int)w[l->row_verdict];
    else if (r->reader && (w[l->digest_lo] != (uint32_t)digest || w[l->digest_hi] != (uint32_t)(digest >> 32)))
        verdict = ROWS_DIFFER;
    if (verdict == OK && index)
        for (uint32_t i = 0; i < rows; i++)
            copy_answer(r, n, index[i] & ~RECEIVE_ONLY, out + i * r->row_bytes, 1);
    else if (verdict == OK)
        copy_answer(r, n, 0, out, rows);
    if (r->reader) {
        store(&w[l->ack + l->stride * (r->reader - 1)], seq);
        sem_post(ack_sem(l, r->base, r->reader));
    }
    if (verdict != OK) return verdict;
    uint64_t elapsed = now_ns() - start;
    int b = 0;
    while (b < N_BUCKETS && elapsed > r->buckets_ns[b]) b++;
    r->stats[l->r_calls] += 1;
    r->stats[l->r_call_ns] += elapsed;
    r->stats[l->r_buckets + b] += 1;
    return OK;
}

static PyObject *RankChannel_call(RankChannel *r, PyObject *args) {
    int layer;
    unsigned long long in, out, index = 0;
    unsigned int rows, total = 0;
    if (!PyArg_ParseTuple(args, "iKKI|KI", &layer, &in, &out, &rows, &index, &total)) return NULL;
    if (layer < 0 || layer >= r->n_layers || rows == 0 || rows > r->max_rows) {
        PyErr_Format(PyExc_ValueError, "layer %d / rows %u out of range", layer, rows);
        return NULL;
    }
    if ((index != 0) != (r->index_offset != 0) || (index && (total == 0 || total > r->max_rows))) {
        PyErr_Format(PyExc_ValueError, "a row index goes with a local-row mailbox and 1..%zd invocation rows",
                     r->max_rows);
        return NULL;
    }
    int rc = rank_round(r, layer, (const char *)(uintptr_t)in, (char *)(uintptr_t)out, rows,
                        (const uint32_t *)(uintptr_t)index, total);
    if (rc == SIGNALLED) return NULL;
    return PyLong_FromLong(rc);
}

static PyObject *RankChannel_probe(RankChannel *r, PyObject *args) {
    unsigned int rows = 1;
    if (!PyArg_ParseTuple(args, "|I", &rows)) return NULL;
    if (r->index_offset) {
        PyErr_SetString(PyExc_ValueError, "a local-row mailbox takes no probe");
        return NULL;
    }
    int rc = rank_round(r, PROBE_LAYER_ID, NULL, NULL, rows, NULL, 0);
    if (rc == SIGNALLED) return NULL;
    return PyLong_FromLong(rc);
}

static int int_list(PyObject *seq, int *out, int max, const char *what) {
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0) return -1;
    if (n > max) {
        PyErr_Format(PyExc_ValueError, "too many %s (%zd > %d)", what, n, max);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        if (item == NULL) return -1;
        out[i] = (int)PyLong_AsLong(item);
        Py_DECREF(item);
        if (PyErr_Occurred()) return -1;
    }
    return (int)n;
}

static int RankChannel_init(RankChannel *r, PyObject *args, PyObject *kw) {
    static char *names[] = {"layout", "base", "reader", "readers", "hidden", "itemsize", "bf16", "max_rows",
                            "groups", "doorbells", "pidfds", "bound_ns", "spin_ns", "slice_ns", "buckets_ns", "index_offset",
                            NULL};
    PyObject *layout, *groups, *doorbells, *pidfds, *buckets;
    unsigned long long base, bound_ns, spin_ns, slice_ns;
    Py_ssize_t hidden, itemsize, max_rows;
    int bf16;
    r->index_offset = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKiinnpnOOOKKKO|n", names, &layout, &base, &r->reader, &r->readers,
                                     &hidden, &itemsize, &bf16, &max_rows, &groups, &doorbells, &pidfds, &bound_ns,
                                     &spin_ns, &slice_ns, &buckets, &r->index_offset))
        return -1;
    if (parse_layout(layout, &r->l) < 0) return -1;
    r->base = (char *)(uintptr_t)base;
    r->w = (volatile uint32_t *)r->base;
    r->stats = (uint64_t *)(r->base + r->l.reader_stats + r->reader * r->l.reader_words * 8);
    r->hidden = hidden;
    r->row_bytes = hidden * itemsize;
    r->plane_bytes = max_rows * r->row_bytes;
    r->max_rows = max_rows;
    r->bf16 = bf16;
    if (r->index_offset && (r->sent = PyMem_Calloc((size_t)max_rows, 1)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    r->bound_ns = bound_ns;
    r->spin_ns = spin_ns;
    r->slice_ns = slice_ns;
    r->seq = r->w[r->l.req_seq];
    int agents_n[MAX_AGENTS];
    long long addr[MAX_AGENTS];
    Py_ssize_t na = PySequence_Size(doorbells);
    if (na < 0 || na > MAX_AGENTS || int_list(pidfds, agents_n, MAX_AGENTS, "agents") != na) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "doorbells and pidfds differ");
        return -1;
    }
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *item = PySequence_GetItem(doorbells, i);
        if (item == NULL) return -1;
        addr[i] = PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (PyErr_Occurred()) return -1;
        r->doorbell[i] = (sem_t *)(uintptr_t)addr[i];
        r->pidfd[i] = agents_n[i];
    }
    r->n_agents = (int)na;
    Py_ssize_t nl = PySequence_Size(groups);
    if (nl < 1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "no layers");
        return -1;
    }
    r->n_layers = (int)nl;
    r->group_len = PyMem_Calloc((size_t)nl, sizeof(int));
    r->groups = PyMem_Calloc((size_t)nl, sizeof(*r->groups));
    if (r->group_len == NULL || r->groups == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < nl; i++) {
        PyObject *g = PySequence_GetItem(groups, i);
        if (g == NULL) return -1;
        int n = int_list(g, r->groups[i], MAX_SHARDS, "shards");
        Py_DECREF(g);
        if (n < 1) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a layer with no FfnAgent");
            return -1;
        }
        for (int s = 0; s < n; s++)
            if (r->groups[i][s] < 0 || r->groups[i][s] >= r->n_agents) {
                PyErr_SetString(PyExc_ValueError, "agent index out of range");
                return -1;
            }
        r->group_len[i] = n;
    }
    if (PySequence_Size(buckets) != N_BUCKETS - 1) {
        PyErr_Format(PyExc_ValueError, "expected %d latency bucket bounds", N_BUCKETS - 1);
        return -1;
    }
    for (int b = 0; b < N_BUCKETS - 1; b++) {
        PyObject *item = PySequence_GetItem(buckets, b);
        if (item == NULL) return -1;
        r->buckets_ns[b] = PyLong_AsUnsignedLongLong(item);
        Py_DECREF(item);
        if (PyErr_Occurred()) return -1;
    }
    r->buckets_ns[N_BUCKETS - 1] = UINT64_MAX;
    return 0;
}

static void RankChannel_dealloc(RankChannel *r) {
    PyMem_Free(r->group_len);
    PyMem_Free(r->groups);
    PyMem_Free(r->sent);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *RankChannel_get_seq(RankChannel *r, void *closure) { return PyLong_FromUnsignedLong(r->seq); }
static PyObject *RankChannel_get_failed(RankChannel *r, void *closure) { return PyLong_FromLong(r->failed_index); }

static PyMethodDef RankChannel_methods[] = {
    {"call", (PyCFunction)RankChannel_call, METH_VARARGS,
     "call(layer, in_ptr, out_ptr, rows, index_ptr=0, total=0) -> status: one layer call, rows copied in and the "
     "result out; on a local-row mailbox `index_ptr` points to the rows' u32 invocation indices"},
    {"probe", (PyCFunction)RankChannel_probe, METH_VARARGS,
     "probe(rows=1) -> status: a call the first FfnAgent answers without computing"},
    {NULL}};
static PyGetSetDef RankChannel_getset[] = {
    {"seq", (getter)RankChannel_get_seq, NULL, "the last call's sequence number", NULL},
    {"failed_index", (getter)RankChannel_get_failed, NULL,
     "of the last failure: the agent (PEER_EXITED), the shard (TIMEOUT, AGENT_ERROR) or -follower (TIMEOUT)", NULL},
    {NULL}};

static PyTypeObject RankChannelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "crosspool.transport._calls.RankChannel",
    .tp_basicsize = sizeof(RankChannel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An Instance rank's end of its mailbox.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RankChannel_init,
    .tp_dealloc = (destructor)RankChannel_dealloc,
    .tp_methods = RankChannel_methods,
    .tp_getset = RankChannel_getset,
};

/* ------------------------------------------------------------------------------------------ */

typedef struct {
    char *base;
    volatile uint32_t *w;
    uint64_t *counters; /* in the agent's inbox: executed, execute ns, queue ns */
    uint8_t *held;      /* per layer: computed here */
    Py_ssize_t n_layers, last_held;
    int readers;
    uint32_t claimed;
    int mid_step; /* the last call claimed was for a layer before the last one held here */
} Served;

typedef struct {
    PyObject_HEAD
    Layout l;
    sem_t *doorbell;
    Served *served;
    Py_ssize_t n;
    uint64_t spin_ns;
} AgentChannel;

/* Whether a call is due soon: some rank is inside a forward pass that has layers left here. */
static int mid_step(AgentChannel *a) {
    for (Py_ssize_t i = 0; i < a->n; i++)
        if (a->served[i].mid_step) return 1;
    return 0;
}

/* A call published and not claimed (read without the GIL: words only). */
static int any_published(AgentChannel *a) {
    for (Py_ssize_t i = 0; i < a->n; i++) {
        Served *s = &a->served[i];
        if (load(&s->w[a->l.req_seq]) != s->claimed && !load(&s->w[a->l.fence])) return 1;
    }
    return 0;
}

/* The oldest published, unclaimed call for this agent: (index, seq, layer, rows, claimed_ns), a
 * stale publication as (-1, index, seq, claimed, 0), a fenced call of a layer held here as
 * (index, seq, layer, 0, 0) (answered without computing), or None.
 * A fenced call is claimed here too: once every agent of the mailbox claimed and answered its
 * last call the daemon can hand the mailbox to the Instance's next engine (Mailbox.reset). */
static PyObject *claim(AgentChannel *a) {
    Layout *l = &a->l;
    for (;;) {
        Served *oldest = NULL;
        uint64_t oldest_ns = 0;
        for (Py_ssize_t i = 0; i < a->n; i++) {
            Served *s = &a->served[i];
            uint32_t published = load(&s->w[l->req_seq]);
            if (published != s->claimed && load(&s->w[l->fence])) {
                uint32_t layer = s->w[l->layer];
                s->claimed = published;
                s->counters[l->c_claimed] = published;
                if (layer == l->probe_layer || (layer < s->n_layers && s->held[layer]))
                    return Py_BuildValue("(nIIIK)", i, published, layer, 0u, 0ull);
                continue;
            }
            if (published != s->claimed) {
                uint64_t t = (uint64_t)s->w[l->submit_lo] | (uint64_t)s->w[l->submit_hi] << 32;
                if (oldest == NULL || t < oldest_ns) {
                    oldest = s;
                    oldest_ns = t;
                }
            }
        }
        if (oldest == NULL) Py_RETURN_NONE;
        volatile uint32_t *w = oldest->w;
        uint32_t seq = load(&w[l->req_seq]), layer = w[l->layer], rows = w[l->rows];
        if (load(&w[l->req_seq]) != seq) continue; /* the rank moved on to its next call while we read */
        Py_ssize_t index = oldest - a->served;
        if ((uint32_t)(seq - oldest->claimed) >= (1u << 31))
            return Py_BuildValue("(inII)", -1, index, seq, oldest->claimed);
        oldest->claimed = seq;
        oldest->counters[l->c_claimed] = seq;
        if (layer == l->probe_layer || (layer < oldest->n_layers && oldest->held[layer])) {
            uint64_t now = now_ns();
            /* A probe is timed in a loop of probes: the next one follows as soon as a layer would. */
            oldest->mid_step = layer == l->probe_layer || (Py_ssize_t)layer < oldest->last_held;
            oldest->counters[l->c_queue_ns] += now - oldest_ns;
            return Py_BuildValue("(nIIIK)", index, seq, layer, rows, (unsigned long long)now);
        }
        /* Otherwise the call is for another agent of the model's placement. */
    }
}

/* A doorbell count is posted per call: a lane takes one, then claims. A wait that times out
 * claims too, so a call whose count another lane took (and found nothing) is not left waiting. */
static PyObject *AgentChannel_next_call(AgentChannel *a, PyObject *args) {
    double timeout_s;
    if (!PyArg_ParseTuple(args, "d", &timeout_s)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (a->spin_ns && mid_step(a)) {
        /* A rank is inside a forward pass: its next call follows one layer's attention later.
         * Watch the mailboxes, yielding the CPU to anything else runnable on it; then block. The
         * doorbell counts of calls found this way are dropped before blocking. Between forward
         * passes (the engine schedules the next step) the lane blocks at once. */
        uint64_t end = now_ns() + a->spin_ns;
        int found = 0;
        while (!(found = any_published(a)) && now_ns() < end) sched_yield();
        if (!found) {
            while (sem_trywait(a->doorbell) == 0) {
            }
            found = any_published(a);
        }
        if (found) goto claim_it;
    }
    struct timespec at;
    clock_gettime(CLOCK_MONOTONIC, &at);
    uint64_t ns = (uint64_t)at.tv_nsec + (uint64_t)(timeout_s * 1e9);
    at.tv_sec += (time_t)(ns / 1000000000ull);
    at.tv_nsec = (long)(ns % 1000000000ull);
    sem_clockwait(a->doorbell, CLOCK_MONOTONIC, &at);
claim_it:
    Py_END_ALLOW_THREADS
    return claim(a);
}

static PyObject *AgentChannel_reply(AgentChannel *a, PyObject *args) {
    Py_ssize_t index;
    unsigned int seq, status;
    int shard;
    unsigned long long claimed_ns;
    if (!PyArg_ParseTuple(args, "nIiIK", &index, &seq, &shard, &status, &claimed_ns)) return NULL;
    if (index < 0 || index >= a->n || shard < 0 || shard >= MAX_SHARDS) {
        PyErr_SetString(PyExc_ValueError, "mailbox or shard out of range");
        return NULL;
    }
    Layout *l = &a->l;
    Served *s = &a->served[index];
    if (claimed_ns) {
        s->counters[l->c_executed] += 1;
        s->counters[l->c_execute_ns] += now_ns() - claimed_ns;
    }
    s->w[l->status + l->stride * shard] = status;
    store(&s->w[l->resp_seq + l->stride * shard], seq);
    for (int r = 0; r < s->readers; r++)
        sem_post((sem_t *)(s->base + l->reply_sems + (shard * l->max_tp + r) * l->sem_size));
    Py_RETURN_NONE;
}

static int AgentChannel_init(AgentChannel *a, PyObject *args, PyObject *kw) {
    static char *names[] = {"layout", "doorbell", "served", "spin_ns", NULL};
    PyObject *layout, *served;
    unsigned long long doorbell, spin_ns = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKO|K", names, &layout, &doorbell, &served, &spin_ns)) return -1;
    a->spin_ns = spin_ns;
    if (parse_layout(layout, &a->l) < 0) return -1;
    if (a->l.c_executed < 0) {
        PyErr_SetString(PyExc_KeyError, "an agent's layout needs c_executed, c_execute_ns, c_queue_ns, c_claimed");
        return -1;
    }
    a->doorbell = (sem_t *)(uintptr_t)doorbell;
    Py_ssize_t n = PySequence_Size(served);
    if (n < 0) return -1;
    a->served = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Served));
    if (a->served == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    a->n = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(served, i);
        if (item == NULL) return -1;
        unsigned long long base, counters;
        int readers;
        Py_buffer held;
        int ok = PyArg_ParseTuple(item, "KKiy*", &base, &counters, &readers, &held);
        Py_DECREF(item);
        if (!ok) return -1;
        Served *s = &a->served[i];
        s->base = (char *)(uintptr_t)base;
        s->w = (volatile uint32_t *)s->base;
        s->counters = (uint64_t *)(uintptr_t)counters;
        s->readers = readers;
        s->n_layers = held.len;
        s->held = PyMem_Malloc(held.len ? (size_t)held.len : 1);
        if (s->held == NULL) {
            PyBuffer_Release(&held);
            PyErr_NoMemory();
            return -1;
        }
        memcpy(s->held, held.buf, (size_t)held.len);
        PyBuffer_Release(&held);
        s->last_held = -1;
        for (Py_ssize_t layer = 0; layer < s->n_layers; layer++)
            if (s->held[layer]) s->last_held = layer;
        s->claimed = s->w[a->l.req_seq];
        s->counters[a->l.c_claimed] = s->claimed;
    }
    return 0;
}

static void AgentChannel_dealloc(AgentChannel *a) {
    for (Py_ssize_t i = 0; a->served && i < a->n; i++) PyMem_Free(a->served[i].held);
    PyMem_Free(a->served);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyMethodDef AgentChannel_methods[] = {
    {"next_call", (PyCFunction)AgentChannel_next_call, METH_VARARGS,
     "next_call(timeout_s) -> (index, seq, layer, rows, claimed_ns) | (-1, index, seq, claimed, 0) | None"},
    {"reply", (PyCFunction)AgentChannel_reply, METH_VARARGS,
     "reply(index, seq, shard, status, claimed_ns): answer a call (its plane written); claimed_ns 0 counts nothing"},
    {NULL}};

static PyTypeObject AgentChannelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "crosspool.transport._calls.AgentChannel",
    .tp_basicsize = sizeof(AgentChannel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An FfnAgent's end of the mailboxes it serves.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)AgentChannel_init,
    .tp_dealloc = (destructor)AgentChannel_dealloc,
    .tp_methods = AgentChannel_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "crosspool.transport._calls",
                                    "Both ends of a layer call through a shared-memory mailbox.", -1, NULL};

PyMODINIT_FUNC PyInit__calls(void) {
    if (PyType_Ready(&RankChannelType) < 0 || PyType_Ready(&AgentChannelType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&RankChannelType);
    Py_INCREF(&AgentChannelType);
    if (PyModule_AddObject(m, "RankChannel", (PyObject *)&RankChannelType) < 0 ||
        PyModule_AddObject(m, "AgentChannel", (PyObject *)&AgentChannelType) < 0 ||
        PyModule_AddIntConstant(m, "OK", OK) < 0 || PyModule_AddIntConstant(m, "FENCED", FENCED) < 0 ||
        PyModule_AddIntConstant(m, "PEER_EXITED", PEER_EXITED) < 0 ||
        PyModule_AddIntConstant(m, "TIMEOUT", TIMEOUT) < 0 ||
        PyModule_AddIntConstant(m, "AGENT_ERROR", AGENT_ERROR) < 0 ||
        PyModule_AddIntConstant(m, "DISAGREE", DISAGREE) < 0 ||
        PyModule_AddIntConstant(m, "ROWS_DIFFER", ROWS_DIFFER) < 0 ||
        PyModule_AddIntConstant(m, "ROWS_UNOWNED", ROWS_UNOWNED) < 0 ||
        PyModule_AddIntConstant(m, "RECEIVE_ONLY", RECEIVE_ONLY) < 0 ||
        PyModule_AddIntConstant(m, "N_BUCKETS", N_BUCKETS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
