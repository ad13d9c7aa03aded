/*
 * cdmlfs._native: the C accelerator behind cdmlfs.inflate and cdmlfs.checkpoints.
 *
 * Why it exists: a FUSE read of a deflated ZIP member is positioned read +
 * inflate + CRC-32, and the stdlib does that at roughly half the speed of
 * libdeflate while doing it in three separately allocated steps.  Here each
 * member read is one call that runs entirely with the GIL released, so the
 * FUSE worker threads really decode in parallel.
 *
 * Two families of functions:
 *   - whole members: libdeflate into an exactly sized output, then CRC-32;
 *   - checkpoints ("zran"): zlib, which unlike libdeflate can stop at block
 *     boundaries and resume from (bit offset, 32 KiB window), giving random
 *     access inside multi-GB deflate streams.
 *
 * Error contract (mapped to cdmlfs.errors by cdmlfs/inflate.py):
 *   DecodeError (a ValueError) for bad data, wrong size, CRC mismatch;
 *   EOFError for a short read; OSError for I/O; ValueError for bad arguments.
 * No function ever returns partial output.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <libdeflate.h>
#include <zlib.h>

#include "crc32.h"

/* Reason strings: cdmlfs/inflate.py's pure-Python fallback uses the same ones. */
#define MSG_BAD_DATA "invalid deflate data"
#define MSG_SIZE "inflated to a different size than declared"
#define MSG_TRAILING "trailing data after the end of the deflate stream"
#define MSG_TRUNCATED "truncated deflate data"

/* Deflate cannot expand one input byte to more than 1032 output bytes (a
 * 258-byte match coded in 2 bits); declared sizes beyond that are corrupt
 * headers, and refusing them avoids allocating gigabytes for nothing. */
#define MAX_RATIO 1032
#define RATIO_SLACK 1024

#define WINDOW_SIZE 32768
#define SCRATCH_SIZE (256 * 1024)
#define MAX_IO_CHUNK ((size_t)1 << 30)  /* Linux pread caps one call near 2 GiB */
#define MAX_ZLIB_CHUNK ((uInt)1 << 30)  /* zlib's avail_in/avail_out are 32-bit */
#define MAX_INTERVALS ((int64_t)1 << 26)
#define STALL_LIMIT 4                   /* zlib calls in a row without progress */
#define GIL_FREE_CRC_MIN (4 << 20)      /* below this, releasing the GIL costs more: at ~28 GB/s a 1 MiB CRC
                                           takes 35 us, while getting the GIL back from busy fetch threads
                                           took ~0.5 ms a call (S3 sequential reads spent half their time so) */
#define HUGE_ADVICE_MIN ((size_t)4 << 20)

static PyObject *DecodeError;

/* ---------------------------------------------------------------- results */

/* Outcome of work done without the GIL; turned into an exception afterwards. */
typedef enum {
    ST_OK = 0,
    ST_BAD_DATA,
    ST_SIZE,
    ST_TRAILING,
    ST_TRUNCATED,
    ST_CRC,
    ST_NOMEM,
    ST_OSERR,
    ST_EOF,
} status_t;

typedef struct {
    status_t st;
    int err;                 /* errno for ST_OSERR */
    uint32_t expected, got;  /* ST_CRC */
    long long offset;        /* ST_EOF, ST_OSERR */
    size_t want, have;       /* ST_EOF */
} result_t;

static PyObject *
raise_result(const result_t *r)
{
    char msg[160];
    switch (r->st) {
    case ST_OK:
        PyErr_SetString(PyExc_SystemError, "raise_result called without an error");
        break;
    case ST_BAD_DATA:
        PyErr_SetString(DecodeError, MSG_BAD_DATA);
        break;
    case ST_SIZE:
        PyErr_SetString(DecodeError, MSG_SIZE);
        break;
    case ST_TRAILING:
        PyErr_SetString(DecodeError, MSG_TRAILING);
        break;
    case ST_TRUNCATED:
        PyErr_SetString(DecodeError, MSG_TRUNCATED);
        break;
    case ST_CRC:
        snprintf(msg, sizeof msg, "CRC mismatch (expected 0x%08x, got 0x%08x)",
                 (unsigned)r->expected, (unsigned)r->got);
        PyErr_SetString(DecodeError, msg);
        break;
    case ST_NOMEM:
        PyErr_NoMemory();
        break;
    case ST_OSERR:
        errno = r->err;
        PyErr_SetFromErrno(PyExc_OSError);
        break;
    case ST_EOF:
        PyErr_Format(PyExc_EOFError, "unexpected end of file: got %zu of %zu bytes at offset %lld",
                     r->have, r->want, r->offset);
        break;
    }
    return NULL;
}

/* --------------------------------------------------------- argument checks */

/* "O&" converter: a CRC-32 must be an int in [0, 2**32). */
static int
crc_converter(PyObject *obj, void *out)
{
    unsigned long long v;
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "crc must be an int");
        return 0;
    }
    v = PyLong_AsUnsignedLongLong(obj);
    if ((v == (unsigned long long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFull) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "crc must be in range(2**32)");
        return 0;
    }
    *(uint32_t *)out = (uint32_t)v;
    return 1;
}

/* "O&" converter for an optional CRC: None means "do not check". */
static int
opt_crc_converter(PyObject *obj, void *out)
{
    int64_t *res = out;
    uint32_t v;
    if (obj == Py_None) {
        *res = -1;
        return 1;
    }
    if (!crc_converter(obj, &v))
        return 0;
    *res = v;
    return 1;
}

static int
check_sizes(Py_ssize_t comp_size, Py_ssize_t size)
{
    char msg[160];
    if (comp_size < 0 || size < 0) {
        PyErr_SetString(PyExc_ValueError, "sizes must be non-negative");
        return -1;
    }
    if (comp_size <= (PY_SSIZE_T_MAX - RATIO_SLACK) / MAX_RATIO
        && size > comp_size * MAX_RATIO + RATIO_SLACK) {
        snprintf(msg, sizeof msg, "declared size %zd is impossible for %zd compressed bytes",
                 size, comp_size);
        PyErr_SetString(DecodeError, msg);
        return -1;
    }
    return 0;
}

/* Refuses reads past the end of a regular file before anything is allocated,
 * so a corrupt size field costs a syscall instead of a huge allocation. */
static int
check_extent(int fd, long long offset, Py_ssize_t n)
{
    struct stat st;
    if (offset < 0) {
        PyErr_SetString(PyExc_ValueError, "offset must be non-negative");
        return -1;
    }
    if (fstat(fd, &st) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (S_ISREG(st.st_mode) && (offset > (long long)st.st_size || n > (long long)st.st_size - offset)) {
        long long have = (long long)st.st_size - offset;
        PyErr_Format(PyExc_EOFError, "unexpected end of file: got %lld of %zd bytes at offset %lld",
                     have > 0 ? have : 0, n, offset);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------ GIL-free I/O */

/* Reads exactly n bytes; loops over short reads and EINTR.  No GIL needed. */
static int
pread_full(int fd, void *buf, size_t n, long long offset, result_t *r)
{
    size_t done = 0;
    while (done < n) {
        size_t want = n - done > MAX_IO_CHUNK ? MAX_IO_CHUNK : n - done;
        ssize_t k = pread(fd, (char *)buf + done, want, (off_t)(offset + (long long)done));
        if (k < 0) {
            if (errno == EINTR)
                continue;
            r->st = ST_OSERR;
            r->err = errno;
            r->offset = offset;
            return -1;
        }
        if (k == 0) {
            r->st = ST_EOF;
            r->want = n;
            r->have = done;
            r->offset = offset;
            return -1;
        }
        done += (size_t)k;
    }
    return 0;
}

/* Fresh multi-MB buffers are page-faulted 4 KiB at a time, which costs about a
 * tenth of a 50 MB member read; where transparent huge pages are enabled in
 * "madvise" mode, asking for them removes most of that.  Purely advisory. */
static void
advise_huge(void *p, size_t n)
{
#ifdef MADV_HUGEPAGE
    uintptr_t page = 4096, start, end;
    if (!p || n < HUGE_ADVICE_MIN)
        return;
    start = ((uintptr_t)p + page - 1) & ~(page - 1);
    end = ((uintptr_t)p + n) & ~(page - 1);
    if (end > start)
        (void)madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

/* ------------------------------------------ per-thread libdeflate decompressor */

/* libdeflate decompressors are not thread-safe but are costly enough (~10 KiB
 * of tables) that allocating one per call shows up on 4 KiB members, so each
 * thread keeps its own, freed by the key destructor when the thread exits. */
static pthread_key_t tls_key;
static pthread_once_t tls_once = PTHREAD_ONCE_INIT;
static int tls_error;

static void
free_tls_decompressor(void *p)
{
    libdeflate_free_decompressor(p);
}

static void
make_tls_key(void)
{
    tls_error = pthread_key_create(&tls_key, free_tls_decompressor);
}

/* Returns this thread's decompressor; *owned is set when it could not be
 * stored and the caller must free it. */
static struct libdeflate_decompressor *
thread_decompressor(int *owned)
{
    struct libdeflate_decompressor *d = pthread_getspecific(tls_key);
    *owned = 0;
    if (d)
        return d;
    d = libdeflate_alloc_decompressor();
    if (d && pthread_setspecific(tls_key, d) != 0)
        *owned = 1;
    return d;
}

/* Sets r to ST_CRC unless expected is -1 (no check) or matches. */
static void
check_crc(const void *buf, size_t n, int64_t expected, result_t *r)
{
    uint32_t got;
    if (expected < 0)
        return;
    got = cdmlfs_crc32(0, buf, n);
    if (got != (uint32_t)expected) {
        r->st = ST_CRC;
        r->expected = (uint32_t)expected;
        r->got = got;
    }
}

/* ----------------------------------------------------------- zlib helpers */

/* Feeds one input buffer of any size to zlib in 32-bit sized pieces. */
typedef struct {
    const unsigned char *next;
    size_t left;
} feed_t;

static void
refill(z_stream *s, feed_t *f)
{
    if (s->avail_in == 0 && f->left > 0) {
        uInt take = f->left > MAX_ZLIB_CHUNK ? MAX_ZLIB_CHUNK : (uInt)f->left;
        s->next_in = (Bytef *)f->next;
        s->avail_in = take;
        f->next += take;
        f->left -= take;
    }
}

static status_t
zlib_status(int ret)
{
    return ret == Z_MEM_ERROR ? ST_NOMEM : ST_BAD_DATA;
}

/* Exact-size inflate with zlib, with the checks in the same order as the
 * pure-Python fallback.  libdeflate cannot tell a truncated stream from one
 * that is simply too short, so its failures are re-diagnosed here: both
 * backends then give the same reason for the same bad member.  No GIL needed;
 * writes at most out_n bytes into out. */
static status_t
zlib_inflate_exact(const void *in, size_t in_n, void *out, size_t out_n)
{
    z_stream s;
    feed_t f = {in, in_n};
    size_t filled = 0;
    unsigned char spare;
    int ret, stalls = 0, overflow = 0;
    status_t st;

    memset(&s, 0, sizeof s);
    if (inflateInit2(&s, -15) != Z_OK)
        return ST_NOMEM;
    for (;;) {
        uInt avail, in_before;
        refill(&s, &f);
        if (filled < out_n) {
            size_t left = out_n - filled;
            s.next_out = (Bytef *)out + filled;
            avail = left > MAX_ZLIB_CHUNK ? MAX_ZLIB_CHUNK : (uInt)left;
        }
        else {
            s.next_out = &spare; /* one spare byte detects output beyond out_n */
            avail = 1;
        }
        s.avail_out = avail;
        in_before = s.avail_in;
        ret = inflate(&s, Z_NO_FLUSH);
        if (filled < out_n)
            filled += avail - s.avail_out;
        else if (s.avail_out == 0)
            overflow = 1;
        if (ret != Z_OK && ret != Z_STREAM_END && ret != Z_BUF_ERROR) {
            st = zlib_status(ret);
            break;
        }
        if (overflow) {
            st = ST_SIZE;
            break;
        }
        if (ret == Z_STREAM_END) {
            st = filled < out_n ? ST_SIZE : (s.avail_in || f.left) ? ST_TRAILING : ST_OK;
            break;
        }
        if (avail == s.avail_out && in_before == s.avail_in) {
            if ((s.avail_in == 0 && f.left == 0) || ++stalls > STALL_LIMIT) {
                st = ST_BAD_DATA; /* input ended inside the stream */
                break;
            }
        }
        else {
            stalls = 0;
        }
    }
    inflateEnd(&s);
    return st;
}

/* Inflates a whole raw deflate member into exactly out_n bytes, then checks
 * its CRC.  No GIL needed.
 *
 * libdeflate is the fast path.  Whenever it fails, or its output fails the CRC,
 * zlib decodes the member again to give the verdict: the error path is rare, and
 * this way both backends name the same reason for the same bad member (libdeflate
 * cannot tell a truncated stream from a short one, and tolerates some malformed
 * Huffman codes that zlib rejects). */
static void
inflate_member(const void *in, size_t in_n, void *out, size_t out_n, uint32_t crc, result_t *r)
{
    int owned;
    size_t used = 0;
    enum libdeflate_result res;
    struct libdeflate_decompressor *d;

    /* Some writers store an empty member as zero deflate bytes; accept it. */
    if (in_n == 0 && out_n == 0) {
        check_crc(out, 0, crc, r);
        return;
    }
    if (!(d = thread_decompressor(&owned))) {
        r->st = ST_NOMEM;
        return;
    }
    /* actual_out NULL: anything but exactly out_n bytes is an error. */
    res = libdeflate_deflate_decompress_ex(d, in, in_n, out, out_n, &used, NULL);
    if (owned)
        libdeflate_free_decompressor(d);
    if (res == LIBDEFLATE_SUCCESS && used == in_n) {
        check_crc(out, out_n, crc, r);
        if (r->st == ST_OK)
            return;
    }
    r->st = zlib_inflate_exact(in, in_n, out, out_n);
    if (r->st == ST_OK)
        check_crc(out, out_n, crc, r);
}

/* -------------------------------------------------- whole-member functions */

static PyObject *
py_crc32(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"data", "value", NULL};
    Py_buffer in;
    unsigned long value = 0;
    uint32_t crc;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|k:crc32", kwlist, &in, &value))
        return NULL;
    if (in.len >= GIL_FREE_CRC_MIN) {
        Py_BEGIN_ALLOW_THREADS
        crc = cdmlfs_crc32((uint32_t)value, in.buf, (size_t)in.len);
        Py_END_ALLOW_THREADS
    }
    else {
        crc = cdmlfs_crc32((uint32_t)value, in.buf, (size_t)in.len);
    }
    PyBuffer_Release(&in);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *
py_inflate(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"data", "size", "crc", NULL};
    Py_buffer in;
    Py_ssize_t size;
    uint32_t crc;
    PyObject *out;
    result_t r = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*nO&:inflate", kwlist, &in, &size,
                                     crc_converter, &crc))
        return NULL;
    if (check_sizes(in.len, size) < 0 || !(out = PyBytes_FromStringAndSize(NULL, size))) {
        PyBuffer_Release(&in);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    advise_huge(PyBytes_AS_STRING(out), (size_t)size);
    inflate_member(in.buf, (size_t)in.len, PyBytes_AS_STRING(out), (size_t)size, crc, &r);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    if (r.st != ST_OK) {
        Py_DECREF(out);
        return raise_result(&r);
    }
    return out;
}

static PyObject *
py_inflate_into(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"data", "out", "crc", NULL};
    Py_buffer in, out;
    uint32_t crc;
    result_t r = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*w*O&:inflate_into", kwlist, &in, &out,
                                     crc_converter, &crc))
        return NULL;
    if (check_sizes(in.len, out.len) < 0) {
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t written = out.len; /* read before the view is released */
    Py_BEGIN_ALLOW_THREADS
    inflate_member(in.buf, (size_t)in.len, out.buf, (size_t)out.len, crc, &r);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    if (r.st != ST_OK)
        return raise_result(&r);
    return PyLong_FromSsize_t(written);
}

static PyObject *
py_read_deflated(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"fd", "offset", "comp_size", "size", "crc", NULL};
    int fd;
    long long offset;
    Py_ssize_t comp_size, size;
    uint32_t crc;
    PyObject *out;
    result_t r = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iLnnO&:read_deflated", kwlist, &fd, &offset,
                                     &comp_size, &size, crc_converter, &crc))
        return NULL;
    if (check_sizes(comp_size, size) < 0 || check_extent(fd, offset, comp_size) < 0)
        return NULL;
    if (!(out = PyBytes_FromStringAndSize(NULL, size)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    void *buf = malloc(comp_size > 0 ? (size_t)comp_size : 1);
    advise_huge(buf, (size_t)comp_size);
    advise_huge(PyBytes_AS_STRING(out), (size_t)size);
    if (!buf)
        r.st = ST_NOMEM;
    else if (pread_full(fd, buf, (size_t)comp_size, offset, &r) == 0)
        inflate_member(buf, (size_t)comp_size, PyBytes_AS_STRING(out), (size_t)size, crc, &r);
    free(buf);
    Py_END_ALLOW_THREADS
    if (r.st != ST_OK) {
        Py_DECREF(out);
        return raise_result(&r);
    }
    return out;
}

static PyObject *
py_read_stored(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"fd", "offset", "size", "crc", NULL};
    int fd;
    long long offset;
    Py_ssize_t size;
    int64_t crc = -1;
    PyObject *out;
    result_t r = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iLn|O&:read_stored", kwlist, &fd, &offset, &size,
                                     opt_crc_converter, &crc))
        return NULL;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "sizes must be non-negative");
        return NULL;
    }
    if (check_extent(fd, offset, size) < 0 || !(out = PyBytes_FromStringAndSize(NULL, size)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    advise_huge(PyBytes_AS_STRING(out), (size_t)size);
    if (pread_full(fd, PyBytes_AS_STRING(out), (size_t)size, offset, &r) == 0)
        check_crc(PyBytes_AS_STRING(out), (size_t)size, crc, &r);
    Py_END_ALLOW_THREADS
    if (r.st != ST_OK) {
        Py_DECREF(out);
        return raise_result(&r);
    }
    return out;
}

/* ------------------------------------------------------------ checkpoints */

/* A place where inflation can restart: a deflate block boundary, given by
 * the output offset, the compressed bytes consumed, how many bits of the last
 * consumed byte are still unread, and the 32 KiB of output before it. */
typedef struct {
    int64_t out, in;
    int bits;
    unsigned wlen;
    unsigned char *window;
} zpoint_t;

/* ZranBuilder: one streaming pass over a member that verifies it and records,
 * for each interval of `spacing` output bytes, the last block boundary at or
 * before the interval start (so decoding interval k inflates at most one
 * deflate block before it) and the compressed offset by which the interval's
 * output is complete (so the reader knows how much to fetch). */
typedef struct {
    PyObject_HEAD
    z_stream strm;
    int strm_ready, ended, failed, busy;
    int64_t size, spacing, n_intervals;
    int64_t out_pos, in_pos;
    uint32_t crc;
    int64_t next_start; /* first interval whose start point is not yet committed */
    int64_t next_end;   /* first interval whose end offset is not yet recorded */
    zpoint_t cand;      /* last block boundary seen; committed once passed */
    int cand_set;
    zpoint_t *points;
    int64_t npoints, cap;
    int64_t *point_of, *ends;
    unsigned char *scratch;
} ZranBuilder;

static int
builder_commit(ZranBuilder *b, int64_t k)
{
    if (b->npoints == 0 || b->points[b->npoints - 1].out != b->cand.out) {
        zpoint_t *p;
        if (b->npoints == b->cap) {
            int64_t cap = b->cap ? b->cap * 2 : 16;
            zpoint_t *np = realloc(b->points, (size_t)cap * sizeof *np);
            if (!np)
                return -1;
            b->points = np;
            b->cap = cap;
        }
        p = &b->points[b->npoints];
        *p = b->cand;
        p->window = NULL;
        if (p->wlen) {
            if (!(p->window = malloc(p->wlen)))
                return -1;
            memcpy(p->window, b->cand.window, p->wlen);
        }
        b->npoints++;
    }
    b->point_of[k] = b->npoints - 1;
    return 0;
}

/* Called at each block boundary. */
static int
builder_boundary(ZranBuilder *b)
{
    int64_t pos = b->out_pos;
    while (b->next_start < b->n_intervals && b->next_start * b->spacing < pos) {
        if (builder_commit(b, b->next_start) < 0)
            return -1;
        b->next_start++;
    }
    if (b->next_start < b->n_intervals && !(b->cand_set && b->cand.out == pos)) {
        uInt wlen = WINDOW_SIZE;
        b->cand.out = pos;
        b->cand.in = b->in_pos;
        b->cand.bits = b->strm.data_type & 7;
        if (inflateGetDictionary(&b->strm, b->cand.window, &wlen) != Z_OK)
            return -1;
        b->cand.wlen = wlen;
        b->cand_set = 1;
    }
    return 0;
}

static status_t
builder_run(ZranBuilder *b, const unsigned char *in, size_t n)
{
    feed_t f = {in, n};
    int stalls = 0;
    if (b->ended)
        return n ? ST_TRAILING : ST_OK;
    for (;;) {
        int64_t interval_end, stop; /* stop: output offset, then bytes left until it */
        uInt avail, in_before;
        size_t produced, consumed;
        int ret;

        refill(&b->strm, &f);
        /* Stop exactly at interval ends so their compressed offsets are exact;
         * once the declared size is reached, one spare byte detects overflow. */
        interval_end = (b->out_pos / b->spacing + 1) * b->spacing;
        stop = interval_end < b->size ? interval_end : b->size;
        stop = stop > b->out_pos ? stop - b->out_pos : 1;
        avail = stop > SCRATCH_SIZE ? SCRATCH_SIZE : (uInt)stop;
        b->strm.next_out = b->scratch;
        b->strm.avail_out = avail;
        in_before = b->strm.avail_in;
        ret = inflate(&b->strm, Z_BLOCK);
        produced = avail - b->strm.avail_out;
        consumed = in_before - b->strm.avail_in;
        b->in_pos += (int64_t)consumed;
        if (ret != Z_OK && ret != Z_STREAM_END && ret != Z_BUF_ERROR)
            return zlib_status(ret);
        if (b->out_pos + (int64_t)produced > b->size)
            return ST_SIZE;
        b->crc = cdmlfs_crc32(b->crc, b->scratch, produced);
        b->out_pos += (int64_t)produced;
        while (b->next_end < b->n_intervals) {
            int64_t end = (b->next_end + 1) * b->spacing;
            if (b->out_pos < (end < b->size ? end : b->size))
                break;
            b->ends[b->next_end++] = b->in_pos;
        }
        if (ret == Z_STREAM_END) {
            b->ended = 1;
            return (b->strm.avail_in || f.left) ? ST_TRAILING : ST_OK;
        }
        if ((b->strm.data_type & 128) && !(b->strm.data_type & 64) && builder_boundary(b) < 0)
            return ST_NOMEM;
        if (produced == 0 && consumed == 0) {
            if (b->strm.avail_in == 0 && f.left == 0)
                return ST_OK; /* wants more input */
            if (++stalls > STALL_LIMIT)
                return ST_BAD_DATA;
        }
        else {
            stalls = 0;
        }
    }
}

static void
builder_free(ZranBuilder *b)
{
    if (b->strm_ready)
        inflateEnd(&b->strm);
    b->strm_ready = 0;
    for (int64_t i = 0; i < b->npoints; i++)
        free(b->points[i].window);
    free(b->points);
    free(b->cand.window);
    free(b->point_of);
    free(b->ends);
    free(b->scratch);
    b->points = NULL;
    b->cand.window = NULL;
    b->point_of = b->ends = NULL;
    b->scratch = NULL;
    b->npoints = b->cap = 0;
}

static void
ZranBuilder_dealloc(ZranBuilder *b)
{
    builder_free(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *
ZranBuilder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"size", "spacing", NULL};
    long long size, spacing;
    ZranBuilder *b;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "LL:ZranBuilder", kwlist, &size, &spacing))
        return NULL;
    if (size < 0 || spacing <= 0) {
        PyErr_SetString(PyExc_ValueError, "size must be >= 0 and spacing > 0");
        return NULL;
    }
    if (size / spacing >= MAX_INTERVALS) {
        PyErr_SetString(PyExc_ValueError, "spacing too small for this size");
        return NULL;
    }
    if (!(b = (ZranBuilder *)type->tp_alloc(type, 0)))
        return NULL;
    b->size = size;
    b->spacing = spacing;
    b->n_intervals = size / spacing + (size % spacing != 0); /* no size + spacing: it may overflow */
    b->point_of = calloc((size_t)b->n_intervals + 1, sizeof(int64_t));
    b->ends = calloc((size_t)b->n_intervals + 1, sizeof(int64_t));
    b->scratch = malloc(SCRATCH_SIZE);
    b->cand.window = malloc(WINDOW_SIZE);
    if (!b->point_of || !b->ends || !b->scratch || !b->cand.window) {
        Py_DECREF(b);
        return PyErr_NoMemory();
    }
    if (inflateInit2(&b->strm, -15) != Z_OK) {
        Py_DECREF(b);
        return PyErr_NoMemory();
    }
    b->strm_ready = 1;
    return (PyObject *)b;
}

static PyObject *
ZranBuilder_feed(ZranBuilder *b, PyObject *arg)
{
    Py_buffer in;
    status_t st;
    if (b->busy || b->failed || !b->strm_ready) {
        PyErr_SetString(PyExc_RuntimeError, "ZranBuilder is busy, failed or finished");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &in, PyBUF_SIMPLE) < 0)
        return NULL;
    b->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = builder_run(b, in.buf, (size_t)in.len);
    Py_END_ALLOW_THREADS
    b->busy = 0;
    PyBuffer_Release(&in);
    if (st != ST_OK) {
        result_t r = {st};
        b->failed = 1;
        return raise_result(&r);
    }
    Py_RETURN_NONE;
}

/* Returns (crc, points, point_of, ends) where points is a list of
 * (out, in, bits, window) tuples and the other two are per-interval lists. */
static PyObject *
ZranBuilder_finish(ZranBuilder *b, PyObject *unused)
{
    PyObject *points = NULL, *point_of = NULL, *ends = NULL;
    if (b->busy || b->failed || !b->strm_ready) {
        PyErr_SetString(PyExc_RuntimeError, "ZranBuilder is busy, failed or finished");
        return NULL;
    }
    if (!b->ended || b->out_pos != b->size) {
        result_t r = {b->ended ? ST_SIZE : ST_TRUNCATED};
        b->failed = 1;
        return raise_result(&r);
    }
    while (b->next_start < b->n_intervals) {
        if (builder_commit(b, b->next_start) < 0)
            return PyErr_NoMemory();
        b->next_start++;
    }
    if (!(points = PyList_New((Py_ssize_t)b->npoints)) || !(point_of = PyList_New((Py_ssize_t)b->n_intervals))
        || !(ends = PyList_New((Py_ssize_t)b->n_intervals)))
        goto fail;
    for (int64_t i = 0; i < b->npoints; i++) {
        zpoint_t *p = &b->points[i];
        PyObject *t = Py_BuildValue("(LLiy#)", (long long)p->out, (long long)p->in, p->bits,
                                    p->window ? (const char *)p->window : "", (Py_ssize_t)p->wlen);
        if (!t)
            goto fail;
        PyList_SET_ITEM(points, (Py_ssize_t)i, t);
    }
    for (int64_t k = 0; k < b->n_intervals; k++) {
        PyObject *a = PyLong_FromLongLong(b->point_of[k]), *e = PyLong_FromLongLong(b->ends[k]);
        if (!a || !e) {
            Py_XDECREF(a);
            Py_XDECREF(e);
            goto fail;
        }
        PyList_SET_ITEM(point_of, (Py_ssize_t)k, a);
        PyList_SET_ITEM(ends, (Py_ssize_t)k, e);
    }
    builder_free(b);
    return Py_BuildValue("(kNNN)", (unsigned long)b->crc, points, point_of, ends);
fail:
    Py_XDECREF(points);
    Py_XDECREF(point_of);
    Py_XDECREF(ends);
    return NULL;
}

static PyMethodDef ZranBuilder_methods[] = {
    {"feed", (PyCFunction)ZranBuilder_feed, METH_O,
     "feed(chunk): inflate the next compressed bytes (GIL released)."},
    {"finish", (PyCFunction)ZranBuilder_finish, METH_NOARGS,
     "finish() -> (crc, points, point_of, ends); checks the stream ended at the declared size."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ZranBuilderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cdmlfs._native.ZranBuilder",
    .tp_doc = "ZranBuilder(size, spacing): one verifying pass that records restart points.",
    .tp_basicsize = sizeof(ZranBuilder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = ZranBuilder_new,
    .tp_dealloc = (destructor)ZranBuilder_dealloc,
    .tp_methods = ZranBuilder_methods,
};

/* ZranReader: restarts inflation at a recorded point, discards `skip` output
 * bytes and collects the next `size` bytes.  Fed compressed chunks by Python
 * because only the caller knows how to read the archive (file, S3, ...). */
typedef struct {
    PyObject_HEAD
    z_stream strm;
    int strm_ready, busy, failed;
    int64_t skip_left;
    PyObject *result;
    Py_ssize_t filled, want;
    unsigned char *scratch;
} ZranReader;

static status_t
reader_run(ZranReader *z, const unsigned char *in, size_t n, int *done)
{
    feed_t f = {in, n};
    int stalls = 0;
    char *dst = PyBytes_AS_STRING(z->result);
    *done = 0;
    for (;;) {
        uInt avail, in_before;
        size_t produced, consumed;
        int ret;
        unsigned char *out;
        if (z->filled == z->want && z->skip_left == 0) {
            *done = 1;
            return ST_OK;
        }
        refill(&z->strm, &f);
        if (z->skip_left > 0) {
            out = z->scratch;
            avail = z->skip_left > SCRATCH_SIZE ? SCRATCH_SIZE : (uInt)z->skip_left;
        }
        else {
            Py_ssize_t left = z->want - z->filled;
            out = (unsigned char *)dst + z->filled;
            avail = left > (Py_ssize_t)MAX_ZLIB_CHUNK ? MAX_ZLIB_CHUNK : (uInt)left;
        }
        z->strm.next_out = out;
        z->strm.avail_out = avail;
        in_before = z->strm.avail_in;
        ret = inflate(&z->strm, Z_NO_FLUSH);
        produced = avail - z->strm.avail_out;
        consumed = in_before - z->strm.avail_in;
        if (ret != Z_OK && ret != Z_STREAM_END && ret != Z_BUF_ERROR)
            return zlib_status(ret);
        if (z->skip_left > 0)
            z->skip_left -= (int64_t)produced;
        else
            z->filled += (Py_ssize_t)produced;
        if (ret == Z_STREAM_END && (z->filled < z->want || z->skip_left > 0))
            return ST_SIZE;
        if (produced == 0 && consumed == 0) {
            if (z->strm.avail_in == 0 && f.left == 0)
                return ST_OK; /* wants more input */
            if (++stalls > STALL_LIMIT)
                return ST_BAD_DATA;
        }
        else {
            stalls = 0;
        }
    }
}

static void
ZranReader_dealloc(ZranReader *z)
{
    if (z->strm_ready)
        inflateEnd(&z->strm);
    Py_XDECREF(z->result);
    free(z->scratch);
    Py_TYPE(z)->tp_free((PyObject *)z);
}

static PyObject *
ZranReader_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"window", "bits", "prime", "skip", "size", NULL};
    Py_buffer window;
    int bits, prime;
    long long skip;
    Py_ssize_t size;
    ZranReader *z;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*iiLn:ZranReader", kwlist, &window, &bits, &prime,
                                     &skip, &size))
        return NULL;
    if (bits < 0 || bits > 7 || prime < 0 || prime > 255 || skip < 0 || size < 0
        || window.len > WINDOW_SIZE) {
        PyBuffer_Release(&window);
        PyErr_SetString(PyExc_ValueError, "invalid checkpoint");
        return NULL;
    }
    if (!(z = (ZranReader *)type->tp_alloc(type, 0))) {
        PyBuffer_Release(&window);
        return NULL;
    }
    z->skip_left = skip;
    z->want = size;
    if (!(z->result = PyBytes_FromStringAndSize(NULL, size))
        || (skip > 0 && !(z->scratch = malloc(SCRATCH_SIZE)))) {
        PyBuffer_Release(&window);
        Py_DECREF(z);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    if (inflateInit2(&z->strm, -15) != Z_OK) {
        PyBuffer_Release(&window);
        Py_DECREF(z);
        return PyErr_NoMemory();
    }
    z->strm_ready = 1;
    /* The unread high bits of the byte before the restart offset go first. */
    if ((bits && inflatePrime(&z->strm, bits, prime >> (8 - bits)) != Z_OK)
        || (window.len && inflateSetDictionary(&z->strm, window.buf, (uInt)window.len) != Z_OK)) {
        PyBuffer_Release(&window);
        Py_DECREF(z);
        PyErr_SetString(PyExc_ValueError, "invalid checkpoint");
        return NULL;
    }
    PyBuffer_Release(&window);
    return (PyObject *)z;
}

static PyObject *
ZranReader_feed(ZranReader *z, PyObject *arg)
{
    Py_buffer in;
    status_t st;
    int done = 0;
    if (z->busy || z->failed) {
        PyErr_SetString(PyExc_RuntimeError, "ZranReader is busy or failed");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &in, PyBUF_SIMPLE) < 0)
        return NULL;
    z->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    st = reader_run(z, in.buf, (size_t)in.len, &done);
    Py_END_ALLOW_THREADS
    z->busy = 0;
    PyBuffer_Release(&in);
    if (st != ST_OK) {
        result_t r = {st};
        z->failed = 1;
        return raise_result(&r);
    }
    return PyBool_FromLong(done);
}

static PyObject *
ZranReader_result(ZranReader *z, PyObject *unused)
{
    if (z->busy || z->failed || z->filled != z->want || z->skip_left) {
        PyErr_SetString(PyExc_RuntimeError, "ZranReader has not produced its output");
        return NULL;
    }
    Py_INCREF(z->result);
    return z->result;
}

static PyMethodDef ZranReader_methods[] = {
    {"feed", (PyCFunction)ZranReader_feed, METH_O,
     "feed(chunk) -> bool: inflate more input (GIL released); True once the output is complete."},
    {"result", (PyCFunction)ZranReader_result, METH_NOARGS, "result() -> bytes: the requested output."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ZranReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cdmlfs._native.ZranReader",
    .tp_doc = "ZranReader(window, bits, prime, skip, size): inflate from a checkpoint.",
    .tp_basicsize = sizeof(ZranReader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = ZranReader_new,
    .tp_dealloc = (destructor)ZranReader_dealloc,
    .tp_methods = ZranReader_methods,
};

/* ----------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"crc32", (PyCFunction)(void (*)(void))py_crc32, METH_VARARGS | METH_KEYWORDS,
     "crc32(data, value=0) -> int: CRC-32 as zlib.crc32, via ISA-L or libdeflate (CRC32_BACKEND)."},
    {"inflate", (PyCFunction)(void (*)(void))py_inflate, METH_VARARGS | METH_KEYWORDS,
     "inflate(data, size, crc) -> bytes: raw deflate to exactly size bytes, CRC checked."},
    {"inflate_into", (PyCFunction)(void (*)(void))py_inflate_into, METH_VARARGS | METH_KEYWORDS,
     "inflate_into(data, out, crc) -> int: fill the writable buffer out exactly."},
    {"read_deflated", (PyCFunction)(void (*)(void))py_read_deflated, METH_VARARGS | METH_KEYWORDS,
     "read_deflated(fd, offset, comp_size, size, crc) -> bytes: pread + inflate + CRC."},
    {"read_stored", (PyCFunction)(void (*)(void))py_read_stored, METH_VARARGS | METH_KEYWORDS,
     "read_stored(fd, offset, size, crc=None) -> bytes: pread exactly size bytes (+ CRC)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cdmlfs._native",
    .m_doc = "libdeflate/zlib accelerator for cdmlfs; use cdmlfs.inflate, not this module.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *m;
    pthread_once(&tls_once, make_tls_key);
    if (tls_error) {
        PyErr_SetString(PyExc_ImportError, "cdmlfs._native: pthread_key_create failed");
        return NULL;
    }
    if (PyType_Ready(&ZranBuilderType) < 0 || PyType_Ready(&ZranReaderType) < 0)
        return NULL;
    if (!(m = PyModule_Create(&native_module)))
        return NULL;
    if (!DecodeError
        && !(DecodeError = PyErr_NewExceptionWithDoc(
                 "cdmlfs._native.DecodeError",
                 "Member data does not decode, has the wrong size, or fails its CRC.",
                 PyExc_ValueError, NULL)))
        goto fail;
    Py_INCREF(DecodeError);
    if (PyModule_AddObject(m, "DecodeError", DecodeError) < 0) {
        Py_DECREF(DecodeError);
        goto fail;
    }
    Py_INCREF(&ZranBuilderType);
    if (PyModule_AddObject(m, "ZranBuilder", (PyObject *)&ZranBuilderType) < 0) {
        Py_DECREF(&ZranBuilderType);
        goto fail;
    }
    Py_INCREF(&ZranReaderType);
    if (PyModule_AddObject(m, "ZranReader", (PyObject *)&ZranReaderType) < 0) {
        Py_DECREF(&ZranReaderType);
        goto fail;
    }
    if (PyModule_AddStringConstant(m, "LIBDEFLATE_VERSION", LIBDEFLATE_VERSION_STRING) < 0
        || PyModule_AddStringConstant(m, "ZLIB_VERSION", zlibVersion()) < 0
        || PyModule_AddStringConstant(m, "CRC32_BACKEND", CDMLFS_CRC32_BACKEND) < 0
        || PyModule_AddIntConstant(m, "MAX_RATIO", MAX_RATIO) < 0
        || PyModule_AddIntConstant(m, "RATIO_SLACK", RATIO_SLACK) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
