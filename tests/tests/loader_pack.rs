//! The ABI's `Loader` end to end: the reference loader pack
//! (`plugins/loader-npy`), signed and verified like any pack, opens a model
//! directory of `.npy` tensors that the host cannot read itself, through
//! `PackModule::loaders`, and the model computes the built-in safetensors
//! loader's logits bit for bit (SmolLM2, exported from its GGUF).

use std::path::{Path, PathBuf};

use spinfer_engine::Engine;
use spinfer_engine::config::Config;
use spinfer_engine::convert::{OutDType, gguf_to_safetensors};
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::loader::Loader;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::safetensors::{SafetensorsModel, canonical_to_hf};
use spinfer_kernels::GgmlType;
use spinfer_registry::{KeyPair, sha256_file, sign_pack};
use spinfer_tests::{built_pack_libs, profile_dir, smollm2};

/// Writes `data` (f32, C order, `shape` outermost first) as a `.npy` file.
fn write_npy(path: &Path, shape: &[usize], data: &[u8]) {
    let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
    let tuple = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {tuple}, }}").into_bytes();
    let total = (10 + header.len() + 1).next_multiple_of(64);
    header.resize(total - 10 - 1, b' ');
    header.push(b'\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header);
    out.extend_from_slice(data);
    std::fs::write(path, out).unwrap();
}

/// The safetensors export at `st` rewritten as a directory of `.npy`
/// tensors named by their Hugging Face names, with its `config.json` and
/// `tokenizer.json`.
fn npy_dir(st: &Path, out: &Path) {
    std::fs::create_dir_all(out).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(st.join(f), out.join(f)).unwrap();
    }
    let model = SafetensorsModel::open(st).unwrap();
    for name in model.tensor_names() {
        let t = model.tensor(&name).unwrap();
        assert_eq!(t.ty, GgmlType::F32, "{name}");
        let hf = canonical_to_hf(&name).unwrap_or(name.clone());
        let shape: Vec<usize> = t.dims.iter().rev().copied().collect();
        write_npy(&out.join(format!("{hf}.npy")), &shape, t.data.bytes());
    }
}

/// A signed pack directory around the loader-npy library; `loaders` is its
/// manifest's `[[loaders]]` list.
fn loader_pack(root: &Path, key: &KeyPair, version: &str, loaders: &[&str]) -> PathBuf {
    let dir = root.join("loader-npy");
    std::fs::create_dir_all(&dir).unwrap();
    let lib = built_pack_libs().join("libspinfer_pack_loader_npy.so");
    std::fs::copy(&lib, dir.join("libloader_npy.so")).unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    let entries: String = loaders.iter().map(|l| format!("[[loaders]]\nname = \"{l}\"\n")).collect();
    let manifest = format!(
        "name = \"loader-npy\"\nversion = \"{version}\"\nabi_version = 1\nkind = \"native\"\n\
         min_host_version = \"0.1.0\"\n\n[artefact]\nfile = \"libloader_npy.so\"\nsha256 = \"{}\"\n\n{entries}",
        sha256_file(&dir.join("libloader_npy.so")).unwrap()
    );
    std::fs::write(dir.join("pack.toml"), manifest).unwrap();
    sign_pack(&dir, key).unwrap();
    dir
}

fn config(model: &Path, packs: &Path, state: &Path, key: &KeyPair, precision: &str) -> Config {
    let text = format!(
        "[model]\npath = \"{}\"\nprecision = \"{precision}\"\nctx = 64\nthreads = 2\n\
         [packs]\ndirs = [\"{}\"]\ntrusted_keys = [\"{}\"]\ninstall_record = \"{}\"\ninstall_witness = \"{}\"\n",
        model.display(),
        packs.display(),
        key.public_key(),
        state.join("installed.toml").display(),
        state.join("installed.sum").display(),
    );
    Config::parse(&text, Path::new("spinfer.toml")).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

fn last_logits(e: &Engine, prompt: &str) -> Vec<f32> {
    let ids = e.tokenize(prompt).unwrap();
    let mut s = e.new_session();
    e.model.forward_last(&mut s, &ids).unwrap().to_vec()
}

#[test]
fn a_loader_pack_opens_a_format_the_host_does_not_know() {
    let Some(gguf) = smollm2() else { return };
    // The exports are 540 MB each: under the target directory, not /tmp.
    let scratch = tempfile::tempdir_in(profile_dir()).unwrap();
    let (st, npy) = (scratch.path().join("st"), scratch.path().join("npy"));
    gguf_to_safetensors(&GgufFile::open(&gguf).unwrap(), &st, OutDType::F32, &mut |_, _| {}).unwrap();
    npy_dir(&st, &npy);

    // The host alone cannot read the directory, and says what is missing.
    let options = |precision| ModelOptions { precision, ctx: 64, threads: 2, ..ModelOptions::default() };
    let Err(e) = Engine::load(&npy, options(Precision::Precise)) else { panic!("the host has no .npy loader") };
    assert!(e.to_string().contains(&npy.display().to_string()), "{e}");

    let key = KeyPair::generate().unwrap();
    let packs = scratch.path().join("packs");
    loader_pack(&packs, &key, "1.0.0", &["npy_dir"]);
    for (precision, name) in [(Precision::Precise, "precise"), (Precision::Fast, "fast")] {
        let (through_pack, status) = Engine::from_config(&config(&npy, &packs, scratch.path(), &key, name)).unwrap();
        assert!(status.iter().all(|s| s.outcome.is_ok()), "{status:?}");
        let builtin = Engine::load(&st, options(precision)).unwrap();
        for prompt in ["The capital of France is", "def fibonacci(n):"] {
            let (want, got) = (last_logits(&builtin, prompt), last_logits(&through_pack, prompt));
            assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{name}: {prompt}");
        }
    }

    // A loader the signed manifest does not list is not used.
    std::fs::remove_dir_all(&packs).unwrap();
    loader_pack(&packs, &key, "1.0.1", &["other_loader"]);
    let Err(e) = Engine::from_config(&config(&npy, &packs, scratch.path(), &key, "precise")) else {
        panic!("a loader the manifest does not list opened the model")
    };
    assert!(e.to_string().contains(&npy.display().to_string()), "{e}");
}
