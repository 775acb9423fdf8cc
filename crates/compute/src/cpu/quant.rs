//! Quantized weight matrices (ggml's block formats, as GGUF files hold them) and `x · Wᵀ` that
//! reads them as stored.
//!
//! A decode step streams every weight once, so its speed follows the weights' bytes: a Q4_1
//! matrix is 5.6x smaller than its f32 form. [`matmul_t_quant`] dequantizes eight rows at a
//! time into a buffer that stays in cache and runs the f32 kernels of [`super::matmul_t`] on
//! it. Every weight is dequantized by the same function as at load ([`dequantize_into`], each
//! value computed with the same operations) and every dot product in the same order, so the
//! result is the same bits as [`super::matmul_t`] on the dequantized matrix, for any batch.

use super::matmul::{for_row_tasks, isa, run_rows_on, Isa};
use super::memory::WeightMemory;

/// A ggml tensor type [`QuantMatrix`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 values: an f16 scale, 32 i8.
    Q8_0,
    /// 32 values: an f16 scale, 16 bytes of nibbles offset by 8.
    Q4_0,
    /// 32 values: f16 scale and min, 16 bytes of nibbles.
    Q4_1,
    /// 32 values: an f16 scale, 4 bytes of fifth bits, 16 bytes of nibbles offset by 16.
    Q5_0,
    /// 32 values: f16 scale and min, 4 bytes of fifth bits, 16 bytes of nibbles.
    Q5_1,
    /// 256 values in 8 groups with 6-bit scales and mins, 4-bit values.
    Q4K,
    /// As Q4_K with a fifth bit per value.
    Q5K,
    /// 256 values in 16 groups with i8 scales, 6-bit values.
    Q6K,
}

impl QuantType {
    /// The type of ggml type id `id`, if it is one of these.
    pub fn from_ggml(id: u32) -> Option<Self> {
        Some(match id {
            1 => Self::F16,
            30 => Self::Bf16,
            8 => Self::Q8_0,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            _ => return None,
        })
    }

    /// Values a block holds.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F16 | Self::Bf16 => 1,
            Self::Q8_0 | Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => 256,
        }
    }

    /// Bytes a block takes.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F16 | Self::Bf16 => 2,
            Self::Q8_0 => 34,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }
}

/// Every f16 as f32 (256 KiB): a block's scales are converted once per 32 or 256 values, and
/// `half`'s conversion checks the CPU's features on every call, which cost more than the
/// values themselves.
static F16_TO_F32: std::sync::LazyLock<Box<[f32]>> =
    std::sync::LazyLock::new(|| (0..=u16::MAX).map(|b| half::f16::from_bits(b).to_f32()).collect());

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    F16_TO_F32[u16::from_le_bytes([b[i], b[i + 1]]) as usize]
}

/// The 6-bit scale and min `j` of a Q4_K / Q5_K block's 12 packed scale bytes.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        (((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4)) as f32, ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as f32)
    }
}

/// Dequantizes whole blocks of `ty` in `bytes` into `out` (`bytes.len() / block_bytes *
/// block_elems` values, in stored order).
///
/// # Panics
/// If `bytes` is not whole blocks or `out` has another length (callers size both from the
/// checked shape).
#[inline(always)]
pub fn dequantize_into(ty: QuantType, bytes: &[u8], out: &mut [f32]) {
    let (eb, bb) = (ty.block_elems(), ty.block_bytes());
    assert!(bytes.len().is_multiple_of(bb) && out.len() == bytes.len() / bb * eb, "dequantize: bad lengths");
    match ty {
        QuantType::F16 => blocks::<2, 1>(bytes, out, |b, o| o[0] = f16_at(b, 0)),
        QuantType::Bf16 => {
            blocks::<2, 1>(bytes, out, |b, o| o[0] = f32::from_bits((u16::from_le_bytes(*b) as u32) << 16))
        }
        // Every other format block by block, through the units a `QuantMatrix` keeps (so both
        // give a value by the same operations).
        QuantType::Q8_0
        | QuantType::Q4_0
        | QuantType::Q4_1
        | QuantType::Q5_0
        | QuantType::Q5_1
        | QuantType::Q4K
        | QuantType::Q5K
        | QuantType::Q6K => {
            let split = ty.split().expect("block formats are kept in units");
            let (mut values, mut scales) = ([0u8; 192], [0.0f32; 16]);
            let per_block = split.units_per_block(ty);
            let (values, scales) = (&mut values[..per_block * split.bytes], &mut scales[..per_block * split.scales]);
            for (b, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(eb)) {
                split_block(ty, b, values, scales);
                dequantize_split(ty, values, scales, o);
            }
        }
    }
}

/// A Q8_0 block's values: `q · d`.
#[inline(always)]
fn q8_0_values(d: f32, q: &[u8; 32], o: &mut [f32; 32]) {
    for i in 0..32 {
        o[i] = q[i] as i8 as f32 * d;
    }
}

/// A Q4_0 / Q4_1 block's values from its 16 nibble bytes: low nibbles are values 0-15, high
/// nibbles 16-31; Q4_0 offsets them by 8 (`m` = 0), Q4_1 adds its min (`bias` = 0):
/// `x = (q - bias) d + m`.
#[inline(always)]
fn q4_values(d: f32, bias: f32, m: f32, q: &[u8; 16], o: &mut [f32; 32]) {
    for i in 0..16 {
        o[i] = ((q[i] & 0xf) as f32 - bias) * d + m;
        o[i + 16] = ((q[i] >> 4) as f32 - bias) * d + m;
    }
}

/// A Q5_0 / Q5_1 block's values from its 4 bytes of fifth bits (bit `i` for value `i`) and 16
/// nibble bytes (as Q4's): `x = (q - bias) d`, plus `m` for Q5_1, as ggml computes them.
#[inline(always)]
fn q5_values(d: f32, bias: f32, m: Option<f32>, q: &[u8; 20], o: &mut [f32; 32]) {
    let high = u32::from_le_bytes([q[0], q[1], q[2], q[3]]);
    for i in 0..16 {
        let lo = (q[4 + i] & 0xf) as u32 | ((high >> i) & 1) << 4;
        let hi = (q[4 + i] >> 4) as u32 | ((high >> (i + 16)) & 1) << 4;
        let (lo, hi) = ((lo as f32 - bias) * d, (hi as f32 - bias) * d);
        (o[i], o[i + 16]) = match m {
            Some(m) => (lo + m, hi + m),
            None => (lo, hi),
        };
    }
}

/// `f` on each block of `BB` bytes and its `EB` values (fixed sizes, so the loops inside
/// vectorize without bounds checks).
#[inline(always)]
fn blocks<const BB: usize, const EB: usize>(bytes: &[u8], out: &mut [f32], f: impl Fn(&[u8; BB], &mut [f32; EB])) {
    for (b, o) in bytes.as_chunks::<BB>().0.iter().zip(out.as_chunks_mut::<EB>().0) {
        f(b, o);
    }
}

/// How a quantized format is kept: in units of `values` consecutive values (a 32-value block,
/// or a group of a K format's superblock), each unit's value bytes (`bytes`, nibbles and high
/// bits as the file has them, or regrouped so that a unit holds all of its own) in one array and
/// its scales as f32 (`scales`: d, or d and m; for the K formats the products of the superblock
/// scale and each sub-block's, as the reference multiplies them first) in another. A product
/// then reads each scale with one load and each unit from one place.
#[derive(Clone, Copy, Debug)]
struct Split {
    values: usize,
    bytes: usize,
    scales: usize,
}

impl Split {
    fn units_per_block(self, ty: QuantType) -> usize {
        ty.block_elems() / self.values
    }
}

impl QuantType {
    fn split(self) -> Option<Split> {
        let (values, bytes, scales) = match self {
            Self::Q8_0 => (32, 32, 1),
            Self::Q4_0 => (32, 16, 1),
            Self::Q4_1 => (32, 16, 2),
            Self::Q5_0 => (32, 20, 1),
            Self::Q5_1 => (32, 20, 2),
            // A 64-value group: 32 nibble bytes (low nibbles then high), two (scale, min).
            Self::Q4K => (64, 32, 4),
            // As Q4_K, and the group's 64 fifth bits (8 bytes).
            Self::Q5K => (64, 40, 4),
            // A 128-value half: 64 low-nibble bytes, 32 bytes of 2-bit highs, 8 scales.
            Self::Q6K => (128, 96, 8),
            Self::F16 | Self::Bf16 => return None,
        };
        Some(Split { values, bytes, scales })
    }
}

/// One file block of a split format as its units: value bytes into `values`, scales into
/// `scales` (`units_per_block` units of each).
fn split_block(ty: QuantType, b: &[u8], values: &mut [u8], scales: &mut [f32]) {
    let copy = |values: &mut [u8], at: usize| {
        let n = values.len();
        values.copy_from_slice(&b[at..at + n]);
    };
    match ty {
        QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 => {
            copy(values, 2);
            scales[0] = f16_at(b, 0);
        }
        QuantType::Q4_1 | QuantType::Q5_1 => {
            copy(values, 4);
            (scales[0], scales[1]) = (f16_at(b, 0), f16_at(b, 2));
        }
        // d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits, bit 2g of
        // byte i for value i of group g's low half, 2g + 1 for its high half,) 128 bytes of
        // nibbles: 4 groups of 64 values, each 32 low nibbles then 32 high ones, each half with
        // its scale and min.
        QuantType::Q4K | QuantType::Q5K => {
            let (d, dmin, packed) = (f16_at(b, 0), f16_at(b, 2), &b[4..16]);
            let (qs, per) = if ty == QuantType::Q4K { (16, 32) } else { (48, 40) };
            for g in 0..4 {
                for half in 0..2 {
                    let (sc, m) = scale_min_k4(2 * g + half, packed);
                    (scales[4 * g + 2 * half], scales[4 * g + 2 * half + 1]) = (d * sc, dmin * m);
                }
                let unit = &mut values[per * g..per * (g + 1)];
                unit[..32].copy_from_slice(&b[qs + 32 * g..qs + 32 * g + 32]);
                if ty == QuantType::Q5K {
                    let bits =
                        (0..64).fold(0u64, |acc, v| acc | (((b[16 + v % 32] >> (2 * g + v / 32)) & 1) as u64) << v);
                    unit[32..40].copy_from_slice(&bits.to_le_bytes());
                }
            }
        }
        // 128 bytes of low nibbles, 64 of 2-bit highs, 16 i8 scales, d: two halves of 128
        // values, each four runs of 32 (ql low, ql+32 low, ql high, ql+32 high nibbles).
        QuantType::Q6K => {
            let d = f16_at(b, 208);
            for half in 0..2 {
                let unit = &mut values[96 * half..96 * (half + 1)];
                unit[..64].copy_from_slice(&b[64 * half..64 * half + 64]);
                unit[64..].copy_from_slice(&b[128 + 32 * half..128 + 32 * half + 32]);
                for i in 0..8 {
                    scales[8 * half + i] = d * (b[192 + 8 * half + i] as i8 as f32);
                }
            }
        }
        QuantType::F16 | QuantType::Bf16 => unreachable!("kept as the file has them"),
    }
}

/// A Q4_K group's 64 values: `(d · sc) q - dmin · m` for each half.
#[inline(always)]
fn q4k_values(q: &[u8; 32], s: &[f32; 4], o: &mut [f32; 64]) {
    for i in 0..32 {
        o[i] = s[0] * (q[i] & 0xf) as f32 - s[1];
        o[32 + i] = s[2] * (q[i] >> 4) as f32 - s[3];
    }
}

/// A Q5_K group's 64 values: as Q4_K's with 16 added to a value whose fifth bit is set.
#[inline(always)]
fn q5k_values(q: &[u8; 40], s: &[f32; 4], o: &mut [f32; 64]) {
    let bits = u64::from_le_bytes([q[32], q[33], q[34], q[35], q[36], q[37], q[38], q[39]]);
    let high = |v: usize| if (bits >> v) & 1 != 0 { 16.0 } else { 0.0 };
    for i in 0..32 {
        o[i] = s[0] * ((q[i] & 0xf) as f32 + high(i)) - s[1];
        o[32 + i] = s[2] * ((q[i] >> 4) as f32 + high(32 + i)) - s[3];
    }
}

/// A Q6_K half's 128 values: `(d · sc) (q - 32)`, q from a nibble and two high bits, in four
/// runs of 32 with a scale per 16 values.
#[inline(always)]
fn q6k_values(q: &[u8; 96], s: &[f32; 8], o: &mut [f32; 128]) {
    let (ql, qh) = q.split_at(64);
    for l in 0..32 {
        let is = l / 16;
        let (lo, hi, h) = (ql[l], ql[l + 32], qh[l]);
        let q1 = ((lo & 0xf) | ((h & 3) << 4)) as i32 - 32;
        let q2 = ((hi & 0xf) | (((h >> 2) & 3) << 4)) as i32 - 32;
        let q3 = ((lo >> 4) | (((h >> 4) & 3) << 4)) as i32 - 32;
        let q4 = ((hi >> 4) | (((h >> 6) & 3) << 4)) as i32 - 32;
        o[l] = s[is] * q1 as f32;
        o[l + 32] = s[is + 2] * q2 as f32;
        o[l + 64] = s[is + 4] * q3 as f32;
        o[l + 96] = s[is + 6] * q4 as f32;
    }
}

/// A `[rows, cols]` weight matrix in a ggml block format, each row whole blocks.
#[derive(Clone, Debug)]
pub struct QuantMatrix {
    ty: QuantType,
    rows: usize,
    cols: usize,
    /// Each unit's value bytes (`Split`), in order; F16 and BF16 as the file stores them.
    data: WeightMemory<u8>,
    /// Each unit's scales, in order.
    scales: WeightMemory<f32>,
}

impl QuantMatrix {
    /// Takes `data`, checking that it is `rows` rows of `cols` values of `ty` in whole blocks.
    pub fn new(ty: QuantType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self, String> {
        if !cols.is_multiple_of(ty.block_elems()) {
            return Err(format!("{cols} columns are not whole {ty:?} blocks of {}", ty.block_elems()));
        }
        let want = rows * cols / ty.block_elems() * ty.block_bytes();
        if data.len() != want {
            return Err(format!("{rows} x {cols} of {ty:?} takes {want} bytes, not {}", data.len()));
        }
        let Some(split) = ty.split() else {
            return Ok(Self {
                ty,
                rows,
                cols,
                data: WeightMemory::concat(&[&data]),
                scales: WeightMemory::concat(&[]),
            });
        };
        let blocks = data.len() / ty.block_bytes();
        let per = split.units_per_block(ty);
        let (block_bytes, block_scales) = (per * split.bytes, per * split.scales);
        let file = data.chunks_exact(ty.block_bytes());
        let (mut spare_values, mut spare_scales) = (vec![0u8; block_bytes], vec![0.0f32; block_scales]);
        let values = WeightMemory::filled(blocks * block_bytes, |out| {
            for (b, o) in file.clone().zip(out.chunks_exact_mut(block_bytes)) {
                split_block(ty, b, o, &mut spare_scales);
            }
        });
        let scales = WeightMemory::filled(blocks * block_scales, |out| {
            for (b, o) in file.zip(out.chunks_exact_mut(block_scales)) {
                split_block(ty, b, &mut spare_values, o);
            }
        });
        Ok(Self { ty, rows, cols, data: values, scales })
    }

    /// The block format.
    pub fn quant_type(&self) -> QuantType {
        self.ty
    }

    /// Rows (outputs of a projection).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns (inputs).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held (what a forward reads).
    pub fn bytes(&self) -> usize {
        self.data.len() + self.scales.len() * 4
    }

    fn blocks_per_row(&self) -> usize {
        self.cols / self.ty.block_elems()
    }

    /// A row's bytes in `data`.
    fn row_bytes(&self) -> usize {
        self.blocks_per_row() * self.ty.split().map_or(self.ty.block_bytes(), |s| s.units_per_block(self.ty) * s.bytes)
    }

    /// A row's scales in `scales`.
    fn row_scales(&self) -> usize {
        self.blocks_per_row() * self.ty.split().map_or(0, |s| s.units_per_block(self.ty) * s.scales)
    }

    /// Rows `r0..r0 + n`: their bytes and their scales.
    fn rows_of(&self, r0: usize, n: usize) -> (&[u8], &[f32]) {
        let (rb, rs) = (self.row_bytes(), self.row_scales());
        (&self.data[r0 * rb..(r0 + n) * rb], &self.scales[r0 * rs..(r0 + n) * rs])
    }

    /// Row `r` as f32 into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        self.dequantize_rows(r, 1, out);
    }

    /// Rows `r0..r0 + n` as f32 into `out` (`n * cols` values): the values
    /// [`dequantize_into`] gives on the file's blocks, by the same operations.
    #[inline(always)]
    fn dequantize_rows(&self, r0: usize, n: usize, out: &mut [f32]) {
        let (bytes, scales) = self.rows_of(r0, n);
        dequantize_split(self.ty, bytes, scales, out);
    }

    /// The whole matrix as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        self.dequantize_rows(0, self.rows, &mut out);
        out
    }

    /// The matrix whose row `i` is this one's row `order[i]` (a permutation of the rows).
    pub fn with_rows(&self, order: &[usize]) -> Result<Self, String> {
        if let Some(&r) = order.iter().find(|&&r| r >= self.rows) {
            return Err(format!("row {r} of {}", self.rows));
        }
        let rows: Vec<(&[u8], &[f32])> = order.iter().map(|&r| self.rows_of(r, 1)).collect();
        let data = WeightMemory::concat(&rows.iter().map(|r| r.0).collect::<Vec<_>>());
        let scales = WeightMemory::concat(&rows.iter().map(|r| r.1).collect::<Vec<_>>());
        Ok(Self { ty: self.ty, rows: order.len(), cols: self.cols, data, scales })
    }
}

/// [`dequantize_into`] for a [`QuantMatrix`]'s storage: units' value bytes and scales apart,
/// F16 and BF16 as the file stores them.
#[inline(always)]
fn dequantize_split(ty: QuantType, bytes: &[u8], scales: &[f32], out: &mut [f32]) {
    match ty {
        QuantType::Q8_0 => split_units::<32, 1, 32>(bytes, scales, out, |q, s, o| q8_0_values(s[0], q, o)),
        QuantType::Q4_0 => split_units::<16, 1, 32>(bytes, scales, out, |q, s, o| q4_values(s[0], 8.0, 0.0, q, o)),
        QuantType::Q4_1 => split_units::<16, 2, 32>(bytes, scales, out, |q, s, o| q4_values(s[0], 0.0, s[1], q, o)),
        QuantType::Q5_0 => split_units::<20, 1, 32>(bytes, scales, out, |q, s, o| q5_values(s[0], 16.0, None, q, o)),
        QuantType::Q5_1 => {
            split_units::<20, 2, 32>(bytes, scales, out, |q, s, o| q5_values(s[0], 0.0, Some(s[1]), q, o))
        }
        QuantType::Q4K => split_units::<32, 4, 64>(bytes, scales, out, q4k_values),
        QuantType::Q5K => split_units::<40, 4, 64>(bytes, scales, out, q5k_values),
        QuantType::Q6K => split_units::<96, 8, 128>(bytes, scales, out, q6k_values),
        QuantType::F16 | QuantType::Bf16 => dequantize_into(ty, bytes, out),
    }
}

/// `f` on each unit kept apart: its `QB` value bytes, its `S` scales, its `V` values.
#[inline(always)]
fn split_units<const QB: usize, const S: usize, const V: usize>(
    bytes: &[u8],
    scales: &[f32],
    out: &mut [f32],
    f: impl Fn(&[u8; QB], &[f32; S], &mut [f32; V]),
) {
    let units = bytes.len() / QB;
    assert!(bytes.len() == units * QB && scales.len() == units * S && out.len() == units * V, "bad lengths");
    let (q, s, o) = (bytes.as_chunks::<QB>().0, scales.as_chunks::<S>().0, out.as_chunks_mut::<V>().0);
    for ((q, s), o) in q.iter().zip(s).zip(o) {
        f(q, s, o);
    }
}

/// Rows dequantized together: one pass of the f32 kernels over them (8 rows x a few thousand
/// columns stay in L2).
const ROW_GROUP: usize = 8;

/// Rows `j0..j0 + rows` of `w` against all tokens into `part` (`part[t * rows + j]`): a few
/// tokens of a 32-value format on AVX-512 straight from the blocks (the decode step), otherwise
/// eight rows at a time dequantized into `scratch` for the f32 kernels.
#[inline(always)]
fn quant_rows(x: &[f32], tokens: usize, w: &QuantMatrix, j0: usize, rows: usize, part: &mut [f32], isa: Isa) {
    let k = w.cols;
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && tokens <= x86::FUSED_TOKENS {
        let (bytes, scales) = w.rows_of(j0, rows);
        // Safety: `Isa::Avx512` means AVX-512F, AVX2 and FMA were detected, and this function
        // is only compiled into `quant_rows_avx512`, which enables them.
        if unsafe { x86::fused_rows(w.ty, x, tokens, bytes, scales, k, part) } {
            return;
        }
    }
    let mut scratch = vec![0.0f32; ROW_GROUP * k];
    let mut j = 0;
    while j < rows {
        let n = ROW_GROUP.min(rows - j);
        let ((bytes, scales), values) = (w.rows_of(j0 + j, n), &mut scratch[..n * k]);
        #[cfg(target_arch = "x86_64")]
        let done = isa != Isa::Portable && x86::dequantize_split(w.ty, bytes, scales, values);
        #[cfg(not(target_arch = "x86_64"))]
        let done = false;
        if !done {
            dequantize_split(w.ty, bytes, scales, values);
        }
        run_rows_on(isa, x, tokens, &scratch[..n * k], k, n, &mut part[j..], rows);
        j += n;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn quant_rows_avx2(x: &[f32], tokens: usize, w: &QuantMatrix, j0: usize, rows: usize, part: &mut [f32]) {
    quant_rows(x, tokens, w, j0, rows, part, Isa::Avx2)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn quant_rows_avx512(x: &[f32], tokens: usize, w: &QuantMatrix, j0: usize, rows: usize, part: &mut [f32]) {
    quant_rows(x, tokens, w, j0, rows, part, Isa::Avx512)
}

fn quant_task(x: &[f32], tokens: usize, w: &QuantMatrix, j0: usize, rows: usize, part: &mut [f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // Safety: the CPU supports AVX-512F, AVX2 and FMA (detected at run time), all the
        // function adds.
        Isa::Avx512 => unsafe { quant_rows_avx512(x, tokens, w, j0, rows, part) },
        #[cfg(target_arch = "x86_64")]
        // Safety: the CPU supports AVX2 and FMA (detected at run time), all the function adds.
        Isa::Avx2 => unsafe { quant_rows_avx2(x, tokens, w, j0, rows, part) },
        _ => quant_rows(x, tokens, w, j0, rows, part, Isa::Portable),
    }
}

/// `out[t * rows + j] = Σ x[t, kk] · w[j, kk]`, the bits [`super::matmul_t`] gives on
/// `w.dequantize()`, reading `w` as stored.
///
/// # Panics
/// If a slice is shorter than its stated shape (a programming error, not a request error).
pub fn matmul_t_quant(x: &[f32], tokens: usize, w: &QuantMatrix, out: &mut [f32]) {
    let (m, k) = (w.rows, w.cols);
    assert!(x.len() >= tokens * k && out.len() >= tokens * m);
    if tokens == 0 || m == 0 {
        return;
    }
    for_row_tasks(tokens, m, out, |j0, rows, part| quant_task(x, tokens, w, j0, rows, part));
}

/// The 32-value formats with explicit SIMD: each value dequantized by the same operations, in
/// the same order, as [`super::dequantize_into`] (one conversion, one multiply, one add; no
/// fused multiply-add), so the same bits: into memory with AVX2 ([`dequantize_split`]), or into
/// registers and straight into the f32 kernels' dot products with AVX-512 ([`fused_rows`]).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::QuantType;
    use crate::cpu::matmul::x86::fold_tile;

    /// Dequantizes a [`super::QuantMatrix`]'s rows of a 32-value format (value bytes and
    /// scales apart) into `out` with AVX2, if `ty` is one (else `false`, nothing written).
    ///
    /// Only called from code compiled for AVX2 after detecting it (`quant_rows_avx2`,
    /// `quant_rows_avx512`).
    #[inline(always)]
    pub(super) fn dequantize_split(ty: QuantType, bytes: &[u8], scales: &[f32], out: &mut [f32]) -> bool {
        let blocks = out.len() / 32;
        let Some(split) = ty.split().filter(|_| matches!(ty, QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1))
        else {
            return false;
        };
        assert!(
            out.len() == blocks * 32 && bytes.len() == blocks * split.bytes && scales.len() == blocks * split.scales,
            "dequantize: bad lengths"
        );
        for (b, o) in out.chunks_exact_mut(32).enumerate() {
            let (q, s) = (&bytes[b * split.bytes..], &scales[b * split.scales..]);
            // Safety: AVX2 is present (see above); the loads read the block's `split.bytes`
            // bytes and each store writes 8 of its 32 values.
            unsafe {
                let d = _mm256_set1_ps(s[0]);
                match ty {
                    QuantType::Q8_0 => {
                        for c in 0..4 {
                            let q = _mm_loadl_epi64(q.as_ptr().add(8 * c).cast());
                            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                            _mm256_storeu_ps(o.as_mut_ptr().add(8 * c), _mm256_mul_ps(v, d));
                        }
                    }
                    _ => {
                        let (bias, m) = if ty == QuantType::Q4_0 { (8.0, 0.0) } else { (0.0, s[1]) };
                        let (bias, m) = (_mm256_set1_ps(bias), _mm256_set1_ps(m));
                        let q = _mm_loadu_si128(q.as_ptr().cast());
                        let low = _mm_and_si128(q, _mm_set1_epi8(0x0f));
                        let high = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0f));
                        // Values 0-7, 8-15 (low nibbles of bytes 0-7, 8-15), then 16-23, 24-31.
                        let parts = [low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)];
                        for (c, p) in parts.into_iter().enumerate() {
                            let v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p));
                            let y = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v, bias), d), m);
                            _mm256_storeu_ps(o.as_mut_ptr().add(8 * c), y);
                        }
                    }
                }
            }
        }
        true
    }

    /// How far ahead of its reads a fused product asks for a row's bytes (measured on SmolLM2's
    /// files, one token: 2 KiB ahead gave Q4_1 +12%, Q8_0 +13%, Q4_K_M +10% over none; 1 KiB
    /// less).
    const PREFETCH_AHEAD: usize = 2048;

    /// Up to this many tokens a product reads the blocks straight into its dot products; more
    /// share one dequantization of each row through memory.
    pub(super) const FUSED_TOKENS: usize = 4;

    /// A format's unit as a [`super::QuantMatrix`] keeps it (`Split`): its values, value
    /// bytes and scales, and its values as 16-lane vectors.
    trait Block {
        const UNIT: usize;
        const BYTES: usize;
        const SCALES: usize;
        /// Calls `f(i, v)` with values `16 i..16 i + 16` of the unit whose value bytes are at
        /// `q` and scales at `s`, for i = 0, 1, ... in order.
        ///
        /// # Safety
        /// `q` points at `BYTES` readable bytes, `s` at `SCALES` f32s; the CPU has AVX-512F.
        unsafe fn unit(q: *const u8, s: *const f32, f: impl FnMut(usize, __m512));
    }

    /// A [`Block`] of 32 values from a function giving its two vectors.
    macro_rules! block32 {
        ($name:ident, $bytes:literal, $scales:literal, $values:expr) => {
            struct $name;
            impl Block for $name {
                const UNIT: usize = 32;
                const BYTES: usize = $bytes;
                const SCALES: usize = $scales;
                #[inline(always)]
                unsafe fn unit(q: *const u8, s: *const f32, mut f: impl FnMut(usize, __m512)) {
                    // Safety: as the trait's.
                    let (a, b) = unsafe { $values(q, s) };
                    f(0, a);
                    f(1, b);
                }
            }
        };
    }

    /// The sixteen values 0.0..15.0.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, and the caller must be compiled with it.
    #[inline(always)]
    unsafe fn iota() -> __m512 {
        _mm512_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0)
    }

    /// A 4-bit block's 16 possible values, `(q - bias) d + m` for q = 0..15 by the reference's
    /// operations, then each value looked up by its nibble: the same bits as computing each.
    /// The 16 bytes go one to an i32 lane, whose low four bits are the low nibble (all a
    /// 16-entry permute reads), then shifted down by four for the high ones.
    #[inline(always)]
    unsafe fn lookup(nibbles: *const u8, d: __m512, bias: __m512, m: __m512) -> (__m512, __m512) {
        let table = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(unsafe { iota() }, bias), d), m);
        // Safety: the caller's block holds the 16 bytes.
        let bytes = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(nibbles.cast()) });
        (_mm512_permutexvar_ps(bytes, table), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table))
    }

    block32!(Q40, 16, 1, |q, s: *const f32| lookup(q, _mm512_set1_ps(*s), _mm512_set1_ps(8.0), _mm512_setzero_ps()));
    block32!(Q41, 16, 2, |q, s: *const f32| lookup(
        q,
        _mm512_set1_ps(*s),
        _mm512_setzero_ps(),
        _mm512_set1_ps(*s.add(1))
    ));

    /// A 5-bit block's 32 possible values, `(q - bias) d (+ m)` for q = 0..31 by the
    /// reference's operations, each value looked up by its nibble and fifth bit (bit `i` of the
    /// first four bytes for value `i`).
    #[inline(always)]
    unsafe fn lookup5(q: *const u8, d: __m512, bias: __m512, m: Option<__m512>) -> (__m512, __m512) {
        let low = unsafe { iota() };
        let high = _mm512_add_ps(low, _mm512_set1_ps(16.0));
        let value = |q: __m512| {
            let v = _mm512_mul_ps(_mm512_sub_ps(q, bias), d);
            m.map_or(v, |m| _mm512_add_ps(v, m))
        };
        let (t0, t1) = (value(low), value(high));
        // Safety: the caller's block holds the 4 + 16 bytes.
        let (bits, bytes) = unsafe {
            (
                _mm512_set1_epi32(q.cast::<i32>().read_unaligned()),
                _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(4).cast())),
            )
        };
        let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let fifth = |shift: __m512i| {
            _mm512_and_si512(_mm512_slli_epi32::<4>(_mm512_srlv_epi32(bits, shift)), _mm512_set1_epi32(0x10))
        };
        let lo = _mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0f)), fifth(lane));
        let hi = _mm512_or_si512(_mm512_srli_epi32::<4>(bytes), fifth(_mm512_add_epi32(lane, _mm512_set1_epi32(16))));
        (_mm512_permutex2var_ps(t0, lo, t1), _mm512_permutex2var_ps(t0, hi, t1))
    }

    block32!(Q50, 20, 1, |q, s: *const f32| lookup5(q, _mm512_set1_ps(*s), _mm512_set1_ps(16.0), None));
    block32!(Q51, 20, 2, |q, s: *const f32| lookup5(
        q,
        _mm512_set1_ps(*s),
        _mm512_setzero_ps(),
        Some(_mm512_set1_ps(*s.add(1)))
    ));

    /// Q8_0: `q · d`, bytes 0-15 and 16-31.
    #[inline(always)]
    unsafe fn q8_0(q: *const u8, s: *const f32) -> (__m512, __m512) {
        // Safety: the caller's unit holds the 32 bytes and the scale.
        let d = _mm512_set1_ps(unsafe { *s });
        let half = |at: usize| {
            let q = unsafe { _mm_loadu_si128(q.add(at).cast()) };
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d)
        };
        (half(0), half(16))
    }
    block32!(Q80, 32, 1, q8_0);

    /// Q4_K's 64-value group: two 16-entry tables `(d · sc) q - dmin · m`, the low nibbles of
    /// the 32 bytes looked up in the first, the high ones in the second.
    struct Q4K;
    impl Block for Q4K {
        const UNIT: usize = 64;
        const BYTES: usize = 32;
        const SCALES: usize = 4;
        #[inline(always)]
        unsafe fn unit(q: *const u8, s: *const f32, mut f: impl FnMut(usize, __m512)) {
            // Safety: as the trait's.
            let (low, high, b0, b1) = unsafe {
                let table = |a: f32, b: f32| _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(a), iota()), _mm512_set1_ps(b));
                (
                    table(*s, *s.add(1)),
                    table(*s.add(2), *s.add(3)),
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(q.cast())),
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(16).cast())),
                )
            };
            f(0, _mm512_permutexvar_ps(b0, low));
            f(1, _mm512_permutexvar_ps(b1, low));
            f(2, _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b0), high));
            f(3, _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b1), high));
        }
    }

    /// Q5_K's 64-value group: as Q4_K's with 32-entry tables, the index's fifth bit from the
    /// group's 64 bits.
    struct Q5K;
    impl Block for Q5K {
        const UNIT: usize = 64;
        const BYTES: usize = 40;
        const SCALES: usize = 4;
        #[inline(always)]
        unsafe fn unit(q: *const u8, s: *const f32, mut f: impl FnMut(usize, __m512)) {
            // Safety: as the trait's.
            let (low, high, b0, b1, bits) = unsafe {
                let table = |a: f32, b: f32| {
                    let (a, b) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
                    let upper = _mm512_add_ps(iota(), _mm512_set1_ps(16.0));
                    (_mm512_sub_ps(_mm512_mul_ps(a, iota()), b), _mm512_sub_ps(_mm512_mul_ps(a, upper), b))
                };
                (
                    table(*s, *s.add(1)),
                    table(*s.add(2), *s.add(3)),
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(q.cast())),
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(q.add(16).cast())),
                    q.add(32).cast::<u64>().read_unaligned(),
                )
            };
            let nibble = |v: __m512i, i: usize| {
                let fifth = (bits >> (16 * i)) as u16 as __mmask16;
                _mm512_mask_or_epi32(v, fifth, v, _mm512_set1_epi32(16))
            };
            let low_nibbles = |b: __m512i| _mm512_and_si512(b, _mm512_set1_epi32(0x0f));
            f(0, _mm512_permutex2var_ps(low.0, nibble(low_nibbles(b0), 0), low.1));
            f(1, _mm512_permutex2var_ps(low.0, nibble(low_nibbles(b1), 1), low.1));
            f(2, _mm512_permutex2var_ps(high.0, nibble(_mm512_srli_epi32::<4>(b0), 2), high.1));
            f(3, _mm512_permutex2var_ps(high.0, nibble(_mm512_srli_epi32::<4>(b1), 3), high.1));
        }
    }

    /// Q6_K's 128-value half: eight vectors `(d · sc) (q - 32)`, q a nibble of the first 64
    /// bytes with two bits of the last 32, one scale each.
    struct Q6K;
    impl Block for Q6K {
        const UNIT: usize = 128;
        const BYTES: usize = 96;
        const SCALES: usize = 8;
        #[inline(always)]
        unsafe fn unit(q: *const u8, s: *const f32, mut f: impl FnMut(usize, __m512)) {
            let bytes = |at: usize| {
                // Safety: the caller's unit holds the 96 bytes.
                _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(q.add(at).cast()) })
            };
            let (low4, three) = (_mm512_set1_epi32(0x0f), _mm512_set1_epi32(3));
            // Run r of 32 values: nibbles of bytes 0-31 (r even) or 32-63, low (r < 2) or high,
            // with bits 2r, 2r + 1 of bytes 64-95; in two vectors of 16 (c).
            for r in 0..4 {
                for c in 0..2 {
                    let l = bytes(32 * (r % 2) + 16 * c);
                    let nib = if r < 2 { _mm512_and_si512(l, low4) } else { _mm512_srli_epi32::<4>(l) };
                    let h =
                        _mm512_and_si512(_mm512_srlv_epi32(bytes(64 + 16 * c), _mm512_set1_epi32(2 * r as i32)), three);
                    let q6 = _mm512_sub_epi32(_mm512_or_si512(nib, _mm512_slli_epi32::<4>(h)), _mm512_set1_epi32(32));
                    // Safety: the caller's unit holds the 8 scales.
                    let scale = _mm512_set1_ps(unsafe { *s.add(2 * r + c) });
                    f(2 * r + c, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q6)));
                }
            }
        }
    }

    /// `R` rows of blocks against `C` tokens: the f32 tile's dot products (`matmul` module
    /// docs) on the rows' values as [`super::dequantize_into`] gives them, each value
    /// dequantized in registers once for all `C` tokens.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and FMA, and the caller must be compiled with them.
    #[inline(always)]
    unsafe fn fused_tile<B: Block, const R: usize, const C: usize>(
        rows: [(&[u8], &[f32]); R],
        x: [&[f32]; C],
        k: usize,
    ) -> [[f32; C]; R] {
        let units = k / B::UNIT;
        assert!(k.is_multiple_of(B::UNIT), "a row of whole units");
        for (q, s) in &rows {
            assert!(q.len() >= units * B::BYTES && s.len() >= units * B::SCALES, "unit row shorter than k");
        }
        for t in &x {
            assert!(t.len() >= k, "token row shorter than k");
        }
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for u in 0..units {
            for r in 0..R {
                let (q, s) = rows[r];
                // Ask for the row's bytes some way ahead: the hardware prefetcher keeps up with
                // few of the rows' streams at once. (A hint: any address is allowed.)
                _mm_prefetch::<_MM_HINT_T0>(q.as_ptr().wrapping_add(u * B::BYTES + PREFETCH_AHEAD).cast());
                // Safety: each row holds `units` units (asserted), and the callback's loads are
                // at u * UNIT + 16 i + 16 <= k <= each token row's length.
                unsafe {
                    B::unit(q.as_ptr().add(u * B::BYTES), s.as_ptr().add(u * B::SCALES), |i, w| {
                        for c in 0..C {
                            let xv = _mm512_loadu_ps(x[c].as_ptr().add(u * B::UNIT + 16 * i));
                            acc[r][c] = _mm512_fmadd_ps(w, xv, acc[r][c]);
                        }
                    })
                };
            }
        }
        // Whole units of 16-value vectors leave no tail.
        unsafe { fold_tile(acc) }
    }

    /// The rows of `bytes` and `scales` (a [`super::QuantMatrix`]'s, `k` values each) against
    /// `tokens` (at most [`FUSED_TOKENS`]) rows of `x`, into `part[t * rows + j]`, with
    /// [`fused_tile`]; `false` (nothing written) for formats it does not read.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2 and FMA, and the caller must be compiled with them.
    #[inline(always)]
    pub(super) unsafe fn fused_rows(
        ty: QuantType,
        x: &[f32],
        tokens: usize,
        bytes: &[u8],
        scales: &[f32],
        k: usize,
        part: &mut [f32],
    ) -> bool {
        // Safety (each arm): as this function's.
        unsafe {
            match ty {
                QuantType::Q4_0 => rows_of::<Q40>(x, tokens, bytes, scales, k, part),
                QuantType::Q4_1 => rows_of::<Q41>(x, tokens, bytes, scales, k, part),
                QuantType::Q5_0 => rows_of::<Q50>(x, tokens, bytes, scales, k, part),
                QuantType::Q5_1 => rows_of::<Q51>(x, tokens, bytes, scales, k, part),
                QuantType::Q8_0 => rows_of::<Q80>(x, tokens, bytes, scales, k, part),
                QuantType::Q4K => rows_of::<Q4K>(x, tokens, bytes, scales, k, part),
                QuantType::Q5K => rows_of::<Q5K>(x, tokens, bytes, scales, k, part),
                QuantType::Q6K => rows_of::<Q6K>(x, tokens, bytes, scales, k, part),
                _ => return false,
            }
        }
        true
    }

    #[inline(always)]
    unsafe fn rows_of<B: Block>(x: &[f32], tokens: usize, bytes: &[u8], scales: &[f32], k: usize, part: &mut [f32]) {
        let (rb, rs) = (k / B::UNIT * B::BYTES, k / B::UNIT * B::SCALES);
        let rows = bytes.len() / rb;
        let row = |j: usize| (&bytes[j * rb..(j + 1) * rb], &scales[j * rs..(j + 1) * rs]);
        let xrow = |t: usize| &x[t * k..(t + 1) * k];
        // `$r` rows at a time (the accumulators and each row's values in registers).
        macro_rules! run {
            ($r:literal, $c:literal) => {{
                let mut j = 0;
                while j < rows {
                    if j + $r <= rows {
                        let v = unsafe {
                            fused_tile::<B, $r, $c>(std::array::from_fn(|i| row(j + i)), std::array::from_fn(xrow), k)
                        };
                        for (i, vals) in v.iter().enumerate() {
                            for (t, &val) in vals.iter().enumerate() {
                                part[t * rows + j + i] = val;
                            }
                        }
                        j += $r;
                    } else {
                        let v = unsafe { fused_tile::<B, 1, $c>([row(j)], std::array::from_fn(xrow), k) };
                        for (t, &val) in v[0].iter().enumerate() {
                            part[t * rows + j] = val;
                        }
                        j += 1;
                    }
                }
            }};
        }
        // One token: eight rows in flight, except for the 4-bit formats whose few operations a
        // value leave them fastest at four (measured on SmolLM2's files: Q8_0 and Q5_0 +8-15%
        // at eight, Q4_1 -4%). More tokens: four (their accumulators).
        match tokens {
            1 if B::UNIT == 32 && B::BYTES == 16 => run!(4, 1),
            1 => run!(8, 1),
            2 => run!(4, 2),
            3 => run!(4, 3),
            4 => run!(4, 4),
            n => unreachable!("{n} tokens in the fused path"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matmul_t;

    fn bytes(seed: &mut u64, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| {
                *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (*seed >> 33) as u8
            })
            .collect()
    }

    /// Random blocks of each type, with their f16 scales set to small finite values: the
    /// matrix and the file's bytes it was made from.
    fn random_matrix(ty: QuantType, rows: usize, cols: usize, seed: &mut u64) -> (QuantMatrix, Vec<u8>) {
        let mut data = bytes(seed, rows * cols / ty.block_elems() * ty.block_bytes());
        let small =
            |b: &mut [u8], at: usize, v: f32| b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        for (i, b) in data.chunks_exact_mut(ty.block_bytes()).enumerate() {
            let v = 0.01 + (i % 7) as f32 * 0.003;
            match ty {
                QuantType::F16 | QuantType::Bf16 => {
                    let x = ((i % 13) as f32 - 6.0) * 0.05;
                    let raw = if ty == QuantType::F16 {
                        half::f16::from_f32(x).to_le_bytes()
                    } else {
                        half::bf16::from_f32(x).to_le_bytes()
                    };
                    b.copy_from_slice(&raw);
                }
                QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q5_0 => small(b, 0, v),
                QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4K | QuantType::Q5K => {
                    small(b, 0, v);
                    small(b, 2, v * 0.5);
                }
                QuantType::Q6K => small(b, 208, v),
            }
        }
        (QuantMatrix::new(ty, rows, cols, data.clone()).unwrap(), data)
    }

    #[test]
    fn quantized_products_are_the_bits_of_the_f32_product_on_the_dequantized_weights_for_any_batch() {
        let mut seed = 5u64;
        let types = [
            QuantType::F16,
            QuantType::Bf16,
            QuantType::Q8_0,
            QuantType::Q4_0,
            QuantType::Q4_1,
            QuantType::Q5_0,
            QuantType::Q5_1,
            QuantType::Q4K,
            QuantType::Q5K,
            QuantType::Q6K,
        ];
        for ty in types {
            let (rows, cols) = (37, 512);
            let (w, file) = random_matrix(ty, rows, cols, &mut seed);
            let dense = w.dequantize();
            assert!(dense.iter().all(|v| v.is_finite()), "{ty:?}");
            // As kept (scales apart for the 32-value formats), the values the file's blocks give.
            let mut direct = vec![0.0; rows * cols];
            dequantize_into(ty, &file, &mut direct);
            assert_eq!(dense, direct, "{ty:?}");
            let swapped = w.with_rows(&[1, 0]).unwrap();
            let (mut a, mut b) = (vec![0.0; cols], vec![0.0; cols]);
            swapped.dequantize_row(0, &mut a);
            w.dequantize_row(1, &mut b);
            assert_eq!(a, b, "{ty:?}: with_rows");
            for tokens in [1, 3, 9] {
                let x: Vec<f32> = bytes(&mut seed, tokens * cols).iter().map(|&b| b as f32 / 128.0 - 1.0).collect();
                let mut want = vec![0.0; tokens * rows];
                matmul_t(&x, tokens, &dense, rows, cols, &mut want);
                let mut got = vec![0.0; tokens * rows];
                matmul_t_quant(&x, tokens, &w, &mut got);
                assert_eq!(got, want, "{ty:?}, {tokens} tokens");
            }
            // A row alone gives its row of the whole.
            let mut row = vec![0.0; cols];
            w.dequantize_row(5, &mut row);
            assert_eq!(&row[..], &dense[5 * cols..6 * cols], "{ty:?}");
        }
    }

    #[test]
    fn shapes_that_are_not_whole_blocks_are_refused_with_the_numbers() {
        let e = QuantMatrix::new(QuantType::Q4K, 2, 100, vec![0; 10]).unwrap_err();
        assert!(e.contains("100 columns") && e.contains("256"), "{e}");
        let e = QuantMatrix::new(QuantType::Q8_0, 2, 64, vec![0; 10]).unwrap_err();
        assert!(e.contains("136 bytes"), "{e}");
        let w = QuantMatrix::new(QuantType::Q8_0, 2, 32, vec![0; 68]).unwrap();
        assert!(w.with_rows(&[1, 0]).is_ok() && w.with_rows(&[2]).is_err());
    }
}
