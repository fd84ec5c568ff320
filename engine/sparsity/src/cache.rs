//! The bounded cache of cold FFN neurons under a memory budget, and the
//! policies that decide which neurons stay in it.
//!
//! Policies implement the plugin ABI's [`CachePolicy`] trait
//! (`spinfer_plugin_api`), so a third-party pack's `CachePolicyBox` fits the
//! same slot as the built-in ones. The contract the [`ColdCache`] host
//! follows:
//!
//! * every access to a cold neuron calls `on_access` (resident or not);
//! * a miss calls `admit`; `true` means the policy now tracks the neuron as
//!   resident, and the host calls `evict` until a slot is free;
//! * `evict` names a resident neuron and forgets it.
//!
//! Built in: [`Lru`] (least recently used), [`FreqLru`]
//! (frequency-weighted LRU: a neuron's priority is its last access time plus
//! `horizon × its calibrated activation frequency`, so frequently active
//! neurons outlive rarely active ones accessed at the same time) and
//! [`Sweep`] (ranks by layer, then recency: decode sweeps the layers in
//! order, where LRU is at its worst) and [`Window`] (the neurons used in
//! the last `k` tokens, LLM in a Flash's windowing).

use std::collections::{BTreeSet, HashMap};

use spinfer_plugin_api::abi_stable::std_types::{ROption, RString};
pub use spinfer_plugin_api::{CachePolicy, CachePolicyBox, NeuronId};

/// The built-in cache policies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CachePolicyKind {
    /// Least recently used.
    Lru,
    /// Frequency-weighted LRU.
    FreqLru,
    /// Sweep-aware: by layer, then recency ([`Sweep`]; the default).
    #[default]
    Sweep,
    /// The neurons of the last `k` tokens ([`Window`]).
    Window(u16),
}

impl CachePolicyKind {
    pub fn name(self) -> &'static str {
        match self {
            CachePolicyKind::Lru => "lru",
            CachePolicyKind::FreqLru => "freq-lru",
            CachePolicyKind::Sweep => "sweep",
            CachePolicyKind::Window(_) => "window",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        if let Some(k) = s.strip_prefix("window:") {
            return k.parse().ok().filter(|k| (1..=MAX_WINDOW).contains(k)).map(CachePolicyKind::Window);
        }
        match s {
            "lru" => Some(CachePolicyKind::Lru),
            "window" => Some(CachePolicyKind::Window(WINDOW_TOKENS)),
            "freq-lru" | "frequency-lru" | "lfru" => Some(CachePolicyKind::FreqLru),
            "sweep" => Some(CachePolicyKind::Sweep),
            _ => None,
        }
    }
}

/// Priority-ordered resident set shared by both policies: evicts the
/// lowest priority (ties: the lowest neuron id).
#[derive(Default)]
struct Resident {
    prio: HashMap<NeuronId, u64>,
    order: BTreeSet<(u64, NeuronId)>,
}

impl Resident {
    fn set(&mut self, n: NeuronId, p: u64) {
        if let Some(old) = self.prio.insert(n, p) {
            self.order.remove(&(old, n));
        }
        self.order.insert((p, n));
    }

    fn touch(&mut self, n: NeuronId, p: u64) {
        if self.prio.contains_key(&n) {
            self.set(n, p);
        }
    }

    fn pop(&mut self) -> Option<NeuronId> {
        let (_, n) = self.order.pop_first()?;
        self.prio.remove(&n);
        Some(n)
    }
}

/// Least recently used.
#[derive(Default)]
pub struct Lru {
    clock: u64,
    resident: Resident,
}

impl CachePolicy for Lru {
    fn name(&self) -> RString {
        "lru".into()
    }

    fn on_access(&mut self, neuron: NeuronId) {
        self.clock += 1;
        self.resident.touch(neuron, self.clock);
    }

    fn admit(&mut self, neuron: NeuronId) -> bool {
        // Newest of all, even without a preceding `on_access`.
        self.clock += 1;
        self.resident.set(neuron, self.clock);
        true
    }

    fn evict(&mut self) -> ROption<NeuronId> {
        self.resident.pop().into()
    }
}

/// How a [`Ranked`] policy orders resident neurons: the priority of a
/// neuron accessed at time `clock` (the lowest is evicted first).
pub trait Rank {
    const NAME: &'static str;
    fn priority(&self, clock: u64, n: NeuronId) -> u64;
}

/// A policy that re-ranks a neuron at every access by its [`Rank`].
pub struct Ranked<R> {
    clock: u64,
    rank: R,
    resident: Resident,
}

impl<R: Rank + Send> CachePolicy for Ranked<R> {
    fn name(&self) -> RString {
        R::NAME.into()
    }

    fn on_access(&mut self, neuron: NeuronId) {
        self.clock += 1;
        let p = self.rank.priority(self.clock, neuron);
        self.resident.touch(neuron, p);
    }

    fn admit(&mut self, neuron: NeuronId) -> bool {
        let p = self.rank.priority(self.clock, neuron);
        self.resident.set(neuron, p);
        true
    }

    fn evict(&mut self) -> ROption<NeuronId> {
        self.resident.pop().into()
    }
}

/// Frequency-weighted LRU: priority = last access + `horizon × freq`, with
/// `freq` the neuron's calibrated activation frequency (0..=1, the
/// sidecar's `active_freq`). With all frequencies equal it is LRU.
pub type FreqLru = Ranked<ByFrequency>;

pub struct ByFrequency {
    horizon: f64,
    /// Per layer, per neuron.
    freq: Vec<Vec<f32>>,
}

impl FreqLru {
    /// `horizon`: how many accesses a neuron of frequency 1 outlives one of
    /// frequency 0 last used at the same time.
    pub fn new(horizon: usize, freq: Vec<Vec<f32>>) -> Self {
        Ranked { clock: 0, rank: ByFrequency { horizon: horizon as f64, freq }, resident: Resident::default() }
    }
}

impl Rank for ByFrequency {
    const NAME: &'static str = "freq-lru";
    fn priority(&self, clock: u64, n: NeuronId) -> u64 {
        let f = self.freq.get(n.layer as usize).and_then(|l| l.get(n.index as usize)).copied().unwrap_or(0.0);
        clock + (self.horizon * f64::from(f.clamp(0.0, 1.0))) as u64
    }
}

/// Sweep-aware. Each decode step visits the layers in order, and on a
/// small model the cold neurons one step uses outnumber the cache's slots
/// several times over: LRU then evicts the earliest layers' neurons just
/// before the next step asks for them (a cyclic sweep larger than the
/// cache is its worst case) and hits only by chance. This policy ranks by
/// layer first, the earliest layers kept, and by recency within a layer:
/// the early layers' cold set stays resident from step to step, turning
/// over as their neurons change, and a newcomer ranking below everything
/// resident (a late layer's, the cache full of earlier ones) is not
/// admitted, so it does not churn the cache.
pub type Sweep = Ranked<ByLayer>;

pub struct ByLayer {
    layers: u64,
}

/// Room for the recency clock below the layer rank.
const SWEEP_CLOCK_BITS: u32 = 44;

impl Sweep {
    /// A policy for a model of `layers` layers.
    pub fn new(layers: usize) -> Self {
        Ranked { clock: 0, rank: ByLayer { layers: layers.clamp(1, 1 << 16) as u64 }, resident: Resident::default() }
    }
}

impl Rank for ByLayer {
    const NAME: &'static str = "sweep";
    fn priority(&self, clock: u64, n: NeuronId) -> u64 {
        let rank = self.layers - 1 - u64::from(n.layer).min(self.layers - 1);
        (rank << SWEEP_CLOCK_BITS) | (clock & ((1 << SWEEP_CLOCK_BITS) - 1))
    }
}

/// Tokens [`Window`] keeps by default (`window`; `window:K` sets K).
pub const WINDOW_TOKENS: u16 = 5;
/// The largest K of `window:K`.
const MAX_WINDOW: u16 = 10_000;

/// Windowing (LLM in a Flash, Alizadeh et al. 2023): keep the neurons used
/// in the last `k` tokens, read only the newcomers. Decode visits the layers
/// in order, so a token begins where an access's layer falls below the
/// previous access's. A neuron ranks by the last token that used it (ties:
/// the later layer leaves first, as in [`Sweep`]); a newcomer is admitted
/// while the cache has a free slot or its stalest neuron has left the
/// window, so once the window fits it is never churned by one token's
/// overflow, and a window larger than the cache keeps what fits of it.
pub struct Window {
    k: u64,
    slots: usize,
    token: u64,
    last_layer: u32,
    resident: Resident,
}

impl Window {
    /// A window of `k` tokens over a cache of `slots` slots.
    pub fn new(k: usize, slots: usize) -> Self {
        Self { k: k.max(1) as u64, slots, token: 0, last_layer: 0, resident: Resident::default() }
    }

    fn priority(&self, n: NeuronId) -> u64 {
        (self.token << 16) | u64::from(0xFFFF - n.layer.min(0xFFFF))
    }
}

impl CachePolicy for Window {
    fn name(&self) -> RString {
        "window".into()
    }

    fn on_access(&mut self, neuron: NeuronId) {
        if neuron.layer < self.last_layer {
            self.token += 1;
        }
        self.last_layer = neuron.layer;
        let p = self.priority(neuron);
        self.resident.touch(neuron, p);
    }

    fn admit(&mut self, neuron: NeuronId) -> bool {
        let room = self.resident.prio.len() < self.slots;
        let stale = self.resident.order.first().is_some_and(|&(p, _)| (p >> 16) + self.k <= self.token);
        if !(room || stale) {
            return false;
        }
        let p = self.priority(neuron);
        self.resident.set(neuron, p);
        true
    }

    fn evict(&mut self) -> ROption<NeuronId> {
        self.resident.pop().into()
    }
}

/// A boxed policy (built-in or a pack's `CachePolicyBox`).
pub type BoxedPolicy = Box<dyn CachePolicy + Send>;

const NONE: u32 = u32::MAX;

/// A fixed number of `record`-byte slots holding cold neurons, with a
/// policy choosing what stays.
pub struct ColdCache {
    record: usize,
    data: Vec<u8>,
    /// Per layer, per neuron: its slot or `NONE`.
    slot_of: Vec<Vec<u32>>,
    /// Per slot: the neuron in it.
    owner: Vec<Option<NeuronId>>,
    free: Vec<u32>,
    policy: BoxedPolicy,
}

impl ColdCache {
    /// `slots` slots of `record` bytes for a model of `layers` × `ffn`
    /// neurons (the slots are allocated, zeroed, up front: they are what
    /// the budget pays for).
    pub fn new(slots: usize, record: usize, layers: usize, ffn: usize, policy: BoxedPolicy) -> Self {
        Self {
            record,
            data: vec![0; slots * record],
            slot_of: vec![vec![NONE; ffn]; layers],
            owner: vec![None; slots],
            free: (0..slots as u32).rev().collect(),
            policy,
        }
    }

    pub fn slots(&self) -> usize {
        self.owner.len()
    }

    pub fn policy_name(&self) -> String {
        self.policy.name().into()
    }

    /// Resident bytes (slots and maps).
    pub fn bytes(&self) -> usize {
        self.data.len() + self.slot_of.iter().map(|l| l.len() * 4).sum::<usize>() + self.owner.len() * 12
    }

    /// Records an access; the neuron's record when resident.
    pub fn lookup(&mut self, n: NeuronId) -> Option<&[u8]> {
        self.policy.on_access(n);
        let s = *self.slot_of.get(n.layer as usize)?.get(n.index as usize)?;
        if s == NONE {
            return None;
        }
        let r = self.record;
        Some(&self.data[s as usize * r..(s as usize + 1) * r])
    }

    /// Offers a missed neuron's record; stored when the policy admits it
    /// and a slot can be freed. Returns whether it was stored.
    pub fn insert(&mut self, n: NeuronId, rec: &[u8]) -> bool {
        debug_assert_eq!(rec.len(), self.record);
        if self.owner.is_empty() || !self.policy.admit(n) {
            return false;
        }
        // Evict until a slot is free (bounded: a policy naming neurons the
        // host does not hold cannot loop forever).
        let mut tries = self.owner.len() + 1;
        while self.free.is_empty() && tries > 0 {
            tries -= 1;
            let ROption::RSome(v) = self.policy.evict() else { break };
            if v == n {
                // The newcomer ranks lowest: the policy has dropped it.
                return false;
            }
            if let Some(s) = self.slot_of.get_mut(v.layer as usize).and_then(|l| l.get_mut(v.index as usize))
                && *s != NONE
            {
                self.owner[*s as usize] = None;
                self.free.push(*s);
                *s = NONE;
            }
        }
        let Some(s) = self.free.pop() else { return false };
        let r = self.record;
        self.data[s as usize * r..(s as usize + 1) * r].copy_from_slice(rec);
        self.owner[s as usize] = Some(n);
        self.slot_of[n.layer as usize][n.index as usize] = s;
        true
    }

    /// Whether `n` is resident (no access recorded).
    pub fn contains(&self, n: NeuronId) -> bool {
        self.slot_of.get(n.layer as usize).and_then(|l| l.get(n.index as usize)).is_some_and(|&s| s != NONE)
    }
}

/// The built-in policy `kind` for a cache of `slots` slots; `freq` are the
/// calibrated activation frequencies (per layer, per neuron).
pub fn policy(kind: CachePolicyKind, slots: usize, freq: Vec<Vec<f32>>) -> BoxedPolicy {
    match kind {
        CachePolicyKind::Lru => Box::new(Lru::default()),
        CachePolicyKind::FreqLru => Box::new(FreqLru::new(slots, freq)),
        CachePolicyKind::Sweep => Box::new(Sweep::new(freq.len())),
        CachePolicyKind::Window(k) => Box::new(Window::new(usize::from(k), slots)),
    }
}

#[cfg(test)]
mod tests {
    use spinfer_plugin_api::CachePolicy_TO;
    use spinfer_plugin_api::abi_stable::sabi_trait::TD_Opaque;

    use super::*;

    fn n(index: u32) -> NeuronId {
        NeuronId { layer: 0, index }
    }

    fn rec(v: u8) -> [u8; 4] {
        [v; 4]
    }

    /// Decode steps sweeping 4 layers of 3 cold neurons each through 6
    /// slots: LRU evicts each layer's neurons just before the next step
    /// needs them and never hits; the sweep-aware policy keeps the first
    /// two layers resident and hits on them every step.
    #[test]
    fn sweep_keeps_the_early_layers_where_lru_never_hits() {
        let run = |policy: BoxedPolicy| {
            let mut c = ColdCache::new(6, 4, 4, 3, policy);
            let mut hits = 0;
            for _step in 0..5 {
                for layer in 0..4u32 {
                    for index in 0..3u32 {
                        let id = NeuronId { layer, index };
                        if c.lookup(id).is_some() {
                            hits += 1;
                        } else {
                            c.insert(id, &rec(index as u8));
                        }
                    }
                }
            }
            (hits, c)
        };
        let (lru_hits, _) = run(Box::<Lru>::default());
        let (sweep_hits, c) = run(Box::new(Sweep::new(4)));
        assert_eq!(lru_hits, 0);
        assert_eq!(sweep_hits, 4 * 6, "layers 0 and 1 hit on every step after the first");
        assert!(
            (0..3).all(|i| c.contains(NeuronId { layer: 0, index: i }) && c.contains(NeuronId { layer: 1, index: i }))
        );
        // A later layer's newcomer, ranking below everything resident, is
        // not admitted; an earlier layer's replaces the least recent
        // neuron of the latest layer resident.
        let id = |layer, index| NeuronId { layer, index };
        let mut c = ColdCache::new(2, 4, 2, 4, Box::new(Sweep::new(2)));
        for i in 0..2 {
            assert!(c.lookup(id(1, i)).is_none() && c.insert(id(1, i), &rec(1)));
        }
        assert!(c.lookup(id(0, 0)).is_none() && c.insert(id(0, 0), &rec(2)));
        assert!(c.contains(id(0, 0)) && !c.contains(id(1, 0)) && c.contains(id(1, 1)));
        assert!(c.lookup(id(0, 1)).is_none() && c.insert(id(0, 1), &rec(3)));
        assert!(c.lookup(id(1, 2)).is_none());
        assert!(!c.insert(id(1, 2), &rec(4)), "a late layer's neuron displaced an early one");
        assert!(c.contains(id(0, 0)) && c.contains(id(0, 1)));
        assert_eq!(CachePolicyKind::parse("sweep"), Some(CachePolicyKind::Sweep));
        assert_eq!(CachePolicyKind::default(), CachePolicyKind::Sweep);
    }

    /// Steps sweeping 2 layers of 3 cold neurons through 4 slots: LRU
    /// never hits; a window of 1 token keeps the first 4 neurons it met
    /// (the window does not fit, so overflow is not admitted) and hits on
    /// them every step; when the working set moves on, the neurons that left
    /// the window are replaced.
    #[test]
    fn window_keeps_the_recent_tokens_neurons() {
        let id = |layer, index| NeuronId { layer, index };
        let step = |c: &mut ColdCache, set: &[u32]| {
            let mut hits = 0;
            for layer in 0..2u32 {
                for &index in set {
                    if c.lookup(id(layer, index)).is_some() {
                        hits += 1;
                    } else {
                        c.insert(id(layer, index), &rec(index as u8));
                    }
                }
            }
            hits
        };
        let mut lru = ColdCache::new(4, 4, 2, 8, Box::<Lru>::default());
        let mut win = ColdCache::new(4, 4, 2, 8, Box::new(Window::new(1, 4)));
        let (mut lru_hits, mut win_hits) = (0, 0);
        for _ in 0..5 {
            lru_hits += step(&mut lru, &[0, 1, 2]);
            win_hits += step(&mut win, &[0, 1, 2]);
        }
        assert_eq!(lru_hits, 0);
        assert_eq!(win_hits, 4 * 4, "4 resident neurons hit on each of the last 4 steps");
        assert!(win.contains(id(0, 0)) && win.contains(id(1, 0)) && !win.contains(id(1, 2)));
        // New neurons for two tokens: the old ones left the 1-token window.
        step(&mut win, &[5, 6]);
        step(&mut win, &[5, 6]);
        assert!((0..2).all(|l| win.contains(id(l, 5)) && win.contains(id(l, 6)) && !win.contains(id(l, 0))));
        assert_eq!(CachePolicyKind::parse("window"), Some(CachePolicyKind::Window(WINDOW_TOKENS)));
        assert_eq!(CachePolicyKind::parse("window:12"), Some(CachePolicyKind::Window(12)));
        assert_eq!(CachePolicyKind::parse("window:0"), None);
        assert_eq!(CachePolicyKind::parse("window:x"), None);
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut c = ColdCache::new(2, 4, 1, 8, Box::new(Lru::default()));
        assert!(c.lookup(n(1)).is_none());
        assert!(c.insert(n(1), &rec(1)));
        assert!(c.lookup(n(2)).is_none());
        assert!(c.insert(n(2), &rec(2)));
        // Touch 1: 2 is now the least recently used.
        assert_eq!(c.lookup(n(1)), Some(&rec(1)[..]));
        assert!(c.lookup(n(3)).is_none());
        assert!(c.insert(n(3), &rec(3)));
        assert!(c.contains(n(1)) && c.contains(n(3)) && !c.contains(n(2)));
        assert_eq!(c.lookup(n(3)), Some(&rec(3)[..]));
        // Now 1 is the oldest.
        assert!(c.lookup(n(4)).is_none());
        assert!(c.insert(n(4), &rec(4)));
        assert!(!c.contains(n(1)) && c.contains(n(3)) && c.contains(n(4)));
    }

    #[test]
    fn frequency_weighted_lru_keeps_frequent_neurons() {
        // Neuron 0 is active on 90% of tokens, the others on 1%.
        let mut freq = vec![0.01f32; 8];
        freq[0] = 0.9;
        let mut c = ColdCache::new(2, 4, 1, 8, Box::new(FreqLru::new(10, vec![freq.clone()])));
        let mut lru = ColdCache::new(2, 4, 1, 8, Box::new(Lru::default()));
        // A scan of rarely active neurons after neuron 0.
        for cache in [&mut c, &mut lru] {
            for i in 0..6u32 {
                if cache.lookup(n(i)).is_none() {
                    cache.insert(n(i), &rec(i as u8));
                }
            }
        }
        assert!(c.contains(n(0)), "frequent neuron evicted by a scan");
        assert!(c.contains(n(5)));
        assert!(!lru.contains(n(0)), "plain LRU forgets it");
        // Beyond its horizon even a frequent neuron goes.
        for i in 0..20u32 {
            let j = 1 + i % 7;
            if c.lookup(n(j)).is_none() {
                c.insert(n(j), &rec(j as u8));
            }
        }
        assert!(!c.contains(n(0)));
    }

    #[test]
    fn an_abi_policy_object_drives_the_cache() {
        let p: CachePolicyBox = CachePolicy_TO::from_value(Lru::default(), TD_Opaque);
        assert_eq!(p.name().as_str(), "lru");
        let mut c = ColdCache::new(1, 4, 2, 4, Box::new(p));
        let a = NeuronId { layer: 1, index: 3 };
        assert!(c.lookup(a).is_none());
        assert!(c.insert(a, &rec(7)));
        assert!(c.insert(n(0), &rec(8)));
        assert!(!c.contains(a) && c.contains(n(0)));
        assert_eq!(c.policy_name(), "lru");
    }

    #[test]
    fn an_empty_cache_stores_nothing() {
        let mut c = ColdCache::new(0, 4, 1, 4, Box::new(Lru::default()));
        assert!(!c.insert(n(0), &rec(1)));
        assert!(c.lookup(n(0)).is_none());
        assert_eq!(CachePolicyKind::parse("lru"), Some(CachePolicyKind::Lru));
        assert_eq!(CachePolicyKind::parse(CachePolicyKind::FreqLru.name()), Some(CachePolicyKind::FreqLru));
    }
}
