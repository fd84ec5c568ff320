//! Built without feature `cuda`: every probe answers "not compiled" and no
//! backend can be made (as candle does its `cuda_backend` when the feature is off).
//! The types exist so that code using the backend builds either way; they
//! are uninhabited, so none of their methods can run.

use std::convert::Infallible;
use std::marker::PhantomData;

use crate::backend::{Grid, KArg, Module};
use crate::{CudaError, CudaUnavailable, DeviceInfo, Result};

/// What device buffers may hold (no bound without CUDA).
pub trait ElemBound {}
impl ElemBound for u8 {}
impl ElemBound for i32 {}
impl ElemBound for f32 {}

const NOT_COMPILED: CudaUnavailable = CudaUnavailable::NotCompiled { feature: "cuda" };

pub(crate) fn probe() -> std::result::Result<DeviceInfo, CudaUnavailable> {
    Err(NOT_COMPILED)
}

pub(crate) fn compile_ptx(_: Module, _: &str, _: &str, _: bool) -> Result<String> {
    Err(CudaError::Unavailable(NOT_COMPILED))
}

pub(crate) struct Buf<T>(Infallible, PhantomData<T>);

pub(crate) struct Pinned<T>(Infallible, PhantomData<T>);

pub(crate) struct Backend(Infallible);

pub(crate) struct Graph(Infallible);

impl Backend {
    pub(crate) fn new(_: &DeviceInfo, _: Option<std::sync::Arc<str>>) -> Result<Self> {
        Err(CudaError::Unavailable(NOT_COMPILED))
    }
    pub(crate) fn upload<T>(&self, _: &[T]) -> Result<Buf<T>> {
        match self.0 {}
    }
    pub(crate) fn alloc<T>(&self, _: usize) -> Result<Buf<T>> {
        match self.0 {}
    }
    pub(crate) fn download<T>(&self, _: &Buf<T>, _: usize) -> Result<Vec<T>> {
        match self.0 {}
    }
    pub(crate) fn download_range<T>(&self, _: &Buf<T>, _: usize, _: &mut [T]) -> Result<()> {
        match self.0 {}
    }
    pub(crate) fn alloc_pinned<T>(&self, _: usize) -> Result<Pinned<T>> {
        match self.0 {}
    }
    pub(crate) fn download_pinned<'h, T>(
        &self,
        _: &Buf<T>,
        _: usize,
        _: usize,
        _: &'h mut Pinned<T>,
    ) -> Result<&'h [T]> {
        match self.0 {}
    }
    pub(crate) fn write<T>(&self, _: &mut Buf<T>, _: usize, _: &[T]) -> Result<()> {
        match self.0 {}
    }
    pub(crate) fn copy<T>(&self, _: &Buf<T>, _: &mut Buf<T>) -> Result<()> {
        match self.0 {}
    }
    pub(crate) fn synchronize(&self) -> Result<()> {
        match self.0 {}
    }
    pub(crate) fn ptr<T>(&self, _: &Buf<T>) -> u64 {
        match self.0 {}
    }
    /// # Safety
    ///
    /// Never callable: the backend is uninhabited.
    pub(crate) unsafe fn launch(&self, _: Module, _: &str, _: Grid, _: &[KArg]) -> Result<()> {
        match self.0 {}
    }
    pub(crate) fn launches(&self) -> u64 {
        match self.0 {}
    }
    pub(crate) fn begin_capture(&self) -> Result<()> {
        match self.0 {}
    }
    pub(crate) fn end_capture(&self) -> Result<Graph> {
        match self.0 {}
    }
    pub(crate) fn launch_graph(&self, _: &Graph) -> Result<()> {
        match self.0 {}
    }
    pub(crate) fn time_ms(&self, _: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        match self.0 {}
    }
}
