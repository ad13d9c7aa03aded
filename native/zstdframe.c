/* cdmlfs._zstdframe: decode one zstd frame straight into a caller's buffer, a prefix at a time.
 *
 * Why not python-zstandard's stream reader: it decodes into the decoder's own window buffer
 * and copies out (a fresh multi-MiB allocation per decoder, page-faulted on this VM at
 * ~1.5 us a page, plus the copy). With ZSTD_d_stableOutBuffer the frame buffer itself is the
 * window: no second buffer, no copy, and the decoder (DCtx) is reused frame after frame.
 * Every call that decodes releases the GIL; reads from a file descriptor happen in the same
 * GIL-free call (pread + decode), the way cdmlfs._native does for deflate.
 *
 * The frame checksum (XXH64 of the content) is checked by us, in one pass over the buffer once
 * the frame ends, not by zstd while it decodes: a reader that only needs a prefix (a member
 * with its own CRC) does not pay for hashing it, and the thread that finishes the frame does.
 *
 * Use: d = FrameDecoder(); d.start(buffer)  (buffer: writable, exactly the frame's size);
 * then d.feed(chunk) or d.feed_fd(fd, offset, length, until) until d.done; d.release()
 * lets go of the buffer. A frame that needs more room than the buffer, or ends early,
 * raises DecodeError, and so does a frame whose checksum (checked as above) does not match.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels answer EINVAL and pages are touched */
#endif

#define ZSTD_STATIC_LINKING_ONLY /* ZSTD_d_stableOutBuffer (stable since zstd 1.5.x, still behind this) */
#include <zstd.h>
#define XXH_INLINE_ALL /* header-only use of the system xxhash (libxxhash-dev): nothing to link */
#include <xxhash.h>

/* Compressed bytes per pread: small while a reader waits for a prefix (it stops soon after its
 * bytes), large when decoding on to the frame's end (fewer calls). */
#define FD_CHUNK_PREFIX (32 << 10)
#define FD_CHUNK (256 << 10)

static PyObject *DecodeError;

typedef struct {
    PyObject_HEAD
    ZSTD_DCtx *dctx;
    Py_buffer out;
    int out_held;
    size_t pos;   /* bytes of out that are final */
    int done;     /* the frame ended exactly at the end of out (checksum verified if present) */
    int failed;
    int busy;
    unsigned char *scratch; /* FD_CHUNK bytes for feed_fd */
    int has_checksum;       /* -1: header not seen whole yet */
    unsigned char head[ZSTD_FRAMEHEADERSIZE_MAX]; /* the frame header, gathered across feeds */
    size_t head_len;
    unsigned char tail[4];  /* the last 4 input bytes consumed: the checksum, once the frame ends */
    size_t total_in;
} FrameDecoder;

/* Keep the last 4 bytes of everything consumed so far. */
static void
remember_tail(FrameDecoder *d, const unsigned char *src, size_t n)
{
    if (n >= 4) {
        memcpy(d->tail, src + n - 4, 4);
    }
    else if (n > 0) {
        memmove(d->tail, d->tail + n, 4 - n);
        memcpy(d->tail + 4 - n, src, n);
    }
    d->total_in += n;
}

/* The frame ended: compare XXH64(content) with the checksum that closed it (what zstd would do). */
static const char *
verify_checksum(FrameDecoder *d)
{
    if (d->has_checksum == 0)
        return NULL;
    if (d->total_in < 4)
        return "frame too short for its checksum";
    uint32_t want = (uint32_t)d->tail[0] | (uint32_t)d->tail[1] << 8 | (uint32_t)d->tail[2] << 16
                    | (uint32_t)d->tail[3] << 24;
    uint32_t got = (uint32_t)XXH64(d->out.buf, (size_t)d->out.len, 0);
    return got == want ? NULL : "Restored data doesn't match checksum";
}

/* Decode from `src` until it is used up or the frame ends; returns NULL or a static error text. */
static const char *
decode_some(FrameDecoder *d, const void *src, size_t len, size_t *consumed)
{
    ZSTD_inBuffer in = {src, len, 0};
    ZSTD_outBuffer out = {d->out.buf, (size_t)d->out.len, d->pos};
    const char *err = NULL;
    if (d->has_checksum < 0) {
        /* The header may arrive over several feeds: decide once it is whole. */
        size_t take = sizeof d->head - d->head_len;
        if (take > len)
            take = len;
        memcpy(d->head + d->head_len, src, take);
        d->head_len += take;
        ZSTD_frameHeader zfh;
        size_t r = ZSTD_getFrameHeader(&zfh, d->head, d->head_len);
        if (r == 0)
            d->has_checksum = zfh.checksumFlag ? 1 : 0;
        else if (ZSTD_isError(r))
            d->has_checksum = 1; /* unreadable: zstd reports it; never skip a check we cannot see */
        /* else: more header bytes to come */
    }
    while (in.pos < in.size && !d->done) {
        size_t in0 = in.pos, out0 = out.pos;
        size_t ret = ZSTD_decompressStream(d->dctx, &out, &in);
        if (ZSTD_isError(ret)) {
            err = ZSTD_getErrorName(ret);
            break;
        }
        remember_tail(d, (const unsigned char *)src + in0, in.pos - in0);
        if (ret == 0) {
            d->done = 1; /* frame complete */
            if (out.pos != out.size)
                err = "frame ended before the size its index gives";
            else
                /* On a mismatch every byte is there, only unverified: pos stays at the end, for
                 * readers that check members' own CRCs; nothing else uses a failed frame. */
                err = verify_checksum(d);
        }
        else if (in.pos == in0 && out.pos == out0) {
            err = out.pos == out.size ? "frame has more data than the size its index gives"
                                      : "decoder made no progress";
            break;
        }
    }
    if (!err && d->done && in.pos < in.size)
        err = "data after the end of the frame";
    d->pos = out.pos;
    *consumed = in.pos;
    return err;
}

static PyObject *
fail(FrameDecoder *d, const char *why)
{
    d->failed = 1;
    PyErr_SetString(DecodeError, why);
    return NULL;
}

static int
check_idle(FrameDecoder *d)
{
    if (d->busy) {
        PyErr_SetString(PyExc_RuntimeError, "FrameDecoder is in use by another thread");
        return -1;
    }
    return 0;
}

static int
check_ready(FrameDecoder *d)
{
    if (check_idle(d) < 0)
        return -1;
    if (!d->out_held || d->failed) {
        PyErr_SetString(PyExc_RuntimeError, "FrameDecoder has no frame (call start) or failed");
        return -1;
    }
    return 0;
}

static PyObject *
FrameDecoder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"window_log_max", NULL};
    int wlog = 27;
    FrameDecoder *d;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|i:FrameDecoder", kwlist, &wlog))
        return NULL;
    if (!(d = (FrameDecoder *)type->tp_alloc(type, 0)))
        return NULL;
    d->dctx = ZSTD_createDCtx();
    if (!d->dctx) {
        Py_DECREF(d);
        return PyErr_NoMemory();
    }
    if (ZSTD_isError(ZSTD_DCtx_setParameter(d->dctx, ZSTD_d_windowLogMax, wlog))) {
        Py_DECREF(d);
        ZSTD_bounds b = ZSTD_dParam_getBounds(ZSTD_d_windowLogMax);
        return PyErr_Format(PyExc_ValueError, "window_log_max %d is outside %d..%d", wlog, b.lowerBound,
                            b.upperBound);
    }
    if (ZSTD_isError(ZSTD_DCtx_setParameter(d->dctx, ZSTD_d_stableOutBuffer, 1))
        || ZSTD_isError(ZSTD_DCtx_setParameter(d->dctx, ZSTD_d_forceIgnoreChecksum, 1))) {
        Py_DECREF(d);
        PyErr_SetString(PyExc_RuntimeError, "this libzstd lacks ZSTD_d_stableOutBuffer or forceIgnoreChecksum");
        return NULL;
    }
    return (PyObject *)d;
}

static void
release_out(FrameDecoder *d)
{
    if (d->out_held) {
        PyBuffer_Release(&d->out);
        d->out_held = 0;
    }
}

static void
FrameDecoder_dealloc(FrameDecoder *d)
{
    release_out(d);
    ZSTD_freeDCtx(d->dctx);
    free(d->scratch);
    Py_TYPE(d)->tp_free((PyObject *)d);
}

static PyObject *
FrameDecoder_start(FrameDecoder *d, PyObject *arg)
{
    if (check_idle(d) < 0)
        return NULL;
    release_out(d);
    if (PyObject_GetBuffer(arg, &d->out, PyBUF_WRITABLE) < 0)
        return NULL;
    d->out_held = 1;
    d->pos = 0;
    d->done = 0;
    d->failed = 0;
    d->has_checksum = -1;
    d->head_len = 0;
    d->total_in = 0;
    memset(d->tail, 0, sizeof d->tail);
    ZSTD_DCtx_reset(d->dctx, ZSTD_reset_session_only);
    Py_RETURN_NONE;
}

static PyObject *
FrameDecoder_feed(FrameDecoder *d, PyObject *arg)
{
    Py_buffer in;
    const char *err;
    size_t consumed = 0;
    if (check_ready(d) < 0)
        return NULL;
    if (PyObject_GetBuffer(arg, &in, PyBUF_SIMPLE) < 0)
        return NULL;
    d->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    err = decode_some(d, in.buf, (size_t)in.len, &consumed);
    Py_END_ALLOW_THREADS
    d->busy = 0;
    PyBuffer_Release(&in);
    if (err)
        return fail(d, err);
    return PyLong_FromSize_t(d->pos);
}

/* feed_fd(fd, offset, length, until) -> consumed: pread + decode from `offset` until `until`
 * bytes of output are final, the frame is done, or `length` compressed bytes are used. */
static PyObject *
FrameDecoder_feed_fd(FrameDecoder *d, PyObject *args)
{
    int fd;
    long long offset, length;
    Py_ssize_t until;
    const char *err = NULL;
    int io_errno = 0;
    long long used = 0;
    if (!PyArg_ParseTuple(args, "iLLn:feed_fd", &fd, &offset, &length, &until))
        return NULL;
    if (check_ready(d) < 0)
        return NULL;
    if (offset < 0 || length < 0) {
        PyErr_SetString(PyExc_ValueError, "negative offset or length");
        return NULL;
    }
    if (!d->scratch && !(d->scratch = malloc(FD_CHUNK)))
        return PyErr_NoMemory();
    d->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    /* until >= the buffer's size: on to the frame's end (its checksum follows the last byte). */
    int to_end = until >= (Py_ssize_t)d->out.len;
    size_t chunk = to_end ? FD_CHUNK : FD_CHUNK_PREFIX;
    while (used < length && !d->done && ((Py_ssize_t)d->pos < until || to_end)) {
        size_t want = (size_t)(length - used) < chunk ? (size_t)(length - used) : chunk;
        ssize_t got = pread(fd, d->scratch, want, (off_t)(offset + used));
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0) {
            io_errno = got < 0 ? errno : 0;
            err = got < 0 ? "read failed" : "archive is shorter than its index says";
            break;
        }
        size_t consumed = 0;
        err = decode_some(d, d->scratch, (size_t)got, &consumed);
        used += (long long)consumed;
        if (err)
            break;
    }
    Py_END_ALLOW_THREADS
    d->busy = 0;
    if (io_errno) {
        d->failed = 1;
        errno = io_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (err)
        return fail(d, err);
    return PyLong_FromLongLong(used);
}

static PyObject *
FrameDecoder_release(FrameDecoder *d, PyObject *unused)
{
    if (check_idle(d) < 0)
        return NULL;
    release_out(d);
    Py_RETURN_NONE;
}

static PyObject *
FrameDecoder_get_pos(FrameDecoder *d, void *closure)
{
    return PyLong_FromSize_t(d->pos);
}

static PyObject *
FrameDecoder_get_done(FrameDecoder *d, void *closure)
{
    return PyBool_FromLong(d->done);
}

static PyMethodDef FrameDecoder_methods[] = {
    {"start", (PyCFunction)FrameDecoder_start, METH_O,
     "start(buffer): decode the next frame into this writable buffer (exactly the frame's size)."},
    {"feed", (PyCFunction)FrameDecoder_feed, METH_O,
     "feed(chunk) -> int: decode compressed bytes (GIL released); returns the bytes of output final."},
    {"feed_fd", (PyCFunction)FrameDecoder_feed_fd, METH_VARARGS,
     "feed_fd(fd, offset, length, until) -> int: pread + decode until `until` output bytes are final;"
     " returns the compressed bytes used."},
    {"release", (PyCFunction)FrameDecoder_release, METH_NOARGS, "release(): let go of the buffer."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef FrameDecoder_getset[] = {
    {"pos", (getter)FrameDecoder_get_pos, NULL, "bytes of output that are final", NULL},
    {"done", (getter)FrameDecoder_get_done, NULL, "the frame ended exactly at the buffer's end", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FrameDecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cdmlfs._zstdframe.FrameDecoder",
    .tp_doc = "FrameDecoder(window_log_max=27): a reusable zstd frame decoder into caller buffers.",
    .tp_basicsize = sizeof(FrameDecoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = FrameDecoder_new,
    .tp_dealloc = (destructor)FrameDecoder_dealloc,
    .tp_methods = FrameDecoder_methods,
    .tp_getset = FrameDecoder_getset,
};

/* populate(buffer): fault in every page of a writable buffer (an anonymous mapping) for writing,
 * contents unchanged, with the GIL released.
 *
 * Why: frame buffers are pre-faulted off the reader's path by a background thread. mmap.mmap with
 * MAP_POPULATE does the same work but holds the GIL through it (1-2 ms for 4 MiB here), and every
 * reader answered in Python waited that long for the GIL meanwhile: measured through the mount,
 * the first read of a frame spent half its time off the CPU. */
static PyObject *
zstdframe_populate(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    int rc, err = 0;
    (void)self;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)view.buf, end = start + (uintptr_t)view.len;
    uintptr_t first = start & ~((uintptr_t)page - 1); /* madvise wants a page-aligned start */
    rc = view.len > 0 ? madvise((void *)first, end - first, MADV_POPULATE_WRITE) : 0;
    if (rc != 0) {
        err = errno;
        if (err == EINVAL || err == ENOSYS) { /* an older kernel: one write per page does it */
            volatile unsigned char *p = (volatile unsigned char *)view.buf;
            for (Py_ssize_t i = 0; i < view.len; i += page)
                p[i] = p[i];
            if (view.len > 0)
                p[view.len - 1] = p[view.len - 1];
            rc = 0;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* A methods table also makes faulthandler's crash report list this module (it lists only
 * extension modules that have one). */
static PyMethodDef zstdframe_methods[] = {
    {"populate", zstdframe_populate, METH_O,
     "populate(buffer): fault in a writable buffer's pages, contents unchanged, without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef zstdframe_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cdmlfs._zstdframe",
    .m_doc = "libzstd frame decoder for cdmlfs; use cdmlfs.formats.zstdframes, not this module.",
    .m_size = -1,
    .m_methods = zstdframe_methods,
};

PyMODINIT_FUNC
PyInit__zstdframe(void)
{
    PyObject *m;
    if (PyType_Ready(&FrameDecoderType) < 0)
        return NULL;
    if (!(m = PyModule_Create(&zstdframe_module)))
        return NULL;
    if (!DecodeError
        && !(DecodeError = PyErr_NewExceptionWithDoc("cdmlfs._zstdframe.DecodeError",
                                                     "corrupt or mis-sized zstd frame", PyExc_ValueError,
                                                     NULL))) {
        Py_DECREF(m);
        return NULL;
    }
    /* PyModule_AddObject takes the reference only when it succeeds. */
    Py_INCREF(DecodeError);
    if (PyModule_AddObject(m, "DecodeError", DecodeError) < 0) {
        Py_DECREF(DecodeError);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&FrameDecoderType);
    if (PyModule_AddObject(m, "FrameDecoder", (PyObject *)&FrameDecoderType) < 0) {
        Py_DECREF(&FrameDecoderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
