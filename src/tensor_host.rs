//! Host access to CPU tensors handed over by `torch_ops/`. A [`TensorRef`] with real data is
//! only built in [`crate::api`] from a live `at::Tensor` that outlives the op call, which
//! is what makes these views sound.

use crate::tensor::{Device, TensorRef};

/// Plain-old-data element types that may be viewed in host memory (CPU tensors, shared memory).
pub trait Pod: Copy + 'static {}
impl Pod for u8 {}
impl Pod for u16 {}
impl Pod for i32 {}
impl Pod for u32 {}
impl Pod for i64 {}
impl Pod for u64 {}
impl Pod for f32 {}

impl TensorRef {
    fn assert_host_view<T>(&self) {
        assert_eq!(self.device, Device::Cpu, "host view of a {} tensor", self.device);
        assert_eq!(self.dtype.size(), std::mem::size_of::<T>(), "host view with wrong element size for {}", self.dtype);
        assert!(self.is_contiguous(), "host view of a non-contiguous tensor");
    }

    /// The elements of a contiguous CPU tensor.
    pub fn cpu_slice<T: Pod>(&self) -> &[T] {
        self.assert_host_view::<T>();
        let n = self.numel();
        if n == 0 {
            return &[];
        }
        assert!(!self.data.is_null(), "host view of a tensor without data");
        // SAFETY: capi built this from a live CPU tensor of n elements of T's size, contiguous.
        unsafe { std::slice::from_raw_parts(self.data as *const T, n) }
    }

    /// Mutable elements of a contiguous CPU output tensor (the op owns it for the call).
    #[allow(clippy::mut_from_ref)]
    pub fn cpu_slice_mut<T: Pod>(&self) -> &mut [T] {
        self.assert_host_view::<T>();
        let n = self.numel();
        if n == 0 {
            return &mut [];
        }
        assert!(!self.data.is_null(), "host view of a tensor without data");
        // SAFETY: as above; outputs are fresh tensors (or `(a!)` arguments) nobody else touches.
        unsafe { std::slice::from_raw_parts_mut(self.data as *mut T, n) }
    }

    /// The raw bytes of a contiguous CPU tensor of any dtype.
    pub fn cpu_bytes(&self) -> &[u8] {
        assert_eq!(self.device, Device::Cpu, "host view of a {} tensor", self.device);
        assert!(self.is_contiguous(), "host view of a non-contiguous tensor");
        let n = self.numel() * self.dtype.size();
        if n == 0 {
            return &[];
        }
        assert!(!self.data.is_null(), "host view of a tensor without data");
        // SAFETY: a live contiguous CPU tensor of n bytes (see cpu_slice).
        unsafe { std::slice::from_raw_parts(self.data as *const u8, n) }
    }

    /// Mutable raw bytes of a contiguous CPU output tensor of any dtype.
    #[allow(clippy::mut_from_ref)]
    pub fn cpu_bytes_mut(&self) -> &mut [u8] {
        assert_eq!(self.device, Device::Cpu, "host view of a {} tensor", self.device);
        assert!(self.is_contiguous(), "host view of a non-contiguous tensor");
        let n = self.numel() * self.dtype.size();
        if n == 0 {
            return &mut [];
        }
        assert!(!self.data.is_null(), "host view of a tensor without data");
        // SAFETY: as cpu_slice_mut.
        unsafe { std::slice::from_raw_parts_mut(self.data, n) }
    }

    /// Whether the strides are a permutation of a contiguous layout (e.g. a transposed view):
    /// the elements exactly cover `numel` consecutive storage slots.
    pub fn is_dense(&self) -> bool {
        if self.numel() == 0 {
            return true;
        }
        let mut dims: Vec<(i64, i64)> = self.strides().iter().copied().zip(self.sizes().iter().copied()).filter(|&(_, n)| n != 1).collect();
        dims.sort_unstable();
        let mut expected = 1i64;
        for (stride, size) in dims {
            if stride != expected {
                return false;
            }
            expected *= size;
        }
        true
    }

    /// The `numel` storage elements of a dense CPU output tensor with any dense strides (see
    /// [`TensorRef::is_dense`]), in storage order: index them with `strides()`. Used for
    /// outputs DeepEP allocates transposed, such as LL FP8 scales.
    #[allow(clippy::mut_from_ref)]
    pub fn cpu_dense_storage_mut<T: Pod>(&self) -> &mut [T] {
        assert_eq!(self.device, Device::Cpu, "host view of a {} tensor", self.device);
        assert_eq!(self.dtype.size(), std::mem::size_of::<T>(), "host view with wrong element size for {}", self.dtype);
        assert!(
            self.is_dense(),
            "dense host view of a tensor with gaps or overlaps: sizes {:?} strides {:?}",
            self.sizes(),
            self.strides()
        );
        let n = self.numel();
        if n == 0 {
            return &mut [];
        }
        assert!(!self.data.is_null(), "host view of a tensor without data");
        // SAFETY: capi built this from a live CPU tensor whose n elements occupy exactly n
        // consecutive slots from `data` (density checked above); the op owns it for the call.
        unsafe { std::slice::from_raw_parts_mut(self.data as *mut T, n) }
    }

    /// Copies a 2-D CPU tensor with any strides into row-major bytes.
    pub fn cpu_copy_2d_contiguous(&self) -> Vec<u8> {
        assert_eq!(self.device, Device::Cpu);
        assert_eq!(self.ndim(), 2);
        let (rows, cols, es) = (self.size(0), self.size(1), self.dtype.size());
        let (s0, s1) = (self.strides()[0] as isize, self.strides()[1] as isize);
        let mut out = vec![0u8; rows * cols * es];
        if out.is_empty() {
            return out;
        }
        assert!(!self.data.is_null());
        for i in 0..rows {
            for j in 0..cols {
                let off = (i as isize * s0 + j as isize * s1) * es as isize;
                // SAFETY: (i, j) is inside the tensor described by sizes/strides.
                let src = unsafe { std::slice::from_raw_parts(self.data.offset(off), es) };
                out[(i * cols + j) * es..(i * cols + j + 1) * es].copy_from_slice(src);
            }
        }
        out
    }

    /// Topk indices as i64, whichever of int32/int64 the tensor holds (contiguous CPU).
    pub fn cpu_indices_i64(&self) -> Vec<i64> {
        match self.dtype {
            crate::tensor::DType::Int64 => self.cpu_slice::<i64>().to_vec(),
            crate::tensor::DType::Int32 => self.cpu_slice::<i32>().iter().map(|&v| v as i64).collect(),
            d => panic!("indices of dtype {d}"),
        }
    }

    /// Writes i64 indices into an int32 or int64 contiguous CPU tensor.
    pub fn cpu_store_indices(&self, v: &[i64]) {
        match self.dtype {
            crate::tensor::DType::Int64 => self.cpu_slice_mut::<i64>().copy_from_slice(v),
            crate::tensor::DType::Int32 => {
                for (d, s) in self.cpu_slice_mut::<i32>().iter_mut().zip(v) {
                    *d = *s as i32;
                }
            }
            d => panic!("indices of dtype {d}"),
        }
    }
}
