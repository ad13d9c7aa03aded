/*
 * CRC-32 (zlib's polynomial and conventions) for the C accelerators.
 *
 * Why two implementations: every first read of a ZIP member is checked against its CRC, so at
 * large reads the CRC is a fixed share of the work (an S3 scan receives, copies and checks each
 * byte once). libdeflate 1.14 (Debian 12) folds with 128-bit PCLMULQDQ, about 12 GB/s here; ISA-L
 * folds with VPCLMULQDQ on CPUs that have it (AVX-512 ones), about 35 GB/s on the same core
 * (copy + CRC of 1 GiB in 1 MiB pieces: 0.155 s vs 0.078 s); elsewhere the two are about as fast.
 * ISA-L is used when the build finds it (pkg-config libisal, which defines CDMLFS_HAVE_ISAL);
 * libdeflate, which the inflate path links anyway, otherwise.
 * Both give zlib.crc32's values, continuation included (crc32(b, crc32(a)) == crc32(a + b)).
 */
#ifndef CDMLFS_CRC32_H
#define CDMLFS_CRC32_H

#include <stddef.h>
#include <stdint.h>

#ifdef CDMLFS_HAVE_ISAL
#include <isa-l/crc.h>
#define CDMLFS_CRC32_BACKEND "isa-l"

static inline uint32_t
cdmlfs_crc32(uint32_t crc, const void *buf, size_t len)
{
    return crc32_gzip_refl(crc, (const unsigned char *)buf, (uint64_t)len);
}
#else
#include <libdeflate.h>
#define CDMLFS_CRC32_BACKEND "libdeflate"

static inline uint32_t
cdmlfs_crc32(uint32_t crc, const void *buf, size_t len)
{
    return libdeflate_crc32(crc, buf, len);
}
#endif

#endif
