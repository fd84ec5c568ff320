//! A resolved kernel bound for use, with the built-in kernel that takes
//! over, for good, the first time a pack's kernel fails.

use std::sync::atomic::{AtomicBool, Ordering};

use spinfer_kernels::KernelError;
use spinfer_kernels::kernel::{MatmulCall, MatmulKernel};
use spinfer_kernels::pool::ThreadPool;

use crate::registry::{Choice, Resolved};

/// A [`Resolved`] kernel ready to be called per token: a pack kernel's
/// first failure (a trap, a timeout, a disabled pack, wrong buffers) is
/// logged once and its calls move to the built-in fallback for the rest of
/// the process. [`KernelError::NotOffered`] is not a failure: the caller
/// learns the kernel does not serve the form and is not switched.
pub struct BoundKernel {
    resolved: Resolved,
    failed: AtomicBool,
}

impl BoundKernel {
    pub fn new(resolved: Resolved) -> Self {
        Self { resolved, failed: AtomicBool::new(false) }
    }

    /// The provider (`name@version#hash`, or `cpu-builtin`) of the kernel
    /// resolution chose.
    pub fn provider(&self) -> &str {
        &self.resolved.provider
    }

    /// Why it was chosen.
    pub fn choice(&self) -> Choice {
        self.resolved.choice
    }

    /// The other candidates and their recorded decode medians (ns).
    pub fn alternatives(&self) -> &[(String, Option<u64>)] {
        &self.resolved.alternatives
    }

    /// The kernel resolution chose.
    pub fn chosen(&self) -> &dyn MatmulKernel {
        self.resolved.kernel.as_ref()
    }

    /// The kernel calls go to now: the chosen one, or its fallback once it
    /// has failed.
    pub fn active(&self) -> &dyn MatmulKernel {
        match &self.resolved.fallback {
            Some(fb) if self.failed.load(Ordering::Relaxed) => fb.as_ref(),
            _ => self.resolved.kernel.as_ref(),
        }
    }

    /// Whether the chosen kernel has failed and its fallback serves.
    pub fn has_failed_over(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Runs `call` on [`Self::active`]; if that is a pack kernel with a
    /// fallback and it fails, logs why (naming `what`, e.g. the tensor)
    /// and runs the call on the fallback, which serves from then on. An
    /// error names no kernel: [`Self::active`] is the one that returned it.
    pub fn run(&self, pool: &ThreadPool, what: &str, mut call: MatmulCall<'_>) -> Result<(), KernelError> {
        let Some(fb) = &self.resolved.fallback else { return self.resolved.kernel.run(pool, call) };
        if self.failed.load(Ordering::Relaxed) {
            return fb.run(pool, call);
        }
        match self.resolved.kernel.run(pool, call.reborrow()) {
            Err(e) if !matches!(e, KernelError::NotOffered { .. }) => {
                tracing::error!(
                    what,
                    kernel = self.resolved.kernel.name(),
                    "{e}; falling back to {} for good",
                    fb.name()
                );
                self.failed.store(true, Ordering::Relaxed);
                fb.run(pool, call)
            }
            r => r,
        }
    }
}

impl From<Resolved> for BoundKernel {
    fn from(r: Resolved) -> Self {
        Self::new(r)
    }
}
