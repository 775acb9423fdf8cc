//! Named f32 tensors: read from safetensors files (single or sharded; f32, bf16, f16) or made
//! by a preset, then taken one by one by the transformer builder.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use tandem_compute::cpu::{QuantMatrix, WeightMemory};

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
#[derive(Default)]
pub struct WeightMap {
    tensors: HashMap<String, Tensor>,
    /// Matrices kept in a ggml block format (a GGUF file's, for the CPU engine).
    quantized: HashMap<String, QuantMatrix>,
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
            let data = to_f32(&name, view.dtype(), view.data())?;
            self.insert(name, Tensor { shape: view.shape().to_vec(), data });
        }
        Ok(())
    }
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
        other => return Err(ModelError::UnsupportedDtype { name: name.to_string(), dtype: format!("{other:?}") }),
    })
}
