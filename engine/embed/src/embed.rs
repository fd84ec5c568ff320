//! Sentence embeddings from a sentence-transformers model directory (e.g.
//! all-MiniLM-L6-v2): tokenizer, BERT encoder, pooling and normalisation,
//! as `SentenceTransformer.encode` computes them.
//!
//! The directory holds what sentence-transformers saves:
//! - `config.json` + `model.safetensors` (the BERT encoder, [`crate::bert`]);
//! - `tokenizer.json` (WordPiece; `[CLS] ... [SEP]` added around each text);
//! - `modules.json`: the module list (Transformer, Pooling, optionally
//!   Normalize); without it, `1_Pooling` and no normalisation are assumed;
//! - `1_Pooling/config.json` (or the Pooling module's path): the pooling mode;
//! - `sentence_bert_config.json` (optional): `max_seq_length`.
//!
//! Texts longer than `max_seq_length` tokens (including `[CLS]` and `[SEP]`)
//! are cut to that length, keeping `[SEP]` last, as sentence-transformers
//! does; each cut is logged (`tracing::warn!`) and reported in
//! [`Embedding::truncated`]. The empty string is a valid input: it is
//! encoded as `[CLS] [SEP]` and embedded like any other text (that is what
//! sentence-transformers returns for `""`).

use std::path::{Path, PathBuf};

use serde_json::Value;
use spinfer_kernels::pool::ThreadPool;

use crate::bert::{BertConfig, BertModel, Pooling, l2_normalize};
use crate::{Error, Result};
use spinfer_formats::Error as FileError;
use spinfer_formats::safetensors::SafetensorsModel;
use spinfer_kernel_select::registry::KernelRegistry;
use spinfer_tokenizer::Tokenizer;

/// Load-time options.
#[derive(Clone, Debug)]
pub struct EmbedderOptions {
    /// Threads of the embedder's pool.
    pub threads: usize,
    /// Texts per forward pass in [`Embedder::embed_batch`].
    pub batch_size: usize,
    /// A sparse-FFN sidecar (`spinfer calibrate-embed`): the FFN's down
    /// projection runs over the kept neurons only
    /// ([`crate::experimental::bert_sparse`]; also [`Embedder::load_sparsity`]).
    pub sparsity: Option<PathBuf>,
    /// Run the encoder's matmuls with reduced-precision products: bf16
    /// weights and activations for Q/K/V, the attention output and the
    /// FFN's first projection on CPUs with AVX-512 BF16 (about 1.45x the
    /// f32 throughput on 256-token inputs), int16 ones for all four on
    /// other CPUs with AVX2 ([`BertModel::prepack`]). Every matmul runs on
    /// weights packed once at load either way, where the CPU has AVX2 or
    /// AVX-512. On all-MiniLM-L6-v2 the embeddings stay within cosine
    /// 0.9999 of PyTorch's (f32: 0.9999999). Default: on, unless the
    /// environment variable `SPINFER_EMBED_REDUCED` is `0`, `off` or
    /// `false`.
    pub reduced_precision: bool,
}

impl Default for EmbedderOptions {
    fn default() -> Self {
        let reduced_precision = !matches!(
            std::env::var("SPINFER_EMBED_REDUCED").map(|v| v.to_ascii_lowercase()).as_deref(),
            Ok("0" | "off" | "false")
        );
        Self {
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            batch_size: 32,
            sparsity: None,
            reduced_precision,
        }
    }
}

/// The token ids the model sees for one text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokens {
    /// `[CLS] ... [SEP]`, at most [`Embedder::max_tokens`] long.
    pub ids: Vec<u32>,
    /// Tokens the text had (with `[CLS]`/`[SEP]`) before truncation.
    pub original_len: usize,
    /// Whether the text was cut to fit.
    pub truncated: bool,
}

/// One text's embedding and how it was read.
#[derive(Clone, Debug, PartialEq)]
pub struct Embedding {
    pub vector: Vec<f32>,
    /// Tokens fed to the model (after truncation).
    pub tokens: usize,
    /// Whether the text was cut to [`Embedder::max_tokens`].
    pub truncated: bool,
}

/// A loaded sentence-embedding model. `Send + Sync`: share it between
/// threads; concurrent calls are correct (a call that finds the thread
/// pool busy runs on its own thread).
pub struct Embedder {
    dir: PathBuf,
    /// The encoder's directory (the Transformer module's path).
    model_dir: PathBuf,
    model: BertModel,
    tokenizer: Tokenizer,
    pooling: Pooling,
    normalize: bool,
    max_tokens: usize,
    pool: ThreadPool,
    batch_size: usize,
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Embedder>();
};

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder")
            .field("dir", &self.dir)
            .field("dimensions", &self.dimensions())
            .field("pooling", &self.pooling)
            .field("normalize", &self.normalize)
            .field("max_tokens", &self.max_tokens)
            .field("prepacked", &self.model.prepacked())
            .finish_non_exhaustive()
    }
}

impl Embedder {
    /// Loads a sentence-transformers directory with the built-in kernels.
    pub fn load(dir: &Path, options: EmbedderOptions) -> Result<Self> {
        Self::load_with_registry(dir, &KernelRegistry::builtin(), options)
    }

    /// Loads a sentence-transformers directory, resolving every matmul
    /// through `registry`.
    pub fn load_with_registry(dir: &Path, registry: &KernelRegistry, options: EmbedderOptions) -> Result<Self> {
        if options.batch_size == 0 {
            return Err(Error::InvalidArgument("batch size must be at least 1".into()));
        }
        if options.threads > spinfer_models::model::llama::MAX_THREADS {
            return Err(Error::InvalidArgument(format!(
                "{} threads (EmbedderOptions::threads) is more than the {} allowed",
                options.threads,
                spinfer_models::model::llama::MAX_THREADS
            )));
        }
        let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
        if !meta.is_dir() {
            return Err(Error::format(dir, "is not a directory (give the sentence-transformers model directory)"));
        }
        // The module list: where the encoder and the pooling config live,
        // and whether vectors are normalised.
        let modules = read_modules(dir)?;
        let model_dir = dir.join(&modules.transformer);
        let tokenizer_path = model_dir.join("tokenizer.json");
        let pooling_path = dir.join(&modules.pooling).join("config.json");
        // Missing files first, before any slow loading.
        for (path, what) in [(&tokenizer_path, "the tokenizer"), (&pooling_path, "the pooling configuration")] {
            if !path.is_file() {
                return Err(Error::format(path, format!("not found ({what} of the embedding model)")));
            }
        }

        let config = BertConfig::from_file(&model_dir.join("config.json"))?;
        let pooling = read_pooling(&pooling_path, config.hidden)?;
        let max_tokens = match read_optional_json(&model_dir.join("sentence_bert_config.json"))? {
            Some((path, json)) => match json.get("max_seq_length").filter(|v| !v.is_null()) {
                None => config.max_positions,
                Some(v) => {
                    let m = v.as_u64().and_then(|m| usize::try_from(m).ok()).filter(|&m| m >= 2).ok_or_else(|| {
                        FileError::Metadata {
                            path,
                            key: "max_seq_length".into(),
                            detail: format!("must be an integer of at least 2, got {v}"),
                        }
                    })?;
                    m.min(config.max_positions)
                }
            },
            None => config.max_positions,
        };

        let tokenizer = Tokenizer::from_json_file(&tokenizer_path)?;
        // The post-processor must put [CLS] before and [SEP] after the text:
        // truncation relies on it.
        let empty = tokenizer.encode("", true)?;
        if empty.len() != 2 {
            let d = format!("does not wrap a text in [CLS] ... [SEP] (the empty text gives {} tokens)", empty.len());
            return Err(spinfer_tokenizer::Error::Tokenizer(format!("{}: {d}", tokenizer_path.display())).into());
        }

        let loader = SafetensorsModel::open(&model_dir)?;
        let mut model = BertModel::load(&loader, registry, config)?;
        let packed = model.prepack(options.reduced_precision)?;
        tracing::debug!(
            dir = %dir.display(), ?pooling, normalize = modules.normalize, max_tokens, ?packed, "embedder loaded"
        );
        let mut embedder = Self {
            dir: dir.to_path_buf(),
            model_dir,
            model,
            tokenizer,
            pooling,
            normalize: modules.normalize,
            max_tokens,
            pool: ThreadPool::new(options.threads.max(1)),
            batch_size: options.batch_size,
        };
        if let Some(path) = &options.sparsity {
            embedder.load_sparsity(path)?;
        }
        Ok(embedder)
    }

    /// Width of the embeddings.
    pub fn dimensions(&self) -> usize {
        self.pooling.modes() * self.model.config.hidden
    }

    /// Longest token sequence the model reads (`[CLS]` and `[SEP]` included).
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Whether embeddings are scaled to unit length.
    pub fn normalizes(&self) -> bool {
        self.normalize
    }

    pub fn model(&self) -> &BertModel {
        &self.model
    }

    /// For the sparse FFN's setup (`experimental/bert_sparse.rs`).
    pub(crate) fn model_mut(&mut self) -> &mut BertModel {
        &mut self.model
    }

    /// The encoder's directory (`config.json`, `model.safetensors`).
    pub fn model_dir(&self) -> &Path {
        &self.model_dir
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The model's input for `text`: `[CLS] word pieces [SEP]`, cut to
    /// [`Embedder::max_tokens`] (keeping `[SEP]` last) with a warning.
    pub fn tokenize(&self, text: &str) -> Result<Tokens> {
        let mut ids = self.tokenizer.encode(text, true)?;
        let original_len = ids.len();
        let truncated = original_len > self.max_tokens;
        if truncated {
            let sep = ids[original_len - 1];
            ids.truncate(self.max_tokens - 1);
            ids.push(sep);
            tracing::warn!(tokens = original_len, max = self.max_tokens, "input truncated to the model's max length");
        }
        Ok(Tokens { ids, original_len, truncated })
    }

    /// The embedding of one text.
    pub fn embed(&self, text: &str) -> Result<Vec<f32>> {
        let mut v = self.embed_batch_detailed(&[text])?;
        Ok(v.pop().map(|e| e.vector).unwrap_or_default())
    }

    /// Embeddings of several texts, in order; texts go through the model
    /// `batch_size` at a time.
    pub fn embed_batch(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        Ok(self.embed_batch_detailed(texts)?.into_iter().map(|e| e.vector).collect())
    }

    /// As [`Embedder::embed_batch`], with token counts and truncation flags.
    pub fn embed_batch_detailed(&self, texts: &[&str]) -> Result<Vec<Embedding>> {
        let mut out = Vec::with_capacity(texts.len());
        for batch in texts.chunks(self.batch_size) {
            let tokens = batch.iter().map(|t| self.tokenize(t)).collect::<Result<Vec<_>>>()?;
            let seqs: Vec<&[u32]> = tokens.iter().map(|t| t.ids.as_slice()).collect();
            let states = self.model.forward(&self.pool, &seqs)?;
            let hidden = self.model.config.hidden;
            let mut start = 0;
            for t in &tokens {
                let len = t.ids.len();
                let mut vector = self.pooling.apply(&states[start * hidden..(start + len) * hidden], hidden);
                if self.normalize {
                    l2_normalize(&mut vector);
                }
                out.push(Embedding { vector, tokens: len, truncated: t.truncated });
                start += len;
            }
        }
        Ok(out)
    }
}

/// Where the modules of a sentence-transformers directory live.
struct Modules {
    /// The encoder's directory, relative to the model directory.
    transformer: PathBuf,
    /// The Pooling module's directory.
    pooling: PathBuf,
    normalize: bool,
}

/// Reads `modules.json`; without one, the encoder is at the top level,
/// pooling in `1_Pooling` and there is no normalisation. Modules other than
/// Transformer, Pooling and Normalize (e.g. Dense) are refused: skipping
/// them would silently compute another function.
fn read_modules(dir: &Path) -> Result<Modules> {
    let mut m = Modules { transformer: PathBuf::new(), pooling: PathBuf::from("1_Pooling"), normalize: false };
    let Some((path, json)) = read_optional_json(&dir.join("modules.json"))? else {
        tracing::debug!(dir = %dir.display(), "no modules.json: assuming Transformer, 1_Pooling, no Normalize");
        return Ok(m);
    };
    let list = json.as_array().ok_or_else(|| Error::format(&path, "must hold a json array of modules"))?;
    let mut have_pooling = false;
    for (i, module) in list.iter().enumerate() {
        let field = |key: &str| module.get(key).and_then(Value::as_str);
        let ty = field("type").ok_or_else(|| Error::format(&path, format!("module {i} has no 'type' string")))?;
        let rel = PathBuf::from(field("path").unwrap_or(""));
        if rel.components().any(|c| !matches!(c, std::path::Component::Normal(_))) {
            return Err(Error::format(
                &path,
                format!("module {i} has path {rel:?}, which is not inside the directory"),
            ));
        }
        match ty.rsplit('.').next().unwrap_or(ty) {
            "Transformer" => m.transformer = rel,
            "Pooling" => {
                m.pooling = rel;
                have_pooling = true;
            }
            "Normalize" => m.normalize = true,
            other => {
                let d =
                    format!("module {i} is '{other}' ({ty}), which is not supported (Transformer, Pooling, Normalize)");
                return Err(Error::format(&path, d));
            }
        }
    }
    if !have_pooling {
        return Err(Error::format(&path, "lists no Pooling module"));
    }
    Ok(m)
}

/// Reads a Pooling module's `config.json`.
fn read_pooling(path: &Path, hidden: usize) -> Result<Pooling> {
    let text =
        spinfer_formats::bounded::read_text(path, spinfer_formats::bounded::MAX_CONFIG_BYTES, "a pooling config")?;
    let json: Value = serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid json: {e}")))?;
    let key_err = |key: &str, detail: String| -> Error {
        FileError::Metadata { path: path.to_path_buf(), key: key.into(), detail }.into()
    };
    let flag = |key: &str| -> Result<bool> {
        match json.get(key).filter(|v| !v.is_null()) {
            None => Ok(false),
            Some(v) => v.as_bool().ok_or_else(|| key_err(key, format!("must be a boolean, got {v}"))),
        }
    };
    for key in ["pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken"] {
        if flag(key)? {
            return Err(key_err(key, "is on, which is not supported yet".into()));
        }
    }
    if let Some(v) = json.get("word_embedding_dimension").filter(|v| !v.is_null())
        && v.as_u64() != Some(hidden as u64)
    {
        return Err(key_err("word_embedding_dimension", format!("is {v} but the model's hidden_size is {hidden}")));
    }
    let p = Pooling {
        cls: flag("pooling_mode_cls_token")?,
        max: flag("pooling_mode_max_tokens")?,
        mean: flag("pooling_mode_mean_tokens")?,
        mean_sqrt_len: flag("pooling_mode_mean_sqrt_len_tokens")?,
    };
    if p.modes() == 0 {
        return Err(Error::format(path, "turns no pooling mode on"));
    }
    Ok(p)
}

/// `Some((path, json))` if the file exists; an error if it exists but is
/// not valid JSON.
fn read_optional_json(path: &Path) -> Result<Option<(PathBuf, Value)>> {
    let Some(text) =
        spinfer_formats::bounded::read_text_opt(path, spinfer_formats::bounded::MAX_CONFIG_BYTES, "a JSON config")?
    else {
        return Ok(None);
    };
    let json = serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid json: {e}")))?;
    Ok(Some((path.to_path_buf(), json)))
}

/// Cosine similarity (0 when either vector is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut ab, mut aa, mut bb) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 { 0.0 } else { (ab / (aa.sqrt() * bb.sqrt())) as f32 }
}

/// The STS benchmark: sentence pairs with gold similarity scores, and the
/// Spearman correlation it is scored by.
pub mod sts {
    use std::path::Path;

    use crate::{Error, Result};

    /// One scored sentence pair.
    #[derive(Clone, Debug, PartialEq)]
    pub struct Pair {
        /// Gold similarity, 0 (unrelated) to 5 (equivalent).
        pub score: f64,
        pub sentence1: String,
        pub sentence2: String,
    }

    /// Reads an STS-B file (`sts-test.csv` of the original distribution):
    /// tab-separated, no header, no quoting; columns genre, file, year, id,
    /// score, sentence1, sentence2 (some rows carry extra source columns,
    /// which are ignored). Empty lines are skipped.
    pub fn read(path: &Path) -> Result<Vec<Pair>> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let text = String::from_utf8(bytes)
            .map_err(|e| Error::format(path, format!("is not valid UTF-8 (byte {})", e.utf8_error().valid_up_to())))?;
        let mut pairs = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.is_empty() {
                continue;
            }
            let cols: Vec<&str> = line.split('\t').collect();
            if cols.len() < 7 {
                let d = format!("line {}: {} tab-separated columns, expected at least 7", i + 1, cols.len());
                return Err(Error::format(path, d));
            }
            let score =
                cols[4].trim().parse::<f64>().ok().filter(|s| s.is_finite()).ok_or_else(|| {
                    Error::format(path, format!("line {}: score '{}' is not a number", i + 1, cols[4]))
                })?;
            pairs.push(Pair { score, sentence1: cols[5].to_string(), sentence2: cols[6].to_string() });
        }
        if pairs.is_empty() {
            return Err(Error::format(path, "holds no sentence pairs"));
        }
        Ok(pairs)
    }

    /// Spearman's rank correlation: the Pearson correlation of the ranks,
    /// ties given their average rank (as `scipy.stats.spearmanr`). NaN when
    /// either side is constant or the lengths differ.
    pub fn spearman(x: &[f64], y: &[f64]) -> f64 {
        if x.len() != y.len() || x.len() < 2 {
            return f64::NAN;
        }
        pearson(&ranks(x), &ranks(y))
    }

    /// 1-based ranks, ties averaged.
    fn ranks(v: &[f64]) -> Vec<f64> {
        let mut idx: Vec<usize> = (0..v.len()).collect();
        idx.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
        let mut r = vec![0.0; v.len()];
        let mut i = 0;
        while i < idx.len() {
            let mut j = i + 1;
            while j < idx.len() && v[idx[j]] == v[idx[i]] {
                j += 1;
            }
            // Positions i..j (0-based) share the mean of ranks i+1..=j.
            let avg = (i + j + 1) as f64 / 2.0;
            for &k in &idx[i..j] {
                r[k] = avg;
            }
            i = j;
        }
        r
    }

    fn pearson(x: &[f64], y: &[f64]) -> f64 {
        let n = x.len() as f64;
        let (mx, my) = (x.iter().sum::<f64>() / n, y.iter().sum::<f64>() / n);
        let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
        for (&a, &b) in x.iter().zip(y) {
            sxy += (a - mx) * (b - my);
            sxx += (a - mx) * (a - mx);
            syy += (b - my) * (b - my);
        }
        sxy / (sxx * syy).sqrt()
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn spearman_with_ties() {
            assert_eq!(ranks(&[10.0, 20.0, 20.0, 5.0]), vec![2.0, 3.5, 3.5, 1.0]);
            assert!((spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 30.0]) - 1.0).abs() < 1e-12);
            assert!((spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
            // scipy.stats.spearmanr([1,2,3,4,5], [5,6,7,8,7]) = 0.8207826816681233
            let r = spearman(&[1.0, 2.0, 3.0, 4.0, 5.0], &[5.0, 6.0, 7.0, 8.0, 7.0]);
            assert!((r - 0.820_782_681_668_123_3).abs() < 1e-12, "{r}");
            assert!(spearman(&[1.0, 1.0], &[1.0, 2.0]).is_nan());
        }

        #[test]
        fn reads_sts_rows() {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("sts.csv");
            let rows = "g\tf\t2012\t0001\t2.500\tA b.\tC d.\ng\tf\t2012\t0002\t4\tE\tF\tsrc1\tsrc2\n\n";
            std::fs::write(&p, rows).unwrap();
            let pairs = read(&p).unwrap();
            assert_eq!(pairs.len(), 2);
            assert_eq!(
                (pairs[0].score, pairs[0].sentence1.as_str(), pairs[0].sentence2.as_str()),
                (2.5, "A b.", "C d.")
            );
            assert_eq!(pairs[1].sentence2, "F");
            std::fs::write(&p, "g\tf\t2012\t0001\tx\tA\tB\n").unwrap();
            let e = read(&p).unwrap_err().to_string();
            assert!(e.contains("sts.csv") && e.contains("line 1") && e.contains("'x'"), "{e}");
            std::fs::write(&p, "a\tb\n").unwrap();
            assert!(read(&p).unwrap_err().to_string().contains("at least 7"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_basics() {
        assert!((cosine(&[1.0, 0.0], &[1.0, 0.0]) - 1.0).abs() < 1e-7);
        assert!(cosine(&[1.0, 0.0], &[0.0, 1.0]).abs() < 1e-7);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 1.0]), 0.0);
    }

    #[test]
    fn a_thread_count_past_the_limit_is_refused_before_anything_is_read() {
        let options = EmbedderOptions { threads: 1 << 30, ..EmbedderOptions::default() };
        let Err(e) = Embedder::load(Path::new("/nonexistent"), options) else { panic!("loaded") };
        let e = e.to_string();
        assert!(e.contains("1073741824 threads") && e.contains("EmbedderOptions::threads"), "{e}");
    }

    #[test]
    fn modules_and_pooling_configs() {
        let dir = tempfile::tempdir().unwrap();
        // No modules.json: defaults.
        let m = read_modules(dir.path()).unwrap();
        assert_eq!((m.transformer, m.pooling, m.normalize), (PathBuf::new(), PathBuf::from("1_Pooling"), false));
        let modules = |j: &str| {
            std::fs::write(dir.path().join("modules.json"), j).unwrap();
            read_modules(dir.path())
        };
        let m = modules(
            r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
                {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
                {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
        )
        .unwrap();
        assert!(m.normalize);
        let e = modules(r#"[{"path":"1_Pooling","type":"sentence_transformers.models.Pooling"},{"path":"2_Dense","type":"sentence_transformers.models.Dense"}]"#)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("modules.json") && e.contains("'Dense'"), "{e}");
        let e = modules(r#"[{"path":"../x","type":"Pooling"}]"#).err().unwrap().to_string();
        assert!(e.contains("not inside"), "{e}");

        let p = dir.path().join("pooling.json");
        let pooling = |j: &str| {
            std::fs::write(&p, j).unwrap();
            read_pooling(&p, 4)
        };
        let got = pooling(r#"{"word_embedding_dimension":4,"pooling_mode_mean_tokens":true}"#).unwrap();
        assert_eq!(got, Pooling { mean: true, ..Default::default() });
        let e = pooling(r#"{"word_embedding_dimension":8,"pooling_mode_cls_token":true}"#).unwrap_err().to_string();
        assert!(e.contains("word_embedding_dimension") && e.contains("hidden_size is 4"), "{e}");
        let e = pooling(r#"{"pooling_mode_lasttoken":true}"#).unwrap_err().to_string();
        assert!(e.contains("pooling_mode_lasttoken"), "{e}");
        assert!(pooling(r#"{"pooling_mode_mean_tokens":false}"#).unwrap_err().to_string().contains("no pooling mode"));
    }
}
