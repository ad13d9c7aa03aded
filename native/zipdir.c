/*
 * cdmlfs._zipdir: the ZIP central directory parse of cdmlfs/formats/zip.py, in C, for the
 * records that need none of its special cases.
 *
 * Why: mounting a ZIP parses every central directory record and adds it to the index.  In
 * Python that costs ~6 us per entry (1.2-1.8 s for 200,000 entries on the 2-core CI machine,
 * most of a mount).  Nearly every record of a real dataset is "plain": an ASCII or UTF-8
 * name that is already a safe relative path, a new path in a directory already known, no
 * record that contradicts itself.  plain_run() adds a run of such records to the index
 * builder's own containers and returns their columns; it stops, without consuming it, at the
 * first record that is anything else, and the Python parser handles that one (warnings,
 * problems, implied directories, duplicates, cp437 names, unicode path fields, errors) before
 * calling it again.  So every rule lives in Python, and this file only has to agree with it on
 * the plain records: tests/test_zip_native.py compares whole indexes built both ways.
 *
 * plain_run(buf, pos, end, max_records, prefix, source_size, dos_cache, paths, lookup, dir_ids,
 *           path_bytes, path_allowance, allowance_per_entry, implied_dir_mode, implied_dir_mtime)
 *   -> (records, entries, new_pos, path_bytes, path_allowance,
 *       kind, mode, mtime, size, method, flags, offset, comp_size, crc, parent)
 * The columns are bytes in the item formats of cdmlfs.index.Index (B, H, d, Q, H, B, q, Q, I, I);
 * entries counts them: the records' entries and the directories their paths imply
 * (IndexBuilder._make_dirs), in the order the Python builder would add them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Must match cdmlfs/index.py and cdmlfs/formats/zip.py. */
#define KIND_FILE 0
#define KIND_DIR 1
#define KIND_SYMLINK 2
#define METHOD_STORED 0
#define METHOD_AES 99
#define F_ENCRYPTED 1
#define F_NEEDS_LOCAL_HEADER 2
#define F_INCONSISTENT 8
#define PERMISSION_BITS 0777
#define MAX_MTIME 1099511627776.0 /* 2**40 */
#define MAX_SIZE UINT64_C(0x7FFFFFFFFFFFFFFF)
#define FLAG_ENCRYPTED 0x1
#define FLAG_STRONG_ENCRYPTION 0x40
#define FLAG_UTF8 0x800
#define CDH_SIG 0x02014B50u
#define NAME_MAX_BYTES 255
#define NTFS_EPOCH_OFFSET UINT64_C(116444736000000000)
#define MAX_IMPLIED 32 /* directories one record may imply here; deeper names go to Python */

static uint16_t
le16(const unsigned char *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t
le32(const unsigned char *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static uint64_t
le64(const unsigned char *p)
{
    return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32);
}

/* Python's set UNIX_MODE_SYSTEMS and SYMLINK_SYSTEMS. */
static int
unix_mode_system(unsigned system)
{
    switch (system) {
    case 2: case 3: case 5: case 12: case 13: case 16: case 17: case 30:
        return 1;
    }
    return 0;
}

static int
symlink_system(unsigned system)
{
    switch (system) {
    case 0: case 2: case 3: case 5: case 16: case 30:
        return 1;
    }
    return 0;
}

/* The name is already what pathrules.normalize() returns (but for one trailing '/'): every
 * component non-empty, not "." or "..", free of NUL and backslash (a ZIP separator), at most
 * NAME_MAX bytes.  Bytes, not characters: '/', '\\', '.' and NUL are single bytes in UTF-8, and a
 * surrogate-escaped name encodes back to these very bytes. */
static int
name_is_normal(const unsigned char *name, Py_ssize_t n)
{
    Py_ssize_t start = 0;
    if (n == 0)
        return 0;
    if (name[n - 1] == '/')
        n--;
    if (n == 0)
        return 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (i == n || name[i] == '/') {
            Py_ssize_t len = i - start;
            if (len == 0 || len > NAME_MAX_BYTES)
                return 0;
            if (name[start] == '.' && (len == 1 || (len == 2 && name[start + 1] == '.')))
                return 0;
            start = i + 1;
        }
        else if (name[i] == 0 || name[i] == '\\') {
            return 0;
        }
    }
    return 1;
}

static int
is_ascii(const unsigned char *p, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i] & 0x80)
            return 0;
    return 1;
}

/* The extra field at *at (zip.py _iter_extra): its id, and its body cut at the end of the extra
 * fields; advances *at.  0 when no field header is left. */
static int
next_extra(const unsigned char *extra, Py_ssize_t len, Py_ssize_t *at, unsigned *hid,
           const unsigned char **body, Py_ssize_t *blen)
{
    Py_ssize_t xp = *at, hlen;
    if (xp + 4 > len)
        return 0;
    *hid = le16(extra + xp);
    hlen = le16(extra + xp + 2);
    *body = extra + xp + 4;
    *blen = len - xp - 4 < hlen ? len - xp - 4 : hlen;
    *at = xp + 4 + hlen;
    return 1;
}

/* zip.py _ntfs_mtime: tag 1 of an NTFS extra field; returns 0 when it has none (or a zero time,
 * or one past the index's range). */
static int
ntfs_mtime(const unsigned char *body, Py_ssize_t len, double *out)
{
    Py_ssize_t pos = 4;
    while (pos + 4 <= len) {
        unsigned tag = le16(body + pos), size = le16(body + pos + 2);
        pos += 4;
        if (tag == 1 && size >= 8 && pos + 8 <= len) {
            uint64_t ft = le64(body + pos);
            if (!ft)
                return 0;
            /* Python: (ft - K) / 1e7 with an exact integer difference, correctly rounded to a double. */
            *out = ft >= NTFS_EPOCH_OFFSET ? (double)(ft - NTFS_EPOCH_OFFSET) / 1e7
                                           : -(double)(NTFS_EPOCH_OFFSET - ft) / 1e7;
            return *out >= -MAX_MTIME && *out <= MAX_MTIME; /* past the range: absent, as unzip */
        }
        pos += size;
    }
    return 0;
}

/* zip.py _dos_to_epoch: time.mktime of the local date and time (0.0 where mktime fails). */
static double
dos_to_epoch_uncached(unsigned ddate, unsigned dtime)
{
    struct tm tm;
    unsigned month = (ddate >> 5) & 0xF, day = ddate & 0x1F;
    time_t t;
    memset(&tm, 0, sizeof tm);
    tm.tm_year = (int)((ddate >> 9) & 0x7F) + 1980 - 1900;
    tm.tm_mon = (int)(month ? month : 1) - 1;
    tm.tm_mday = (int)(day ? day : 1);
    tm.tm_hour = (int)((dtime >> 11) & 0x1F);
    tm.tm_min = (int)((dtime >> 5) & 0x3F);
    tm.tm_sec = (int)(dtime & 0x1F) * 2;
    tm.tm_isdst = -1;
    tm.tm_wday = -1; /* as time.mktime: -1 that mktime leaves alone means failure */
    t = mktime(&tm);
    if (t == (time_t)-1 && tm.tm_wday == -1)
        return 0.0;
    return (double)t;
}

/* The parse's DOS time cache, shared with the Python parser (zip.py dos_cache): glibc's mktime
 * resolves an ambiguous local time (the hour repeated when clocks go back) from the state its
 * previous call left, so both parsers must compute each date once, at its first record, as the
 * Python parser alone would.  Returns -1 with an exception set on error. */
static int
dos_to_epoch(PyObject *cache, unsigned ddate, unsigned dtime, double *out)
{
    PyObject *key = PyLong_FromUnsignedLong(((unsigned long)ddate << 16) | dtime), *value;
    int rc = -1;
    if (!key)
        return -1;
    value = PyDict_GetItemWithError(cache, key);
    if (value) {
        *out = PyFloat_AsDouble(value);
        rc = *out == -1.0 && PyErr_Occurred() ? -1 : 0;
    }
    else if (!PyErr_Occurred()) {
        *out = dos_to_epoch_uncached(ddate, dtime);
        value = PyFloat_FromDouble(*out);
        rc = value && PyDict_SetItem(cache, key, value) == 0 ? 0 : -1;
        Py_XDECREF(value);
    }
    Py_DECREF(key);
    return rc;
}

struct columns {
    unsigned char *kind, *flags;
    uint16_t *mode, *method;
    double *mtime;
    uint64_t *size, *comp_size;
    int64_t *offset;
    uint32_t *crc, *parent;
};

/* Row n of the columns (a directory has no data: its size, method, flags, offset and CRC are 0). */
static void
put_row(struct columns *c, Py_ssize_t n, unsigned kind, unsigned mode, double mtime, long parent,
        uint64_t size, unsigned method, unsigned char flags, int64_t offset, uint64_t comp_size, uint32_t crc)
{
    int dir = kind == KIND_DIR;
    c->kind[n] = (unsigned char)kind;
    c->mode[n] = (uint16_t)(mode & PERMISSION_BITS);
    c->mtime[n] = mtime;
    c->parent[n] = (uint32_t)parent;
    c->size[n] = dir ? 0 : size;
    c->method[n] = (uint16_t)(dir ? METHOD_STORED : method);
    c->flags[n] = dir ? 0 : flags;
    c->offset[n] = dir ? 0 : offset;
    c->comp_size[n] = dir ? 0 : comp_size;
    c->crc[n] = dir ? 0 : crc;
}

/* paths.append(path); lookup[path] = dir_ids[path] (a directory) = eid: as IndexBuilder does. */
static int
add_path(PyObject *paths, PyObject *lookup, PyObject *dir_ids, PyObject *path, Py_ssize_t eid_value,
         int is_dir)
{
    PyObject *eid = PyLong_FromSsize_t(eid_value);
    int bad = !eid || PyList_Append(paths, path) < 0 || PyDict_SetItem(lookup, path, eid) < 0
              || (is_dir && PyDict_SetItem(dir_ids, path, eid) < 0);
    Py_XDECREF(eid);
    return bad ? -1 : 0;
}

/* The entry id of path's parent directory, as IndexBuilder.add finds it, or -1 to leave the
 * record to Python (or on error: *err = 1, an exception set).  Missing ancestors, which
 * IndexBuilder._make_dirs would create, go to missing[] deepest first and their characters to
 * *path_chars; one that is a file already (a warning) or more than MAX_IMPLIED of them leave the
 * record to Python.  Consecutive entries mostly share their directory: the last one found is
 * remembered by its bytes (dir_ids only ever gains keys, so a found id stays right). */
static long
parent_dir(PyObject *dir_ids, PyObject *lookup, PyObject *path, const unsigned char *raw,
           Py_ssize_t raw_len, PyObject **last_parent, long *last_id, PyObject **missing, int *n_missing,
           long long *path_chars, int *err)
{
    Py_ssize_t cut = raw_len, end;
    while (cut > 0 && raw[cut - 1] != '/')
        cut--;
    cut = cut > 0 ? cut - 1 : 0; /* bytes of the parent path */
    if (*last_parent && PyBytes_GET_SIZE(*last_parent) == cut
        && memcmp(PyBytes_AS_STRING(*last_parent), raw, (size_t)cut) == 0)
        return *last_id;
    end = PyUnicode_FindChar(path, '/', 0, PyUnicode_GET_LENGTH(path), -1);
    for (;;) {
        PyObject *prefix, *value;
        int clash;
        if (end == -2)
            goto error;
        if (end == -1)
            end = 0; /* the root, named "" */
        if (!(prefix = PyUnicode_Substring(path, 0, end)))
            goto error;
        value = PyDict_GetItemWithError(dir_ids, prefix);
        if (value) {
            long id = PyLong_AsLong(value);
            Py_DECREF(prefix);
            if (id == -1 && PyErr_Occurred())
                goto error;
            if (*n_missing == 0) {
                Py_XDECREF(*last_parent);
                if (!(*last_parent = PyBytes_FromStringAndSize((const char *)raw, cut)))
                    goto error;
                *last_id = id;
            }
            return id;
        }
        if (PyErr_Occurred()) {
            Py_DECREF(prefix);
            goto error;
        }
        clash = end == 0 || *n_missing == MAX_IMPLIED ? 1 : PyDict_Contains(lookup, prefix);
        if (clash != 0) {
            Py_DECREF(prefix);
            if (clash < 0)
                goto error;
            return -1;
        }
        missing[(*n_missing)++] = prefix;
        *path_chars += PyUnicode_GET_LENGTH(prefix);
        end = PyUnicode_FindChar(path, '/', 0, end, -1);
    }
error:
    *err = 1;
    return -1;
}

static PyObject *
plain_run(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t pos, end, max_records;
    long long prefix, source_size, path_bytes, allowance, per_entry;
    unsigned dir_mode;
    double dir_mtime;
    PyObject *missing[MAX_IMPLIED];
    int n_missing = 0;
    PyObject *dos_cache, *paths, *lookup, *dir_ids;
    PyObject *last_parent = NULL, *result = NULL;
    long last_parent_id = 0;
    struct columns c;
    void *block = NULL;
    Py_ssize_t n = 0, records = 0, cap, cap_records, first_eid;
    uint32_t dos_key = 0;
    double dos_value = 0.0;
    int dos_known = 0; /* dos_key/dos_value hold the last date looked up in dos_cache */
    int err = 0;

    if (!PyArg_ParseTuple(args, "y*nnnLLO!O!O!O!LLLId:plain_run", &view, &pos, &end, &max_records, &prefix,
                          &source_size, &PyDict_Type, &dos_cache, &PyList_Type, &paths, &PyDict_Type,
                          &lookup, &PyDict_Type, &dir_ids, &path_bytes, &allowance, &per_entry, &dir_mode,
                          &dir_mtime))
        return NULL;
    if (pos < 0 || end > view.len || pos > end || prefix < 0 || prefix > source_size || max_records < 0) {
        PyErr_SetString(PyExc_ValueError, "plain_run: bad range");
        goto done;
    }
    cap_records = (end - pos) / 46;
    if (cap_records > max_records)
        cap_records = max_records;
    /* Room for one implied directory per record, and for the deepest record at the start. */
    cap = 2 * cap_records + MAX_IMPLIED + 1;
    block = malloc((size_t)(cap ? cap : 1) * (1 + 1 + 2 * 2 + 8 * 4 + 4 * 2)); /* the 10 columns */
    if (!block) {
        PyErr_NoMemory();
        goto done;
    }
    {
        unsigned char *p = block;
        c.mtime = (double *)p; p += cap * 8;
        c.size = (uint64_t *)p; p += cap * 8;
        c.comp_size = (uint64_t *)p; p += cap * 8;
        c.offset = (int64_t *)p; p += cap * 8;
        c.crc = (uint32_t *)p; p += cap * 4;
        c.parent = (uint32_t *)p; p += cap * 4;
        c.mode = (uint16_t *)p; p += cap * 2;
        c.method = (uint16_t *)p; p += cap * 2;
        c.kind = p; p += cap;
        c.flags = p;
    }
    first_eid = PyList_GET_SIZE(paths);

    while (records < cap_records) {
        const unsigned char *rec = (const unsigned char *)view.buf + pos;
        unsigned made_by, gflags, method, dtime, ddate, nlen, xlen, clen, system, kind, mode;
        uint32_t crc, eattr;
        uint64_t csize, usize, loff;
        const unsigned char *name, *extra;
        Py_ssize_t rec_len, path_len;
        double mtime = 0.0;
        int have_mtime = 0;
        unsigned char eflags;
        int ends_with_slash;
        PyObject *path, *known;
        long parent;
        long long new_allowance, new_path_bytes;
        int64_t offset;

        if (end - pos < 46 || le32(rec) != CDH_SIG)
            break;
        made_by = le16(rec + 4);
        gflags = le16(rec + 8);
        method = le16(rec + 10);
        dtime = le16(rec + 12);
        ddate = le16(rec + 14);
        crc = le32(rec + 16);
        csize = le32(rec + 20);
        usize = le32(rec + 24);
        nlen = le16(rec + 28);
        xlen = le16(rec + 30);
        clen = le16(rec + 32);
        eattr = le32(rec + 38);
        loff = le32(rec + 42);
        rec_len = 46 + (Py_ssize_t)nlen + xlen + clen;
        if (end - pos < rec_len)
            break;
        name = rec + 46;
        extra = name + nlen;
        system = made_by >> 8;
        /* Names the Python parser decodes otherwise (cp437) or replaces (unicode path field). */
        if (!(gflags & FLAG_UTF8) && system != 3 && system != 19 && !is_ascii(name, nlen))
            break;
        if (!name_is_normal(name, nlen))
            break;
        ends_with_slash = name[nlen - 1] == '/';

        /* ZIP64 values, from the first ZIP64 extra field (zip.py _zip64_values). */
        if (usize == 0xFFFFFFFFu || csize == 0xFFFFFFFFu || loff == 0xFFFFFFFFu) {
            Py_ssize_t xp = 0;
            int found = 0;
            unsigned hid;
            const unsigned char *body;
            Py_ssize_t blen;
            while (next_extra(extra, xlen, &xp, &hid, &body, &blen)) {
                if (hid == 0x0001) {
                    Py_ssize_t bp = 0;
                    found = 1;
                    if (usize == 0xFFFFFFFFu) {
                        if (bp + 8 > blen) { found = 0; break; }
                        usize = le64(body + bp);
                        bp += 8;
                    }
                    if (csize == 0xFFFFFFFFu) {
                        if (bp + 8 > blen) { found = 0; break; }
                        csize = le64(body + bp);
                        bp += 8;
                    }
                    if (loff == 0xFFFFFFFFu) {
                        if (bp + 8 > blen) { found = 0; break; }
                        loff = le64(body + bp);
                    }
                    break;
                }
            }
            if (!found)
                break; /* a problem the Python parser records */
        }
        /* Times and the unicode path field (zip.py _time_and_unicode_path). */
        if (xlen) {
            Py_ssize_t xp = 0;
            double ext = 0.0, ntfs = 0.0;
            int have_ext = 0, have_ntfs = 0, upath = 0;
            unsigned hid;
            const unsigned char *body;
            Py_ssize_t blen;
            while (next_extra(extra, xlen, &xp, &hid, &body, &blen)) {
                if (hid == 0x5455 && blen >= 5 && (body[0] & 1)) {
                    /* zip.py ext_timestamp: a top bit set counts only where the DOS time agrees. */
                    uint32_t v = le32(body + 1);
                    uint32_t dos = ((uint32_t)ddate << 16) | dtime;
                    have_ext = 1;
                    if (!(v >> 31) || dos >= 0x74320000u)
                        ext = (double)v;
                    else if (dos == 0x00210000u)
                        ext = (double)v - 4294967296.0;
                    else
                        have_ext = 0;
                }
                else if (hid == 0x000A) {
                    have_ntfs = ntfs_mtime(body, blen, &ntfs); /* the last NTFS field decides */
                }
                else if (hid == 0x7075 && blen >= 5 && body[0] == 1) {
                    upath = 1;
                }
            }
            if (upath && !(gflags & FLAG_UTF8))
                break;
            if (have_ntfs) {
                mtime = ntfs;
                have_mtime = 1;
            }
            else if (have_ext) {
                mtime = ext;
                have_mtime = 1;
            }
        }
        /* Kind and permissions (zip.py _unix_mode, _dos_mode). */
        {
            unsigned mode_hi = eattr >> 16;
            int have_unix = 0;
            if (mode_hi) {
                if (unix_mode_system(system)) {
                    have_unix = 1;
                }
                else if (system == 0) {
                    int is_dir = (eattr & 0x10) || ends_with_slash;
                    unsigned owner = 0400 | ((eattr & 0x01) ? 0 : 0200) | (is_dir ? 0100 : 0);
                    have_unix = (mode_hi & 0700) == owner;
                }
            }
            if (have_unix) {
                unsigned ftype = mode_hi & 0170000;
                kind = ftype == 0040000 ? KIND_DIR
                       : (ftype == 0120000 && symlink_system(system)) ? KIND_SYMLINK
                       : KIND_FILE;
                mode = mode_hi & 0777;
            }
            else {
                kind = ((eattr & 0x10) || ends_with_slash) ? KIND_DIR : KIND_FILE;
                mode = 0444 | ((eattr & 0x01) ? 0 : 0200) | (kind == KIND_DIR ? 0111 : 0);
            }
            if (ends_with_slash)
                kind = KIND_DIR;
            else if (kind == KIND_DIR && (usize || csize)) /* zip.py: a file, by its name */
                kind = KIND_FILE; /* with the attributes' mode, x bits too, as unzip gives it */
        }
        eflags = F_NEEDS_LOCAL_HEADER;
        if ((gflags & (FLAG_ENCRYPTED | FLAG_STRONG_ENCRYPTION)) || method == METHOD_AES)
            eflags |= F_ENCRYPTED;
        else if (usize == 0 && kind == KIND_FILE && (crc != 0 || (method == METHOD_STORED && csize != 0)))
            eflags |= F_INCONSISTENT;
        else if (method == METHOD_STORED && kind == KIND_FILE && csize != usize)
            break; /* a problem the Python parser records */
        offset = loff >= (uint64_t)(source_size - prefix) ? -1 : (int64_t)(loff + (uint64_t)prefix);
        if (usize > MAX_SIZE)
            usize = MAX_SIZE;
        if (csize > MAX_SIZE)
            csize = MAX_SIZE;
        if (kind == KIND_SYMLINK && usize == 0)
            break; /* IndexBuilder.add drops an empty link target, with a warning */
        if (kind == KIND_SYMLINK)
            mode = 0777;

        /* IndexBuilder.add for a new path in a known directory. */
        path_len = ends_with_slash ? (Py_ssize_t)nlen - 1 : (Py_ssize_t)nlen;
        path = PyUnicode_DecodeUTF8((const char *)name, path_len, "surrogateescape");
        if (!path) {
            err = 1;
            break;
        }
        known = PyDict_GetItemWithError(lookup, path);
        if (known || PyErr_Occurred()) {
            Py_DECREF(path);
            err = PyErr_Occurred() != NULL;
            break; /* a duplicate: the Python rules decide */
        }
        new_allowance = allowance + per_entry;
        new_path_bytes = path_bytes + PyUnicode_GET_LENGTH(path);
        parent = parent_dir(dir_ids, lookup, path, name, path_len, &last_parent, &last_parent_id, missing,
                            &n_missing, &new_path_bytes, &err);
        if (parent < 0 || new_path_bytes > new_allowance) {
            Py_DECREF(path);
            break; /* back to Python (or an error); over the budget, the Python builder refuses it */
        }
        if (n + n_missing + 1 > cap) {
            Py_DECREF(path);
            break; /* the columns are full: the next call goes on from this record */
        }
        if (!have_mtime) { /* only now: dates are computed in record order, as in Python */
            uint32_t key = ((uint32_t)ddate << 16) | dtime;
            if (!dos_known || key != dos_key) {
                if (dos_to_epoch(dos_cache, ddate, dtime, &dos_value) < 0) {
                    Py_DECREF(path);
                    err = 1;
                    break;
                }
                dos_key = key;
                dos_known = 1;
            }
            mtime = dos_value;
        }
        if (!(mtime >= -MAX_MTIME && mtime <= MAX_MTIME))
            mtime = mtime != mtime ? 0.0 : mtime > 0 ? MAX_MTIME : -MAX_MTIME; /* as IndexBuilder.add */
        while (n_missing > 0) { /* the implied directories, shallowest first */
            PyObject *dir = missing[--n_missing];
            int bad = add_path(paths, lookup, dir_ids, dir, first_eid + n, 1);
            Py_DECREF(dir);
            if (bad) {
                err = 1;
                break;
            }
            put_row(&c, n, KIND_DIR, dir_mode, dir_mtime, parent, 0, 0, 0, 0, 0, 0);
            parent = (long)(first_eid + n);
            n++;
        }
        if (err || add_path(paths, lookup, dir_ids, path, first_eid + n, kind == KIND_DIR) < 0) {
            Py_DECREF(path);
            err = 1;
            break;
        }
        Py_DECREF(path);
        allowance = new_allowance;
        path_bytes = new_path_bytes;
        put_row(&c, n, kind, mode, mtime, parent, usize, method, eflags, offset, csize, crc);
        n++;
        records++;
        pos += rec_len;
    }
    while (n_missing > 0) /* a record given back to Python after its ancestors were looked up */
        Py_DECREF(missing[--n_missing]);
    if (err) /* the caller's parse fails: what this call added to the containers is discarded with them */
        goto done;
    result = Py_BuildValue(
        "nnnLLy#y#y#y#y#y#y#y#y#y#", records, n, pos, path_bytes, allowance, (const char *)c.kind, n,
        (const char *)c.mode, n * 2, (const char *)c.mtime, n * 8, (const char *)c.size, n * 8,
        (const char *)c.method, n * 2, (const char *)c.flags, n, (const char *)c.offset, n * 8,
        (const char *)c.comp_size, n * 8, (const char *)c.crc, n * 4, (const char *)c.parent, n * 4);
done:
    Py_XDECREF(last_parent);
    free(block);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef zipdir_methods[] = {
    {"plain_run", plain_run, METH_VARARGS,
     "plain_run(buf, pos, end, max_records, prefix, source_size, dos_cache, paths, lookup, dir_ids, "
     "path_bytes, path_allowance, allowance_per_entry, implied_dir_mode, implied_dir_mtime) -> "
     "(records, entries, new_pos, path_bytes, path_allowance, *columns)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef zipdir_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cdmlfs._zipdir",
    .m_doc = "ZIP central directory records to index columns; use cdmlfs.formats.zip, not this module.",
    .m_size = -1,
    .m_methods = zipdir_methods,
};

PyMODINIT_FUNC
PyInit__zipdir(void)
{
    return PyModule_Create(&zipdir_module);
}
