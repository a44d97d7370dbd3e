//! The block formats of ggml and their dequantisation to f32.
//!
//! One function per block type, its byte layout in its doc comment, each the arithmetic
//! of ggml's reference `dequantize_row_*` (`ggml-quants.c`) in the same order of
//! operations, so the values are bit-identical to it and to the `gguf` Python package
//! (`gguf.quants.dequantize`; `tests/it/gguf.rs` compares SHA-256 digests of whole
//! models). All multi-byte fields are little-endian; `f16` scales are IEEE half floats
//! (the `half` crate converts them exactly). A block is read as a fixed-size array, so
//! the loops have no per-value allocation and no bounds checks the compiler cannot drop.

use half::f16;

use super::GgmlType;
use crate::error::{Error, Result};

/// Values per K-quant super-block (`QK_K`).
const QK_K: usize = 256;

/// Dequantise `out.len()` values of type `t` from `bytes`: `out.len()` must be a
/// multiple of `t`'s block size and `bytes` exactly the blocks that hold them.
pub fn dequantize(t: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    dequantize_into(t, bytes, out).map_err(Error::Other)
}

/// [`dequantize`] with the problem in words, for callers that name the tensor.
pub(super) fn dequantize_into(
    t: GgmlType,
    bytes: &[u8],
    out: &mut [f32],
) -> std::result::Result<(), String> {
    let (bs, ts) = (t.block_size(), t.type_size());
    if !out.len().is_multiple_of(bs) {
        return Err(format!(
            "{} values of {t}: not a multiple of its block of {bs}",
            out.len()
        ));
    }
    if bytes.len() / ts != out.len() / bs || !bytes.len().is_multiple_of(ts) {
        return Err(format!(
            "{} bytes of {t} for {} values: expected {} ({} blocks of {ts} bytes)",
            bytes.len(),
            out.len(),
            out.len() / bs * ts,
            out.len() / bs
        ));
    }
    match t {
        GgmlType::F32 => blocks(bytes, out, f32_le),
        GgmlType::F16 => blocks(bytes, out, f16_le),
        GgmlType::BF16 => blocks(bytes, out, bf16_le),
        GgmlType::Q4_0 => blocks(bytes, out, q4_0),
        GgmlType::Q4_1 => blocks(bytes, out, q4_1),
        GgmlType::Q5_0 => blocks(bytes, out, q5_0),
        GgmlType::Q5_1 => blocks(bytes, out, q5_1),
        GgmlType::Q8_0 => blocks(bytes, out, q8_0),
        GgmlType::Q2_K => blocks(bytes, out, q2_k),
        GgmlType::Q3_K => blocks(bytes, out, q3_k),
        GgmlType::Q4_K => blocks(bytes, out, q4_k),
        GgmlType::Q5_K => blocks(bytes, out, q5_k),
        GgmlType::Q6_K => blocks(bytes, out, q6_k),
        GgmlType::Q8_K => blocks(bytes, out, q8_k),
        _ => {
            return Err(format!(
                "dequantising {t} (ggml type {}) is not supported; phaselens reads {}",
                t.id(),
                supported_names()
            ));
        }
    }
    Ok(())
}

/// The dequantisable types' names, comma-separated (for messages).
pub(super) fn supported_names() -> String {
    let names: Vec<&str> = GgmlType::ALL
        .iter()
        .filter(|t| t.dequantizable())
        .map(|t| t.name())
        .collect();
    names.join(", ")
}

/// Apply a block decoder to every block: `TS` bytes to `BS` values. The lengths were
/// checked by the caller, so the remainders are empty.
/// Generic over the decoder (not a fn pointer) and inlined, so each block's loop is
/// compiled into one tight loop per type, also at the dev profile's opt-level 1.
#[inline(always)]
fn blocks<const TS: usize, const BS: usize>(
    bytes: &[u8],
    out: &mut [f32],
    f: impl Fn(&[u8; TS], &mut [f32; BS]),
) {
    let (bs, _) = bytes.as_chunks::<TS>();
    let (ys, _) = out.as_chunks_mut::<BS>();
    let n = bs.len().min(ys.len());
    for i in 0..n {
        f(&bs[i], &mut ys[i]);
    }
}

#[inline(always)]
fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// F32: 4 bytes, one little-endian IEEE single.
#[inline(always)]
fn f32_le(b: &[u8; 4], y: &mut [f32; 1]) {
    y[0] = f32::from_le_bytes(*b);
}

/// F16: 2 bytes, one IEEE half.
#[inline(always)]
fn f16_le(b: &[u8; 2], y: &mut [f32; 1]) {
    y[0] = f16::from_le_bytes(*b).to_f32();
}

/// BF16: 2 bytes, the upper half of an f32's bits.
#[inline(always)]
fn bf16_le(b: &[u8; 2], y: &mut [f32; 1]) {
    y[0] = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16);
}

/// Q4_0, 32 values in 18 bytes: `d: f16`, `qs: [u8; 16]`. Value `j` is the low nibble
/// of `qs[j]`, value `j + 16` its high nibble; `x = (q - 8) * d`.
#[inline(always)]
fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = half_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = (i32::from(q & 0xF) - 8) as f32 * d;
        y[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

/// Q4_1, 32 values in 20 bytes: `d: f16`, `m: f16`, `qs: [u8; 16]` (nibbles as in
/// Q4_0); `x = q * d + m`.
#[inline(always)]
fn q4_1(b: &[u8; 20], y: &mut [f32; 32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    for j in 0..16 {
        let q = b[4 + j];
        y[j] = f32::from(q & 0xF) * d + m;
        y[j + 16] = f32::from(q >> 4) * d + m;
    }
}

/// The 5-bit quants of Q5_0 / Q5_1: `qh` (u32) holds bit 4 of value `j` at bit `j`,
/// `qs` the low nibbles as in Q4_0.
#[inline(always)]
fn q5_pair(qh: u32, qs: u8, j: usize) -> (u8, u8) {
    let h0 = ((qh >> j) & 1) as u8;
    let h1 = ((qh >> (j + 16)) & 1) as u8;
    ((qs & 0xF) | (h0 << 4), (qs >> 4) | (h1 << 4))
}

/// Q5_0, 32 values in 22 bytes: `d: f16`, `qh: [u8; 4]` (the fifth bits, a u32),
/// `qs: [u8; 16]`; `x = (q - 16) * d`.
#[inline(always)]
fn q5_0(b: &[u8; 22], y: &mut [f32; 32]) {
    let d = half_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let (x0, x1) = q5_pair(qh, b[6 + j], j);
        y[j] = (i32::from(x0) - 16) as f32 * d;
        y[j + 16] = (i32::from(x1) - 16) as f32 * d;
    }
}

/// Q5_1, 32 values in 24 bytes: `d: f16`, `m: f16`, `qh: [u8; 4]`, `qs: [u8; 16]`;
/// `x = q * d + m`.
#[inline(always)]
fn q5_1(b: &[u8; 24], y: &mut [f32; 32]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let (x0, x1) = q5_pair(qh, b[8 + j], j);
        y[j] = f32::from(x0) * d + m;
        y[j + 16] = f32::from(x1) * d + m;
    }
}

/// Q8_0, 32 values in 34 bytes: `d: f16`, `qs: [i8; 32]`; `x = q * d`.
#[inline(always)]
fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = half_at(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..]) {
        *y = f32::from(q as i8) * d;
    }
}

/// Q2_K, 256 values in 84 bytes: `scales: [u8; 16]` (per 16 values: scale in the low
/// nibble, min in the high), `qs: [u8; 64]` (2-bit quants), `d: f16`, `dmin: f16`.
/// Value `128 h + 32 j + l` (h < 2, j < 4, l < 32) is bits `2j..2j+2` of `qs[32 h + l]`;
/// its sub-block is `8 h + 2 j + l / 16`; `x = (d * sc) * q - dmin * m`.
#[inline(always)]
fn q2_k(b: &[u8; 84], y: &mut [f32; QK_K]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (half_at(b, 80), half_at(b, 82));
    for h in 0..2 {
        let q = &qs[32 * h..32 * h + 32];
        for j in 0..4 {
            for (half, q) in q.chunks_exact(16).enumerate() {
                let sc = scales[8 * h + 2 * j + half];
                let dl = d * f32::from(sc & 0xF);
                let ml = dmin * f32::from(sc >> 4);
                let y = &mut y[128 * h + 32 * j + 16 * half..][..16];
                for (y, &q) in y.iter_mut().zip(q) {
                    *y = dl * f32::from((q >> (2 * j)) & 3) - ml;
                }
            }
        }
    }
}

/// The 16 six-bit scales of Q3_K from its 12 scale bytes: scale `i`'s low nibble is
/// nibble `i / 8` of byte `i % 8`, its two high bits are bits `2 (i / 4)..` of byte
/// `8 + i % 4`; the scale is that 6-bit number minus 32.
fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = (s[i % 8] >> (4 * (i / 8))) & 0xF;
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Q3_K, 256 values in 110 bytes: `hmask: [u8; 32]` (bit 2 of each quant, inverted),
/// `qs: [u8; 64]` (its low 2 bits), `scales: [u8; 12]` (16 six-bit scales,
/// [`q3_k_scales`]), `d: f16`. Value `128 h + 32 j + l` (h < 2, j < 4, l < 32) has low
/// bits `2j..2j+2` of `qs[32 h + l]` and high bit `4 h + j` of `hmask[l]`;
/// `q = low - (high ? 0 : 4)`; sub-block `8 h + 2 j + l / 16`; `x = (d * sc) * q`.
#[inline(always)]
fn q3_k(b: &[u8; 110], y: &mut [f32; QK_K]) {
    let (hmask, qs) = (&b[..32], &b[32..96]);
    let d = half_at(b, 108);
    let mut ds = [0f32; 16];
    for (ds, s) in ds.iter_mut().zip(q3_k_scales(&b[96..108])) {
        *ds = d * f32::from(s);
    }
    for h in 0..2 {
        for j in 0..4 {
            let y = &mut y[128 * h + 32 * j..][..32];
            for (l, y) in y.iter_mut().enumerate() {
                let low = ((qs[32 * h + l] >> (2 * j)) & 3) as i8;
                let q = if (hmask[l] >> (4 * h + j)) & 1 == 1 {
                    low
                } else {
                    low - 4
                };
                *y = ds[8 * h + 2 * j + l / 16] * f32::from(q);
            }
        }
    }
}

/// Scale and min of sub-block `j` (< 8) of a Q4_K / Q5_K super-block, six bits each,
/// from its 12 scale bytes (ggml's `get_scale_min_k4`): for `j < 4` the low six bits of
/// bytes `j` and `j + 4`; else the nibbles of byte `j + 4` with the top two bits of bytes
/// `j - 4` and `j`.
#[inline(always)]
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K, 256 values in 144 bytes: `d: f16`, `dmin: f16`, `scales: [u8; 12]` (eight
/// six-bit scales and mins, [`scale_min_k4`]), `qs: [u8; 128]`. Values `64 g + l` and
/// `64 g + 32 + l` (g < 4, l < 32) are the low and high nibble of `qs[32 g + l]`, in
/// sub-blocks `2 g` and `2 g + 1`; `x = (d * sc) * q - dmin * m`.
#[inline(always)]
fn q4_k(b: &[u8; 144], y: &mut [f32; QK_K]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..]);
    for g in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * g, scales);
        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let q = &qs[32 * g..32 * g + 32];
        let (lo, hi) = y[64 * g..64 * g + 64].split_at_mut(32);
        for ((lo, hi), &q) in lo.iter_mut().zip(hi).zip(q) {
            *lo = d1 * f32::from(q & 0xF) - m1;
            *hi = d2 * f32::from(q >> 4) - m2;
        }
    }
}

/// Q5_K, 256 values in 176 bytes: `d: f16`, `dmin: f16`, `scales: [u8; 12]` (as
/// Q4_K), `qh: [u8; 32]`, `qs: [u8; 128]`. As Q4_K, with bit 4 of the quant of value
/// `32 s + l` (sub-block s < 8) in bit `s` of `qh[l]`.
#[inline(always)]
fn q5_k(b: &[u8; 176], y: &mut [f32; QK_K]) {
    let (d, dmin) = (half_at(b, 0), half_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..]);
    for g in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * g, scales);
        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(m2));
        let q = &qs[32 * g..32 * g + 32];
        let (lo, hi) = y[64 * g..64 * g + 64].split_at_mut(32);
        for (l, (lo, hi)) in lo.iter_mut().zip(hi).enumerate() {
            let h0 = ((qh[l] >> (2 * g)) & 1) << 4;
            let h1 = ((qh[l] >> (2 * g + 1)) & 1) << 4;
            *lo = d1 * f32::from((q[l] & 0xF) | h0) - m1;
            *hi = d2 * f32::from((q[l] >> 4) | h1) - m2;
        }
    }
}

/// Q6_K, 256 values in 210 bytes: `ql: [u8; 128]` (low nibbles), `qh: [u8; 64]` (high
/// 2 bits), `scales: [i8; 16]` (per 16 values), `d: f16`. In half `n` (< 2), value
/// `128 n + 32 k + l` (k < 4, l < 32) takes its low nibble from `ql[64 n + l]` (k = 0:
/// low, 2: high) or `ql[64 n + 32 + l]` (k = 1: low, 3: high), its high bits from bits
/// `2k..2k+2` of `qh[32 n + l]`; `q` is that 6-bit number minus 32, its sub-block
/// `8 n + 2 k + l / 16`; `x = (d * sc) * q`.
#[inline(always)]
fn q6_k(b: &[u8; 210], y: &mut [f32; QK_K]) {
    let (ql, qh) = (&b[..128], &b[128..192]);
    let d = half_at(b, 208);
    let mut ds = [0f32; 16];
    for (ds, &s) in ds.iter_mut().zip(&b[192..208]) {
        *ds = d * f32::from(s as i8);
    }
    for n in 0..2 {
        let (ql, qh, ds) = (&ql[64 * n..], &qh[32 * n..], &ds[8 * n..]);
        let y = &mut y[128 * n..];
        for l in 0..32 {
            let (a, c, h, is) = (ql[l], ql[l + 32], qh[l], l / 16);
            let q1 = ((a & 0xF) | ((h & 3) << 4)) as i8 - 32;
            let q2 = ((c & 0xF) | (((h >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((a >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((c >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
            y[l] = ds[is] * f32::from(q1);
            y[l + 32] = ds[is + 2] * f32::from(q2);
            y[l + 64] = ds[is + 4] * f32::from(q3);
            y[l + 96] = ds[is + 6] * f32::from(q4);
        }
    }
}

/// Q8_K, 256 values in 292 bytes: `d: f32`, `qs: [i8; 256]`, `bsums: [i16; 16]` (sums
/// for ggml's dot products, unused here); `x = d * q`.
#[inline(always)]
fn q8_k(b: &[u8; 292], y: &mut [f32; QK_K]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (y, &q) in y.iter_mut().zip(&b[4..260]) {
        *y = d * f32::from(q as i8);
    }
}
