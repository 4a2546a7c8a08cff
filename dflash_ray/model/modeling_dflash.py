"""A DFlash drafter as transformers loads it: every export ships this file (with draft_core.py, speculative.py,
layers.py and attention.py, which it imports) and its config.json maps `AutoModel` to `DFlashDraftModel`, the
way the DFlash authors' published drafters load:

    from transformers import AutoModel, AutoModelForCausalLM
    draft = AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True, dtype="auto").eval()
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype="auto").eval()
    ids = draft.spec_generate(target=target, input_ids=prompt_ids, max_new_tokens=256,
                              stop_token_ids=[tokenizer.eos_token_id], temperature=0.0)

Greedy speculative decoding (speculative.py, the code dflash-ray's own evaluation runs): the output equals the
target's plain greedy decoding. The drafter holds no embedding or head: it uses the target's, given with
`target=`. Imports only torch and transformers (nothing of dflash-ray's training package).
"""
from __future__ import annotations

import torch

from transformers import PreTrainedModel, Qwen3Config

from .draft_core import DraftCore
from .speculative import speculative_generate


class DFlashDraftModel(DraftCore, PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DrafterLayer"]

    def __init__(self, config):
        super().__init__(config)
        self._build_core(config)
        self._target_weights: dict = {}   # the target's embedding and head (a dict: not registered as parameters)
        self.post_init()

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._attached("embed")

    @property
    def head_weight(self) -> torch.Tensor:
        return self._attached("head")

    def _attached(self, name: str) -> torch.Tensor:
        if name not in self._target_weights:
            raise RuntimeError("the drafter uses its target's embedding and head: pass target= to spec_generate "
                               "(or call attach_target(target) first)")
        return self._target_weights[name]

    def attach_target(self, target) -> "DFlashDraftModel":
        """Use `target`'s input embedding and output head (its hidden width must be this drafter's)."""
        embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        if embed.shape[1] != self.config.hidden_size:
            raise ValueError(f"the target's width {embed.shape[1]} is not the drafter's {self.config.hidden_size}")
        self._target_weights = {"embed": embed.detach(), "head": head.detach()}
        return self

    def forward(self, block_ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [1, L, H] of a block [1, L] placed right after the context whose tapped target
        features (concatenated, [1, S, n_taps * H]) are given; logits: `self.logits(hidden)`."""
        cache = self.extend_context(self.new_cache(), target_hidden)
        return self.draft_hidden(cache, block_ids)

    @torch.inference_mode()
    def spec_generate(self, target, input_ids: torch.Tensor, max_new_tokens: int, stop_token_ids=None,
                      temperature: float = 0.0, return_stats: bool = False):
        """Greedy DFlash decoding of one prompt [1, n] against `target`: the ids [1, <= n + max_new_tokens]
        (with return_stats, also each cycle's acceptance length: accepted drafted tokens + 1). The arguments
        in the order of the DFlash authors' `spec_generate(target, input_ids, max_new_tokens, stop_token_ids,
        temperature)` (z-lab/dflash dflash/model.py)."""
        if temperature:
            raise ValueError("spec_generate decodes greedily (temperature 0): its output equals the target's")
        if input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate decodes one prompt at a time, got a batch of {input_ids.shape[0]}")
        self.attach_target(target)
        output, lengths = speculative_generate(self, target, input_ids, max_new_tokens, stop_token_ids)
        return (output, lengths) if return_stats else output
