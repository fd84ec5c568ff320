#!/usr/bin/env python3
"""Writes the seed corpora in tests/fuzz/corpus/ (committed; rerun to refresh).

Needs the models of scripts/fetch-models.sh (SmolLM2-135M-Instruct Q4_1 GGUF,
all-MiniLM-L6-v2; both Apache-2.0) and Python's `cryptography` for the one
seed with a real ed25519 signature. Deterministic: the same files every run.
"""
import base64
import hashlib
import json
import os
import random
import struct
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")
SEP = b"\n--8<--\n"
SMOL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
MINILM = os.path.join(ROOT, "models", "all-MiniLM-L6-v2")
rng = random.Random(15)


def out(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---------------------------------------------------------------- GGUF
T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64, T_I64, T_F64 = range(13)
G_F32, G_F16, G_Q4_0, G_Q4_1, G_Q8_0 = 0, 1, 2, 3, 8


def read_gguf_metadata(path):
    """(key, type, value) of every metadata entry of a GGUF file."""
    with open(path, "rb") as f:
        b = f.read(4 << 20)
    pos = 0

    def rd(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, b, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def s():
        nonlocal pos
        n = rd("<Q")
        v = b[pos:pos + n].decode("utf8")
        pos += n
        return v

    scalar = {T_U8: "<B", T_I8: "<b", T_U16: "<H", T_I16: "<h", T_U32: "<I", T_I32: "<i", T_F32: "<f",
              T_BOOL: "<?", T_U64: "<Q", T_I64: "<q", T_F64: "<d"}

    def val(t):
        if t == T_STR:
            return s()
        if t == T_ARR:
            et, n = rd("<I"), rd("<Q")
            return (et, [val(et) for _ in range(n)])
        return rd(scalar[t])

    assert b[:4] == b"GGUF"
    pos = 8
    rd("<Q")
    nkv = rd("<Q")
    out_ = []
    for _ in range(nkv):
        k = s()
        t = rd("<I")
        out_.append((k, t, val(t)))
    return out_


def gguf_value(t, v):
    if t == T_STR:
        e = v.encode()
        return struct.pack("<Q", len(e)) + e
    if t == T_ARR:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(gguf_value(et, x) for x in items)
    fmt = {T_U8: "<B", T_I8: "<b", T_U16: "<H", T_I16: "<h", T_U32: "<I", T_I32: "<i", T_F32: "<f",
           T_BOOL: "<?", T_U64: "<Q", T_I64: "<q", T_F64: "<d"}[t]
    return struct.pack(fmt, v)


def f16(x):
    return struct.pack("<e", x)


def quantize(ty, n):
    """n elements of type ty, small random values (valid scales)."""
    if ty == G_F32:
        return b"".join(struct.pack("<f", rng.uniform(-0.1, 0.1)) for _ in range(n))
    if ty == G_F16:
        return b"".join(f16(rng.uniform(-0.1, 0.1)) for _ in range(n))
    blocks = n // 32
    if ty == G_Q4_0:
        return b"".join(f16(0.01) + bytes(rng.randrange(256) for _ in range(16)) for _ in range(blocks))
    if ty == G_Q4_1:
        return b"".join(f16(0.01) + f16(-0.08) + bytes(rng.randrange(256) for _ in range(16)) for _ in range(blocks))
    if ty == G_Q8_0:
        return b"".join(f16(0.001) + bytes(rng.randrange(256) for _ in range(32)) for _ in range(blocks))
    raise ValueError(ty)


def gguf(metadata, tensors, align=32):
    """A GGUF v3 file: metadata [(key, type, value)], tensors [(name, dims, type, data)]."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for k, t, v in metadata:
        head += gguf_value(T_STR, k) + struct.pack("<I", t) + gguf_value(t, v)
    data = b""
    infos = b""
    for name, dims, ty, blob in tensors:
        data += b"\0" * (-len(data) % align)
        infos += gguf_value(T_STR, name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", ty, len(data))
        data += blob
    body = head + infos
    body += b"\0" * (-len(body) % align)
    return body + data


def llama_tensors(dim, n_heads, n_kv, ffn, vocab, layers, wty, tied=True, bias=False):
    hd = dim // n_heads
    t = [("token_embd.weight", [dim, vocab], wty, quantize(wty, dim * vocab))]
    for l in range(layers):
        p = f"blk.{l}."
        t += [
            (p + "attn_norm.weight", [dim], G_F32, struct.pack("<f", 1.0) * dim),
            (p + "attn_q.weight", [dim, n_heads * hd], wty, quantize(wty, dim * n_heads * hd)),
            (p + "attn_k.weight", [dim, n_kv * hd], wty, quantize(wty, dim * n_kv * hd)),
            (p + "attn_v.weight", [dim, n_kv * hd], wty, quantize(wty, dim * n_kv * hd)),
            (p + "attn_output.weight", [n_heads * hd, dim], wty, quantize(wty, dim * n_heads * hd)),
            (p + "ffn_norm.weight", [dim], G_F32, struct.pack("<f", 1.0) * dim),
            (p + "ffn_gate.weight", [dim, ffn], wty, quantize(wty, dim * ffn)),
            (p + "ffn_up.weight", [dim, ffn], wty, quantize(wty, dim * ffn)),
            (p + "ffn_down.weight", [ffn, dim], wty, quantize(wty, dim * ffn)),
        ]
        if bias:
            t += [
                (p + "attn_q.bias", [n_heads * hd], G_F32, quantize(G_F32, n_heads * hd)),
                (p + "attn_k.bias", [n_kv * hd], G_F32, quantize(G_F32, n_kv * hd)),
                (p + "attn_v.bias", [n_kv * hd], G_F32, quantize(G_F32, n_kv * hd)),
            ]
    t.append(("output_norm.weight", [dim], G_F32, struct.pack("<f", 1.0) * dim))
    if not tied:
        t.append(("output.weight", [dim, vocab], wty, quantize(wty, dim * vocab)))
    return t


def smol_vocab(n):
    """SmolLM2's first n tokens, their types, and the merges among them."""
    md = {k: v for k, _, v in read_gguf_metadata(SMOL)}
    tokens = md["tokenizer.ggml.tokens"][1][:n]
    types = md["tokenizer.ggml.token_type"][1][:n]
    have = set(tokens)
    merges = []
    for m in md["tokenizer.ggml.merges"][1]:
        a, b = m.split(" ", 1)
        if a in have and b in have and a + b in have:
            merges.append(m)
    return md, tokens, types, merges


def gguf_seeds():
    with open(SMOL, "rb") as f:
        out("gguf", "smollm2-head-64k.gguf", f.read(64 << 10))
    md, tokens, types, merges = smol_vocab(400)
    meta = []
    for k, t, v in read_gguf_metadata(SMOL):
        if k.startswith("tokenizer.ggml.tokens"):
            v = (T_STR, tokens)
        elif k == "tokenizer.ggml.token_type":
            v = (T_I32, types)
        elif k == "tokenizer.ggml.merges":
            v = (T_STR, merges)
        elif k == "llama.vocab_size":
            v = len(tokens)
        elif k == "llama.block_count":
            v = 2
        elif k == "llama.embedding_length":
            v = 32
        elif k == "llama.feed_forward_length":
            v = 64
        elif k == "llama.attention.head_count":
            v = 4
        elif k == "llama.attention.head_count_kv":
            v = 2
        elif k == "llama.rope.dimension_count":
            v = 8
        elif k == "llama.context_length":
            v = 64
        meta.append((k, t, v))
    for name, wty in [("q4_1", G_Q4_1), ("q8_0", G_Q8_0), ("q4_0", G_Q4_0)]:
        out("gguf", f"smollm2-tiny-{name}.gguf", gguf(meta, llama_tensors(32, 4, 2, 64, len(tokens), 2, wty)))
    # Qwen2 with q/k/v biases, an untied f16 output, and a SentencePiece vocabulary.
    spm = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + ["\u2581the", "\u2581a", "he", "llo"]
    spm_types = [2, 3, 3] + [6] * 256 + [1] * 4
    meta = [
        ("general.architecture", T_STR, "qwen2"),
        ("qwen2.block_count", T_U32, 1),
        ("qwen2.context_length", T_U32, 32),
        ("qwen2.embedding_length", T_U32, 8),
        ("qwen2.feed_forward_length", T_U32, 16),
        ("qwen2.attention.head_count", T_U32, 2),
        ("qwen2.attention.head_count_kv", T_U32, 1),
        ("qwen2.rope.freq_base", T_F32, 1000000.0),
        ("qwen2.attention.layer_norm_rms_epsilon", T_F32, 1e-6),
        ("general.alignment", T_U32, 32),
        ("tokenizer.ggml.model", T_STR, "llama"),
        ("tokenizer.ggml.tokens", T_ARR, (T_STR, spm)),
        ("tokenizer.ggml.scores", T_ARR, (T_F32, [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0])),
        ("tokenizer.ggml.token_type", T_ARR, (T_I32, spm_types)),
        ("tokenizer.ggml.bos_token_id", T_U32, 1),
        ("tokenizer.ggml.eos_token_id", T_U32, 2),
        ("tokenizer.ggml.unknown_token_id", T_U32, 0),
        ("tokenizer.ggml.add_bos_token", T_BOOL, True),
    ]
    out("gguf", "qwen2-spm-f32.gguf", gguf(meta, llama_tensors(8, 2, 1, 16, len(spm), 1, G_F32, tied=False, bias=True)))
    out("gguf", "qwen2-spm-f16.gguf", gguf(meta, llama_tensors(8, 2, 1, 16, len(spm), 1, G_F16, tied=False, bias=True)))


# ---------------------------------------------------------------- safetensors
def safetensors(tensors, metadata=None):
    """tensors: [(name, shape, data bytes)] all F32."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    off = 0
    for name, shape, data in tensors:
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(d for _, _, d in tensors)


def f32s(n, ones=False):
    return b"".join(struct.pack("<f", 1.0 if ones else rng.uniform(-0.1, 0.1)) for _ in range(n))


def minilm_seed():
    with open(os.path.join(MINILM, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    words = ["the", "quick", "brown", "fox", "hello", "world", "##s", "##ing", ",", "!", ".", "1", "2", "3"]
    keep = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    keep += [t for t, i in sorted(vocab.items(), key=lambda x: x[1]) if 999 <= i < 1100]
    keep += [w for w in words if w in vocab and w not in keep]
    new = {t: i for i, t in enumerate(keep)}
    tok["model"]["vocab"] = new
    for a in tok.get("added_tokens", []):
        a["id"] = new[a["content"]]
    pp = tok.get("post_processor") or {}
    for name, st in (pp.get("special_tokens") or {}).items():
        st["ids"] = [new[t] for t in st["tokens"]]
    if "sep" in pp:
        pp["sep"][1] = new[pp["sep"][0]]
    if "cls" in pp:
        pp["cls"][1] = new[pp["cls"][0]]
    tok["truncation"] = None
    tok["padding"] = None
    tokenizer = json.dumps(tok, ensure_ascii=False, separators=(",", ":"))
    with open(os.path.join(MINILM, "config.json")) as f:
        cfg = json.load(f)
    V, H, I, P = len(keep), 8, 16, 16
    cfg.update(vocab_size=V, hidden_size=H, intermediate_size=I, max_position_embeddings=P,
               num_attention_heads=2, num_hidden_layers=1)
    with open(os.path.join(MINILM, "model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    sub = {384: H, 1536: I, 30522: V, 512: P}
    tensors = []
    for name, info in sorted(header.items()):
        if name == "__metadata__":
            continue
        if ".layer." in name and ".layer.0." not in name:
            continue
        shape = [sub.get(d, d) for d in info["shape"]]
        size = 1
        for d in shape:
            size *= d
        tensors.append((name, shape, f32s(size, ones="LayerNorm.weight" in name)))
    with open(os.path.join(MINILM, "modules.json")) as f:
        modules = f.read()
    with open(os.path.join(MINILM, "1_Pooling", "config.json")) as f:
        pooling = json.load(f)
    pooling["word_embedding_dimension"] = H
    parts = [json.dumps(cfg, indent=1), tokenizer, modules, json.dumps(pooling, indent=1)]
    out("safetensors", "minilm-tiny", SEP.join(p.encode() for p in parts) + SEP + safetensors(tensors))
    # Without modules.json (defaults) and with the pooling config only.
    out("safetensors", "minilm-tiny-nomodules",
        SEP.join([parts[0].encode(), parts[1].encode(), b"", parts[3].encode(), safetensors(tensors)]))


def llama_st_seed():
    md, tokens, types, merges = smol_vocab(300)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i in range(3)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": merges},
    }
    D, F, NH, NKV, V = 16, 32, 2, 1, len(tokens)
    hd = D // NH
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D, "intermediate_size": F,
           "num_hidden_layers": 1, "num_attention_heads": NH, "num_key_value_heads": NKV, "vocab_size": V,
           "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    p = "model.layers.0."
    tensors = [
        ("model.embed_tokens.weight", [V, D], f32s(V * D)),
        (p + "self_attn.q_proj.weight", [NH * hd, D], f32s(NH * hd * D)),
        (p + "self_attn.k_proj.weight", [NKV * hd, D], f32s(NKV * hd * D)),
        (p + "self_attn.v_proj.weight", [NKV * hd, D], f32s(NKV * hd * D)),
        (p + "self_attn.o_proj.weight", [D, NH * hd], f32s(NH * hd * D)),
        (p + "input_layernorm.weight", [D], f32s(D, ones=True)),
        (p + "post_attention_layernorm.weight", [D], f32s(D, ones=True)),
        (p + "mlp.gate_proj.weight", [F, D], f32s(F * D)),
        (p + "mlp.up_proj.weight", [F, D], f32s(F * D)),
        (p + "mlp.down_proj.weight", [D, F], f32s(F * D)),
        ("model.norm.weight", [D], f32s(D, ones=True)),
    ]
    parts = [json.dumps(cfg, indent=1).encode(), json.dumps(tok, ensure_ascii=False).encode(), b"", b"",
             safetensors(tensors, {"format": "pt"})]
    out("safetensors", "llama-tiny", SEP.join(parts))


# ---------------------------------------------------------------- operator TOML
def toml_seeds():
    ex = os.path.join(ROOT, "docs", "examples")
    for n in sorted(os.listdir(ex)):
        if n.endswith(".toml"):
            with open(os.path.join(ex, n), "rb") as f:
                out("operator_toml", n, f.read())
    pub = "ed25519:" + base64.b64encode(public_key_of_seed()).decode()
    out("operator_toml", "everything.toml", f"""[model]
path = "m.gguf"
precision = "precise"
ctx = 512
threads = 2

[packs]
dirs = ["packs", "/opt/spinfer/packs"]
trusted_keys = ["{pub}"]
revoked_keys = []
allow_unsigned = false
install_record = "installed.toml"
history = "history.redb"

[kernels]
exclude = ["cpu-simd"]

[kernels.pin]
"matmul/q4_1*q8_1" = "cpu-simd:avx512/q4_1*q8_1"

[sparsity]
file = "m.spinfer"
predictor = "low-rank"
ffn_budget_mb = 64.5
cache_policy = "lru"
dense_above = 0.5

[wasm]
max_memory_mb = 64
timeout_ms = 1000
fuel = 1000000
""")


# ---------------------------------------------------------------- packs
KEY_SEED = bytes([7] * 32)


def public_key_of_seed():
    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        sys.exit("make_seeds.py: needs python3-cryptography (pip install cryptography)")
    k = Ed25519PrivateKey.from_private_bytes(KEY_SEED)
    return k.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def sign(data):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    k = Ed25519PrivateKey.from_private_bytes(KEY_SEED)
    return ("ed25519:" + base64.b64encode(public_key_of_seed()).decode() + ":" +
            base64.b64encode(k.sign(data)).decode() + "\n").encode()


def manifest(name, version, kind, file, artefact, kernels):
    m = (f'name = "{name}"\nversion = "{version}"\nabi_version = 1\nkind = "{kind}"\n'
         f'min_host_version = "0.1.0"\ndescription = "fuzz seed"\nauthors = ["spinfer"]\n'
         f'[artefact]\nfile = "{file}"\nsha256 = "{hashlib.sha256(artefact).hexdigest()}"\n')
    for k in kernels:
        m += f'[[kernels]]\nname = "{k[0]}"\nop = "matmul"\nweight = "{k[1]}"\nact = "{k[2]}"\n'
    return m.encode()


def pack_seeds():
    wasm = b"\0asm\x01\0\0\0"
    m = manifest("demo", "1.2.3", "wasm", "k.wasm", wasm, [("dot_f32", "f32", "f32")])
    pub = "ed25519:" + base64.b64encode(public_key_of_seed()).decode()
    out("pack", "wasm-signed", SEP.join([m, sign(m), wasm, b""]))
    out("pack", "wasm-sign-me", SEP.join([m, b"SIGN", wasm, b""]))
    record = f'[[pack]]\nname = "demo"\nsigner = "{pub}"\nversion = "2.0.0"\n'.encode()
    out("pack", "wasm-downgrade", SEP.join([m, b"SIGN", wasm, record]))
    so = b"\x7fELF" + bytes(60)
    n = manifest("cpu-simd", "0.1.0", "native", "libcpu_simd.so", so,
                 [("avx512_q4_1", "q4_1", "q8_1"), ("avx2_q8_0", "q8_0", "q8_0")])
    out("pack", "native-unsigned", SEP.join([n, b"", so, b'[[pack]]\nname = "cpu-simd"\nsigner = "unsigned"\nversion = "0.0.9"\n']))
    out("pack", "native-badsig", SEP.join([n, sign(m), so, b""]))


# ---------------------------------------------------------------- sidecar
def sidecar(n_layers, dim, ffn, predictor, lowrank_rank=None, attn=None):
    model = {"arch": "llama", "n_layers": n_layers, "dim": dim, "ffn_dim": ffn, "vocab_size": 400,
             "fingerprint": "0123456789abcdef"}
    meta = {"format": "spinfer-sparsity", "version": "1", "predictor": predictor, "target_sparsity": "0.5",
            "model": json.dumps(model), "calibration": json.dumps({"text": "wiki.test", "byte_offset": 0, "tokens": 64})}
    if lowrank_rank is not None:
        meta["lowrank"] = json.dumps({"rank": lowrank_rank, "recall_target": 0.9, "heldout_recall": [0.9] * n_layers,
                                      "predicted_fraction": [0.5] * n_layers, "heldout_tokens": 16})
    if attn is not None:
        meta["attn_sparsity"] = str(attn)
    t = []
    for l in range(n_layers):
        t.append((f"blk.{l}.ffn_gate.threshold", [1], struct.pack("<f", 0.05)))
        t.append((f"blk.{l}.ffn.keep", [1], struct.pack("<f", float(ffn // 2))))
        t.append((f"blk.{l}.ffn_down.input_threshold", [1], struct.pack("<f", 0.01)))
        t.append((f"blk.{l}.ffn.active_freq", [ffn], b"".join(struct.pack("<f", 0.5) for _ in range(ffn))))
        if lowrank_rank is not None:
            r = lowrank_rank
            t.append((f"blk.{l}.ffn_pred.p", [r, dim], f32s(r * dim)))
            t.append((f"blk.{l}.ffn_pred.q", [ffn, r], f32s(ffn * r)))
            t.append((f"blk.{l}.ffn_pred.threshold", [1], struct.pack("<f", 0.1)))
        if attn is not None:
            t.append((f"blk.{l}.attn_output.input_threshold", [1], struct.pack("<f", 0.02)))
    return safetensors(t, meta)


def sidecar_seeds():
    out("sidecar", "gate-threshold.spinfer", sidecar(2, 8, 16, "gate-threshold"))
    out("sidecar", "low-rank-attn.spinfer", sidecar(2, 8, 16, "low-rank", lowrank_rank=2, attn=0.3))
    out("sidecar", "top-k.spinfer", sidecar(1, 4, 4, "top-k"))


# ---------------------------------------------------------------- history
def bincode_f32s(v):
    # bincode 2, standard config: varint length (< 251: one byte), then LE f32s.
    assert len(v) < 251
    return bytes([len(v)]) + b"".join(struct.pack("<f", x) for x in v)


def history_seeds():
    cfg = {"dimensions": 16, "distance_metric": "Euclidean", "storage_path": "history.redb",
           "hnsw_config": {"m": 16, "ef_construction": 100, "ef_search": 64, "max_elements": 100000},
           "quantization": None}
    rows = []
    for i, (rows_, cols, ns) in enumerate([(576, 576, 12000), (1536, 576, 30000), (576, 1536, None)]):
        rec = {"host": "x86_64-avx512", "op": "matmul", "phase": "Decode" if i < 2 else "Prefill", "wtype": "q4_1",
               "act": "q8_1", "rows": rows_, "cols": cols, "n_tokens": 1, "kernel_id": "builtin/avx512/q4_1*q8_1",
               "median_ns": ns, "rejected": None if ns else "disagreed with the reference", "date": 1764000000 + i}
        vec = [rng.random() for _ in range(16)]
        rows += [f"{1764000000 + i:010}-{i}".encode(), bincode_f32s(vec), json.dumps(rec).encode()]
    out("history", "three-records", SEP.join([json.dumps(cfg).encode()] + rows))
    out("history", "no-config", SEP.join([b""] + rows[:3]))
    out("history", "foreign-dims", SEP.join([json.dumps(dict(cfg, dimensions=4)).encode(), b"a", bincode_f32s([0.5] * 4), b"{}"]))


if __name__ == "__main__":
    gguf_seeds()
    minilm_seed()
    llama_st_seed()
    toml_seeds()
    pack_seeds()
    sidecar_seeds()
    history_seeds()
