"""The peer for bench/e2e.py: a plain static-cache Llama under torch.compile(mode="reduce-overhead").

gpt-fast's recipe in ~100 lines: the whole decode step is one compiled function over a static
KV cache [B, Hkv, max_len, D] per layer, attention is SDPA over the full cache with a position
mask, and torch.compile's CUDA graphs remove the launch overhead. It reads the same safetensors
checkpoint that meshserve loads (Llama layout, no rope scaling beyond llama3 factors).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F


def _inv_freq(cfg: dict, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, head_dim, 2).float() / head_dim))
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type") == "llama3":  # Llama 3.1 wavelength rule
        old, factor = rs["original_max_position_embeddings"], rs["factor"]
        low, high = old / rs["low_freq_factor"], old / rs["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
        scaled = torch.where(wavelen > low, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        inv = torch.where((wavelen >= high) & (wavelen <= low), mid, scaled)
    return inv


def _const(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t, requires_grad=False)


class StaticLlama(torch.nn.Module):
    """Decode-only Llama: `forward(tokens [B], pos int)` -> logits [B, V] float32."""

    def __init__(self, ckpt: Path, *, batch: int, max_len: int, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        from safetensors.torch import load_file

        cfg = json.loads((ckpt / "config.json").read_text())
        self.h, self.nh, self.nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd, self.eps, self.layers = self.h // self.nh, cfg["rms_norm_eps"], cfg["num_hidden_layers"]
        w: dict[str, torch.Tensor] = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            w.update({k: v.to(device, dtype) for k, v in load_file(str(f)).items()})
        # Parameters and buffers: torch.compile's CUDA graphs treat them as static (no copy per replay).
        self.embed, self.norm, self.lm_head = (_const(w[n]) for n in (
            "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"))

        def per_layer(make) -> torch.nn.ParameterList:
            return torch.nn.ParameterList(_const(make(f"model.layers.{i}.")) for i in range(self.layers))

        self.wqkv = per_layer(lambda p: torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        self.wo = per_layer(lambda p: w[p + "self_attn.o_proj.weight"])
        self.w13 = per_layer(lambda p: torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
        self.w2 = per_layer(lambda p: w[p + "mlp.down_proj.weight"])
        self.ln1 = per_layer(lambda p: w[p + "input_layernorm.weight"])
        self.ln2 = per_layer(lambda p: w[p + "post_attention_layernorm.weight"])
        w.clear()  # the concatenated copies are what the model keeps
        freqs = torch.arange(max_len).float()[:, None] * _inv_freq(cfg, self.hd)[None, :]
        self.register_buffer("cos", freqs.cos().to(device))  # [max_len, D/2]
        self.register_buffer("sin", freqs.sin().to(device))
        self.register_buffer("positions", torch.arange(max_len, device=device))
        shape = (batch, self.nkv, max_len, self.hd)
        g = torch.Generator(device).manual_seed(0)  # random context: the bytes attention reads
        self.k = per_layer(lambda p: torch.randn(shape, device=device, generator=g).to(dtype))
        self.v = per_layer(lambda p: torch.randn(shape, device=device, generator=g).to(dtype))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [B, H, 1, D]
        at = pos.view(1)  # a tensor index keeps the step free of host values (one graph for every pos)
        cos, sin = self.cos.index_select(0, at).to(x.dtype), self.sin.index_select(0, at).to(x.dtype)  # [1, D/2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        x = F.embedding(tokens, self.embed)  # [B, h]
        mask = (self.positions <= pos)[None, None, None, :]  # [1, 1, 1, max_len]
        q_size, kv_size = self.nh * self.hd, self.nkv * self.hd
        for i in range(self.layers):
            y = F.rms_norm(x, (self.h,), self.ln1[i], self.eps)
            q, k, v = (y @ self.wqkv[i].t()).split([q_size, kv_size, kv_size], dim=-1)
            q = self._rope(q.view(b, self.nh, 1, self.hd), pos)
            k = self._rope(k.view(b, self.nkv, 1, self.hd), pos)
            self.k[i].index_copy_(2, pos.view(1), k)
            self.v[i].index_copy_(2, pos.view(1), v.view(b, self.nkv, 1, self.hd))
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, enable_gqa=True)
            x = x + o.reshape(b, q_size) @ self.wo[i].t()
            y = F.rms_norm(x, (self.h,), self.ln2[i], self.eps)
            gate, up = (y @ self.w13[i].t()).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.w2[i].t()
        return (F.rms_norm(x, (self.h,), self.norm, self.eps) @ self.lm_head.t()).float()


def time_decode(ckpt: Path, *, batch: int, context: int, steps: int, device: str = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """(compile seconds, median seconds per decode step) at `context` cached tokens."""
    import statistics
    import time

    model = StaticLlama(ckpt, batch=batch, max_len=context + steps + 8, device=device, dtype=dtype)
    step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    tokens = torch.randint(3, model.embed.shape[0], (batch,), device=device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(3):  # compile, record the graph, replay
            tokens = step(tokens, torch.tensor(context + i, device=device)).argmax(-1)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        times = []
        for i in range(3, steps):
            t = time.perf_counter()
            tokens = step(tokens, torch.tensor(context + i, device=device)).argmax(-1)
            tokens.cpu()  # the sampled tokens come back to the host every step, as in a server
            times.append(time.perf_counter() - t)
    del model, step
    torch.cuda.empty_cache()
    return compile_s, statistics.median(times)
