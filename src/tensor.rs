//! Torch-free tensor descriptors. `torch_ops/` turns each `at::Tensor` into a [`TensorRef`]
//! (pointer, dtype, device, sizes, strides); everything below works on these, so the whole
//! library except the shim can be tested without libtorch.

use crate::error::{Error, Result};
use std::fmt;

/// CUDA stream to launch on (`cudaStream_t`); null for CPU buffers.
pub type Stream = *mut std::ffi::c_void;

/// Element types the ops accept. Values match `deep_ep_dtype_t` in `csrc/deep_ep_capi.h`.
#[repr(i32)]
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum DType {
    BFloat16 = 0,
    Float32 = 1,
    Float8E4m3 = 2,
    Int32 = 3,
    Int64 = 4,
    Bool = 5,
    UInt8 = 6,
    /// Types no op accepts; listed so error messages can name them.
    Float16 = 7,
    Float64 = 8,
    Int8 = 9,
    Int16 = 10,
    Other = 11,
}

impl DType {
    /// Converts the C enum value; unknown values are an error, not undefined behaviour.
    pub fn from_raw(v: i32) -> Option<DType> {
        Some(match v {
            0 => DType::BFloat16,
            1 => DType::Float32,
            2 => DType::Float8E4m3,
            3 => DType::Int32,
            4 => DType::Int64,
            5 => DType::Bool,
            6 => DType::UInt8,
            7 => DType::Float16,
            8 => DType::Float64,
            9 => DType::Int8,
            10 => DType::Int16,
            11 => DType::Other,
            _ => return None,
        })
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::BFloat16 | DType::Float16 | DType::Int16 => 2,
            DType::Float32 | DType::Int32 => 4,
            DType::Int64 | DType::Float64 => 8,
            DType::Float8E4m3 | DType::Bool | DType::UInt8 | DType::Int8 | DType::Other => 1,
        }
    }

    /// The name torch prints for this dtype (`torch.bfloat16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::BFloat16 => "torch.bfloat16",
            DType::Float32 => "torch.float32",
            DType::Float8E4m3 => "torch.float8_e4m3fn",
            DType::Int32 => "torch.int32",
            DType::Int64 => "torch.int64",
            DType::Bool => "torch.bool",
            DType::UInt8 => "torch.uint8",
            DType::Float16 => "torch.float16",
            DType::Float64 => "torch.float64",
            DType::Int8 => "torch.int8",
            DType::Int16 => "torch.int16",
            DType::Other => "an unsupported dtype",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a tensor lives.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(i32),
}

impl Device {
    /// `-1` is the CPU, `n >= 0` is CUDA device `n` (the C encoding).
    pub fn from_raw(v: i32) -> Device {
        if v < 0 {
            Device::Cpu
        } else {
            Device::Cuda(v)
        }
    }

    /// Inverse of [`Device::from_raw`].
    pub fn to_raw(self) -> i32 {
        match self {
            Device::Cpu => -1,
            Device::Cuda(i) => i,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Most dimensions any op argument has.
pub const MAX_DIMS: usize = 4;

/// A borrowed view of one tensor argument: the caller keeps the storage alive for the
/// duration of the op. Strides are in elements, as in torch.
#[derive(Copy, Clone, Debug)]
pub struct TensorRef {
    pub(crate) data: *mut u8,
    pub dtype: DType,
    pub device: Device,
    ndim: usize,
    sizes: [i64; MAX_DIMS],
    strides: [i64; MAX_DIMS],
}

// The pointer is only dereferenced by the backend inside the op call that received it.
unsafe impl Send for TensorRef {}
unsafe impl Sync for TensorRef {}

impl TensorRef {
    /// Builds a descriptor. Only `ffi` code (which knows the pointer is valid) and tests
    /// (with null pointers, for validation only) call this; reading the data is `unsafe`-gated
    /// in `ffi::tensor`.
    pub(crate) fn new(data: *mut u8, dtype: DType, device: Device, sizes: &[i64], strides: &[i64]) -> Self {
        assert!(sizes.len() <= MAX_DIMS && sizes.len() == strides.len());
        let mut s = [0; MAX_DIMS];
        let mut st = [0; MAX_DIMS];
        s[..sizes.len()].copy_from_slice(sizes);
        st[..strides.len()].copy_from_slice(strides);
        TensorRef { data, dtype, device, ndim: sizes.len(), sizes: s, strides: st }
    }

    /// Shape-only descriptor with a null pointer and contiguous strides (validation tests).
    pub fn meta(dtype: DType, device: Device, sizes: &[i64]) -> Self {
        let mut strides = vec![1i64; sizes.len()];
        for i in (0..sizes.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * sizes[i + 1].max(1);
        }
        TensorRef::new(std::ptr::null_mut(), dtype, device, sizes, &strides)
    }

    /// Sizes of each dimension.
    pub fn sizes(&self) -> &[i64] {
        &self.sizes[..self.ndim]
    }

    /// Strides of each dimension, in elements.
    pub fn strides(&self) -> &[i64] {
        &self.strides[..self.ndim]
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.ndim
    }

    /// Size of dimension `d` (panics if out of range: call after checking `ndim`).
    pub fn size(&self, d: usize) -> usize {
        self.sizes[d] as usize
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.sizes().iter().product::<i64>() as usize
    }

    /// Raw data pointer (device or host).
    pub fn data_ptr(&self) -> *mut u8 {
        self.data
    }

    /// Row-major contiguity, ignoring strides of size-1 dimensions as torch does.
    pub fn is_contiguous(&self) -> bool {
        if self.numel() == 0 {
            return true; // torch reports empty tensors contiguous whatever their strides
        }
        let mut expected = 1i64;
        for d in (0..self.ndim).rev() {
            if self.sizes[d] != 1 && self.strides[d] != expected {
                return false;
            }
            expected *= self.sizes[d];
        }
        true
    }

    /// Starts a validation chain for argument `name` of `op`.
    pub fn check<'a>(&'a self, op: &'static str, name: &'static str) -> Check<'a> {
        Check { t: self, op, name }
    }
}

/// A dimension requirement in [`Check::shape`]: a name for messages and an optional exact size.
pub type DimSpec = (&'static str, Option<usize>);

/// Fluent validation of one argument, producing messages such as
/// `deep_ep::dispatch: topk_idx must be int32 or int64 on cuda:0, got float32 on cpu`.
pub struct Check<'a> {
    t: &'a TensorRef,
    op: &'static str,
    name: &'static str,
}

impl Check<'_> {
    /// Requires one of `dtypes` and the given device (checked together for one clear message).
    pub fn on(self, dtypes: &[DType], device: Device) -> Result<Self> {
        if !dtypes.contains(&self.t.dtype) || self.t.device != device {
            let want: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
            return Err(Error::invalid(
                self.op,
                format!("{} must be {} on {}, got {} on {}", self.name, want.join(" or "), device, self.t.dtype, self.t.device),
            ));
        }
        Ok(self)
    }

    /// Requires this exact shape; `None` sizes only fix the rank.
    pub fn shape(self, dims: &[DimSpec]) -> Result<Self> {
        let ok =
            self.t.ndim == dims.len() && dims.iter().zip(self.t.sizes()).all(|((_, want), got)| want.map_or(true, |w| w as i64 == *got));
        if !ok {
            let want: Vec<String> = dims
                .iter()
                .map(|(n, s)| match s {
                    Some(v) => format!("{n}={v}"),
                    None => n.to_string(),
                })
                .collect();
            return Err(Error::invalid(self.op, format!("{} must have shape [{}], got {:?}", self.name, want.join(", "), self.t.sizes())));
        }
        Ok(self)
    }

    /// Requires row-major contiguous storage.
    pub fn contiguous(self) -> Result<Self> {
        if !self.t.is_contiguous() {
            return Err(Error::invalid(
                self.op,
                format!("{} must be contiguous, got strides {:?} for shape {:?}", self.name, self.t.strides(), self.t.sizes()),
            ));
        }
        Ok(self)
    }

    /// Ends the chain.
    pub fn done(self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_op_argument_dtype_and_device() {
        let t = TensorRef::meta(DType::Float32, Device::Cpu, &[4, 8]);
        let e = t.check(crate::op_names::DISPATCH, "topk_idx").on(&[DType::Int32, DType::Int64], Device::Cuda(0)).err().unwrap();
        assert_eq!(e.to_string(), "deep_ep::dispatch: topk_idx must be torch.int32 or torch.int64 on cuda:0, got torch.float32 on cpu");
    }

    #[test]
    fn shape_and_contiguity() {
        let t = TensorRef::meta(DType::Int64, Device::Cpu, &[4, 8]);
        assert!(t.check("op", "a").shape(&[("n", Some(4)), ("k", None)]).is_ok());
        let e = t.check("op", "a").shape(&[("n", Some(5)), ("k", None)]).err().unwrap();
        assert!(e.to_string().contains("a must have shape [n=5, k], got [4, 8]"), "{e}");
        let nc = TensorRef::new(std::ptr::null_mut(), DType::Int64, Device::Cpu, &[4, 8], &[1, 4]);
        assert!(nc.check("op", "a").contiguous().is_err());
        assert!(t.is_contiguous());
    }
}
