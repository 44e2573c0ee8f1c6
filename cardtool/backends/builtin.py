"""cardtool's own registrations: every op's numpy reference, its device-generic torch implementation on
cpu and cuda, and the bfloat16 variants of the matmul-heavy ops on the avx512_bf16 CPU tier."""

from __future__ import annotations

__all__ = ["OPS", "register"]

OPS = ("flow_match_step", "flow_sde_step", "cfg_combine", "attention", "rms_norm", "modulated_layer_norm",
       "rope_3d", "timestep_embedding", "lora_bgmv")


def register(components, kernels) -> None:
    for op in OPS:
        kernels.register(op, "numpy", "generic", "default", target=f"cardtool.backends.reference:{op}",
                         dtypes=("float64",), reference=True)
        kernels.register(op, "cpu", "generic", "default", target=f"cardtool.backends.torch_ops:{op}",
                         requires=("torch",))
        kernels.register(op, "cuda", "generic", "default", target=f"cardtool.backends.torch_ops:{op}",
                         requires=("torch",), dtypes=("float64", "float32", "float16", "bfloat16"))
    for op in ("attention", "lora_bgmv"):
        kernels.register(op, "cpu", "avx512_bf16", "bf16", target=f"cardtool.backends.cpu_bf16:{op}",
                         requires=("torch",), dtypes=("float32",))
