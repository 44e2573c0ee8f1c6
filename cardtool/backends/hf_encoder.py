"""`hf-encoder`: a Hugging Face encoder as a frozen text encoder, loaded strictly offline from a folder.

Output as Wan pads its umT5 states: token hidden states (B, max_length, d) zero beyond each prompt's
tokens, and the boolean mask of real tokens. The empty prompt is the null condition for CFG.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cardtool.errors import RunFailed, threads_refused

__all__ = ["HFTextEncoder"]


class HFTextEncoder:
    def __init__(self, folder: Path, max_length: int, device: str, dtype: torch.dtype):
        os.environ["HF_HUB_OFFLINE"] = "1"  # a folder on disk, never the hub
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging

        logging.disable_progress_bar()

        self.max_length, self.device = max_length, device
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        # feed-forward chunking changes memory, not values, and needs max_length to be a multiple of its chunk
        model, loading = AutoModel.from_pretrained(folder, local_files_only=True, use_safetensors=True, dtype=dtype,
                                                   chunk_size_feed_forward=0, output_loading_info=True)
        if loading["missing_keys"]:  # transformers would initialise them at random: an encoder that is not the file's
            missing = sorted(loading["missing_keys"])
            tensors = "a tensor" if len(missing) == 1 else f"{len(missing)} tensors"
            raise ValueError(f"model.safetensors lacks {tensors} of the {model.config.model_type} encoder config.json "
                             f"describes (e.g. {', '.join(missing[:3])})")
        self.model = model.to(device).eval().requires_grad_(False)
        self.dim = self.model.config.hidden_size
        self.folder, self.rows = folder, self.model.get_input_embeddings().num_embeddings
        types = getattr(getattr(self.model, "embeddings", None), "token_type_embeddings", None)
        self.types = types.num_embeddings if isinstance(types, torch.nn.Embedding) else None

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            tokens = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.max_length,
                                    return_attention_mask=True, return_tensors="pt").to(self.device)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise RunFailed(f"the text encoder's tokenizer in {self.folder} cannot encode the prompts: "
                            f"{type(e).__name__}: {str(e)[:200]}") from None
        except BaseException as e:  # its thread pool, refused a thread, panics
            refused = threads_refused(e, "encoding the prompts, ")
            if refused is None:
                raise
            raise refused from None
        if tokens["input_ids"].shape[1] != self.max_length:  # shorter than the special tokens: not truncated at all
            raise RunFailed(f"the text encoder's tokenizer in {self.folder} cannot fit a prompt in max_length "
                            f"{self.max_length} (it made {tokens['input_ids'].shape[1]} tokens); raise max_length")
        outside = tokens["input_ids"] >= self.rows  # a token the tokenizer added past the embeddings
        if outside.any():
            token = int(tokens["input_ids"][outside][0])
            raise RunFailed(f"the text encoder's tokenizer in {self.folder} gives token id {token} "
                            f"({self.tokenizer.convert_ids_to_tokens(token)!r}); the encoder's embeddings hold "
                            f"{self.rows}")
        types = tokens.get("token_type_ids")
        if self.types is not None and types is not None and bool((types >= self.types).any()):
            raise RunFailed(f"the text encoder's tokenizer in {self.folder} gives token type "
                            f"{int(types.max())}; the encoder's embeddings hold {self.types}")
        states = self.model(**tokens, return_dict=True).last_hidden_state
        mask = tokens["attention_mask"].bool()
        return states * mask[..., None].to(states.dtype), mask
