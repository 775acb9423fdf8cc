//! Named f32 tensors: read from safetensors files (single or sharded; f32, bf16, f16, and FP8
//! e4m3 with block scales, dequantized) or made by a preset, then taken one by one by the
//! transformer builder.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};
use tandem_compute::cpu::{QuantMatrix, WeightMemory};
pub use tandem_compute::fp8::{e4m3_to_f32, f32_to_e4m3};

use crate::ModelError;

/// A host tensor converted to f32, row-major.
#[derive(Clone, Debug)]
pub struct Tensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Elements.
    pub data: Vec<f32>,
}

/// A bag of named tensors the transformer builder takes from. Taking moves the tensor out, so
/// each weight is held once.
#[derive(Clone, Default)]
pub struct WeightMap {
    tensors: HashMap<String, Tensor>,
    /// Matrices kept in a ggml block format (a GGUF file's, for the CPU engine).
    quantized: HashMap<String, QuantMatrix>,
    /// Tensors read from FP8 (e4m3) and not yet multiplied by their block scales.
    fp8_unscaled: BTreeSet<String>,
}

/// A weight matrix as the CPU engine holds it: f32, or in the block format it was stored in.
#[derive(Clone, Debug)]
pub enum Matrix {
    /// `[rows, cols]` row-major, in memory of its own ([`WeightMemory`]: huge pages).
    F32(WeightMemory<f32>),
    /// Read as stored by [`tandem_compute::cpu::matmul_t_quant`].
    Quant(QuantMatrix),
}

impl WeightMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a tensor.
    pub fn insert(&mut self, name: impl Into<String>, tensor: Tensor) {
        self.tensors.insert(name.into(), tensor);
    }

    /// Adds (or replaces) a matrix kept in its block format.
    pub fn insert_quantized(&mut self, name: impl Into<String>, matrix: QuantMatrix) {
        let name = name.into();
        self.tensors.remove(&name);
        self.quantized.insert(name, matrix);
    }

    /// Whether a tensor is present.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name) || self.quantized.contains_key(name)
    }

    /// Removes and returns matrix `name` (`[rows, cols]`), in its block format if it was kept in
    /// one.
    pub fn take_matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        match self.quantized.remove(name) {
            Some(q) if (q.rows(), q.cols()) == (rows, cols) => Ok(Matrix::Quant(q)),
            Some(q) => Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                expected: vec![rows, cols],
                found: vec![q.rows(), q.cols()],
            }),
            None => self.take(name, &[rows, cols]).map(|v| Matrix::F32(WeightMemory::concat(&[&v]))),
        }
    }

    /// Removes and returns `name` as f32 (dequantized if it was kept quantized), checking its
    /// shape.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        if let Some(q) = self.quantized.remove(name) {
            self.tensors.insert(name.to_string(), Tensor { shape: vec![q.rows(), q.cols()], data: q.dequantize() });
        }
        let t = self.tensors.remove(name).ok_or_else(|| ModelError::MissingTensor { name: name.to_string() })?;
        if t.shape != shape {
            return Err(ModelError::ShapeMismatch { name: name.to_string(), expected: shape.to_vec(), found: t.shape });
        }
        Ok(t.data)
    }

    /// Removes `name`, `count` matrices of `[rows, cols]` stacked in one tensor, and returns
    /// them one by one.
    pub fn take_stacked(
        &mut self,
        name: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let all = self.take(name, &[count, rows, cols])?;
        Ok(all.chunks_exact(rows * cols).map(<[f32]>::to_vec).collect())
    }

    /// Iterates over the tensors (name order unspecified).
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.tensors.iter()
    }

    /// Reads every tensor of the checkpoint in `dir`: `model.safetensors`, or the shards named
    /// by `model.safetensors.index.json`.
    pub fn load_dir(dir: &Path) -> Result<Self, ModelError> {
        let mut map = Self::new();
        for file in checkpoint_files(dir)? {
            map.load_file(&file)?;
        }
        Ok(map)
    }

    fn load_file(&mut self, path: &Path) -> Result<(), ModelError> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // Safety: the map is read-only and lives only for this function; tandem does not
        // modify checkpoint files while loading them. A file truncated underneath us by
        // another process is the one hazard mmap carries, and reading a checkpoint that is
        // being rewritten is wrong in any case.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let st = SafeTensors::deserialize(&mmap)
            .map_err(|e| ModelError::Safetensors { path: path.to_path_buf(), message: e.to_string() })?;
        for (name, view) in st.tensors() {
            if view.dtype() == Dtype::F8_E4M3 {
                self.fp8_unscaled.insert(name.clone());
            }
            let data = to_f32(&name, view.dtype(), view.data())?;
            self.insert(name, Tensor { shape: view.shape().to_vec(), data });
        }
        Ok(())
    }

    /// Multiplies every FP8 weight `NAME` read by [`WeightMap::load_dir`] by its block scales
    /// `NAME_scale_inv` (`[ceil(rows / block[0]), ceil(cols / block[1])]`, one per block, the
    /// last row and column of blocks possibly partial), as `quantization_config` describes
    /// them: afterwards the map holds the dequantized weights. An FP8 tensor without
    /// `block` (no `quantization_config`) or without its scales is an error: unscaled it would
    /// be wrong numbers.
    pub fn dequantize_fp8(&mut self, block: Option<[usize; 2]>) -> Result<(), ModelError> {
        let Some(first) = self.fp8_unscaled.first() else { return Ok(()) };
        let Some([block_rows, block_cols]) = block else {
            return Err(ModelError::UnsupportedConfig(format!(
                "tensor `{first}` is FP8 but config.json has no quantization_config saying how it is scaled"
            )));
        };
        for name in std::mem::take(&mut self.fp8_unscaled) {
            let scale_name = format!("{name}_scale_inv");
            let scales =
                self.tensors.remove(&scale_name).ok_or(ModelError::MissingTensor { name: scale_name.clone() })?;
            let weight = self.tensors.get_mut(&name).ok_or(ModelError::MissingTensor { name: name.clone() })?;
            let [rows, cols] = weight.shape[..] else {
                return Err(ModelError::UnsupportedConfig(format!(
                    "FP8 tensor `{name}` has shape {:?}: block scales need a matrix",
                    weight.shape
                )));
            };
            let (scale_rows, scale_cols) = (rows.div_ceil(block_rows), cols.div_ceil(block_cols));
            if scales.shape != [scale_rows, scale_cols] {
                return Err(ModelError::ShapeMismatch {
                    name: scale_name,
                    expected: vec![scale_rows, scale_cols],
                    found: scales.shape,
                });
            }
            for (r, row) in weight.data.chunks_exact_mut(cols).enumerate() {
                let row_scales = &scales.data[(r / block_rows) * scale_cols..][..scale_cols];
                for (segment, scale) in row.chunks_mut(block_cols).zip(row_scales) {
                    segment.iter_mut().for_each(|w| *w *= scale);
                }
            }
        }
        Ok(())
    }

    /// `--quantization fp8`: every decoder linear weight ([`is_fp8_linear`]) rounded as an FP8
    /// checkpoint holds it, in blocks of `block` (rows, columns; the last ones may be partial):
    /// a block's scale is its largest magnitude over 448 (e4m3's largest), each weight the e4m3
    /// number nearest its quotient by the scale ([`f32_to_e4m3`]), and the map keeps their
    /// product. That is how the published FP8 checkpoints were made (and
    /// scripts/make_fp8_fixture.py makes one), so a model quantized here computes what its FP8
    /// checkpoint would. Returns the names quantized, sorted.
    pub fn quantize_fp8(&mut self, block: [usize; 2]) -> Vec<String> {
        let [block_rows, block_cols] = block.map(|b| b.max(1));
        let mut names: Vec<String> = self
            .tensors
            .iter()
            .filter(|(name, t)| t.shape.len() == 2 && is_fp8_linear(name))
            .map(|(name, _)| name.clone())
            .collect();
        names.sort();
        let table: [f32; 256] = std::array::from_fn(|b| e4m3_to_f32(b as u8));
        for name in &names {
            let Some(t) = self.tensors.get_mut(name) else { continue };
            let cols = t.shape[1].max(1);
            // Each band of block rows on a thread of its own (a 32B model's weights in seconds).
            t.data.par_chunks_mut(block_rows * cols).for_each(|band| {
                let rows = band.len() / cols;
                for c0 in (0..cols).step_by(block_cols) {
                    let c1 = (c0 + block_cols).min(cols);
                    let cells = || (0..rows).flat_map(move |r| (c0..c1).map(move |c| r * cols + c));
                    let amax = cells().map(|i| band[i].abs()).fold(0.0f32, f32::max);
                    // The scale as the checkpoints' makers compute it: in f64, then to f32.
                    let scale = if amax > 0.0 { (f64::from(amax) / 448.0) as f32 } else { 1.0 };
                    for i in cells() {
                        band[i] = table[usize::from(f32_to_e4m3(band[i] / scale))] * scale;
                    }
                }
            });
        }
        names
    }
}

/// Whether tensor `name` is a decoder layer's linear weight, which an FP8 checkpoint stores in
/// FP8 (attention's q, k, v, o and the MLP's or each expert's gate, up, down): not embeddings,
/// norms, the output head or a mixture's router.
pub fn is_fp8_linear(name: &str) -> bool {
    name.starts_with("model.layers.") && name.ends_with("_proj.weight")
}

/// The safetensors files of a checkpoint directory.
fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(ModelError::NotAModel { path: dir.to_path_buf() });
    }
    let text = std::fs::read_to_string(&index).map_err(|e| ModelError::io(&index, e))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| ModelError::Json { path: index.clone(), error: source })?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::Safetensors { path: index.clone(), message: "no `weight_map` object".into() })?;
    let mut files: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
    files.sort();
    files.dedup();
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

fn to_f32(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, ModelError> {
    Ok(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::F8_E4M3 => {
            let table: [f32; 256] = std::array::from_fn(|b| e4m3_to_f32(b as u8));
            bytes.iter().map(|&b| table[usize::from(b)]).collect()
        }
        other => return Err(ModelError::UnsupportedDtype { name: name.to_string(), dtype: format!("{other:?}") }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_bytes_read_as_the_format_defines_them() {
        for (byte, value) in [
            (0x00, 0.0),
            (0x38, 1.0),
            (0x40, 2.0),
            (0x3c, 1.5),
            (0x7e, 448.0),
            (0xfe, -448.0),
            (0x08, 2f32.powi(-6)),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
            (0xb8, -1.0),
            (0x30, 0.5),
        ] {
            assert_eq!(e4m3_to_f32(byte), value, "byte {byte:#04x}");
        }
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        // Every other byte is a finite number, and the 126 positive ones increase strictly.
        let positives: Vec<f32> = (0..0x7f).map(e4m3_to_f32).collect();
        assert!(positives.windows(2).all(|w| w[0] < w[1]));
    }

    /// A 5 x 7 FP8 matrix in 2 x 3 blocks (the last row and column of blocks partial): each
    /// element is multiplied by its own block's scale, and the scales leave the map.
    #[test]
    fn block_scales_multiply_their_own_blocks_partial_ones_too() {
        let mut map = WeightMap::new();
        let (rows, cols) = (5, 7);
        map.insert("w.weight", Tensor { shape: vec![rows, cols], data: vec![1.0; rows * cols] });
        map.fp8_unscaled.insert("w.weight".into());
        let scales: Vec<f32> = (0..9).map(|i| i as f32 + 1.0).collect();
        map.insert("w.weight_scale_inv", Tensor { shape: vec![3, 3], data: scales.clone() });
        map.dequantize_fp8(Some([2, 3])).unwrap();
        let w = map.take("w.weight", &[rows, cols]).unwrap();
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(w[r * cols + c], scales[(r / 2) * 3 + c / 3], "({r}, {c})");
            }
        }
        assert!(!map.contains("w.weight_scale_inv"));
    }

    /// The e4m3 byte nearest `x` (finite, below 448) by search over every positive e4m3 value,
    /// ties to the even byte: the definition, against which the arithmetic is checked.
    fn nearest_by_search(x: f32) -> u8 {
        let values: Vec<f32> = (0..0x7f).map(e4m3_to_f32).collect();
        let a = x.abs();
        let below = values.partition_point(|&v| v <= a) - 1;
        // Exact differences: the neighbours are within a factor of two of `a` past the first step.
        let (down, up) = (a - values[below], values[below + 1] - a);
        let byte = if down < up {
            below
        } else if up < down {
            below + 1
        } else {
            below + (below & 1)
        };
        (if x.is_sign_negative() { 0x80 } else { 0 }) | byte as u8
    }

    /// The arithmetic rounding agrees with the search on values spread over every binade e4m3
    /// has, subnormals and the binade below them included.
    #[test]
    fn e4m3_rounding_agrees_with_a_search_of_the_grid() {
        let mut state = 0x9e3779b97f4a7c15u64;
        for _ in 0..200_000 {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
            let exponent = ((state >> 8) % 20) as i32 - 11;
            let x = (1.0 + unit) * 2f32.powi(exponent) * if state & 1 == 0 { 1.0 } else { -1.0 };
            if x.abs() < 448.0 {
                assert_eq!(f32_to_e4m3(x), nearest_by_search(x), "{x:e}");
            }
        }
    }

    /// Every finite e4m3 number rounds to its own byte, and a value between two neighbours to
    /// the nearer one, a midpoint to the one with the even byte; past 448 saturates.
    #[test]
    fn f32_rounds_to_the_nearest_e4m3_ties_to_even() {
        for byte in (0u8..=0xff).filter(|b| b & 0x7f != 0x7f) {
            let v = e4m3_to_f32(byte);
            let back = f32_to_e4m3(v);
            assert!(back == byte || (v == 0.0 && back & 0x7f == 0), "{byte:#04x} -> {v} -> {back:#04x}");
        }
        for byte in 0u8..0x7e {
            let (lo, hi) = (e4m3_to_f32(byte), e4m3_to_f32(byte + 1));
            let mid = (lo + hi) / 2.0;
            let even = if byte % 2 == 0 { byte } else { byte + 1 };
            assert_eq!(f32_to_e4m3(mid), even, "midpoint of {byte:#04x} and the next");
            assert_eq!(f32_to_e4m3(-mid), 0x80 | even);
            assert_eq!(f32_to_e4m3(lo + (hi - lo) * 0.3), byte);
            assert_eq!(f32_to_e4m3(lo + (hi - lo) * 0.7), byte + 1);
        }
        assert_eq!(f32_to_e4m3(460.0), 0x7e);
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7f);
    }

    /// Quantizing takes the decoder's linear weights only, block by block (partial blocks
    /// scaled by their own largest magnitude), and a weight already on the e4m3 grid of its
    /// block's scale stays as it was.
    #[test]
    fn quantizing_rounds_each_block_of_the_linear_weights_alone() {
        let mut map = WeightMap::new();
        // 3 x 5 in 2 x 3 blocks: block (0, 0) holds 448 * 0.5 and exact grid points, block
        // (0, 1) 7.0 (its own scale 7 / 448), the last row's blocks their own.
        let data = vec![224.0, 1.0, 0.5, 7.0, 3.3, 16.0, 0.1, -2.0, 1.0, 1.0, 0.0, 0.0, 0.0, 5.0, 0.01];
        map.insert("model.layers.0.mlp.up_proj.weight", Tensor { shape: vec![3, 5], data: data.clone() });
        map.insert("model.embed_tokens.weight", Tensor { shape: vec![3, 5], data: data.clone() });
        map.insert("model.layers.0.mlp.gate.weight", Tensor { shape: vec![3, 5], data: data.clone() });
        let names = map.quantize_fp8([2, 3]);
        assert_eq!(names, ["model.layers.0.mlp.up_proj.weight"]);
        let q = map.take("model.layers.0.mlp.up_proj.weight", &[3, 5]).unwrap();
        // Block (0, 0) has scale 0.5: 224, 1, 0.5, 16 are on the grid, -2 too; 0.1 / 0.5 = 0.2
        // rounds to 0.203125 (13 / 64).
        assert_eq!(&q[..3], &[224.0, 1.0, 0.5]);
        assert_eq!(&q[5..8], &[16.0, 0.1015625, -2.0]);
        // Block (0, 1): 7 is its largest, so it maps to 448 exactly; 3.3 -> 3.3 * 64 = 211.2,
        // which rounds to 208 (the grid is 16 apart there): 3.25.
        assert_eq!(q[3], 7.0);
        assert_eq!(q[4], 3.25);
        // The last row's blocks: (0, 0, 0) -> zeros, scale 1; (5.0, 0.01): 5 -> 448, 0.01 * 89.6
        // = 0.896 -> 0.875 (the grid is 1/16 apart there) -> 0.875 / 89.6.
        assert_eq!(&q[10..13], &[0.0, 0.0, 0.0]);
        assert_eq!(q[13], 5.0);
        let scale = (5.0f64 / 448.0) as f32;
        assert_eq!(q[14], 0.875 * scale);
        assert_eq!(map.take("model.embed_tokens.weight", &[3, 5]).unwrap(), data);
        assert_eq!(map.take("model.layers.0.mlp.gate.weight", &[3, 5]).unwrap(), data);
    }

    #[test]
    fn fp8_without_its_scales_or_its_config_is_refused() {
        let fp8 = || {
            let mut map = WeightMap::new();
            map.insert("w.weight", Tensor { shape: vec![4, 4], data: vec![1.0; 16] });
            map.fp8_unscaled.insert("w.weight".into());
            map
        };
        let e = fp8().dequantize_fp8(None).unwrap_err().to_string();
        assert!(e.contains("w.weight") && e.contains("quantization_config"), "{e}");
        let e = fp8().dequantize_fp8(Some([2, 2])).unwrap_err().to_string();
        assert!(e.contains("w.weight_scale_inv"), "{e}");
        let mut wrong = fp8();
        wrong.insert("w.weight_scale_inv", Tensor { shape: vec![1, 1], data: vec![1.0] });
        let e = wrong.dequantize_fp8(Some([2, 2])).unwrap_err().to_string();
        assert!(e.contains("w.weight_scale_inv"), "{e}");
    }
}
