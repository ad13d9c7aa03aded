"""Build hook for the optional C accelerator ``cdmlfs._native``.

Metadata lives in pyproject.toml; this file only adds the extension. The
accelerator is optional because cdmlfs works without it (cdmlfs.inflate falls
back to the stdlib), so a machine without a compiler or libdeflate still gets a
working install plus a loud warning. CI sets CDMLFS_REQUIRE_NATIVE=1 so that a
broken build fails there instead of silently testing the slow path.
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

REQUIRE_NATIVE = os.environ.get("CDMLFS_REQUIRE_NATIVE") == "1"
# Each extension's sources; everything else under native/ is shared headers.
NATIVE_SOURCES = ["native/cdmlfs_native.c"]
FASTPATH_SOURCES = ["native/fastpath.c"]
ZSTDFRAME_SOURCES = ["native/zstdframe.c"]
FUSELOOP_SOURCES = ["native/fuseloop.c"]
ZIPDIR_SOURCES = ["native/zipdir.c"]
CRC32_HEADER = ["native/crc32.h"]  # included by _native and _fastpath (rebuilt when it changes, in the sdist)


def _warn(message: str) -> None:
    """Print a warning that stands out in pip's (verbose) build log."""
    bar = "*" * 78
    print(f"\n{bar}\nWARNING: {message}\n{bar}\n", file=sys.stderr, flush=True)


def _pkg_config(*args: str) -> list[str] | None:
    """Flags from pkg-config, or None when pkg-config or the package is missing."""
    try:
        out = subprocess.run(
            [os.environ.get("PKG_CONFIG", "pkg-config"), *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return shlex.split(out)


def _library_flags(package: str, fallback: str) -> tuple[list[str], list[str]]:
    """Compile and link flags for a C library, from pkg-config when it knows them."""
    cflags = _pkg_config("--cflags", package)
    libs = _pkg_config("--libs", package)
    if cflags is None or libs is None:
        # No pkg-config or no .pc file: the library may still be in the default
        # paths; if not, the compile fails and OptionalBuildExt reports it.
        _warn(f"pkg-config does not know {package}; trying the default paths with {fallback}")
        return [], [fallback]
    return cflags, libs


@functools.cache  # asked once per build, not once per extension (one warning)
def _isal_flags() -> tuple[list[str], list[str]] | None:
    """ISA-L's flags for the CRC-32 of _native and _fastpath (native/crc32.h), or None without it.

    ISA-L is optional: libdeflate's CRC-32 gives the same values, up to 3x slower. With
    CDMLFS_REQUIRE_NATIVE=1 (CI, the Docker image) it is required, so that a missing
    libisal-dev fails the build instead of quietly measuring the slower CRC.
    """
    cflags = _pkg_config("--cflags", "libisal")
    libs = _pkg_config("--libs", "libisal")
    if cflags is None or libs is None:
        if REQUIRE_NATIVE:
            raise SystemExit("CDMLFS_REQUIRE_NATIVE=1, but pkg-config does not know libisal (libisal-dev)")
        _warn("pkg-config does not know libisal (Debian: libisal-dev): CRC-32 by libdeflate, slower")
        return None
    return cflags, libs


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed accelerator build into a warning.

    Unless CDMLFS_REQUIRE_NATIVE=1: then every failure stays fatal.
    """

    def run(self) -> None:
        try:
            super().run()
        except (PlatformError, CCompilerError, ExecError, OSError) as exc:
            self._give_up(exc)

    def build_extension(self, ext: Extension) -> None:
        # Asked here, not at import, so that pip's several setup.py runs warn once.
        if ext.name == ZSTDFRAME.name:
            cflags, libs = _library_flags("libzstd", "-lzstd")
        elif ext.name == FUSELOOP.name:
            cflags, libs = _library_flags("fuse3", "-lfuse3")
        elif ext.name == ZIPDIR.name:
            cflags, libs = [], []  # the Python C API only
        else:
            cflags, libs = _library_flags("libdeflate", "-ldeflate")
            libs = [*libs, "-lz"]
            isal = _isal_flags()
            if isal is not None:  # the faster CRC-32 (native/crc32.h)
                cflags, libs = [*cflags, *isal[0], "-DCDMLFS_HAVE_ISAL"], [*libs, *isal[1]]
        ext.extra_compile_args = [*cflags, "-std=gnu11", "-fvisibility=hidden"]
        ext.extra_link_args = libs
        try:
            super().build_extension(ext)
        except (PlatformError, CCompilerError, ExecError, OSError) as exc:
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        if REQUIRE_NATIVE:
            raise exc
        _warn(
            f"building a C accelerator (cdmlfs._native, _fastpath, _zstdframe, _fuseloop or _zipdir) failed ({exc}).\n"
            "cdmlfs will work, using the slower pure-Python inflate and zstd paths and libfuse's\n"
            "own loop. To build it, install a C compiler, pkg-config, the Python headers and the\n"
            "libdeflate, zlib, zstd and libfuse3 headers (Debian: build-essential pkg-config python3-dev\n"
            "libdeflate-dev zlib1g-dev libzstd-dev libxxhash-dev libisal-dev libfuse3-dev) and reinstall."
        )


NATIVE = Extension(
    "cdmlfs._native",
    sources=NATIVE_SOURCES,
    depends=CRC32_HEADER,
    # Lets setuptools skip the missing library when copying editable outputs.
    optional=not REQUIRE_NATIVE,
)

# The FUSE hot path in C (getattr/read callbacks); see native/fastpath.c.
FASTPATH = Extension(
    "cdmlfs._fastpath", sources=FASTPATH_SOURCES, depends=CRC32_HEADER, optional=not REQUIRE_NATIVE
)

# Frame-by-frame zstd decoding into caller buffers (libzstd); see native/zstdframe.c.
ZSTDFRAME = Extension("cdmlfs._zstdframe", sources=ZSTDFRAME_SOURCES, optional=not REQUIRE_NATIVE)

# libfuse3's main loop, polling briefly between requests (libfuse3); see native/fuseloop.c.
FUSELOOP = Extension("cdmlfs._fuseloop", sources=FUSELOOP_SOURCES, optional=not REQUIRE_NATIVE)

# The ZIP central directory parse for plain records (no library); see native/zipdir.c.
ZIPDIR = Extension("cdmlfs._zipdir", sources=ZIPDIR_SOURCES, optional=not REQUIRE_NATIVE)

setup(ext_modules=[NATIVE, FASTPATH, ZSTDFRAME, FUSELOOP, ZIPDIR], cmdclass={"build_ext": OptionalBuildExt})
