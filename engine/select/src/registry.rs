//! The kernel seam: every matvec/matmul the model runs is described by an
//! operation descriptor ([`MatmulDesc`]: weight type, activation format,
//! shape) and resolved, once at load time, to a kernel object through a
//! [`KernelRegistry`]. Providers offer kernels; the registry picks the
//! highest-scoring provider's best candidate unless a pin says otherwise.
//!
//! One provider is built in (`cpu-builtin`: the scalar reference and the
//! AVX2/AVX-512 kernels of `spinfer-kernels`); native and WASM kernel packs,
//! loaded by `spinfer-packs`, register further providers behind the same
//! seam.

use std::collections::BTreeMap;
use std::sync::Arc;

use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{Form, MatmulDesc, MatmulKernel};

use std::collections::HashMap;
use std::sync::Mutex;

use spinfer_kernels::pool::ThreadPool;

use spinfer_plugin_api::{CachePolicyBox, PredictorBox, PredictorSpec};

pub use crate::op_names::{BUILTIN, describe, pin_key};
use crate::tuning::bench::{Phase, kernel_id, verify};
use crate::tuning::history::{HistoryStore, Host};
use crate::tuning::select::{Reason, select};
use crate::{Error, Result};

/// Something that can offer kernels for operations (ggml-backend's "reg").
pub trait KernelProvider: Send + Sync {
    /// Stable provider name, e.g. `"cpu-builtin"`.
    fn name(&self) -> &str;

    /// How well this provider suits the host; 0 = unsupported. Higher wins.
    fn score(&self) -> u32;

    /// What the score rests on, for reports (a device, or why there is
    /// none); empty by default.
    fn detail(&self) -> String {
        String::new()
    }

    /// Kernels serving `desc` in its form, best first; empty if
    /// unsupported. A kernel offered for a gathered form should carry the
    /// name of the provider's dense kernel it is the form of, so the
    /// gathered product follows the dense choice (see
    /// [`KernelRegistry::resolve_gathered`]).
    fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>>;
}

/// Something that offers the sparse FFN's plugins: neuron predictors and
/// cache policies (a native pack's `PackModule::predictors` and
/// `PackModule::cache_policies`). Kept apart from [`KernelProvider`]: a
/// pack may offer either or both, and the registry asks each role of the
/// providers registered for it.
pub trait SparsityProvider: Send + Sync {
    /// Stable provider name (`name@version#hash` for a pack).
    fn name(&self) -> &str;

    /// How well this provider suits the host; 0 = unusable (skipped).
    fn score(&self) -> u32;

    /// The FFN neuron predictors built for the model `spec` describes.
    fn predictors(&self, spec: &PredictorSpec) -> Vec<PredictorBox> {
        let _ = spec;
        Vec::new()
    }

    /// Fresh cache policies for a cache of `capacity` neurons.
    fn cache_policies(&self, capacity: u64) -> Vec<CachePolicyBox> {
        let _ = capacity;
        Vec::new()
    }
}

/// A plugin object (predictor, cache policy) found in a provider.
pub struct Found<T> {
    /// `"<pack>/<name>"`, as a user names it.
    pub name: String,
    /// The provider (`name@version#hash`) it came from.
    pub provider: String,
    pub object: T,
}

/// The provider built into the engine: `spinfer-kernels` on this CPU.
pub struct CpuBuiltin {
    features: CpuFeatures,
}

impl CpuBuiltin {
    pub fn new() -> Self {
        Self { features: CpuFeatures::detect() }
    }

    pub fn features(&self) -> CpuFeatures {
        self.features
    }
}

impl Default for CpuBuiltin {
    fn default() -> Self {
        Self::new()
    }
}

impl KernelProvider for CpuBuiltin {
    fn name(&self) -> &str {
        BUILTIN
    }

    fn score(&self) -> u32 {
        // Always usable: the scalar reference runs anywhere. External packs
        // that score higher take precedence.
        1
    }

    fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
        spinfer_kernels::matmul::candidates(desc, &self.features).into_iter().map(Arc::from).collect()
    }
}

/// The best built-in kernel for `desc`, outside any registry: for work
/// done once, offline (the k-means of the sparse head's index build).
pub fn builtin_kernel(desc: &MatmulDesc) -> Result<Box<dyn MatmulKernel>> {
    spinfer_kernels::matmul::candidates(desc, &CpuFeatures::detect())
        .into_iter()
        .next()
        .ok_or_else(|| Error::NoKernel { op: describe(desc) })
}

/// Why a kernel was chosen (reported by `spinfer kernels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The operator pinned this kernel by name.
    Pinned,
    /// The best candidate of the highest-scoring provider (no history).
    BestScore,
    /// Fastest measured for this shape on this host.
    Measured,
    /// Fastest over the `shapes` nearest recorded shapes, the nearest
    /// being `rows x cols`.
    NearestNeighbour { rows: usize, cols: usize, shapes: usize },
    /// No other candidate.
    OnlyCandidate,
    /// A gathered form: the form of the dense product's kernel (or its
    /// provider's), else the best built-in one.
    FollowsDense,
}

impl std::fmt::Display for Choice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Choice::Pinned => f.write_str("pinned"),
            Choice::BestScore => f.write_str("default (highest-scoring provider)"),
            Choice::Measured => f.write_str("measured"),
            Choice::NearestNeighbour { rows, cols, shapes: 1 } => write!(f, "nearest measured shape {rows}x{cols}"),
            Choice::NearestNeighbour { rows, cols, shapes } => {
                write!(f, "nearest measured shapes ({shapes}, nearest {rows}x{cols})")
            }
            Choice::OnlyCandidate => f.write_str("only candidate"),
            Choice::FollowsDense => f.write_str("follows the dense product"),
        }
    }
}

/// A resolved operation.
#[derive(Clone)]
pub struct Resolved {
    pub kernel: Arc<dyn MatmulKernel>,
    pub provider: String,
    pub choice: Choice,
    /// Every candidate's `"<provider>/<kernel>"` with its recorded decode
    /// median in ns where the history has one (empty without history).
    pub alternatives: Vec<(String, Option<u64>)>,
    /// For a pack kernel: the built-in kernel to run instead if the pack
    /// fails at run time (a trap, a timeout, a disabled pack).
    pub fallback: Option<Arc<dyn MatmulKernel>>,
}

/// Resolves operation descriptors to kernels.
pub struct KernelRegistry {
    providers: Vec<Arc<dyn KernelProvider>>,
    /// Providers of predictors and cache policies.
    sparsity_providers: Vec<Arc<dyn SparsityProvider>>,
    /// Kernel pins keyed by `"<wtype>*<act>"` (e.g. `"q4_1*q8_1"`) or
    /// `"matmul.<wtype>"`; values are a kernel name or `"<pack>/<kernel>"`.
    pins: BTreeMap<String, String>,
    /// Provider base names (before `@`) never used.
    excluded: Vec<String>,
    /// Measured kernel timings; when present, unpinned operations take the
    /// fastest recorded kernel.
    history: Option<(HistoryStore, String)>,
    /// Pack kernels already checked against the scalar reference, per
    /// operation: `Ok` or why they were refused.
    verified: Mutex<HashMap<(String, MatmulDesc), std::result::Result<(), String>>>,
}

impl KernelRegistry {
    /// A registry holding only the built-in CPU provider.
    pub fn builtin() -> Self {
        Self {
            providers: vec![Arc::new(CpuBuiltin::new())],
            sparsity_providers: Vec::new(),
            pins: BTreeMap::new(),
            excluded: Vec::new(),
            history: None,
            verified: Mutex::new(HashMap::new()),
        }
    }

    pub fn add_provider(&mut self, p: Arc<dyn KernelProvider>) {
        self.providers.push(p);
    }

    /// Registers a provider of predictors and cache policies (a native
    /// pack registers in both roles).
    pub fn add_sparsity_provider(&mut self, p: Arc<dyn SparsityProvider>) {
        self.sparsity_providers.push(p);
    }

    /// Forces `kernel` (a kernel name, or `"<pack>/<kernel name>"`) for
    /// operations matching `key` (`"q4_1*q8_1"` or `"matmul.q4_1"`);
    /// resolution fails if no provider offers it.
    pub fn pin(&mut self, key: impl Into<String>, kernel: impl Into<String>) {
        self.pins.insert(key.into(), kernel.into());
    }

    /// Chooses unpinned kernels from `history` (measurements of this host).
    pub fn set_history(&mut self, history: HistoryStore) {
        self.history = Some((history, Host::detect().fingerprint()));
    }

    /// Every registered kernel provider: name, score, [`KernelProvider::detail`]
    /// and whether `[kernels] exclude` names it, in registration order.
    pub fn providers(&self) -> Vec<(String, u32, String, bool)> {
        self.providers
            .iter()
            .map(|p| {
                let excluded = self.excluded.iter().any(|x| x == base_name(p.name()));
                (p.name().to_string(), p.score(), p.detail(), excluded)
            })
            .collect()
    }

    /// Never uses providers whose base name (before `@`) is `name`.
    pub fn exclude(&mut self, name: impl Into<String>) {
        self.excluded.push(name.into());
    }

    /// Usable providers: not excluded, score > 0, by descending score (ties
    /// in registration order, so resolution is deterministic).
    fn usable(&self) -> Vec<&Arc<dyn KernelProvider>> {
        self.usable_of(&self.providers, |p| (p.name(), p.score()))
    }

    /// [`Self::usable`] over either role's providers; `id` gives a
    /// provider's name and score.
    fn usable_of<'a, P: ?Sized>(&self, list: &'a [Arc<P>], id: impl Fn(&P) -> (&str, u32)) -> Vec<&'a Arc<P>> {
        let mut providers: Vec<_> = list
            .iter()
            .filter(|p| {
                let (name, score) = id(p);
                score > 0 && !self.excluded.iter().any(|x| x == base_name(name))
            })
            .collect();
        providers.sort_by_key(|p| std::cmp::Reverse(id(p).1));
        providers
    }

    /// The pin that applies to `desc`, if any.
    fn pin_for(&self, desc: &MatmulDesc) -> Option<&String> {
        self.pins
            .get(&pin_key(desc.wtype, desc.act))
            .or_else(|| self.pins.get(&format!("matmul.{}", desc.wtype.name())))
    }

    /// Whether a pack kernel computes the right function for `desc` (in
    /// its form): checked once per (kernel, operation) against the scalar
    /// reference on random data, and remembered. Built-in kernels are
    /// trusted (tested in CI); a pack kernel that disagrees is refused and
    /// reported, never used. Tall matrices are checked on a prefix of
    /// their rows (256 plus the remainder modulo 64, so partial row tiles
    /// are exercised too), with the provider's kernel for that shape: the
    /// full 49152-row output matrix would cost tens of milliseconds per
    /// kernel at every load.
    fn trusted(&self, p: &dyn KernelProvider, kernel: &Arc<dyn MatmulKernel>, desc: &MatmulDesc) -> bool {
        if p.name() == BUILTIN {
            return true;
        }
        let key = (kernel_id(p.name(), kernel.as_ref()), *desc);
        let mut cache = self.verified.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let r = cache.entry(key).or_insert_with(|| {
            let rows = if desc.rows > 320 { 256 + desc.rows % 64 } else { desc.rows };
            let small = MatmulDesc { rows, ..*desc };
            let pool = ThreadPool::new(1);
            let r = match p.kernels_for(&small).into_iter().find(|k| k.name() == kernel.name()) {
                Some(k) if small.rows < desc.rows => verify(&small, k.as_ref(), &pool),
                _ => verify(desc, kernel.as_ref(), &pool),
            };
            if let Err(why) = &r {
                tracing::error!(
                    provider = p.name(),
                    kernel = kernel.name(),
                    op = %describe(desc),
                    "pack kernel refused: {why}"
                );
            }
            r
        });
        r.is_ok()
    }

    /// Every kernel any usable provider offers for `desc`: providers by
    /// descending score (ties in registration order), each provider's
    /// kernels best first. Pack kernels that compute the wrong function are
    /// left out. The input of benchmark-driven selection.
    pub fn candidates(&self, desc: &MatmulDesc) -> Vec<(String, Arc<dyn MatmulKernel>)> {
        self.usable()
            .into_iter()
            .flat_map(|p| {
                p.kernels_for(desc)
                    .into_iter()
                    .filter(|k| self.trusted(p.as_ref(), k, desc))
                    .map(|k| (p.name().to_string(), k))
            })
            .collect()
    }

    /// The kernel for `desc` in a gathered form, following the dense
    /// product over the same matrix, served by `dense_kernel` of
    /// `dense_provider`:
    ///
    /// * gathered rows: that provider's row form of the same kernel, else
    ///   the best built-in kernel (which reads rows in place);
    /// * gathered columns: that provider's column AXPY, else none (the
    ///   engine's own neuron-major repack serves the built-in case).
    ///
    /// A pack kernel is checked once against the scalar reference in its
    /// form and comes with the built-in kernel of the form, if any, as its
    /// fallback. So pins, history and exclusions reach the gathered forms
    /// through the dense choice.
    ///
    /// # Errors
    ///
    /// [`Error::NoKernel`] when no provider serves the form.
    pub fn resolve_gathered(&self, desc: &MatmulDesc, dense_provider: &str, dense_kernel: &str) -> Result<Resolved> {
        if desc.form == Form::Dense {
            return self.resolve(desc);
        }
        let builtin = || self.builtin_kernel_for(desc).ok();
        let own = self.usable().into_iter().find(|p| p.name() == dense_provider).and_then(|p| {
            let offered = p.kernels_for(desc);
            let k = match desc.form {
                Form::GatheredRows => offered.into_iter().find(|k| k.name() == dense_kernel),
                _ => offered.into_iter().next(),
            }?;
            self.trusted(p.as_ref(), &k, desc).then(|| (p.name().to_string(), k))
        });
        let (provider, kernel, fallback) = match own {
            Some((provider, kernel)) if provider == BUILTIN => (provider, kernel, None),
            Some((provider, kernel)) => (provider, kernel, builtin()),
            None => (BUILTIN.to_string(), builtin().ok_or_else(|| Error::NoKernel { op: describe(desc) })?, None),
        };
        Ok(Resolved { kernel, provider, choice: Choice::FollowsDense, alternatives: Vec::new(), fallback })
    }

    /// The predictor called `name` (`"<pack>/<predictor>"`, or the bare
    /// predictor name when only one pack offers it) among the usable
    /// providers' predictors for `spec`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming what the loaded packs offer when
    /// none matches, or when a bare name is ambiguous.
    pub fn predictor(&self, name: &str, spec: &PredictorSpec) -> Result<Found<PredictorBox>> {
        self.find_plugin("predictor", name, |p| p.predictors(spec), |o| o.name().to_string())
    }

    /// The cache policy called `name` (as [`KernelRegistry::predictor`]),
    /// fresh, for a cache of `capacity` neurons.
    ///
    /// # Errors
    ///
    /// As [`KernelRegistry::predictor`].
    pub fn cache_policy(&self, name: &str, capacity: u64) -> Result<Found<CachePolicyBox>> {
        self.find_plugin("cache policy", name, |p| p.cache_policies(capacity), |o| o.name().to_string())
    }

    fn find_plugin<T>(
        &self,
        what: &str,
        want: &str,
        offered: impl Fn(&dyn SparsityProvider) -> Vec<T>,
        name_of: impl Fn(&T) -> String,
    ) -> Result<Found<T>> {
        let mut all = Vec::new();
        for p in self.usable_of(&self.sparsity_providers, |p| (p.name(), p.score())) {
            let base = base_name(p.name()).to_string();
            for object in offered(p.as_ref()) {
                let name = format!("{base}/{}", name_of(&object));
                all.push(Found { name, provider: p.name().to_string(), object });
            }
        }
        let exact = all.iter().position(|f| f.name == want);
        let bare: Vec<usize> = all
            .iter()
            .enumerate()
            .filter(|(_, f)| f.name.split_once('/').map(|x| x.1) == Some(want))
            .map(|(i, _)| i)
            .collect();
        let names = || {
            if all.is_empty() {
                "none".to_string()
            } else {
                all.iter().map(|f| f.name.as_str()).collect::<Vec<_>>().join(", ")
            }
        };
        let i = match (exact, bare.as_slice()) {
            (Some(i), _) => i,
            (None, [i]) => *i,
            (None, []) => {
                return Err(Error::InvalidArgument(format!(
                    "no loaded pack offers the {what} '{want}' (offered: {})",
                    names()
                )));
            }
            (None, _) => {
                return Err(Error::InvalidArgument(format!(
                    "{what} '{want}' is offered by several packs ({}): name it as <pack>/{want}",
                    names()
                )));
            }
        };
        Ok(all.swap_remove(i))
    }

    /// Picks the kernel for `desc`: the pinned one if a pin applies,
    /// otherwise the fastest recorded in the history, otherwise the
    /// highest-scoring provider's best candidate. A pack kernel comes with
    /// the built-in kernel that replaces it if the pack fails.
    ///
    /// A gathered form is resolved as its dense product, then
    /// [`KernelRegistry::resolve_gathered`].
    pub fn resolve(&self, desc: &MatmulDesc) -> Result<Resolved> {
        if desc.form != Form::Dense {
            let dense = self.resolve_kernel(&desc.with_form(Form::Dense))?;
            return self.resolve_gathered(desc, &dense.provider, dense.kernel.name());
        }
        let mut r = self.resolve_kernel(desc)?;
        if r.provider != BUILTIN {
            r.fallback = self.builtin_kernel_for(desc).ok();
        }
        Ok(r)
    }

    /// The built-in provider's best kernel for `desc`: in the dense form
    /// it serves any number of rows of `desc.cols` columns, so products over
    /// rows gathered beforehand use it.
    ///
    /// # Errors
    ///
    /// [`Error::NoKernel`] when the built-in kernels do not serve `desc`.
    pub fn builtin_kernel_for(&self, desc: &MatmulDesc) -> Result<Arc<dyn MatmulKernel>> {
        self.providers
            .iter()
            .find(|p| p.name() == BUILTIN)
            .and_then(|p| p.kernels_for(desc).into_iter().next())
            .ok_or_else(|| Error::NoKernel { op: describe(desc) })
    }

    fn resolve_kernel(&self, desc: &MatmulDesc) -> Result<Resolved> {
        let providers = self.usable();
        if let Some(want) = self.pin_for(desc) {
            for p in &providers {
                let base = base_name(p.name());
                // `<pack>/<kernel>`; pack kernels may already carry a
                // `<pack>:` prefix in their names.
                let qualified = |k: &str| format!("{base}/{}", k.strip_prefix(&format!("{base}:")).unwrap_or(k));
                if let Some(k) =
                    p.kernels_for(desc).into_iter().find(|k| k.name() == want || qualified(k.name()) == *want)
                {
                    if !self.trusted(p.as_ref(), &k, desc) {
                        return Err(Error::NoKernel {
                            op: format!(
                                "{} (pinned kernel '{want}' disagrees with the reference kernel)",
                                describe(desc)
                            ),
                        });
                    }
                    let provider = p.name().to_string();
                    return Ok(Resolved {
                        kernel: k,
                        provider,
                        choice: Choice::Pinned,
                        alternatives: Vec::new(),
                        fallback: None,
                    });
                }
            }
            return Err(Error::NoKernel { op: format!("{} (pinned kernel '{want}' is not offered)", describe(desc)) });
        }
        if let Some((history, host)) = &self.history {
            let mut candidates = self.candidates(desc);
            let sel = select(desc, Phase::Decode, &candidates, history, host)?;
            let (provider, kernel) = candidates.swap_remove(sel.index);
            let choice = match sel.reason {
                Reason::Measured => Choice::Measured,
                Reason::NearestNeighbour { from: (rows, cols), shapes } => {
                    Choice::NearestNeighbour { rows, cols, shapes }
                }
                Reason::OnlyCandidate => Choice::OnlyCandidate,
                Reason::Default => Choice::BestScore,
            };
            return Ok(Resolved { kernel, provider, choice, alternatives: sel.alternatives, fallback: None });
        }
        match self.candidates(desc).into_iter().next() {
            Some((provider, kernel)) => {
                Ok(Resolved { kernel, provider, choice: Choice::BestScore, alternatives: Vec::new(), fallback: None })
            }
            None => Err(Error::NoKernel { op: describe(desc) }),
        }
    }
}

/// A provider's name without its `@version#hash` suffix.
pub fn base_name(provider: &str) -> &str {
    provider.split('@').next().unwrap_or(provider)
}

#[cfg(test)]
mod tests {
    use super::*;
    use spinfer_kernels::GgmlType;
    use spinfer_kernels::kernel::{ActType, MatmulCall, Select, not_offered};

    /// A provider offering the scalar kernels under another name.
    struct Fake(&'static str, u32);
    impl KernelProvider for Fake {
        fn name(&self) -> &str {
            self.0
        }
        fn score(&self) -> u32 {
            self.1
        }
        fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
            spinfer_kernels::matmul::candidates(desc, &CpuFeatures::default()).into_iter().map(Arc::from).collect()
        }
    }

    /// Offers one kernel named `pfx:<scalar name>`, as native packs do.
    struct Prefixed;
    struct Renamed(Arc<dyn MatmulKernel>);
    impl MatmulKernel for Renamed {
        fn name(&self) -> &str {
            "pfx:scalar/q4_1*q8_1"
        }
        fn run(&self, pool: &ThreadPool, call: MatmulCall<'_>) -> spinfer_kernels::Result<()> {
            self.0.run(pool, call)
        }
    }
    impl KernelProvider for Prefixed {
        fn name(&self) -> &str {
            "pfx@0.1.0#000000000000"
        }
        fn score(&self) -> u32 {
            1
        }
        fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
            Fake("x", 1).kernels_for(desc).into_iter().map(|k| Arc::new(Renamed(k)) as Arc<dyn MatmulKernel>).collect()
        }
    }

    /// A kernel named `name` that returns zeros in every form.
    struct Zeros(&'static str);
    impl MatmulKernel for Zeros {
        fn name(&self) -> &str {
            self.0
        }
        fn run(&self, _: &ThreadPool, call: MatmulCall<'_>) -> spinfer_kernels::Result<()> {
            call.out.fill(0.0);
            Ok(())
        }
    }

    /// A pack whose only kernel returns zeros.
    struct Wrong;
    impl KernelProvider for Wrong {
        fn name(&self) -> &str {
            "wrong@1.0.0#000000000000"
        }
        fn score(&self) -> u32 {
            1000
        }
        fn kernels_for(&self, _: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
            vec![Arc::new(Zeros("zeros"))]
        }
    }

    #[test]
    fn a_pack_kernel_with_wrong_numbers_is_never_used() {
        let mut r = KernelRegistry::builtin();
        r.add_provider(Arc::new(Wrong));
        // Highest score, but it disagrees with the reference: skipped.
        let got = r.resolve(&DESC).unwrap();
        assert_eq!(got.provider, "cpu-builtin");
        assert!(r.candidates(&DESC).iter().all(|(p, _)| p == "cpu-builtin"));
        // Pinning it is an error naming the reason, not a silent wrong answer.
        r.pin("q4_1*q8_1", "wrong/zeros");
        let err = r.resolve(&DESC).err().expect("refused").to_string();
        assert!(err.contains("zeros") && err.contains("disagrees"), "{err}");
    }

    const DESC: MatmulDesc = MatmulDesc::dense(GgmlType::Q4_1, ActType::Q8_1, 64, 64);

    /// A pack whose dense kernel is right but whose gathered-row form
    /// returns zeros.
    struct WrongRows;
    impl KernelProvider for WrongRows {
        fn name(&self) -> &str {
            "wrong-rows@1.0.0#000000000000"
        }
        fn score(&self) -> u32 {
            1000
        }
        fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
            match desc.form {
                Form::Dense => vec![Arc::new(Renamed(Arc::from(builtin_kernel(desc).unwrap())))],
                _ => vec![Arc::new(Zeros("pfx:scalar/q4_1*q8_1"))],
            }
        }
    }

    #[test]
    fn gathered_rows_follow_the_dense_choice_unless_they_are_wrong() {
        let rows = DESC.with_form(Form::GatheredRows);
        let mut r = KernelRegistry::builtin();
        // The built-in provider: the gathered form of the pinned kernel.
        r.pin("q4_1*q8_1", "scalar/q4_1*q8_1");
        let got = r.resolve(&rows).unwrap();
        assert_eq!((got.provider.as_str(), got.choice), ("cpu-builtin", Choice::FollowsDense));
        // A pack whose dense kernel is right but its rows are not: its
        // dense kernel is used, its gathered rows never are.
        let mut r = KernelRegistry::builtin();
        r.add_provider(Arc::new(WrongRows));
        let dense = r.resolve(&DESC).unwrap();
        assert_eq!(dense.provider, "wrong-rows@1.0.0#000000000000");
        let got = r.resolve(&rows).unwrap();
        assert_eq!(got.provider, "cpu-builtin");
        assert_ne!(got.kernel.name(), "pfx:scalar/q4_1*q8_1");
    }

    /// A pack whose gathered-column AXPY is right (the engine's exact
    /// repack) or, with `zeros`, returns zeros.
    struct ColumnPack {
        zeros: bool,
    }
    struct ColumnAxpy {
        zeros: bool,
        cols: usize,
    }
    impl MatmulKernel for ColumnAxpy {
        fn name(&self) -> &str {
            "axpy"
        }
        fn run(&self, _: &ThreadPool, call: MatmulCall<'_>) -> spinfer_kernels::Result<()> {
            let Select::Columns(idx) = call.select else { return Err(not_offered(self, call.select.form())) };
            if self.zeros {
                call.out.fill(0.0);
                return Ok(());
            }
            spinfer_sparse_kernels::NeuronMajor::from_weights(GgmlType::Q4_1, call.w, call.out.len(), self.cols)?
                .axpy_scalar(idx, call.x, call.out)
        }
    }
    impl KernelProvider for ColumnPack {
        fn name(&self) -> &str {
            if self.zeros { "zero-columns@1.0.0#000000000000" } else { "columns@1.0.0#000000000000" }
        }
        fn score(&self) -> u32 {
            1000
        }
        fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
            match desc.form {
                Form::GatheredColumns if desc.act == ActType::F32 => {
                    vec![Arc::new(ColumnAxpy { zeros: self.zeros, cols: desc.cols })]
                }
                Form::GatheredColumns => Vec::new(),
                _ => vec![Arc::from(builtin_kernel(desc).unwrap())],
            }
        }
    }

    #[test]
    fn column_axpy_follows_the_dense_provider_unless_it_is_wrong() {
        let exact = MatmulDesc { act: ActType::F32, ..DESC }.with_form(Form::GatheredColumns);
        let mut r = KernelRegistry::builtin();
        r.add_provider(Arc::new(ColumnPack { zeros: false }));
        r.add_provider(Arc::new(ColumnPack { zeros: true }));
        let got = r.resolve_gathered(&exact, "columns@1.0.0#000000000000", "any").expect("a checked column kernel");
        assert_eq!((got.provider.as_str(), got.kernel.name()), ("columns@1.0.0#000000000000", "axpy"));
        // Not offered for this arithmetic, not from the built-in provider
        // (its own repack serves it), never when it computes zeros.
        let q8 = DESC.with_form(Form::GatheredColumns);
        assert!(r.resolve_gathered(&q8, "columns@1.0.0#000000000000", "any").is_err());
        assert!(r.resolve_gathered(&exact, "cpu-builtin", "any").is_err());
        assert!(r.resolve_gathered(&exact, "zero-columns@1.0.0#000000000000", "any").is_err());
    }

    #[test]
    fn score_order_pins_and_exclusions() {
        let mut r = KernelRegistry::builtin();
        r.add_provider(Arc::new(Fake("fast-pack@1.0.0#abc", 50)));
        r.add_provider(Arc::new(Fake("dead-pack@1.0.0#def", 0)));
        assert_eq!(r.resolve(&DESC).unwrap().provider, "fast-pack@1.0.0#abc");
        assert!(r.candidates(&DESC).iter().all(|(p, _)| !p.starts_with("dead-pack")));

        r.pin("matmul.q4_1", "cpu-builtin/scalar/q4_1*q8_1");
        let got = r.resolve(&DESC).unwrap();
        assert_eq!((got.provider.as_str(), got.choice), ("cpu-builtin", Choice::Pinned));

        // A pack-prefixed kernel name is reachable as `<pack>/<kernel>`.
        let mut r2 = KernelRegistry::builtin();
        r2.add_provider(Arc::new(Prefixed));
        r2.pin("matmul.q4_1", "pfx/scalar/q4_1*q8_1");
        assert_eq!(r2.resolve(&DESC).unwrap().kernel.name(), "pfx:scalar/q4_1*q8_1");

        r.pin("q4_1*q8_1", "no-such-kernel");
        let err = r.resolve(&DESC).err().expect("pinned kernel does not exist");
        assert!(err.to_string().contains("no-such-kernel"));

        let mut r = KernelRegistry::builtin();
        r.add_provider(Arc::new(Fake("fast-pack@1.0.0#abc", 50)));
        r.exclude("fast-pack");
        assert_eq!(r.resolve(&DESC).unwrap().provider, "cpu-builtin");
    }
}
