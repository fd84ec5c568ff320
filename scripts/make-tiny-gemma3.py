#!/usr/bin/env python3
"""Writes tests/data/tiny-gemma3/: a tiny random Gemma 3 text checkpoint in
Hugging Face's layout (config.json, model.safetensors, f32) and PyTorch's
logits for one token sequence at every position (reference.json), for
tests/tests/hf_gemma3.rs.

Small enough to commit (under 1 MB) and shaped to exercise what a Gemma 3
checkpoint holds: norm weights stored as w of x * (1 + w) (random, not the
zeros transformers initialises), QK-norm, pre and post norms, GeGLU, grouped
heads, local layers with their own RoPE base and a window shorter than the
sequence, and global layers. Needs torch and transformers (5.x):

  PYTHONPATH=/path/to/torch+transformers python3 scripts/make-tiny-gemma3.py
"""
import json, os
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests/data/tiny-gemma3")
torch.manual_seed(0)
cfg = Gemma3TextConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=4, max_position_embeddings=128,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0,
)
model = Gemma3ForCausalLM(cfg).to(torch.float32).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(torch.randn_like(p) * 0.3)
        else:
            p.copy_(torch.randn_like(p) * 0.08)
os.makedirs(OUT, exist_ok=True)
model.save_pretrained(OUT)
for extra in ("generation_config.json",):
    path = os.path.join(OUT, extra)
    if os.path.exists(path):
        os.remove(path)
ids = [2, 17, 301, 45, 45, 9, 488, 120, 7, 33, 260, 5]
with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0]
json.dump({"input_ids": ids, "logits": [[round(float(x), 6) for x in row] for row in logits],
           "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__}},
          open(os.path.join(OUT, "reference.json"), "w"))
print(OUT, logits.shape)
