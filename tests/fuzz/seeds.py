"""Seed inputs per fuzz target: small, valid archives written by real tools and by :mod:`craft`.

Small on purpose (mostly under 4 KiB): mutation throughput falls with input
size, and every interesting structure (ZIP64 records, data descriptors, pax
and GNU long names, seek tables, embedded member tables, a >1 MiB member that
takes the checkpoint path) fits in a few hundred bytes when its data is
compressible.
"""

from __future__ import annotations

import io
import os
import struct
import tarfile
import tempfile
import zipfile

from cdmlfs.formats import tarheader as th
from cdmlfs.formats.tar import EMBEDDED_INDEX_NIBBLE, encode_embedded_index
from cdmlfs.formats.tarmembers import HARDLINK, MemberTable
from cdmlfs.index import DIR, FILE, SYMLINK
from cdmlfs.zstd_seekable import seek_table_frame, skippable_frame
from fuzz import craft

SMALL = {
    "a.txt": b"hello world\n" * 3,
    "dir/b.bin": bytes(range(200)),
    "dir/sub/c.txt": b"",
    "ünï/名.txt": b"x",
}
BIG_ZEROS = 1_200_000  # above the harness's whole-member limit (cache 4 MiB / 4): checkpointed reads


def _zipfile(compression: int, **kw) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compression, **kw) as zf:
        zf.writestr(zipfile.ZipInfo("dir/"), b"")
        for name, data in SMALL.items():
            info = zipfile.ZipInfo(name, date_time=(2021, 6, 15, 12, 30, 44))
            info.compress_type = compression
            info.external_attr = 0o100644 << 16
            zf.writestr(info, data)
        link = zipfile.ZipInfo("link")
        link.external_attr = 0o120777 << 16
        link.create_system = 3
        zf.writestr(link, b"dir/b.bin")
        zf.comment = b"seed"
    return buf.getvalue()


def zip_seeds() -> dict[str, bytes]:
    seeds = {
        "stored": _zipfile(zipfile.ZIP_STORED),
        "deflated": _zipfile(zipfile.ZIP_DEFLATED),
        "bzip2": _zipfile(zipfile.ZIP_BZIP2),
        "lzma": _zipfile(zipfile.ZIP_LZMA),
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open("z64.txt", "w", force_zip64=True) as w:
            w.write(b"zip64 member " * 10)
        zf.writestr("zeros.bin", bytes(BIG_ZEROS))
    seeds["zip64_big"] = buf.getvalue()
    seeds["prefixed"] = b"#!/bin/sh\nexit 0\n" + _zipfile(zipfile.ZIP_DEFLATED)
    seeds["zip64_records"] = craft.build_zip([craft.member("a", b"abc" * 20)], zip64=True)
    seeds["crafted_methods"] = craft.build_zip(
        [
            craft.member("zstd.bin", b"", method=93, data=craft.zstd_frame(b"z" * 3000), size=3000),
            craft.member("stored", b"plain stored bytes"),
            craft.member("enc", b"secret", flags=1),
            craft.member("def64", b"x", method=9),
        ]
    )
    seeds["shared_data"] = craft.build_zip(
        [craft.member("a", b"same" * 100), craft.member("b", b"same" * 100, offset=0, write_local=False)]
    )
    return seeds


def _tarfile(fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        d = tarfile.TarInfo("dir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for name, data in {**SMALL, "long/" + "n" * 120 + ".txt": b"long name"}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_600_000_000
            tf.addfile(info, io.BytesIO(data))
        sym = tarfile.TarInfo("sym")
        sym.type = tarfile.SYMTYPE
        sym.linkname = "a.txt"
        tf.addfile(sym)
        hard = tarfile.TarInfo("hard")
        hard.type = tarfile.LNKTYPE
        hard.linkname = "a.txt"
        tf.addfile(hard)
        fifo = tarfile.TarInfo("fifo")
        fifo.type = tarfile.FIFOTYPE
        tf.addfile(fifo)
    return buf.getvalue()


def tar_seeds() -> dict[str, bytes]:
    seeds = {
        "ustar": _ustar_only(),
        "gnu": _tarfile(tarfile.GNU_FORMAT),
        "pax": _tarfile(tarfile.PAX_FORMAT),
    }
    glob = th.pax_record("mtime", b"1600000000.5") + th.pax_record("comment", b"x")
    header = th.build_block(b"pax_global_header", 0o644, 0, 0, len(glob), 0, th.PAX_GLOBAL)
    body = glob + bytes(th.round_up(len(glob)) - len(glob))
    seeds["pax_global"] = (
        header + body + th.build_header("f", th.REGTYPE, 3) + b"abc" + bytes(509) + bytes(1024)
    )
    return seeds


def _ustar_only() -> bytes:
    out = bytearray()
    out += th.build_header("dir", th.DIRTYPE)
    for name, data in SMALL.items():
        out += th.build_header(name, th.REGTYPE, len(data), mtime=1_600_000_000)
        out += data + bytes(th.round_up(len(data)) - len(data))
    out += th.build_header("sym", th.SYMTYPE, linkname="a.txt")
    return bytes(out + bytes(1024))


def _member_table() -> MemberTable:
    t = MemberTable()
    t.append(DIR, "dir", 0o755, 0.0, 0, 0)
    t.append(FILE, "dir/a", 0o644, 1.5, 12, 512)
    t.append(SYMLINK, "s", 0o777, 0.0, 0, 0, "dir/a")
    t.append(HARDLINK, "h", 0o644, 0.0, 0, 0, "dir/a")
    t.stream_size = 2048
    return t


def zstd_seeds() -> dict[str, bytes]:
    from cdmlfs.pack import pack

    tar = _ustar_only()
    seeds = {
        "one_frame": craft.zstd_frame(tar),
        "no_content_size": craft.zstd_frame(tar, content_size=False),
        "skippable_first": skippable_frame(b"pzstd")
        + craft.zstd_frame(tar[:1024])
        + craft.zstd_frame(tar[1024:]),
    }
    frames = [craft.zstd_frame(tar[i : i + 1024]) for i in range(0, len(tar), 1024)]
    seeds["seekable"] = b"".join(frames) + seek_table_frame(
        [(len(f), len(tar[i * 1024 : (i + 1) * 1024])) for i, f in enumerate(frames)]
    )
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")
        for name, data in {**SMALL, "zeros.bin": bytes(BIG_ZEROS)}.items():
            p = os.path.join(src, name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(data)
        os.symlink("a.txt", os.path.join(src, "sym"))
        out = os.path.join(tmp, "p.tar.zst")
        pack(src, out, frame_size=4096, threads=1)
        with open(out, "rb") as f:
            seeds["packed"] = f.read()
    emb = skippable_frame(encode_embedded_index(_member_table()), EMBEDDED_INDEX_NIBBLE)
    seeds["embedded_only"] = frames[0] + emb + seek_table_frame([(len(frames[0]), 1024), (len(emb), 0)])
    return seeds


# The index target: first byte picks what the payload is fed to (see harness.target_index).
def index_seeds() -> dict[str, bytes]:
    from fuzz.harness import index_bases

    bases = index_bases()
    frames = bases["frames"].encode()
    table = bases["table"].encode()
    return {
        "tar_cache": b"\x00" + table,
        "zst_cache": b"\x01" + struct.pack("<Q", len(frames)) + frames + table,
        "embedded": b"\x02" + encode_embedded_index(bases["table"]),
    }


SEEDS = {"zip": zip_seeds, "tar": tar_seeds, "zstd": zstd_seeds, "index": index_seeds}
