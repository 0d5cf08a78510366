"""GPU check: a random model of Qwen2.5-1.5B's shape in bf16 on CUDA; ms per forward of k tokens after a
500-token context, padded (bit-exact, width 9) and not, and whether row t of a k-token forward equals a
1-token forward (torch.equal) without padding. Prints one JSON line per setting."""
import json
import sys
import time

import torch

sys.path.insert(0, "src")  # run from the repository root: python3 docs/gpu/2026-12-04-h200/cuda_timing.py
from specdecode.models.config import ModelConfig  # noqa: E402
from specdecode.models.decoder import Transformer  # noqa: E402

cfg = ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                  num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1e6, max_position_embeddings=4096,
                  tie_word_embeddings=True, attention_bias=True)
g = torch.Generator(device="cuda").manual_seed(0)


def rnd(*shape):
    return (torch.randn(*shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16)


D, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
sd = {"model.embed_tokens.weight": rnd(cfg.vocab_size, D), "model.norm.weight": 1 + rnd(D)}
for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    sd |= {p + "self_attn.q_proj.weight": rnd(12 * hd, D), p + "self_attn.k_proj.weight": rnd(2 * hd, D),
           p + "self_attn.v_proj.weight": rnd(2 * hd, D), p + "self_attn.q_proj.bias": rnd(12 * hd),
           p + "self_attn.k_proj.bias": rnd(2 * hd), p + "self_attn.v_proj.bias": rnd(2 * hd),
           p + "self_attn.o_proj.weight": rnd(D, 12 * hd), p + "mlp.gate_proj.weight": rnd(I, D),
           p + "mlp.up_proj.weight": rnd(I, D), p + "mlp.down_proj.weight": rnd(D, I),
           p + "input_layernorm.weight": 1 + rnd(D), p + "post_attention_layernorm.weight": 1 + rnd(D)}
print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
ctx = torch.randint(0, cfg.vocab_size, (1, 500))
new = torch.randint(0, cfg.vocab_size, (1, 16))
for width in (None, 9):
    model = Transformer.from_state_dict(cfg, dict(sd), dtype=torch.bfloat16, device="cuda", decode_width=width)
    cache = model.new_cache(1, 1024)
    model(ctx, torch.tensor([0]), cache, num_logits=0)
    out = {"decode_width": width, "ms_by_k": {}, "row_equal_to_1_token": {}}
    one = [model(new[:, t:t + 1], torch.tensor([500 + t]), cache)[0, 0] for t in range(16)]  # token t alone
    for k in (1, 2, 4, 8, 9, 16):
        if width is not None and k > width:
            continue
        for _ in range(3):
            model(new[:, :k], torch.tensor([500]), cache)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 20
        for _ in range(n):
            logits = model(new[:, :k], torch.tensor([500]), cache)
        torch.cuda.synchronize()
        out["ms_by_k"][k] = round((time.perf_counter() - t0) / n * 1000, 2)
        out["row_equal_to_1_token"][k] = all(torch.equal(logits[0, t], one[t]) for t in range(k))
    print(json.dumps(out), flush=True)
    del model, cache
    torch.cuda.empty_cache()
