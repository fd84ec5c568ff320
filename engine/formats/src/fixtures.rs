//! Small model files made in memory, for tests in this and other crates
//! (feature `fixtures`; never in a release build).

/// Safetensors checkpoints: a tiny one-layer Llama and its `config.json`.
pub mod safetensors {
    use serde_json::{Value, json};

    /// (HF name, dtype, shape, bytes) -> a safetensors file.
    pub type T<'a> = (&'a str, &'a str, Vec<usize>, Vec<u8>);

    pub fn st_bytes(tensors: &[T]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut off = 0;
        for (name, dtype, shape, data) in tensors {
            header.insert(
                (*name).into(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + data.len()]}),
            );
            off += data.len();
        }
        let mut h = serde_json::to_vec(&header).unwrap();
        h.resize(h.len().next_multiple_of(8), b' ');
        let mut b = (h.len() as u64).to_le_bytes().to_vec();
        b.extend(h);
        tensors.iter().for_each(|t| b.extend_from_slice(&t.3));
        b
    }

    pub fn f32s(n: usize, seed: f32) -> Vec<u8> {
        (0..n).flat_map(|i| (seed + i as f32).to_le_bytes()).collect()
    }

    /// A one-layer model: hidden 8, 2 heads, 1 kv head, ffn 16, vocab 10.
    pub fn tiny(lm_head: bool, q_bias: bool) -> Vec<T<'static>> {
        let l = |m: &str| -> &'static str { Box::leak(format!("model.layers.0.{m}").into_boxed_str()) };
        let mut v: Vec<T> = vec![
            ("model.embed_tokens.weight", "F32", vec![10, 8], f32s(80, 0.0)),
            (l("self_attn.q_proj.weight"), "F32", vec![8, 8], f32s(64, 1.0)),
            (l("self_attn.k_proj.weight"), "F32", vec![4, 8], f32s(32, 2.0)),
            (l("self_attn.v_proj.weight"), "F32", vec![4, 8], f32s(32, 3.0)),
            (l("self_attn.o_proj.weight"), "F32", vec![8, 8], f32s(64, 4.0)),
            (l("input_layernorm.weight"), "F32", vec![8], f32s(8, 5.0)),
            (l("post_attention_layernorm.weight"), "F32", vec![8], f32s(8, 6.0)),
            (l("mlp.gate_proj.weight"), "F16", vec![16, 8], vec![0; 256]),
            (l("mlp.up_proj.weight"), "BF16", vec![16, 8], vec![0; 256]),
            (l("mlp.down_proj.weight"), "F32", vec![8, 16], f32s(128, 7.0)),
            ("model.norm.weight", "F32", vec![8], f32s(8, 8.0)),
        ];
        if lm_head {
            v.push(("lm_head.weight", "F32", vec![10, 8], f32s(80, 9.0)));
        }
        if q_bias {
            v.push((l("self_attn.q_proj.bias"), "F32", vec![8], f32s(8, 10.0)));
        }
        v
    }

    pub fn config(model_type: &str) -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": model_type, "hidden_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 16, "vocab_size": 10, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
            "max_position_embeddings": 64, "some_unknown_key": {"nested": [1, 2]}, "torch_dtype": "float32"
        })
    }

    pub fn write_dir(cfg: &Value, files: &[(&str, Vec<u8>)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), serde_json::to_vec(cfg).unwrap()).unwrap();
        for (name, bytes) in files {
            std::fs::write(dir.path().join(name), bytes).unwrap();
        }
        dir
    }
}

/// GGUF v3 files: typed metadata and tensors of any type, data aligned to
/// the default 32 bytes. Raw type ids and values are allowed, for files a
/// test wants wrong.
pub mod gguf {
    use spinfer_kernels::GgmlType;

    /// A metadata value.
    #[derive(Clone, Debug)]
    pub enum Value {
        U32(u32),
        F32(f32),
        Bool(bool),
        Str(String),
        Strs(Vec<String>),
        I32s(Vec<i32>),
        /// A value of GGUF type id `.0`, encoded as `.1`.
        Raw(u32, Vec<u8>),
    }

    /// A tensor: its name, GGML-order dims (innermost first), GGML type id
    /// and bytes.
    #[derive(Clone, Debug)]
    pub struct Tensor {
        pub name: String,
        pub dims: Vec<u64>,
        pub ty: u32,
        pub data: Vec<u8>,
    }

    impl Tensor {
        pub fn new(name: impl Into<String>, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> Self {
            Self { name: name.into(), dims: dims.to_vec(), ty: ty as u32, data }
        }

        /// An F32 tensor of `values`.
        pub fn f32(name: impl Into<String>, dims: &[u64], values: &[f32]) -> Self {
            Self::new(name, dims, GgmlType::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect())
        }

        /// An F32 tensor of zeros.
        pub fn zeros(name: impl Into<String>, dims: &[u64]) -> Self {
            let n = dims.iter().product::<u64>() as usize;
            Self::new(name, dims, GgmlType::F32, vec![0; 4 * n])
        }
    }

    fn string(b: &mut Vec<u8>, s: &str) {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    }

    fn value(b: &mut Vec<u8>, v: &Value) {
        let (ty, body): (u32, Vec<u8>) = match v {
            Value::U32(x) => (4, x.to_le_bytes().to_vec()),
            Value::F32(x) => (6, x.to_le_bytes().to_vec()),
            Value::Bool(x) => (7, vec![u8::from(*x)]),
            Value::Str(s) => {
                let mut body = Vec::new();
                string(&mut body, s);
                (8, body)
            }
            Value::Strs(xs) => {
                let mut body = [8u32.to_le_bytes().to_vec(), (xs.len() as u64).to_le_bytes().to_vec()].concat();
                xs.iter().for_each(|x| string(&mut body, x));
                (9, body)
            }
            Value::I32s(xs) => {
                let mut body = [5u32.to_le_bytes().to_vec(), (xs.len() as u64).to_le_bytes().to_vec()].concat();
                xs.iter().for_each(|x| body.extend_from_slice(&x.to_le_bytes()));
                (9, body)
            }
            Value::Raw(ty, body) => (*ty, body.clone()),
        };
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend(body);
    }

    /// The bytes of a GGUF file with `kv` and `tensors`.
    pub fn build<K: AsRef<str>>(kv: &[(K, Value)], tensors: &[Tensor]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(kv.len() as u64).to_le_bytes());
        for (k, v) in kv {
            string(&mut b, k.as_ref());
            value(&mut b, v);
        }
        let mut offset = 0u64;
        for t in tensors {
            string(&mut b, &t.name);
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| b.extend_from_slice(&d.to_le_bytes()));
            b.extend_from_slice(&t.ty.to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offset += (t.data.len() as u64).next_multiple_of(32);
        }
        for t in tensors {
            b.resize(b.len().next_multiple_of(32), 0);
            b.extend_from_slice(&t.data);
        }
        b
    }
}
