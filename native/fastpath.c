/*
 * cdmlfs._fastpath: the FUSE hot path in C.
 *
 * Why: reading one small file through the mount costs the daemon a LOOKUP
 * (getattr) and a READ. Served by Python through ctypes callbacks, those cost
 * ~50 us of daemon CPU per file here, most of it entering and leaving the
 * interpreter. These two C callbacks answer the common cases without the GIL:
 *
 *   getattr: path -> entry through a hash table built once over the index's
 *            path dict, attributes straight from the index columns;
 *   read:    stored members by pread into libfuse's buffer (the first read of a
 *            member reads it whole and checks its CRC, then marks it verified
 *            in the reader's own bitmap); small deflated members read whole by
 *            pread + libdeflate + CRC straight into libfuse's buffer.
 *
 * Everything else (directories listing, partial reads of compressed members,
 * huge members, tar streams, errors of any kind) goes to the Python callback
 * that mfusepy created, which this module calls as a plain C function pointer:
 * ctypes takes the GIL itself. On any doubt the fast path falls back, so the
 * Python path stays the single source of error handling and logging.
 *
 * The columns are the index's own array/bytearray buffers (held as Py_buffer
 * views, which also stops them from being resized); the path strings are the
 * dict's keys (their UTF-8 bytes, stable while the dict lives).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <libdeflate.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32.h"

/* Mirrors cdmlfs.index. */
enum { K_FILE = 0, K_DIR = 1, K_SYMLINK = 2 };
enum { M_STORED = 0, M_DEFLATE = 8, M_IN_STREAM = 0xFF00 };
enum { F_ENCRYPTED = 1, F_NEEDS_LOCAL_HEADER = 2, F_MEMBER_CRC = 4 };
/* Mirrors cdmlfs.reader: states of the shared "verified" column. */
enum { V_UNCHECKED = 0, V_VERIFIED = 1, V_CORRUPT = 2 };
/* Deflate turns one input byte into at most 1032 output bytes: larger declared sizes are corrupt
 * headers (Python answers them). The same limit as cdmlfs.inflate.MAX_RATIO / RATIO_SLACK. */
#define DEFLATE_MAX_RATIO 1032
#define DEFLATE_RATIO_SLACK 1024

typedef int (*getattr_fn)(const char *, struct stat *, void *);
typedef int (*read_fn)(const char *, char *, size_t, off_t, void *);
typedef int (*ioctl_fn)(const char *, unsigned int, void *, void *, unsigned int, void *);
/* libfuse3's readdir and its filler (fuse.h); the fast path runs on libfuse3 only. */
typedef int (*fill_dir_fn)(void *, const char *, const struct stat *, off_t, int);
typedef int (*readdir_fn)(const char *, void *, fill_dir_fn, off_t, void *, int);
enum { READDIR_PLUS = 1 << 0, FILL_DIR_PLUS = 1 << 1 }; /* FUSE_READDIR_PLUS, FUSE_FILL_DIR_PLUS */

enum { COL_KIND, COL_MODE, COL_MTIME, COL_SIZE, COL_METHOD, COL_FLAGS, COL_OFFSET,
       COL_COMP, COL_CRC, COL_NLINK, COL_FAST, COL_VERIFIED, COL_DATA_AT, NCOLS };
static const char *col_names[NCOLS] = {"kind", "mode", "mtime", "size", "method", "flags", "offset",
                                       "comp_size", "crc", "nlink", "fast", "verified", "data_at"};
static const Py_ssize_t col_itemsize[NCOLS] = {1, 2, 8, 8, 2, 1, 8, 8, 4, 4, 1, 1, 8};
/* Written at serve time: the verified states and the ZIP data offsets (both shared with Python). */
static const int col_writable[NCOLS] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1};
/* data_at is empty for formats without local headers (no entry has F_NEEDS_LOCAL_HEADER). */
static const int col_may_be_empty[NCOLS] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};

typedef struct {
    int64_t start;
    Py_buffer view; /* its buf and len are the extent's bytes */
} HotExtent;

typedef struct {
    PyObject_HEAD
    PyObject *lookup;            /* dict str -> int, keeps the key strings alive */
    Py_buffer cols[NCOLS];
    int ncols_held;
    Py_ssize_t n;                /* entries */
    uint64_t *slots;             /* (hash >> 32) << 32 | (eid + 1); 0 = empty */
    const char **keys;           /* eid -> UTF-8 path (no leading '/'), NULL if not indexed */
    uint64_t mask;
    int fd;
    int64_t file_size;
    /* The archive file as opened (set_source_stamp): a read served here checks it is unchanged,
     * as LocalFile.check_unchanged does for Python's reads; has_stamp 0: nothing to check. */
    int has_stamp, stamp_fd;
    int64_t stamp_size, stamp_mtime_ns, stamp_ctime_ns;
    uint32_t uid, gid;
    int64_t whole_limit;
    getattr_fn py_getattr;
    read_fn py_read;
    ioctl_fn py_ioctl;
    unsigned int stats_request; /* the one ioctl Python answers (cdmlfs.statsio.REQUEST) */
    readdir_fn py_readdir;
    /* The directory tree (set_tree): parent of each entry, and each directory's children (in
     * listing order) as a run [child_start, child_start + child_count) of child_ids. */
    Py_buffer tree[4];
    int tree_held;
    /* Decoded container extents (tar stream bytes, one per zstd frame) that reads falling inside
     * are copied from in C, sorted by start. Each holds a buffer export (bytes, or the mmap a frame
     * was decoded into), so the memory stays valid while C reads from it; Python adds an extent
     * the cache holds and drops it when the cache lets it go, so the set never outgrows the bound. */
    pthread_rwlock_t hot_lock; /* C reads share it; adding or dropping an extent takes it alone */
    HotExtent *hot;
    Py_ssize_t nhot, hot_cap;
    atomic_ullong getattr_fast, getattr_slow, read_fast, read_slow, bytes_fast, bytes_source, ioctl_fast;
    atomic_ullong readdir_fast, readdir_slow;
} FastPath;

static FastPath *active; /* the one table the C callbacks serve (one mount per daemon) */

static inline uint64_t
fnv1a(const char *s)
{
    uint64_t h = 1469598103934665603ULL;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ULL;
    }
    return h;
}

static Py_ssize_t
lookup(const FastPath *t, const char *path)
{
    if (*path == '/')
        path++;
    uint64_t h = fnv1a(path);
    uint64_t tag = h >> 32;
    uint64_t i = h & t->mask;
    for (;;) {
        uint64_t s = t->slots[i];
        if (!s)
            return -1;
        if ((s >> 32) == tag) {
            Py_ssize_t eid = (Py_ssize_t)(s & 0xffffffffULL) - 1;
            if (strcmp(t->keys[eid], path) == 0)
                return eid;
        }
        i = (i + 1) & t->mask;
    }
}

#define COL(t, c, type) ((type *)(t)->cols[c].buf)

/* ------------------------------------------------------------ C callbacks */

static void fill_st(const FastPath *t, Py_ssize_t e, struct stat *st);

static int
fp_getattr(const char *path, struct stat *st, void *fi)
{
    FastPath *t = active;
    Py_ssize_t e = lookup(t, path);
    if (e < 0 || !COL(t, COL_FAST, uint8_t)[e]) {
        atomic_fetch_add_explicit(&t->getattr_slow, 1, memory_order_relaxed);
        return t->py_getattr(path, st, fi);
    }
    fill_st(t, e, st);
    atomic_fetch_add_explicit(&t->getattr_fast, 1, memory_order_relaxed);
    return 0;
}

/* The stat of a fast entry from the index columns (as cdmlfs.fuse_ops.fill_stat gives it). */
static void
fill_st(const FastPath *t, Py_ssize_t e, struct stat *st)
{
    uint8_t kind = COL(t, COL_KIND, uint8_t)[e];
    memset(st, 0, sizeof *st);
    st->st_ino = (ino_t)e + 1;
    st->st_uid = t->uid;
    st->st_gid = t->gid;
    st->st_blksize = 4096;
    uint16_t mode = COL(t, COL_MODE, uint16_t)[e];
    if (kind == K_DIR) {
        st->st_mode = S_IFDIR | mode;
        st->st_nlink = COL(t, COL_NLINK, uint32_t)[e];
        st->st_size = 4096;
        st->st_blocks = 8;
    } else {
        uint64_t size = COL(t, COL_SIZE, uint64_t)[e];
        st->st_mode = (kind == K_SYMLINK ? S_IFLNK : S_IFREG) | mode;
        st->st_nlink = 1;
        st->st_size = (off_t)size;
        st->st_blocks = (blkcnt_t)((size + 511) >> 9);
    }
    /* As cdmlfs.fuse_ops.timespec: floored seconds, nanoseconds rounded to the nearest. */
    double m = COL(t, COL_MTIME, double)[e];
    time_t sec = (time_t)m;
    if ((double)sec > m)
        sec -= 1;
    long nsec = (long)((m - (double)sec) * 1e9 + 0.5);
    if (nsec >= 1000000000L) {
        sec += 1;
        nsec -= 1000000000L;
    }
    st->st_mtim.tv_sec = st->st_ctim.tv_sec = st->st_atim.tv_sec = sec;
    st->st_mtim.tv_nsec = st->st_ctim.tv_nsec = st->st_atim.tv_nsec = nsec;
}

/*
 * readdir: a listing went through Python at 15-27 us per entry (a 200k-entry directory took
 * 3-5 s, and blocked every other request of a single-threaded mount meanwhile). Directories whose
 * entries all have C attributes (no hard links, sparse or inconsistent members, no undecodable
 * names) are listed here, with attributes for READDIRPLUS; anything else goes to Python.
 */
static int
fp_readdir(const char *path, void *buf, fill_dir_fn filler, off_t off, void *fi, int flags)
{
    FastPath *t = active;
    Py_ssize_t e = lookup(t, path);
    const uint8_t *fast = COL(t, COL_FAST, uint8_t);
    if (e < 0 || !t->tree_held || !fast[e] || COL(t, COL_KIND, uint8_t)[e] != K_DIR)
        goto slow;
    const uint32_t *parent = (const uint32_t *)t->tree[0].buf;
    const uint32_t *start = (const uint32_t *)t->tree[1].buf;
    const uint32_t *count = (const uint32_t *)t->tree[2].buf;
    const uint32_t *ids = (const uint32_t *)t->tree[3].buf;
    Py_ssize_t up = parent[e];
    if (!fast[up])
        goto slow;
    /* Listing entry k: 0 ".", 1 "..", 2 + j child j, each passed with the offset of the next one
     * (k + 1), as the Python readdir numbers them. With offsets libfuse streams the listing and
     * gives READDIRPLUS entries their node ids; with offset 0 it sent them with id 0 and the kernel
     * dropped their attributes, so every file opened after a listing still cost a LOOKUP. */
    uint64_t k = off > 0 ? (uint64_t)off : 0;
    struct stat st;
    int sent = 0;
    if (k == 0) {
        fill_st(t, e, &st);
        if (filler(buf, ".", &st, 1, 0))
            goto done;
        sent = k = 1;
    }
    if (k == 1) {
        fill_st(t, up, &st);
        if (filler(buf, "..", &st, 2, 0))
            goto done;
        sent = 1;
        k = 2;
    }
    int plus = (flags & READDIR_PLUS) ? FILL_DIR_PLUS : 0;
    uint64_t checked = k - 2;
    for (uint64_t j = k - 2; j < count[e]; j++) {
        if (j == checked) {
            /* Children Python must answer (not in the table, undecodable names): the listing goes
             * there from the first of them on, with the same numbering. */
            uint64_t end = j + 256 < count[e] ? j + 256 : count[e];
            for (; checked < end; checked++) {
                uint32_t c = ids[start[e] + checked];
                if (!fast[c] || !t->keys[c])
                    break;
            }
            if (j == checked) {
                if (!sent)
                    goto slow;
                break; /* a short reply: the kernel asks again from here */
            }
        }
        uint32_t c = ids[start[e] + j];
        const char *name = strrchr(t->keys[c], '/');
        fill_st(t, c, &st);
        if (filler(buf, name ? name + 1 : t->keys[c], &st, (off_t)(j + 3), plus))
            break;
        sent = 1;
    }
done:
    atomic_fetch_add_explicit(&t->readdir_fast, 1, memory_order_relaxed);
    return 0;
slow:
    atomic_fetch_add_explicit(&t->readdir_slow, 1, memory_order_relaxed);
    return t->py_readdir(path, buf, filler, off, fi, flags);
}

static int
pread_full(int fd, char *buf, size_t n, int64_t off)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, n - got, (off_t)(off + (int64_t)got));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (r == 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

static uint32_t
le32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* ZipFormat._check_local_header: the local header h (data at d) is member e's own: same method,
 * and the same CRC-32 in the header or, with bit 3 set, in the data descriptor after the data
 * (zero header fields and a descriptor never written pass, as in Python). */
static int
local_header_agrees(FastPath *t, Py_ssize_t e, const unsigned char *h, int64_t d)
{
    uint32_t crc = COL(t, COL_CRC, uint32_t)[e];
    if ((unsigned)(h[8] | (h[9] << 8)) != COL(t, COL_METHOD, uint16_t)[e])
        return 0;
    if (!(h[6] & 0x08)) {
        uint32_t lcrc = le32(h + 14);
        return lcrc == crc || (lcrc == 0 && le32(h + 18) == 0 && le32(h + 22) == 0);
    }
    int64_t end = d + (int64_t)COL(t, COL_COMP, uint64_t)[e];
    unsigned char tail[8];
    int64_t n = t->file_size - end < 8 ? t->file_size - end : 8;
    if (n < 4 || pread_full(t->fd, (char *)tail, (size_t)n, end) != 0)
        return 0;
    uint32_t first = le32(tail);
    if (first == crc || first == 0x04034b50 || first == 0x02014b50 || first == 0x06064b50 ||
        first == 0x06054b50 || first == 0x07064b50)
        return 1;
    return first == 0x08074b50 && n == 8 && le32(tail + 4) == crc;
}

/* ZIP local header -> data offset, as cdmlfs.formats.zip.ZipFormat.data_offset does: the header
 * offset (index column) never changes; the result goes to the data_at column, one aligned 8-byte
 * store that racing resolvers (C threads, Python) make with the same value. */
static int
resolve_local_header(FastPath *t, Py_ssize_t e, int64_t *data_at)
{
    int64_t at = COL(t, COL_OFFSET, int64_t)[e];
    if (!(COL(t, COL_FLAGS, uint8_t)[e] & F_NEEDS_LOCAL_HEADER)) {
        *data_at = at;
        return 0;
    }
    if (t->cols[COL_DATA_AT].len == 0)
        return -1;
    int64_t *resolved = COL(t, COL_DATA_AT, int64_t);
    int64_t known = __atomic_load_n(&resolved[e], __ATOMIC_RELAXED);
    if (known > 0) {
        *data_at = known;
        return 0;
    }
    unsigned char h[30];
    if (at < 0 || at + 30 > t->file_size || pread_full(t->fd, (char *)h, 30, at) != 0)
        return -1;
    if (!(h[0] == 'P' && h[1] == 'K' && h[2] == 3 && h[3] == 4))
        return -1;
    int64_t nlen = h[26] | (h[27] << 8), xlen = h[28] | (h[29] << 8);
    int64_t d = at + 30 + nlen + xlen;
    /* Unsigned: a ZIP64 size near 2^64 is clamped to 2^63 - 1, and d + that would wrap negative. */
    if (d > t->file_size || COL(t, COL_COMP, uint64_t)[e] > (uint64_t)(t->file_size - d))
        return -1; /* Python says why (the member's data runs past the end of the archive) */
    if (!local_header_agrees(t, e, h, d))
        return -1; /* another member's header (Python says which field disagrees) */
    __atomic_store_n(&resolved[e], d, __ATOMIC_RELAXED);
    *data_at = d;
    return 0;
}

static pthread_key_t tls_key;
static pthread_once_t tls_once = PTHREAD_ONCE_INIT;

static void free_decompressor(void *p) { libdeflate_free_decompressor(p); }
static void make_key(void) { (void)pthread_key_create(&tls_key, free_decompressor); }

static struct libdeflate_decompressor *
decompressor(void)
{
    pthread_once(&tls_once, make_key);
    struct libdeflate_decompressor *d = pthread_getspecific(tls_key);
    if (!d) {
        d = libdeflate_alloc_decompressor();
        if (d && pthread_setspecific(tls_key, d) != 0) {
            libdeflate_free_decompressor(d);
            d = NULL;
        }
    }
    return d;
}

/* Index of the hot extent with the largest start <= at, or -1 (caller holds hot_lock). */
static Py_ssize_t
hot_find(const FastPath *t, int64_t at)
{
    Py_ssize_t lo = 0, hi = t->nhot;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (t->hot[mid].start <= at)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo - 1;
}

/* Copy a read of member e out of the hot extent that holds it. A member with its own CRC
 * (check_crc) is served only once it is verified: when the extent holds the whole member, the CRC
 * is checked here and the member marked verified; otherwise (or on a mismatch) Python answers. */
static int
read_hot(FastPath *t, Py_ssize_t e, char *buf, size_t size, off_t off, uint64_t total, int check_crc)
{
    size_t n = (size_t)((uint64_t)off + size > total ? total - (uint64_t)off : size);
    int64_t member = COL(t, COL_OFFSET, int64_t)[e];
    int64_t at = member + (int64_t)off;
    int hit = 0;
    pthread_rwlock_rdlock(&t->hot_lock);
    Py_ssize_t i = hot_find(t, check_crc ? member : at);
    if (i >= 0 && at + (int64_t)n <= t->hot[i].start + (int64_t)t->hot[i].view.len) {
        const char *ext = (const char *)t->hot[i].view.buf;
        int64_t start = t->hot[i].start; /* <= member (check_crc) or <= at */
        if (check_crc) {
            int whole = member + (int64_t)total <= start + (int64_t)t->hot[i].view.len;
            if (whole && cdmlfs_crc32(0, ext + (member - start), (size_t)total) == COL(t, COL_CRC, uint32_t)[e])
                COL(t, COL_VERIFIED, uint8_t)[e] = V_VERIFIED;
            else
                check_crc = -1; /* not here in one piece, or a mismatch: Python checks and reports */
        }
        if (check_crc >= 0) {
            memcpy(buf, ext + (at - start), n);
            hit = 1;
        }
    }
    pthread_rwlock_unlock(&t->hot_lock);
    if (!hit)
        return -1;
    atomic_fetch_add_explicit(&t->read_fast, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&t->bytes_fast, n, memory_order_relaxed);
    return (int)n;
}

/* Whether the archive may have been written in place since it was opened (its size, mtime or ctime
 * moved). A read served here then goes to Python, which judges (LocalFile.check_unchanged): it fails
 * that read and every later one, and logs why, or takes a touch or a chmod for what it is. Checked
 * after the read: a write moves the mtime and ctime before its data lands, so a read it touched sees
 * the change; the ctime also when the mtime was put back afterwards (touch -d cannot set it). */
static int
source_changed(const FastPath *t)
{
    if (!t->has_stamp)
        return 0;
    struct stat st;
    if (fstat(t->stamp_fd, &st) != 0)
        return 1;
    return (int64_t)st.st_size != t->stamp_size ||
           (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec != t->stamp_mtime_ns ||
           (int64_t)st.st_ctim.tv_sec * 1000000000LL + st.st_ctim.tv_nsec != t->stamp_ctime_ns;
}

static int
fp_read(const char *path, char *buf, size_t size, off_t off, void *fi)
{
    FastPath *t = active;
    Py_ssize_t e = lookup(t, path);
    if (e < 0 || !COL(t, COL_FAST, uint8_t)[e] || COL(t, COL_KIND, uint8_t)[e] != K_FILE ||
        (COL(t, COL_FLAGS, uint8_t)[e] & F_ENCRYPTED))
        goto slow;
    uint64_t total = COL(t, COL_SIZE, uint64_t)[e];
    if ((uint64_t)off >= total)
        return 0;
    uint16_t method = COL(t, COL_METHOD, uint16_t)[e];
    if (method == M_IN_STREAM) {
        uint8_t state = COL(t, COL_VERIFIED, uint8_t)[e];
        if (state == V_CORRUPT)
            goto slow; /* its own CRC failed in Python, whatever frame holds it */
        /* A sound frame does not vouch for a member's own CRC: checked before its first byte. */
        int check = (COL(t, COL_FLAGS, uint8_t)[e] & F_MEMBER_CRC) && state != V_VERIFIED;
        int n = read_hot(t, e, buf, size, off, total, check);
        if (n >= 0 && !source_changed(t))
            return n;
        goto slow;
    }
    if ((method != M_STORED && method != M_DEFLATE) || t->fd < 0)
        goto slow;
    uint8_t *verified = COL(t, COL_VERIFIED, uint8_t);
    if (verified[e] == V_CORRUPT)
        goto slow; /* a member that failed once fails on every later read: Python answers EIO */
    int64_t data_at;
    if (resolve_local_header(t, e, &data_at) != 0)
        goto slow;
    uint32_t crc = COL(t, COL_CRC, uint32_t)[e];
    if (method == M_STORED) {
        size_t n = (size_t)((uint64_t)off + size > total ? total - (uint64_t)off : size);
        uint64_t from_source = n;
        int first = verified[e] != V_VERIFIED;
        if (!first) {
            if (pread_full(t->fd, buf, n, data_at + off) != 0)
                goto slow;
        } else {
            /* First read of a member: only when it covers the whole member, so the CRC can be checked. */
            if (off != 0 || size < total || (int64_t)total > t->whole_limit)
                goto slow;
            if (pread_full(t->fd, buf, total, data_at) != 0 || cdmlfs_crc32(0, buf, total) != crc)
                goto slow; /* Python re-reads, reports and logs */
            from_source = total;
        }
        if (source_changed(t))
            goto slow;
        if (first)
            verified[e] = V_VERIFIED; /* only for bytes of the file as opened */
        atomic_fetch_add_explicit(&t->read_fast, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&t->bytes_fast, n, memory_order_relaxed);
        atomic_fetch_add_explicit(&t->bytes_source, from_source, memory_order_relaxed);
        return (int)n;
    }
    /* Deflate: whole small members only (the kernel's first read of a small file covers it). */
    uint64_t comp = COL(t, COL_COMP, uint64_t)[e];
    /* The compressed bytes are read whole into memory the cache never reserved: only as many as a
     * real deflate stream of `total` bytes can take (stored blocks add 5 bytes per 64 KiB). A
     * record declaring 60 MiB for 100 bytes made each libfuse thread allocate them; Python
     * reserves, reads and reports such a member. */
    if (off != 0 || size < total || (int64_t)total > t->whole_limit || comp > (uint64_t)t->whole_limit + 1024 ||
        comp > total + total / 16 + 1024 || total > comp * DEFLATE_MAX_RATIO + DEFLATE_RATIO_SLACK)
        goto slow;
    struct libdeflate_decompressor *d = decompressor();
    if (!d)
        goto slow;
    char stackbuf[16384];
    char *in = comp <= sizeof stackbuf ? stackbuf : malloc(comp ? comp : 1);
    if (!in)
        goto slow;
    /* The stream must end exactly at the member's compressed size, as the Python path requires:
     * anything else (trailing bytes, an empty member stored as zero deflate bytes) goes there. */
    size_t used = 0;
    int ok = pread_full(t->fd, in, comp, data_at) == 0 &&
             libdeflate_deflate_decompress_ex(d, in, comp, buf, total, &used, NULL) == LIBDEFLATE_SUCCESS &&
             used == comp && cdmlfs_crc32(0, buf, total) == crc;
    if (in != stackbuf)
        free(in);
    if (!ok || source_changed(t))
        goto slow;
    atomic_fetch_add_explicit(&t->read_fast, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&t->bytes_fast, total, memory_order_relaxed);
    atomic_fetch_add_explicit(&t->bytes_source, comp, memory_order_relaxed);
    return (int)total;
slow:
    atomic_fetch_add_explicit(&t->read_slow, 1, memory_order_relaxed);
    return t->py_read(path, buf, size, off, fi);
}

/* ------------------------------------------------------------ Python type */

static void
FastPath_dealloc(FastPath *self)
{
    if (active == self)
        active = NULL;
    for (int i = 0; i < self->ncols_held; i++)
        PyBuffer_Release(&self->cols[i]);
    for (int i = 0; i < self->tree_held; i++)
        PyBuffer_Release(&self->tree[i]);
    for (Py_ssize_t i = 0; i < self->nhot; i++)
        PyBuffer_Release(&self->hot[i].view);
    PyMem_RawFree(self->hot);
    if (self->lookup)
        pthread_rwlock_destroy(&self->hot_lock);
    PyMem_RawFree(self->slots);
    PyMem_RawFree((void *)self->keys);
    Py_XDECREF(self->lookup);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
FastPath_init(FastPath *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"lookup", "columns", "fd", "file_size", "uid", "gid", "whole_limit", NULL};
    PyObject *lookup_dict, *columns;
    int fd;
    long long file_size, whole_limit;
    unsigned int uid, gid;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!iLIIL", kwlist, &PyDict_Type, &lookup_dict, &PyDict_Type,
                                     &columns, &fd, &file_size, &uid, &gid, &whole_limit))
        return -1;
    if (self->lookup) {
        PyErr_SetString(PyExc_RuntimeError, "FastPath is already initialised");
        return -1;
    }
    /* What a failed earlier call left behind (buffers held, tables allocated) goes first. */
    for (int i = 0; i < self->ncols_held; i++)
        PyBuffer_Release(&self->cols[i]);
    self->ncols_held = 0;
    PyMem_RawFree(self->slots);
    PyMem_RawFree((void *)self->keys);
    self->slots = NULL;
    self->keys = NULL;
    Py_ssize_t n = -1;
    for (int c = 0; c < NCOLS; c++) {
        PyObject *obj = PyDict_GetItemString(columns, col_names[c]);
        if (!obj) {
            PyErr_Format(PyExc_KeyError, "missing column %s", col_names[c]);
            return -1;
        }
        int flags = PyBUF_C_CONTIGUOUS | (col_writable[c] ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(obj, &self->cols[c], flags) != 0)
            return -1;
        self->ncols_held = c + 1;
        Py_ssize_t rows = self->cols[c].len / col_itemsize[c];
        if (rows == 0 && col_may_be_empty[c])
            continue;
        if (self->cols[c].len % col_itemsize[c] || (n >= 0 && rows != n)) {
            PyErr_Format(PyExc_ValueError, "column %s has the wrong size", col_names[c]);
            return -1;
        }
        n = rows;
    }
    if (n > 0xfffffffeLL) {
        PyErr_SetString(PyExc_ValueError, "too many entries for the fast path");
        return -1;
    }
    self->n = n;
    Py_ssize_t count = PyDict_Size(lookup_dict);
    uint64_t cap = 16;
    while (cap < (uint64_t)count * 2 + 2)
        cap <<= 1;
    self->slots = PyMem_RawCalloc(cap, sizeof(uint64_t));
    self->keys = PyMem_RawCalloc(n ? n : 1, sizeof(char *));
    if (!self->slots || !self->keys) {
        PyErr_NoMemory();
        return -1;
    }
    self->mask = cap - 1;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(lookup_dict, &pos, &key, &value)) {
        long long eid = PyLong_AsLongLong(value);
        if (eid < 0 || eid >= n) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "entry id out of range");
            return -1;
        }
        const char *utf8 = PyUnicode_AsUTF8AndSize(key, NULL);
        if (!utf8) { /* surrogate-escaped bytes: left to the Python path */
            PyErr_Clear();
            continue;
        }
        self->keys[eid] = utf8;
        uint64_t h = fnv1a(utf8);
        uint64_t i = h & self->mask;
        while (self->slots[i])
            i = (i + 1) & self->mask;
        self->slots[i] = ((h >> 32) << 32) | (uint64_t)(eid + 1);
    }
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
#if defined(__GLIBC__) && defined(__USE_GNU)
    /* Readers never hold it long, but a stream of them must not starve an eviction (it waits
     * with the cache lock held). */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    pthread_rwlock_init(&self->hot_lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    Py_INCREF(lookup_dict);
    self->lookup = lookup_dict;
    self->fd = fd;
    self->file_size = file_size;
    self->uid = uid;
    self->gid = gid;
    self->whole_limit = whole_limit;
    return 0;
}

/*
 * ioctl: Python's open() asks every file whether it is a terminal (TCGETS); those get ENOTTY
 * here. Only the stats request (cdmlfs.statsio) goes to Python.
 */
static int
fp_ioctl(const char *path, unsigned int cmd, void *arg, void *fi, unsigned int flags, void *data)
{
    FastPath *t = active;
    if (cmd == t->stats_request && t->py_ioctl)
        return t->py_ioctl(path, cmd, arg, fi, flags, data);
    atomic_fetch_add_explicit(&t->ioctl_fast, 1, memory_order_relaxed);
    return -ENOTTY;
}

static PyObject *
FastPath_activate(FastPath *self, PyObject *args)
{
    unsigned long long g, r, x = 0, d = 0;
    unsigned int stats_request = 0;
    if (!PyArg_ParseTuple(args, "KK|KKI", &g, &r, &x, &d, &stats_request))
        return NULL;
    if (!self->lookup || !g || !r) {
        PyErr_SetString(PyExc_ValueError, "initialise the table and pass both fallback callbacks");
        return NULL;
    }
    self->py_getattr = (getattr_fn)(uintptr_t)g;
    self->py_read = (read_fn)(uintptr_t)r;
    self->py_ioctl = (ioctl_fn)(uintptr_t)x;
    self->stats_request = stats_request;
    self->py_readdir = (readdir_fn)(uintptr_t)d;
    /* The C callbacks may run until the process ends, so an active table is never released: not
     * even when another replaces it (only tests activate twice), as a callback on another thread
     * may still be reading the earlier one. */
    Py_INCREF(self);
    active = self;
    return Py_BuildValue("KKKK", (unsigned long long)(uintptr_t)fp_getattr, (unsigned long long)(uintptr_t)fp_read,
                         (unsigned long long)(x ? (uintptr_t)fp_ioctl : 0),
                         (unsigned long long)(d ? (uintptr_t)fp_readdir : 0));
}

static PyObject *
FastPath_set_tree(FastPath *self, PyObject *args)
{
    PyObject *objs[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objs[0], &objs[1], &objs[2], &objs[3]))
        return NULL;
    if (!self->lookup || self->tree_held) {
        PyErr_SetString(PyExc_RuntimeError, "set_tree: initialise the table first, and only once");
        return NULL;
    }
    Py_buffer views[4];
    int held = 0;
    for (; held < 4; held++)
        if (PyObject_GetBuffer(objs[held], &views[held], PyBUF_C_CONTIGUOUS) != 0)
            goto fail;
    /* parent, child_start, child_count: one uint32 per entry; child_ids: any number, all < n. */
    for (int i = 0; i < 4; i++)
        if (views[i].itemsize != 4 || views[i].len % 4 || (i < 3 && views[i].len / 4 != self->n)) {
            PyErr_SetString(PyExc_ValueError, "set_tree: uint32 arrays, one per entry (child ids: any length)");
            goto fail;
        }
    const uint32_t *parent = views[0].buf, *start = views[1].buf, *count = views[2].buf, *ids = views[3].buf;
    Py_ssize_t nids = views[3].len / 4;
    for (Py_ssize_t e = 0; e < self->n; e++)
        if (parent[e] >= (uint64_t)self->n || (uint64_t)start[e] + count[e] > (uint64_t)nids) {
            PyErr_SetString(PyExc_ValueError, "set_tree: a parent or a run of children out of range");
            goto fail;
        }
    for (Py_ssize_t j = 0; j < nids; j++)
        if (ids[j] >= (uint64_t)self->n) {
            PyErr_SetString(PyExc_ValueError, "set_tree: a child id out of range");
            goto fail;
        }
    memcpy(self->tree, views, sizeof views);
    self->tree_held = 4;
    Py_RETURN_NONE;
fail:
    while (held-- > 0)
        PyBuffer_Release(&views[held]);
    return NULL;
}

static void
hot_lock_exclusive(FastPath *self)
{
    Py_BEGIN_ALLOW_THREADS /* a C reader may be copying out of an extent */
    pthread_rwlock_wrlock(&self->hot_lock);
    Py_END_ALLOW_THREADS
}

static PyObject *
FastPath_add_hot(FastPath *self, PyObject *args)
{
    long long start;
    PyObject *data;
    if (!PyArg_ParseTuple(args, "LO", &start, &data))
        return NULL;
    if (!self->lookup) {
        PyErr_SetString(PyExc_RuntimeError, "FastPath is not initialised");
        return NULL;
    }
    HotExtent e = {.start = start};
    if (PyObject_GetBuffer(data, &e.view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_buffer old;
    int replaced = 0;
    hot_lock_exclusive(self);
    Py_ssize_t i = hot_find(self, start);
    if (i >= 0 && self->hot[i].start == start) {
        old = self->hot[i].view;
        self->hot[i] = e;
        replaced = 1;
    } else {
        if (self->nhot == self->hot_cap) {
            Py_ssize_t cap = self->hot_cap ? 2 * self->hot_cap : 64;
            HotExtent *grown = PyMem_RawRealloc(self->hot, (size_t)cap * sizeof(HotExtent));
            if (!grown) {
                pthread_rwlock_unlock(&self->hot_lock);
                PyBuffer_Release(&e.view);
                return PyErr_NoMemory();
            }
            self->hot = grown;
            self->hot_cap = cap;
        }
        memmove(&self->hot[i + 2], &self->hot[i + 1], (size_t)(self->nhot - i - 1) * sizeof(HotExtent));
        self->hot[i + 1] = e;
        self->nhot++;
    }
    pthread_rwlock_unlock(&self->hot_lock);
    if (replaced)
        PyBuffer_Release(&old);
    Py_RETURN_NONE;
}

static PyObject *
FastPath_drop_hot(FastPath *self, PyObject *args)
{
    long long start;
    if (!PyArg_ParseTuple(args, "L", &start))
        return NULL;
    if (!self->lookup)
        Py_RETURN_FALSE;
    Py_buffer old;
    int found = 0;
    hot_lock_exclusive(self);
    Py_ssize_t i = hot_find(self, start);
    if (i >= 0 && self->hot[i].start == start) {
        old = self->hot[i].view;
        memmove(&self->hot[i], &self->hot[i + 1], (size_t)(self->nhot - i - 1) * sizeof(HotExtent));
        self->nhot--;
        found = 1;
    }
    pthread_rwlock_unlock(&self->hot_lock);
    if (!found)
        Py_RETURN_FALSE;
    PyBuffer_Release(&old); /* after the unlock: releasing may free the extent */
    Py_RETURN_TRUE;
}

static PyObject *
FastPath_hot_count(FastPath *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->nhot);
}

static PyObject *
FastPath_lookup(FastPath *self, PyObject *arg)
{
    if (!self->lookup) {
        PyErr_SetString(PyExc_RuntimeError, "FastPath is not initialised");
        return NULL;
    }
    const char *path = PyUnicode_AsUTF8(arg);
    if (!path)
        return NULL;
    return PyLong_FromSsize_t(lookup(self, path));
}

static PyObject *
FastPath_stats(FastPath *self, PyObject *Py_UNUSED(ignored))
{
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsK}", "getattr_fast", (unsigned long long)atomic_load(&self->getattr_fast),
                         "getattr_fallback", (unsigned long long)atomic_load(&self->getattr_slow), "read_fast",
                         (unsigned long long)atomic_load(&self->read_fast), "read_fallback",
                         (unsigned long long)atomic_load(&self->read_slow), "bytes_fast",
                         (unsigned long long)atomic_load(&self->bytes_fast), "bytes_source",
                         (unsigned long long)atomic_load(&self->bytes_source), "ioctl_fast",
                         (unsigned long long)atomic_load(&self->ioctl_fast), "readdir_fast",
                         (unsigned long long)atomic_load(&self->readdir_fast), "readdir_fallback",
                         (unsigned long long)atomic_load(&self->readdir_slow));
}

static PyObject *
FastPath_nbytes(FastPath *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong((self->mask + 1) * sizeof(uint64_t) + (unsigned long long)self->n * sizeof(char *));
}

static PyObject *
FastPath_set_source_stamp(FastPath *self, PyObject *args)
{
    int fd;
    long long size, mtime_ns, ctime_ns;
    if (!PyArg_ParseTuple(args, "iLLL", &fd, &size, &mtime_ns, &ctime_ns))
        return NULL;
    self->stamp_fd = fd;
    self->stamp_size = size;
    self->stamp_mtime_ns = mtime_ns; /* as Python's st_mtime_ns: seconds * 1e9 + nanoseconds */
    self->stamp_ctime_ns = ctime_ns;
    self->has_stamp = fd >= 0;
    Py_RETURN_NONE;
}

static PyMethodDef FastPath_methods[] = {
    {"activate", (PyCFunction)FastPath_activate, METH_VARARGS,
     "activate(getattr, read[, ioctl[, readdir[, stats_request]]] fallbacks) -> the C callbacks' addresses\n"
     "Serve from this table; returns the C callbacks to put in fuse_operations."},
    {"lookup", (PyCFunction)FastPath_lookup, METH_O, "lookup(path) -> entry id or -1 (for tests)"},
    {"set_tree", (PyCFunction)FastPath_set_tree, METH_VARARGS,
     "set_tree(parent, child_start, child_count, child_ids): the directory tree, for readdir in C"},
    {"add_hot", (PyCFunction)FastPath_add_hot, METH_VARARGS,
     "add_hot(start, data): serve reads inside this container-stream extent (any buffer) in C"},
    {"drop_hot", (PyCFunction)FastPath_drop_hot, METH_VARARGS,
     "drop_hot(start) -> bool: stop serving from the extent at `start` and release it"},
    {"set_source_stamp", (PyCFunction)FastPath_set_source_stamp, METH_VARARGS,
     "set_source_stamp(fd, size, mtime_ns, ctime_ns): fall back to Python for reads once the archive file changed"},
    {"stats", (PyCFunction)FastPath_stats, METH_NOARGS, "Counters of requests served in C and passed on."},
    {NULL},
};

static PyGetSetDef FastPath_getset[] = {
    {"nbytes", (getter)FastPath_nbytes, NULL, "memory held by the hash table", NULL},
    {"hot_extents", (getter)FastPath_hot_count, NULL, "number of extents reads are served from in C", NULL},
    {NULL},
};

static PyTypeObject FastPathType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cdmlfs._fastpath.FastPath",
    .tp_basicsize = sizeof(FastPath),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "FastPath(lookup, columns, fd, file_size, uid, gid, whole_limit): C getattr/read over an index.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastPath_init,
    .tp_dealloc = (destructor)FastPath_dealloc,
    .tp_methods = FastPath_methods,
    .tp_getset = FastPath_getset,
};

/* Empty, but present: faulthandler's crash report lists only extension modules with a methods table. */
static PyMethodDef fastpath_module_methods[] = {
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cdmlfs._fastpath",
    .m_doc = "C getattr/read callbacks for libfuse3's high-level API.",
    .m_size = -1,
    .m_methods = fastpath_module_methods,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    if (PyType_Ready(&FastPathType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&fastpath_module);
    if (!m)
        return NULL;
    Py_INCREF(&FastPathType);
    if (PyModule_AddObject(m, "FastPath", (PyObject *)&FastPathType) < 0) {
        Py_DECREF(&FastPathType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "CRC32_BACKEND", CDMLFS_CRC32_BACKEND) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
