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
    """v(x_t, t, text) in numpy; `state` maps diffusers' WanTransformer3DModel keys to arrays. With adapters
    (`numpy_adapters.py`): `lora`, a plan that adds each row's LoRA delta to a linear's output, and `control`, each
    ControlNet's rows and residuals — the torch DiT's forward, row for row."""

    def __init__(self, config: WanDiTConfig, state: dict[str, np.ndarray]):
        self.config, self.state = config, state

    def state_dict(self) -> dict[str, np.ndarray]:
        return self.state

    def _linear(self, name, x, lora=None):
        y = x @ self.state[f"{name}.weight"].T + self.state[f"{name}.bias"]
        return y if lora is None else lora(name, x, y)

    def _attention(self, name, x, context, grid, mask, lora):
        c, s = self.config, self.state
        source = x if context is None else context
        q = ops.rms_norm(self._linear(f"{name}.to_q", x, lora), s[f"{name}.norm_q.weight"], c.eps)
        k = ops.rms_norm(self._linear(f"{name}.to_k", source, lora), s[f"{name}.norm_k.weight"], c.eps)
        v = self._linear(f"{name}.to_v", source, lora)
        q, k, v = (a.reshape(a.shape[0], a.shape[1], c.heads, -1).transpose(0, 2, 1, 3) for a in (q, k, v))
        if grid is not None:
            q, k = ops.rope_3d(q, grid), ops.rope_3d(k, grid)
        out = ops.attention(q, k, v, None if mask is None else mask[:, None, None, :])
        out = out.transpose(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)
        return self._linear(f"{name}.to_out.0", out, lora)

    def block(self, i, h, context, modulation, grid, text_mask, lora=None):
        """Block i of the state: self-attention, cross-attention to the projected text, FFN, each adaLN-gated."""
        c, s, b = self.config, self.state, f"blocks.{i}"
        shift, scale, gate, c_shift, c_scale, c_gate = np.split(s[f"{b}.scale_shift_table"] + modulation, 6, 1)
        h = h + self._attention(f"{b}.attn1", ops.modulated_layer_norm(h, shift, scale, c.eps), None, grid, None,
                                lora) * gate
        normed = h if not c.cross_attn_norm else \
            ops.modulated_layer_norm(h, s[f"{b}.norm2.bias"], s[f"{b}.norm2.weight"] - 1, c.eps)
        h = h + self._attention(f"{b}.attn2", normed, context, None, text_mask, lora)
        normed = ops.modulated_layer_norm(h, c_shift, c_scale, c.eps)
        hidden = ops.gelu_tanh(self._linear(f"{b}.ffn.net.0.proj", normed, lora))
        return h + self._linear(f"{b}.ffn.net.2", hidden, lora) * c_gate

    def patchify(self, name, x):
        """Tokens (B, L, D) in (f, h, w) order: a stride = kernel Conv3d is a matmul over each (C, pt, ph, pw)
        patch."""
        batch, channels, frames, height, width = x.shape
        pt, ph, pw = self.config.patch
        patches = x.reshape(batch, channels, frames // pt, pt, height // ph, ph, width // pw, pw)
        weight = self.state[f"{name}.weight"].reshape(self.config.dim, -1)
        patches = patches.transpose(0, 2, 4, 6, 1, 3, 5, 7).reshape(batch, -1, weight.shape[1])
        return patches @ weight.T + self.state[f"{name}.bias"]

    def __call__(self, x, t, text, text_mask=None, lora=None, control=None):
        c = self.config
        text_mask = text_mask if c.text_mask else None  # Wan2.1 attends to every (zero-padded) token
        batch, _, frames, height, width = x.shape
        pt, ph, pw = c.patch
        grid = (frames // pt, height // ph, width // pw)
        h = self.patchify("patch_embedding", x)
        freq = ops.timestep_embedding(np.asarray(t, dtype=x.dtype), c.freq_dim).astype(x.dtype)
        temb = self._linear("condition_embedder.time_embedder.linear_2",
                            silu(self._linear("condition_embedder.time_embedder.linear_1", freq, lora)), lora)
        modulation = self._linear("condition_embedder.time_proj", silu(temb), lora).reshape(batch, 6, c.dim)
        context = self._linear("condition_embedder.text_embedder.linear_2", ops.gelu_tanh(
            self._linear("condition_embedder.text_embedder.linear_1", text, lora)), lora)
        residuals = [branch(h, modulation, context, grid, text_mask) for branch in control or ()]
        for i in range(c.depth):
            h = self.block(i, h, context, modulation, grid, text_mask, lora)
            for rows, outputs in residuals:
                if i < len(outputs):
                    h = h.copy()
                    h[rows] += outputs[i]
        shift, scale = np.split(self.state["scale_shift_table"] + temb[:, None], 2, 1)
        h = self._linear("proj_out", ops.modulated_layer_norm(h, shift, scale, c.eps), lora)
        h = h.reshape(batch, *grid, pt, ph, pw, -1).transpose(0, 7, 1, 4, 2, 5, 3, 6)
        return h.reshape(batch, -1, frames, height, width)
