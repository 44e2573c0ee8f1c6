"""Deliberately wrong kernels: parity must catch each of them."""

from cardtool.backends import torch_ops


def cfg_combine_sign_flipped(v_uncond, v_cond, scale):
    return v_uncond - torch_ops._per_sample(scale, v_cond, v_cond.dtype) * (v_cond - v_uncond)


def attention_drops_mask(q, k, v, mask=None):
    return torch_ops.attention(q, k, v)


def rms_norm_eps_1e3(x, weight=None, eps=1e-6):
    """Subtly wrong: eps 1e-3 instead of the op's, ~5e-4 relative on inputs of unit scale."""
    return torch_ops.rms_norm(x, weight, eps=1e-3)


def attention_nan_for_empty_rows(q, k, v, mask=None):
    """Right wherever a query has a key to attend to; NaN (a softmax over nothing) where it has none."""
    import torch

    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~torch.as_tensor(mask, dtype=torch.bool), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def attention_ignores_scores(q, k, v, mask=None):
    """Uniform weights over the keys, as if the scores were never computed."""
    return v.mean(dim=-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1])


def numpy_attention(q, k, v, mask=None):
    """A plugin's numpy cell that is right: the reference computed at the inputs' own precision."""
    from cardtool.backends import reference

    return reference.attention(q, k, v, mask)


def numpy_attention_drops_mask(q, k, v, mask=None):
    from cardtool.backends import reference

    return reference.attention(q, k, v)


def soft_cap_clamped(x, cap):
    """examples/plugin's op as a hard clamp: right only where |x| is far below the cap."""
    return x.clamp(-cap, cap)
