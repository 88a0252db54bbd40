"""The compact-state codec and AdamW as one-pass C loops, compiled on first use (optional).

StateCodec (state_format.py) converts a chunk of an expert's state with torch ops: an int8
moment's decode is three passes over the chunk (widen the codes, gather, scale), its encode
eight (max, min, maximum, where, divide, shift, mask, gather), a bf16 master's stochastic
rounding three; with AdamW's own passes, one 8.4M-parameter expert's bf16 + int8 step took
36.8 ms against 8.3 for fp32 state (`moescale bench compact-optimizer`), CPU that a 2-core
machine past RAM also needs for the disk's I/O and the compute. Here:
- `decode_int8`, `encode_int8`, `encode_bf16_sr`: each conversion in one pass, with the same
  IEEE operations in the same order as the torch ops, so bitwise their results;
- `adamw_int8`: an expert's whole step with int8 moments, block by block (256 numbers:
  decode, AdamW, encode while the block is in L1), bitwise compact_adamw.adamw_reference
  followed by the codec's encode.
tests/offload/test_codec_kernels.py checks both; a machine without a C compiler computes the
same numbers with torch ops, only slower. AVX-512 and AVX2 paths use gathers and divides of
16 or 8 numbers; other machines get the scalar loops.

The source is compiled with the system's C compiler (`cc`, or $CC) for the machine it runs on
(-march=native; -ffp-contract=off keeps every multiply and add separately rounded) into
$XDG_CACHE_HOME/moescale/kernels (default ~/.cache), named by a hash of the source, the flags,
the compiler's version and the CPU's feature flags (a home shared between hosts gets one build
per kind of CPU), written atomically (a temporary name, then a rename), so parallel
ranks compiling at once are harmless. No compiler, or a failed compile: `load()` returns None
and the torch ops run. ctypes releases the GIL during each call, so the host optimizer's
workers run in parallel.

Deliberately not here: which path to take (StateCodec, compact_adamw.step_compact), the code
tables (int8_codes.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from moescale.offload.int8_codes import (BLOCK, TABLE_BITS, TABLE_MASK, dynamic_map,
                                         nearest_table)

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#define BLOCK %(block)d
#define SHIFT %(shift)d
#define MASK %(mask)du

/* codes -> code_map[codes] * s for m numbers */
static void decode_block(const uint8_t *c, float s, const float *code_map, float *o, int64_t m) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(s);
    for (; j + 16 <= m; j += 16) {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + j)));
        __m512 v = _mm512_i32gather_ps(idx, code_map, 4);
        _mm512_storeu_ps(o + j, _mm512_mul_ps(v, vs));
    }
#elif defined(__AVX2__)
    const __m256 vs = _mm256_set1_ps(s);
    for (; j + 8 <= m; j += 8) {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + j)));
        __m256 v = _mm256_i32gather_ps(code_map, idx, 4);
        _mm256_storeu_ps(o + j, _mm256_mul_ps(v, vs));
    }
#endif
    for (; j < m; j++) o[j] = code_map[c[j]] * s;
}

/* n numbers of whole blocks of codes: out[i] = code_map[codes[i]] * scale[i / BLOCK] */
void decode_int8(const uint8_t *codes, const float *scale, const float *code_map,
                 float *out, int64_t n) {
    for (int64_t lo = 0; lo < n; lo += BLOCK)
        decode_block(codes + lo, scale[lo / BLOCK], code_map, out + lo,
                     n - lo < BLOCK ? n - lo : BLOCK);
}

/* the codes of m numbers divided by d: table[top bits of x / d]; the table is padded by
   3 bytes, so a 4-byte gather at any index stays inside it */
static void quantise_block(const float *xb, int64_t m, float d, const uint8_t *table,
                           uint8_t *c) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 vd = _mm512_set1_ps(d);
    const __m512i vmask = _mm512_set1_epi32(MASK);
    for (; j + 16 <= m; j += 16) {
        __m512 y = _mm512_div_ps(_mm512_loadu_ps(xb + j), vd);
        __m512i idx = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(y), SHIFT),
                                       vmask);
        __m512i w = _mm512_i32gather_epi32(idx, (const void *)table, 1);
        _mm_storeu_si128((__m128i *)(c + j), _mm512_cvtepi32_epi8(w));
    }
#elif defined(__AVX2__)
    const __m256 vd = _mm256_set1_ps(d);
    const __m256i vmask = _mm256_set1_epi32(MASK);
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
        -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i lanes = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
    for (; j + 8 <= m; j += 8) {
        __m256 y = _mm256_div_ps(_mm256_loadu_ps(xb + j), vd);
        __m256i idx = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), SHIFT),
                                       vmask);
        __m256i w = _mm256_i32gather_epi32((const int *)table, idx, 1);
        w = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(w, pick), lanes);
        _mm_storel_epi64((__m128i *)(c + j), _mm256_castsi256_si128(w));
    }
#endif
    for (; j < m; j++) {
        float y = xb[j] / d;
        uint32_t u;
        memcpy(&u, &y, 4);
        c[j] = table[(u >> SHIFT) & MASK];
    }
}

/* forward */
void encode_bf16_sr(const float *x, const int32_t *noise, uint16_t *out, int64_t n);

/* the block's scale (absmax; signed: the larger of max and -min, -0 made +0; a partial
   block counts its zero padding) */
static float block_scale(const float *xb, int64_t m, int is_signed) {
    float mx = m < BLOCK ? 0.0f : xb[0], mn = mx;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 vmx = _mm512_set1_ps(mx), vmn = vmx;
    for (; j + 16 <= m; j += 16) {
        __m512 v = _mm512_loadu_ps(xb + j);
        vmx = _mm512_max_ps(vmx, v);
        vmn = _mm512_min_ps(vmn, v);
    }
    mx = _mm512_reduce_max_ps(vmx);
    mn = _mm512_reduce_min_ps(vmn);
#endif
    for (; j < m; j++) {
        mx = xb[j] > mx ? xb[j] : mx;
        mn = xb[j] < mn ? xb[j] : mn;
    }
    return is_signed ? (mx >= -mn ? mx : -mn) + 0.0f : mx;
}

/* one block's codes and scale */
static void encode_block(const float *xb, int64_t m, uint8_t *c, float *scale,
                         const uint8_t *table, int is_signed) {
    const float s = block_scale(xb, m, is_signed);
    *scale = s;
    quantise_block(xb, m, s > 0.0f ? s : 1.0f, table, c);
    for (int64_t j = m; j < BLOCK; j++) c[j] = table[0];
}

/* AdamW on an expert's n numbers with int8 moments, block by block in one pass: decode the
   block's moments (and a bf16 master), step, encode. hp = {1 - lr wd, beta1, 1 - beta1,
   beta2, 1 - beta2, lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t), eps}; every operation rounds on
   its own (no fused multiply-add), in the order adamw_reference (state_format.py) takes.
   master32: an fp32 master stepped in place; else master16 (bf16) with noise for its
   stochastic rounding (noise[i] for number i). */
void adamw_int8(float *master32, uint16_t *master16, const int32_t *noise, const float *grad,
                int64_t n, uint8_t *m_codes, float *m_scale, uint8_t *v_codes, float *v_scale,
                const float *hp, const float *m_map, const float *v_map,
                const uint8_t *m_table, const uint8_t *v_table) {
    float pb[BLOCK] __attribute__((aligned(64)));
    float mb[BLOCK] __attribute__((aligned(64)));
    float vb[BLOCK] __attribute__((aligned(64)));
    const float decay = hp[0], b1 = hp[1], c1 = hp[2], b2 = hp[3], c2 = hp[4];
    const float step_size = hp[5], inv_bc2_sqrt = hp[6], eps = hp[7];
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        const int64_t m = n - lo < BLOCK ? n - lo : BLOCK;
        const int64_t b = lo / BLOCK;
        decode_block(m_codes + lo, m_scale[b], m_map, mb, m);
        decode_block(v_codes + lo, v_scale[b], v_map, vb, m);
        float *p = master32 ? master32 + lo : pb;
        if (!master32)
            for (int64_t j = 0; j < m; j++) {
                uint32_t u = (uint32_t)master16[lo + j] << 16;
                memcpy(pb + j, &u, 4);
            }
        const float *g = grad + lo;
        for (int64_t j = 0; j < m; j++) {
            const float gj = g[j];
            const float pj = p[j] * decay;
            const float mj = mb[j] * b1 + gj * c1;
            const float vj = vb[j] * b2 + (gj * gj) * c2;
            const float d = sqrtf(vj) * inv_bc2_sqrt + eps;
            p[j] = pj - (mj / d) * step_size;
            mb[j] = mj;
            vb[j] = vj;
        }
        encode_block(mb, m, m_codes + lo, m_scale + b, m_table, 1);
        encode_block(vb, m, v_codes + lo, v_scale + b, v_table, 0);
        if (!master32)
            encode_bf16_sr(pb, noise + lo, master16 + lo, m);
    }
}

/* n numbers -> ceil(n / BLOCK) blocks of codes and their scales; a partial last block is
   quantised as if padded with zeros (its padding gets the code of 0), as the torch ops do */
void encode_int8(const float *x, int64_t n, uint8_t *codes, float *scale,
                 const uint8_t *table, int is_signed) {
    for (int64_t lo = 0; lo < n; lo += BLOCK)
        encode_block(x + lo, n - lo < BLOCK ? n - lo : BLOCK, codes + lo, scale + lo / BLOCK,
                     table, is_signed);
}

/* stochastic rounding to bf16: the fp32 bits plus 16 bits of noise, truncated */
void encode_bf16_sr(const float *x, const int32_t *noise, uint16_t *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        out[i] = (uint16_t)((u + (uint32_t)noise[i]) >> 16);
    }
}
""" % dict(block=BLOCK, shift=32 - TABLE_BITS, mask=TABLE_MASK)


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _cpu() -> str:
    """What -march=native compiles for: the machine and its CPU's feature flags (so that a cache
    directory shared between hosts, e.g. a home on NFS, never hands one CPU's build to another)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moescale" / "kernels"


def _compile(cc: str) -> Path | None:
    """The shared library for this source, flags and compiler (compiled once, then cached)."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, version, _cpu()]).encode())
    target = _cache_dir() / f"codec-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            src, out = Path(tmp) / "codec.c", Path(tmp) / "codec.so"
            src.write_text(SOURCE)
            done = subprocess.run([cc, *FLAGS, "-o", str(out), str(src)],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode != 0 or not out.exists():
                return None
            os.replace(out, target)
    except (OSError, subprocess.SubprocessError):
        return None
    return target


class CodecKernels:
    """The loaded C loops, called with tensors' data pointers (contiguous, of the named
    dtypes; the caller checks sizes)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, n = ctypes.c_void_p, ctypes.c_int64
        self._decode, self._encode, self._sr = lib.decode_int8, lib.encode_int8, lib.encode_bf16_sr
        self._decode.argtypes, self._decode.restype = [p, p, p, p, n], None
        self._encode.argtypes, self._encode.restype = [p, n, p, p, p, ctypes.c_int], None
        self._sr.argtypes, self._sr.restype = [p, p, p, n], None
        self._adamw = lib.adamw_int8
        self._adamw.argtypes, self._adamw.restype = [p, p, p, p, n, p, p, p, p, p, p, p, p, p], None
        # the nearest-code tables with 3 bytes of padding: a 4-byte gather reads past the last
        self._tables = {signed: torch.cat([nearest_table(signed), torch.zeros(3, dtype=torch.uint8)])
                        for signed in (True, False)}

    def decode_int8(self, codes_u8, scale_n, out_C, n: int, signed: bool) -> None:
        """out_C[:n] = the codes' values * their block's scale (fp32)."""
        self._decode(codes_u8.data_ptr(), scale_n.data_ptr(), dynamic_map(signed).data_ptr(),
                     out_C.data_ptr(), n)

    def encode_int8(self, x_C, n: int, codes_u8, scale_n, signed: bool) -> None:
        """x_C[:n] (fp32) -> codes (whole blocks, padding coded as 0) and per-block scales."""
        self._encode(x_C.data_ptr(), n, codes_u8.data_ptr(), scale_n.data_ptr(),
                     self._tables[signed].data_ptr(), int(signed))

    def adamw_int8(self, master, noise, grad_P, n: int, m_parts, v_parts, hp_8) -> None:
        """AdamW on n numbers with int8 moments in one pass (see the C source): master is the
        fp32 [n] master (stepped in place) or the bf16 row with `noise` [n] for its rounding;
        m_parts / v_parts: (codes uint8, scales fp32) of whole blocks; hp_8: fp32 [8]."""
        fp32 = master.dtype == torch.float32
        self._adamw(master.data_ptr() if fp32 else None, None if fp32 else master.data_ptr(),
                    None if fp32 else noise.data_ptr(), grad_P.data_ptr(), n,
                    m_parts[0].data_ptr(), m_parts[1].data_ptr(), v_parts[0].data_ptr(),
                    v_parts[1].data_ptr(), hp_8.data_ptr(), dynamic_map(True).data_ptr(),
                    dynamic_map(False).data_ptr(), self._tables[True].data_ptr(),
                    self._tables[False].data_ptr())

    def encode_bf16_sr(self, x_C, noise_C, out_bf16, n: int) -> None:
        """out = bf16 of (fp32 bits of x + noise) with the low 16 bits dropped."""
        self._sr(x_C.data_ptr(), noise_C.data_ptr(), out_bf16.data_ptr(), n)


@lru_cache(maxsize=1)
def load() -> CodecKernels | None:
    """The compiled loops, or None where no C compiler builds them (the codec then uses torch
    ops, with the same results). Set MOESCALE_CODEC_KERNELS=0 to force the torch ops."""
    if os.environ.get("MOESCALE_CODEC_KERNELS", "1") == "0":
        return None
    cc = _compiler()
    path = _compile(cc) if cc else None
    if path is None:
        return None
    try:
        return CodecKernels(ctypes.CDLL(str(path)))
    except OSError:
        return None
