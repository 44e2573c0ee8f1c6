"""cardtool's own registrations: every op's numpy reference, its device-generic torch implementation on
cpu and cuda, float32 variants by CPU tier, the bfloat16 variants on the avx512_bf16 CPU tier and their float32
emulations on the avx2 tier, attention in both and the bfloat16 linear on AMD's AVX-512 cores (zen4), the float32
linear on its full-width ones (zen5); and the components (keyed by the implementation name a card's `impl` gives) in
torch and, where one exists, numpy."""

from __future__ import annotations

__all__ = ["OPS", "COMPONENT_IMPLS", "register"]

OPS = ("flow_match_step", "flow_sde_step", "flow_renoise_step", "flow_dpm_step", "cfg_combine",
       "attention", "rms_norm", "modulated_layer_norm",
       "rope_3d", "timestep_embedding", "lora_bgmv", "gelu_tanh", "linear")
# the ops with bfloat16 variants on the CPU tiers: avx512_bf16 computes in bf16, avx2 emulates it in float32
BF16_OPS = ("attention", "lora_bgmv", "gelu_tanh", "linear", "modulated_layer_norm", "rms_norm")
AVX2_OPS = ("linear", "lora_bgmv")  # the float32 ops the avx2 tier computes its own way
ZEN4_OPS = ("attention", "linear")  # the ops AMD's AVX-512 cores compute their own way in bfloat16


_B = "cardtool.backends.builders"
# impl → (component kind, config schema, torch builder, numpy builder or None, what the torch builder needs)
COMPONENT_IMPLS = {
    "wan-dit": ("dit", "cardtool.backends.wan_config:WanDiTConfig", f"{_B}:wan_dit_torch", f"{_B}:wan_dit_numpy",
                ("torch",)),
    "conv-vae": ("vae", "cardtool.backends.vae_config:ConvVAEConfig", f"{_B}:conv_vae_torch", f"{_B}:conv_vae_numpy",
                 ("torch",)),
    "hf-encoder": ("text_encoder", "cardtool.backends.hf_encoder_config:HFEncoderConfig", f"{_B}:hf_encoder_torch",
                   f"{_B}:hf_encoder_numpy", ("torch", "transformers")),
    "fashion-cnn": ("classifier", "cardtool.backends.cnn_config:FashionCNNConfig", f"{_B}:fashion_cnn_torch",
                    f"{_B}:fashion_cnn_numpy", ("torch",)),
}
# what `parity --card` runs the components with a numpy forward on
COMPONENT_INPUTS = {impl: f"cardtool.backends.component_parity:{impl.replace('-', '_')}_inputs"
                    for impl in ("wan-dit", "conv-vae", "fashion-cnn", "hf-encoder")}
# the array namespace the denoise loop works in on each device: a cell of COMPONENTS, but no card component
ARRAYS = ("cardtool.backends.arrays:arrays_torch", "cardtool.backends.arrays:arrays_numpy")


def register(components, kernels) -> None:
    for impl, (kind, schema, torch_builder, numpy_builder, requires) in COMPONENT_IMPLS.items():
        for device in ("cuda", "cpu"):
            components.register(impl, device, "default", target=torch_builder, requires=requires, kind=kind,
                                schema=schema)
        if numpy_builder:
            components.register(impl, "numpy", "default", target=numpy_builder, reference=True, kind=kind,
                                schema=schema)
            components.register_inputs(impl, target=COMPONENT_INPUTS[impl])
    for device in ("cuda", "cpu"):
        components.register("arrays", device, "default", target=ARRAYS[0], requires=("torch",))
    components.register("arrays", "numpy", "default", target=ARRAYS[1], reference=True)
    for op in OPS:
        kernels.register(op, "numpy", "generic", "default", target=f"cardtool.backends.reference:{op}",
                         dtypes=("float64",), reference=True)
        kernels.register(op, "cpu", "generic", "default", target=f"cardtool.backends.torch_ops:{op}",
                         requires=("torch",))
        kernels.register(op, "cuda", "generic", "default", target=f"cardtool.backends.torch_ops:{op}",
                         requires=("torch",), dtypes=("float64", "float32", "float16", "bfloat16"))
    # float32 by CPU tier: the avx2 tier's own linear (its GELU apart from the product) and LoRA layout, the generic
    # ones again on avx512_bf16, which would otherwise inherit avx2's cells down its chain
    for op in AVX2_OPS:
        kernels.register(op, "cpu", "avx2", "default", target=f"cardtool.backends.cpu_avx2:{op}", requires=("torch",))
        kernels.register(op, "cpu", "avx512_bf16", "default", target=f"cardtool.backends.torch_ops:{op}",
                         requires=("torch",))
    for op in BF16_OPS:
        kernels.register(op, "cpu", "avx512_bf16", "bf16", target=f"cardtool.backends.cpu_bf16:{op}",
                         requires=("torch",), dtypes=("float32",))
        kernels.register(op, "cpu", "avx2", "bf16", target=f"cardtool.backends.cpu_bf16_emulated:{op}",
                         requires=("torch",), dtypes=("float32",))
    # AMD's AVX-512 cores: short attention written out, bfloat16 products through oneDNN, and float32 products too
    # where the AVX-512 units are full width (cpu_zen4.py)
    kernels.register("attention", "cpu", "zen4", "default", target="cardtool.backends.cpu_zen4:attention",
                     requires=("torch",))
    for op in ZEN4_OPS:
        kernels.register(op, "cpu", "zen4", "bf16", target=f"cardtool.backends.cpu_zen4:{op}_bf16",
                         requires=("torch",), dtypes=("float32",))
    kernels.register("linear", "cpu", "zen5", "default", target="cardtool.backends.cpu_zen4:linear",
                     requires=("torch",))
    # and LoRA's down-projection transposed: MKL, its AVX2 code on AMD's cores, is faster at it that way
    kernels.register("lora_bgmv", "cpu", "zen4", "default", target="cardtool.backends.cpu_zen4:lora_bgmv",
                     requires=("torch",))
