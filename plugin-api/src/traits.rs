//! The FFI-safe traits a pack implements, as `#[sabi_trait]` trait objects.
//!
//! Each trait's `#[sabi(last_prefix_field)]` method marks the end of the
//! methods of ABI version 1: methods added later go below it, preferably
//! with a default body, so an old pack's trait object still loads (calling
//! a method its vtable lacks runs the default, or panics without one). See
//! `docs/plugin-abi.md`.
//!
//! Panics must not cross the boundary: `abi_stable` aborts the process when
//! a trait-object method unwinds. Packs catch panics in their
//! implementations and return [`PackErrorKind::INTERNAL`] instead.
//!
//! [`PackErrorKind::INTERNAL`]: crate::PackErrorKind::INTERNAL

// `Kernel::run_sparse` mirrors `run` plus the index list; the vtable shims
// `#[sabi_trait]` generates for it carry the same flat argument list.
#![allow(clippy::too_many_arguments, reason = "flat FFI signature of Kernel::run_sparse and its generated shims")]

use abi_stable::sabi_trait;
use abi_stable::std_types::{RBox, RErr, ROption, RResult, RSlice, RSliceMut, RStr, RString, RVec};

use crate::error::PackError;
use crate::types::{KernelDesc, NeuronId, TensorInfo};

/// One matvec/matmul implementation for the (operation, weight type,
/// activation type) of its [`KernelDesc`], for any shape the descriptor
/// accepts.
///
/// Kernels are shared between threads and may be called concurrently; a
/// kernel with per-call scratch state keeps it per thread or behind a lock.
#[sabi_trait]
pub trait Kernel: Send + Sync {
    /// What the kernel computes and which shapes it accepts. Cheap; the host
    /// calls it once when listing the pack.
    fn describe(&self) -> KernelDesc;

    /// Called once per static weight matrix before the first `run` with it,
    /// so an accelerator pack can upload or repack it. The host passes the
    /// same slice (address and length) to every later `run`, and keeps it
    /// alive and unchanged for as long as the kernel is used, so a pack may
    /// key its copy by the slice's address. CPU packs usually do nothing.
    ///
    /// # Errors
    ///
    /// [`PackErrorKind::UNSUPPORTED`](crate::PackErrorKind::UNSUPPORTED) if
    /// the shape is not accepted; device errors while uploading.
    fn prepare(&self, weights: RSlice<'_, u8>, rows: usize, cols: usize) -> RResult<(), PackError>;

    /// Dense operations ([`Op::MAT_MUL`], [`Op::TERNARY_MAT_MUL`]):
    /// `out[t * rows + r] = dot(W[r, :], x[t * cols..(t + 1) * cols])`
    /// for `t in 0..n_tokens`. `weights` holds `rows` rows of `cols`
    /// elements of the weight type; `x` holds `n_tokens * cols` f32 values;
    /// `out` holds `n_tokens * rows` values and is overwritten.
    ///
    /// # Errors
    ///
    /// [`PackErrorKind::INVALID_ARGUMENT`](crate::PackErrorKind::INVALID_ARGUMENT)
    /// if a buffer length does not match the shape,
    /// [`PackErrorKind::UNSUPPORTED`](crate::PackErrorKind::UNSUPPORTED) for
    /// shapes the descriptor does not accept.
    ///
    /// [`Op::MAT_MUL`]: crate::Op::MAT_MUL
    /// [`Op::TERNARY_MAT_MUL`]: crate::Op::TERNARY_MAT_MUL
    fn run(
        &self,
        weights: RSlice<'_, u8>,
        x: RSlice<'_, f32>,
        n_tokens: usize,
        rows: usize,
        cols: usize,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), PackError>;

    /// Sparse operations, over the `k = indices.len()` selected rows of
    /// `W` (`rows x cols`):
    ///
    /// * [`Op::GATHERED_ROW_MAT_VEC`]: `x` holds `n_tokens * cols` values, `out`
    ///   holds `n_tokens * k` values, `out[t * k + j] = dot(W[indices[j], :], x[t])`.
    /// * [`Op::GATHERED_COLUMN_AXPY`]: the selected *columns* of `W` as
    ///   stored (`indices` index `0..cols`, strictly ascending): `x` holds
    ///   `n_tokens * k` values, `out` holds `n_tokens * rows` values,
    ///   `out[t * rows + r] = sum_j x[t * k + j] * W[r, indices[j]]`. With
    ///   activation type `F32` the products use the f32 values; with `Q8_0`
    ///   a kernel may quantise them to 8 bits per run of selected columns
    ///   within one 32-column block (the host's fast modes).
    ///
    /// Dense kernels keep the default, which answers `Unsupported`.
    ///
    /// # Errors
    ///
    /// As [`Kernel::run`]; `InvalidArgument` for an index out of range
    /// (or, for `GATHERED_COLUMN_AXPY`, not strictly ascending).
    ///
    /// [`Op::GATHERED_ROW_MAT_VEC`]: crate::Op::GATHERED_ROW_MAT_VEC
    /// [`Op::GATHERED_COLUMN_AXPY`]: crate::Op::GATHERED_COLUMN_AXPY
    #[sabi(last_prefix_field)]
    fn run_sparse(
        &self,
        weights: RSlice<'_, u8>,
        x: RSlice<'_, f32>,
        n_tokens: usize,
        rows: usize,
        cols: usize,
        indices: RSlice<'_, u32>,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), PackError> {
        let _ = (weights, x, n_tokens, rows, cols, indices, out);
        RErr(PackError::unsupported("this kernel implements no sparse operation"))
    }
}

/// An owned, type-erased [`Kernel`] as returned by a pack.
pub type KernelBox = Kernel_TO<'static, RBox<()>>;

/// A model-file format reader. Stateless; [`Loader::open`] returns the
/// per-file state.
#[sabi_trait]
pub trait Loader: Send + Sync {
    /// Short name of the format, e.g. `"gguf"`.
    fn name(&self) -> RString;

    /// How well this loader reads the file at `path`: 0 if it cannot, higher
    /// is better (the host opens the file with the best-scoring loader).
    /// Must be cheap: look at the header, not the whole file.
    fn probe(&self, path: RStr<'_>) -> u32;

    /// Opens the file for reading tensors.
    ///
    /// # Errors
    ///
    /// `NotFound`/`Io` for file problems, `Unsupported` for a format
    /// variant the loader does not read.
    #[sabi(last_prefix_field)]
    fn open(&self, path: RStr<'_>) -> RResult<TensorFileBox, PackError>;
}

/// An owned, type-erased [`Loader`].
pub type LoaderBox = Loader_TO<'static, RBox<()>>;

/// An opened model file.
#[sabi_trait]
pub trait TensorFile: Send + Sync {
    /// Every tensor in the file.
    fn tensors(&self) -> RVec<TensorInfo>;

    /// A metadata value rendered as text (numbers in decimal, arrays as
    /// JSON), or `None` if the key does not exist.
    fn metadata(&self, key: RStr<'_>) -> ROption<RString>;

    /// Copies the tensor's data (in its stored layout) into `out`, which
    /// must be exactly [`TensorInfo::n_bytes`] long.
    ///
    /// # Errors
    ///
    /// `NotFound` for an unknown name, `InvalidArgument` for a wrong `out`
    /// length, `Io` for read failures.
    #[sabi(last_prefix_field)]
    fn read_tensor(&self, name: RStr<'_>, out: RSliceMut<'_, u8>) -> RResult<(), PackError>;
}

/// An owned, type-erased [`TensorFile`].
pub type TensorFileBox = TensorFile_TO<'static, RBox<()>>;

/// Predicts which FFN neurons of a layer will be active for a hidden state,
/// so the engine computes only those rows (neuron sparsity).
#[sabi_trait]
pub trait Predictor: Send + Sync {
    /// Short name, e.g. `"mlp-rank128"`.
    fn name(&self) -> RString;

    /// Writes `out_mask[i] = 1` for neurons predicted active in `layer` and
    /// `0` for the others, and returns the number of active neurons.
    /// `hidden` is the layer's FFN input (`hidden_dim` values), `out_mask`
    /// has `ffn_dim` entries (see [`crate::PredictorSpec`]).
    ///
    /// # Errors
    ///
    /// `InvalidArgument` for a layer out of range or wrong slice lengths.
    #[sabi(last_prefix_field)]
    fn predict(&self, layer: u32, hidden: RSlice<'_, f32>, out_mask: RSliceMut<'_, u8>) -> RResult<usize, PackError>;
}

/// An owned, type-erased [`Predictor`].
pub type PredictorBox = Predictor_TO<'static, RBox<()>>;

/// Decides which FFN neurons stay resident in a bounded cache (fast memory,
/// device memory) when weights do not all fit.
#[sabi_trait]
pub trait CachePolicy: Send {
    /// Short name, e.g. `"lru"`.
    fn name(&self) -> RString;

    /// Records a use of a neuron (resident or not).
    fn on_access(&mut self, neuron: NeuronId);

    /// Whether a neuron that is not resident should be brought in (the host
    /// then evicts until there is room).
    fn admit(&mut self, neuron: NeuronId) -> bool;

    /// The resident neuron to evict next, forgetting it; `None` if the
    /// policy tracks no resident neuron.
    #[sabi(last_prefix_field)]
    fn evict(&mut self) -> ROption<NeuronId>;
}

/// An owned, type-erased [`CachePolicy`].
pub type CachePolicyBox = CachePolicy_TO<'static, RBox<()>>;

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use abi_stable::sabi_trait::TD_Opaque;
    use abi_stable::std_types::{RNone, ROk, RSome};

    use super::*;
    use crate::error::PackErrorKind;
    use crate::types::{ActType, Op, WeightType};

    /// Copies `x` for one token with an identity "matrix" of any shape.
    struct Identity;

    impl Kernel for Identity {
        fn describe(&self) -> KernelDesc {
            KernelDesc {
                name: "identity".into(),
                op: Op::MAT_MUL,
                wtype: WeightType::F32,
                act: ActType::F32,
                cols_multiple: 1,
                rows_multiple: 1,
            }
        }

        fn prepare(&self, _: RSlice<'_, u8>, _: usize, _: usize) -> RResult<(), PackError> {
            ROk(())
        }

        fn run(
            &self,
            _: RSlice<'_, u8>,
            x: RSlice<'_, f32>,
            _: usize,
            _: usize,
            _: usize,
            mut out: RSliceMut<'_, f32>,
        ) -> RResult<(), PackError> {
            out.as_mut_slice().copy_from_slice(x.as_slice());
            ROk(())
        }
    }

    #[test]
    fn kernel_objects_dispatch_and_default_sparse_is_unsupported() {
        let k: KernelBox = Kernel_TO::from_value(Identity, TD_Opaque);
        assert_eq!(k.describe().name.as_str(), "identity");
        let x = [1.0f32, 2.0];
        let mut out = [0.0f32; 2];
        k.run(RSlice::from_slice(&[]), x.as_slice().into(), 1, 2, 2, RSliceMut::from_mut_slice(&mut out))
            .into_result()
            .unwrap();
        assert_eq!(out, x);
        let e = k
            .run_sparse(
                RSlice::from_slice(&[]),
                x.as_slice().into(),
                1,
                2,
                2,
                [0u32].as_slice().into(),
                RSliceMut::from_mut_slice(&mut out),
            )
            .into_result()
            .unwrap_err();
        assert_eq!(e.kind, PackErrorKind::UNSUPPORTED);
    }

    /// First in, first out over admitted neurons.
    #[derive(Default)]
    struct Fifo(VecDeque<NeuronId>);

    impl CachePolicy for Fifo {
        fn name(&self) -> RString {
            "fifo".into()
        }

        fn on_access(&mut self, _: NeuronId) {}

        fn admit(&mut self, neuron: NeuronId) -> bool {
            self.0.push_back(neuron);
            true
        }

        fn evict(&mut self) -> ROption<NeuronId> {
            self.0.pop_front().into()
        }
    }

    #[test]
    fn cache_policy_objects_keep_state() {
        let mut p: CachePolicyBox = CachePolicy_TO::from_value(Fifo::default(), TD_Opaque);
        let a = NeuronId { layer: 0, index: 3 };
        let b = NeuronId { layer: 1, index: 9 };
        p.on_access(a);
        assert!(p.admit(a));
        assert!(p.admit(b));
        assert_eq!(p.evict(), RSome(a));
        assert_eq!(p.evict(), RSome(b));
        assert_eq!(p.evict(), RNone);
    }

    /// Marks neurons whose index is below `hidden[0]`.
    struct Threshold;

    impl Predictor for Threshold {
        fn name(&self) -> RString {
            "threshold".into()
        }

        fn predict(
            &self,
            _: u32,
            hidden: RSlice<'_, f32>,
            mut out_mask: RSliceMut<'_, u8>,
        ) -> RResult<usize, PackError> {
            let limit = hidden.as_slice()[0];
            let mut n = 0;
            for (i, m) in out_mask.as_mut_slice().iter_mut().enumerate() {
                *m = u8::from((i as f32) < limit);
                n += usize::from(*m);
            }
            ROk(n)
        }
    }

    #[test]
    fn predictor_objects_fill_the_mask() {
        let p: PredictorBox = Predictor_TO::from_value(Threshold, TD_Opaque);
        let mut mask = [9u8; 5];
        let n = p.predict(0, [2.5f32].as_slice().into(), RSliceMut::from_mut_slice(&mut mask)).into_result().unwrap();
        assert_eq!((n, mask), (3, [1, 1, 1, 0, 0]));
    }

    /// A "file" with one tensor of four bytes.
    struct OneTensor;

    impl TensorFile for OneTensor {
        fn tensors(&self) -> RVec<TensorInfo> {
            RVec::from(vec![TensorInfo {
                name: "t".into(),
                wtype: WeightType::F32,
                shape: RVec::from(vec![1]),
                n_bytes: 4,
            }])
        }

        fn metadata(&self, key: RStr<'_>) -> ROption<RString> {
            if key.as_str() == "general.architecture" { RSome("llama".into()) } else { RNone }
        }

        fn read_tensor(&self, name: RStr<'_>, mut out: RSliceMut<'_, u8>) -> RResult<(), PackError> {
            if name.as_str() != "t" {
                return RErr(PackError::not_found(format!("no tensor {name}")));
            }
            out.as_mut_slice().copy_from_slice(&1.0f32.to_le_bytes());
            ROk(())
        }
    }

    struct FakeLoader;

    impl Loader for FakeLoader {
        fn name(&self) -> RString {
            "fake".into()
        }

        fn probe(&self, path: RStr<'_>) -> u32 {
            u32::from(path.as_str().ends_with(".fake"))
        }

        fn open(&self, _: RStr<'_>) -> RResult<TensorFileBox, PackError> {
            ROk(TensorFile_TO::from_value(OneTensor, TD_Opaque))
        }
    }

    #[test]
    fn loader_objects_open_and_read() {
        let l: LoaderBox = Loader_TO::from_value(FakeLoader, TD_Opaque);
        assert_eq!(l.probe("model.gguf".into()), 0);
        assert_eq!(l.probe("model.fake".into()), 1);
        let f = l.open("model.fake".into()).into_result().unwrap();
        assert_eq!(f.tensors()[0].n_bytes, 4);
        assert_eq!(f.metadata("general.architecture".into()), RSome(RString::from("llama")));
        let mut buf = [0u8; 4];
        f.read_tensor("t".into(), RSliceMut::from_mut_slice(&mut buf)).into_result().unwrap();
        assert_eq!(f32::from_le_bytes(buf), 1.0);
        let e = f.read_tensor("u".into(), RSliceMut::from_mut_slice(&mut buf)).into_result().unwrap_err();
        assert_eq!(e.kind, PackErrorKind::NOT_FOUND);
    }
}
