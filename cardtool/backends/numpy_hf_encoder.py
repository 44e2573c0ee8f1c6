"""The numpy reference forward of a BERT text encoder (Devlin et al. 2019) from a Hugging Face folder — the
default all-MiniLM-L6-v2 is one — as `hf-encoder` gives it: token states zero-padded to `max_length` beyond each
prompt's tokens, and the mask. The tokenizer is transformers' (torch-free); the layers are transformers' BertModel in
eval mode: post-LayerNorm blocks, attention over the prompt's tokens only."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from cardtool.backends import reference
from cardtool.backends.registry import NoCellAvailable
from cardtool.errors import BadInput, RunFailed

__all__ = ["NumpyBertEncoder"]

_math_erf = np.frompyfunc(math.erf, 1, 1)


def _erf(x):
    """The error function elementwise, by Python's math.erf (numpy has none; a closed-form approximation would
    miss float64's rounding): slow, but a prompt is encoded once."""
    return _math_erf(x).astype(x.dtype)


_ACTIVATIONS = {
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_new": reference.gelu_tanh,
    "gelu_pytorch_tanh": reference.gelu_tanh,
    "relu": lambda x: np.maximum(x, 0.0),
}


def _layer_norm(x, weight, bias, eps):
    """LayerNorm with its affine: the reference's adaLN with no modulation, then weight and bias."""
    return reference.modulated_layer_norm(x, 0.0, 0.0, eps) * weight + bias


class NumpyBertEncoder:
    """__call__(prompts) → (states (B, max_length, d), mask (B, max_length)), in `dtype` (float32 or float64)."""

    def __init__(self, folder: Path, max_length: int, dtype: str):
        config = json.loads((folder / "config.json").read_text())
        kind, act = config.get("model_type"), config.get("hidden_act", "gelu")
        position = config.get("position_embedding_type", "absolute")
        if kind != "bert" or act not in _ACTIVATIONS or position != "absolute":
            raise NoCellAvailable(f"numpy's text encoder is BERT's (absolute positions; gelu, gelu_new or relu); "
                                  f"{folder} holds {kind!r} with {act!r} and {position!r} positions")
        os.environ["HF_HUB_OFFLINE"] = "1"  # a folder on disk, never the hub
        from transformers import AutoTokenizer

        self.folder, self.max_length, self.dtype = folder, max_length, np.dtype(dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.heads, self.eps, self.act = config["num_attention_heads"], config.get("layer_norm_eps", 1e-12), act
        self.layers = config["num_hidden_layers"]
        # some files hold BertModel's tensors under `bert.` (saved from a model with a head)
        self.state = {k.removeprefix("bert."): v.astype(self.dtype) for k, v in bert_state(folder).items()}
        self.dim = self.state["embeddings.word_embeddings.weight"].shape[1]
        self.rows = self.state["embeddings.word_embeddings.weight"].shape[0]

    def _linear(self, name, x):
        return reference.linear(x, self.state[f"{name}.weight"], self.state[f"{name}.bias"])

    def _norm(self, name, x):
        return _layer_norm(x, self.state[f"{name}.weight"], self.state[f"{name}.bias"], self.eps)

    def _tokens(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        try:
            tokens = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.max_length,
                                    return_attention_mask=True, return_token_type_ids=True, return_tensors="np")
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise RunFailed(f"the text encoder's tokenizer in {self.folder} cannot encode the prompts: "
                            f"{type(e).__name__}: {str(e)[:200]}") from None
        ids, mask, types = tokens["input_ids"], tokens["attention_mask"].astype(bool), tokens["token_type_ids"]
        if ids.shape[1] != self.max_length:
            raise RunFailed(f"the text encoder's tokenizer in {self.folder} cannot fit a prompt in max_length "
                            f"{self.max_length} (it made {ids.shape[1]} tokens); raise max_length")
        if (ids >= self.rows).any():  # a token the tokenizer added past the embeddings
            token = int(ids[ids >= self.rows][0])
            raise RunFailed(f"the text encoder's tokenizer in {self.folder} gives token id {token} "
                            f"({self.tokenizer.convert_ids_to_tokens(token)!r}); the encoder's embeddings hold "
                            f"{self.rows}")
        kinds = len(self.state["embeddings.token_type_embeddings.weight"])
        if (types >= kinds).any():
            raise RunFailed(f"the text encoder's tokenizer in {self.folder} gives token type {int(types.max())}; the "
                            f"encoder's embeddings hold {kinds}")
        return ids, mask, types

    def __call__(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each prompt's token states, zero past its tokens. The layers run on the longest prompt's tokens only: the
        padding after them is attended by no query and zeroed in the output, so a prompt of 5 tokens in a 512-token
        encoder costs its 5, not 512² attention scores a layer."""
        ids, mask, types = self._tokens(prompts)
        used = max(1, int(mask.sum(axis=1).max()))
        out = np.zeros((len(ids), ids.shape[1], self.dim), self.dtype)
        out[:, :used] = self._layers(ids[:, :used], mask[:, :used], types[:, :used])
        return out, mask

    def _layers(self, ids: np.ndarray, mask: np.ndarray, types: np.ndarray) -> np.ndarray:
        s, length = self.state, ids.shape[1]
        h = s["embeddings.word_embeddings.weight"][ids] + s["embeddings.position_embeddings.weight"][:length] + \
            s["embeddings.token_type_embeddings.weight"][types]
        h = self._norm("embeddings.LayerNorm", h)
        b, head_dim = len(ids), self.dim // self.heads
        keys = mask[:, None, None, :]  # every query attends to the prompt's tokens only
        for i in range(self.layers):
            at = f"encoder.layer.{i}"
            q, k, v = (self._linear(f"{at}.attention.self.{n}", h).reshape(b, length, self.heads, head_dim)
                       .transpose(0, 2, 1, 3) for n in ("query", "key", "value"))
            context = reference.attention(q, k, v, keys).transpose(0, 2, 1, 3).reshape(b, length, self.dim)
            attended = self._linear(f"{at}.attention.output.dense", context)
            h = self._norm(f"{at}.attention.output.LayerNorm", attended + h)
            inner = _ACTIVATIONS[self.act](self._linear(f"{at}.intermediate.dense", h))
            h = self._norm(f"{at}.output.LayerNorm", self._linear(f"{at}.output.dense", inner) + h)
        return (h * mask[..., None]).astype(self.dtype)


def bert_state(folder: Path) -> dict[str, np.ndarray]:
    """The encoder's tensors from the folder's model.safetensors, as numpy float arrays (bfloat16 files too)."""
    from safetensors import safe_open

    from cardtool.paths import opened_by_utf8_name

    file = folder / "model.safetensors"
    if not file.is_file():
        raise BadInput(f"the text encoder's folder {folder} has no model.safetensors")
    with opened_by_utf8_name(file) as name:
        try:  # without torch where the file allows
            with safe_open(name, framework="numpy") as f:
                return {k: f.get_tensor(k).astype(np.float64) for k in f.keys() if not k.endswith("position_ids")}
        except (TypeError, ValueError):  # bfloat16, which numpy has not: read through torch
            with safe_open(name, framework="pt") as f:
                return {k: f.get_tensor(k).double().numpy() for k in f.keys() if not k.endswith("position_ids")}
