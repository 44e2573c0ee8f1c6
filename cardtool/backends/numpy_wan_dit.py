"""The numpy reference forward of the Wan2.1 DiT: the same architecture as wan_dit.py, written with the
reference ops over a plain state dict, so one safetensors file runs in both and can be compared."""

from __future__ import annotations

import numpy as np

from cardtool.backends import reference as ops
from cardtool.backends.wan_config import WanDiTConfig

__all__ = ["NumpyWanDiT", "silu"]


def silu(x):
    return x / (1 + np.exp(-x))


class NumpyWanDiT:
    """v(x_t, t, text) in numpy; `state` maps diffusers' WanTransformer3DModel keys to arrays."""

    def __init__(self, config: WanDiTConfig, state: dict[str, np.ndarray]):
        self.config, self.state = config, state

    def _linear(self, name, x):
        return x @ self.state[f"{name}.weight"].T + self.state[f"{name}.bias"]

    def _attention(self, name, x, context, grid, mask):
        c, s = self.config, self.state
        source = x if context is None else context
        q = ops.rms_norm(self._linear(f"{name}.to_q", x), s[f"{name}.norm_q.weight"], c.eps)
        k = ops.rms_norm(self._linear(f"{name}.to_k", source), s[f"{name}.norm_k.weight"], c.eps)
        v = self._linear(f"{name}.to_v", source)
        q, k, v = (a.reshape(a.shape[0], a.shape[1], c.heads, -1).transpose(0, 2, 1, 3) for a in (q, k, v))
        if grid is not None:
            q, k = ops.rope_3d(q, grid), ops.rope_3d(k, grid)
        out = ops.attention(q, k, v, None if mask is None else mask[:, None, None, :])
        out = out.transpose(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)
        return self._linear(f"{name}.to_out.0", out)

    def __call__(self, x, t, text, text_mask=None):
        c, s = self.config, self.state
        text_mask = text_mask if c.text_mask else None  # Wan2.1 attends to every (zero-padded) token
        batch, channels, frames, height, width = x.shape
        pt, ph, pw = c.patch
        grid = (frames // pt, height // ph, width // pw)
        # patchify: a stride = kernel Conv3d is a matmul over each (C, pt, ph, pw) patch
        patches = x.reshape(batch, channels, grid[0], pt, grid[1], ph, grid[2], pw).transpose(0, 2, 4, 6, 1, 3, 5, 7)
        weight = s["patch_embedding.weight"].reshape(c.dim, -1)
        h = patches.reshape(batch, -1, weight.shape[1]) @ weight.T + s["patch_embedding.bias"]
        freq = ops.timestep_embedding(np.asarray(t, dtype=x.dtype), c.freq_dim).astype(x.dtype)
        temb = self._linear("condition_embedder.time_embedder.linear_2",
                            silu(self._linear("condition_embedder.time_embedder.linear_1", freq)))
        modulation = self._linear("condition_embedder.time_proj", silu(temb)).reshape(batch, 6, c.dim)
        context = self._linear("condition_embedder.text_embedder.linear_2",
                               ops.gelu_tanh(self._linear("condition_embedder.text_embedder.linear_1", text)))
        for i in range(c.depth):
            b = f"blocks.{i}"
            shift, scale, gate, c_shift, c_scale, c_gate = np.split(s[f"{b}.scale_shift_table"] + modulation, 6, 1)
            h = h + self._attention(f"{b}.attn1", ops.modulated_layer_norm(h, shift, scale, c.eps), None, grid,
                                    None) * gate
            normed = h if not c.cross_attn_norm else \
                ops.modulated_layer_norm(h, s[f"{b}.norm2.bias"], s[f"{b}.norm2.weight"] - 1, c.eps)
            h = h + self._attention(f"{b}.attn2", normed, context, None, text_mask)
            normed = ops.modulated_layer_norm(h, c_shift, c_scale, c.eps)
            h = h + self._linear(f"{b}.ffn.net.2", ops.gelu_tanh(self._linear(f"{b}.ffn.net.0.proj", normed))) * c_gate
        shift, scale = np.split(s["scale_shift_table"] + temb[:, None], 2, 1)
        h = self._linear("proj_out", ops.modulated_layer_norm(h, shift, scale, c.eps))
        h = h.reshape(batch, *grid, pt, ph, pw, -1).transpose(0, 7, 1, 4, 2, 5, 3, 6)
        return h.reshape(batch, -1, frames, height, width)
