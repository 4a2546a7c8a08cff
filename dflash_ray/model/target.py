"""The frozen target LLM: load or build it, and capture the context features the drafter conditions on.

The drafter needs only (a) the hidden states of a few tapped layers, concatenated per token, and (b) the
target's embedding and LM head. `TargetFeatureExtractor` produces (a) exactly as the reference
`dflash.model.extract_context_feature(output.hidden_states, layer_ids)` would, but runs the decoder only up
to the last tapped layer, never the LM head, and keeps no other layer's hidden states.
`load_embed_and_head` reads (b) from the safetensors files without building the model.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from transformers.masking_utils import create_causal_mask

from dflash_ray.hf_config import text_config
from dflash_ray.sizing.memory import stage_layers  # noqa: F401  (the stages' layers)

# transformers renamed create_causal_mask's `past_key_values` to `cache` (between 5.17 and 5.24).
# Pass whichever name this version takes.
_MASK_PARAMS = inspect.signature(create_causal_mask).parameters
_NO_CACHE = {("cache" if "cache" in _MASK_PARAMS else "past_key_values"): None}

logger = logging.getLogger(__name__)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference formula (`dflash.model.build_target_layer_ids`): round(1 + i*(L-4)/(n-1)).

    36 target layers and 5 drafter layers give [1, 9, 17, 25, 33].
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def build_synthetic_target(target_config: dict, vocab_size: int, out_dir: str, seed: int = 0) -> str:
    """Build a randomly initialised causal LM from config fields and save it as a HF directory: a
    Qwen3ForCausalLM, or another architecture when the fields name its `model_type` (e.g. `llama`,
    `qwen3_moe`: tiny stand-ins of the presets' targets).

    Used for the CPU default run and the tests: nothing is downloaded. The global RNG is left untouched.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    fields = _plain(target_config or {})  # a copy: configs write into nested dicts (rope_scaling)
    fields["vocab_size"] = int(vocab_size)
    model_type = fields.pop("model_type", "qwen3")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if model_type == "qwen3":  # the default, built as it always was (same weights for the same seed)
            model = Qwen3ForCausalLM(Qwen3Config(**fields))
        else:
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _plain(value):
    """Nested mappings/sequences (OmegaConf's too) as new plain dicts/lists."""
    from collections.abc import Mapping, Sequence

    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def target_dtype(path: str) -> torch.dtype:
    """The dtype a Hugging Face checkpoint declares (`dtype`, or `torch_dtype` before transformers 5);
    float32 when it declares none."""
    config = json.loads((Path(path) / "config.json").read_text())
    config = config.get("text_config", config) if "dtype" not in config and "torch_dtype" not in config else config
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, str(name).replace("torch.", ""))


def can_load_on_device() -> bool:
    """Whether from_pretrained can read weights straight onto a device: its `device_map` needs the
    accelerate package (a dependency here, but a GPU image may lack it)."""
    from transformers.utils import is_accelerate_available

    return is_accelerate_available()


_warned_host_load = False


def _from_pretrained(model_class, path: str, device: torch.device, **kwargs):
    """model_class.from_pretrained(path, **kwargs) with its weights on `device`. With accelerate,
    device_map={"": device} reads each tensor from the safetensors files onto the device (a Qwen3-8B
    target never sits whole in host memory); without it, load on the CPU and move, saying so once."""
    global _warned_host_load
    if can_load_on_device():
        return model_class.from_pretrained(path, device_map={"": device}, **kwargs)
    if not _warned_host_load:
        _warned_host_load = True
        logger.warning("accelerate is not installed: target weights load into host memory, then move to %s "
                       "(pip install accelerate to load them straight onto the device)", device)
    return model_class.from_pretrained(path, **kwargs).to(device)


def load_target(path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Load a HF causal LM, frozen and in eval mode, onto `device` (directly: `_from_pretrained`).
    bf16 on CUDA, fp32 on the CPU unless `dtype` says otherwise."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _from_pretrained(AutoModelForCausalLM, path, device, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    return model


def load_feature_extractor(path: str, layer_ids: list[int], device: str | torch.device = "cpu",
                           dtype: torch.dtype | None = None, top_k: int = 0) -> "TargetFeatureExtractor":
    """A TargetFeatureExtractor over only what feature capture needs: the decoder (AutoModel, the causal
    LM without its head) with the embedding and layers 0..max(layer_ids). Later layers' weights and the
    LM head are checkpoint keys the model does not have: from_pretrained never reads them, into host or
    device memory. For target actors; at Qwen3-8B's shape with the default taps this skips 2 of 36 layers
    and the 0.6B-parameter head (~1.5 GB of bf16 weights).

    top_k > 0 (distillation's soft labels): every layer and the head too, for `features_and_top_k`."""
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = AutoConfig.from_pretrained(path)
    text = text_config(config)
    total = int(text.num_hidden_layers)
    keep = total if top_k else max(int(i) for i in layer_ids) + 1
    if keep < total:
        text.num_hidden_layers = keep
        if getattr(text, "layer_types", None):
            text.layer_types = list(text.layer_types)[:keep]
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the skipped layers' and the head's weights are "unused" on purpose
    try:
        model = _from_pretrained(AutoModel, path, device, config=config, dtype=dtype, attn_implementation="sdpa")
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval().requires_grad_(False)
    extract = TargetFeatureExtractor(model, layer_ids, num_target_layers=total)
    if top_k:
        _, head = load_embed_and_head(path)
        extract.with_head(head.to(device=device, dtype=dtype), top_k)
    return extract


def _decoder(target_model) -> nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) inside a *ForCausalLM."""
    inner = getattr(target_model, "model", target_model)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            raise TypeError(
                f"target {type(target_model).__name__} has no `{name}`: TargetFeatureExtractor supports "
                "Llama/Qwen-style decoders (model.embed_tokens, model.layers, model.norm, model.rotary_emb)"
            )
    return inner


class TargetFeatureExtractor(nn.Module):
    """Context features of the tapped layers, [B, S, len(layer_ids) * H], from a frozen target.

    Equal to `extract_context_feature(target(..., output_hidden_states=True).hidden_states, layer_ids)`:
    hidden_states[i + 1] is the output of decoder layer i, except that HF replaces the last entry by the
    final-normed state, so a tap on the last layer gets the final norm too.
    """

    def __init__(self, target_model, layer_ids: list[int], num_target_layers: int | None = None,
                 stages: list[tuple[int, int]] | None = None, rank: int = 0):
        super().__init__()
        self.target = target_model  # registered so .to() moves it; it stays frozen
        self.decoder = _decoder(target_model)
        self.config = self.decoder.config
        self.layer_ids = [int(i) for i in layer_ids]
        # a target loaded by load_feature_extractor holds only layers 0..max(layer_ids): the full depth
        # still decides whether a tap is on the last layer (which HF returns final-normed)
        self.num_target_layers = int(num_target_layers or len(self.decoder.layers))
        n_layers = len(self.decoder.layers)
        if not self.layer_ids or min(self.layer_ids) < 0 or max(self.layer_ids) >= n_layers:
            raise ValueError(f"target_layer_ids {self.layer_ids} out of range for a {n_layers}-layer target")
        self.last_layer = max(self.layer_ids)
        self.hidden_size = self.config.hidden_size
        # a stage of a target split over processes (load_target_stage): the layers this one runs
        self.stages = list(stages) if stages else None
        self.stage = self.stages[rank] if self.stages else (0, self.last_layer + 1)

    def with_head(self, head_weight: torch.Tensor, top_k: int) -> "TargetFeatureExtractor":
        """Run every layer and the LM head too: `features_and_top_k` then gives the next-token top-k."""
        if len(self.decoder.layers) != self.num_target_layers or self.stages:
            raise ValueError("the next-token top-k needs the whole target in one process")
        self.head_weight, self.top_k = head_weight, int(top_k)
        self.stage = (0, self.num_target_layers)
        return self

    @torch.no_grad()
    def features_and_top_k(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """(features as `forward`, top-k ids [B, S, k] int32, their probabilities [B, S, k] float32): the
        target's next-token distribution at every position, as its own forward computes it (final norm,
        head, softmax in float32)."""
        hidden = self.decoder.embed_tokens(input_ids)
        out = hidden.new_empty(input_ids.shape[0], input_ids.shape[1], len(self.layer_ids) * self.hidden_size)
        last = self.run_layers(hidden, input_ids, attention_mask, out)
        ids, probs = next_token_top_k(self.decoder.norm(last), self.head_weight, self.top_k)
        return out, ids, probs

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.decoder.embed_tokens(input_ids)
        out = hidden.new_empty(input_ids.shape[0], input_ids.shape[1], len(self.layer_ids) * self.hidden_size)
        self.run_layers(hidden, input_ids, attention_mask, out)
        return out

    @torch.no_grad()
    def run_layers(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   out: torch.Tensor) -> torch.Tensor:
        """Run this extractor's layers (all up to the last tap, or its stage's) on `hidden`, writing each
        tapped layer straight into its slice of `out` (no list of hidden states is kept); the last hidden."""
        dec = self.decoder
        batch_size, seq = input_ids.shape
        position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch_size, -1)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
            position_ids=position_ids, **_NO_CACHE,
        )
        position_embeddings = dec.rotary_emb(hidden, position_ids)
        layer_types = getattr(self.config, "layer_types", None)
        # configs without layer_types (Qwen3-MoE, Mistral) slide every layer when sliding_window is set
        # (Qwen3-MoE clears it unless use_sliding_window); the causal mask here would then be wrong
        sliding = (layer_types and "sliding_attention" in layer_types[: self.last_layer + 1]) or (
            not layer_types and getattr(self.config, "sliding_window", None) is not None)
        if sliding:
            raise NotImplementedError("sliding-window targets are not supported by TargetFeatureExtractor")
        slots = {}
        for j, layer_id in enumerate(self.layer_ids):
            slots.setdefault(layer_id, []).append(j)
        for i in range(*self.stage):  # layers after the last tapped one never run
            hidden = dec.layers[i](
                hidden, attention_mask=mask, position_embeddings=position_embeddings,
                position_ids=position_ids, use_cache=False,
            )
            if isinstance(hidden, tuple):  # older transformers return (hidden, ...)
                hidden = hidden[0]
            for j in slots.get(i, ()):
                tapped = dec.norm(hidden) if i == self.num_target_layers - 1 else hidden
                out[..., j * self.hidden_size:(j + 1) * self.hidden_size] = tapped
        return hidden


@torch.no_grad()
def next_token_top_k(hidden: torch.Tensor, head: torch.Tensor, k: int, chunk_rows: int = 1024):
    """The top-k of softmax(hidden @ head^T) per position, in row chunks (the [rows, V] logits of one chunk
    alive at a time): (ids [..., k] int32, probabilities [..., k] float32, softmax over the whole vocabulary)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids = torch.empty(flat.shape[0], k, dtype=torch.int32, device=hidden.device)
    probs = torch.empty(flat.shape[0], k, dtype=torch.float32, device=hidden.device)
    for lo in range(0, flat.shape[0], chunk_rows):
        logits = (flat[lo:lo + chunk_rows].to(head.dtype) @ head.t()).float()
        top, idx = logits.topk(k, dim=-1)
        probs[lo:lo + chunk_rows] = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        ids[lo:lo + chunk_rows] = idx.to(torch.int32)
    return ids.view(*hidden.shape[:-1], k), probs.view(*hidden.shape[:-1], k)


def _read_config(path: str) -> dict:
    with open(Path(path) / "config.json") as f:
        config = json.load(f)
    # Multimodal checkpoints keep the language model's fields under text_config.
    if "text_config" in config and "tie_word_embeddings" not in config:
        config["tie_word_embeddings"] = config["text_config"].get("tie_word_embeddings", False)
    return config


def missing_weights(path: str) -> str | None:
    """Why the target directory `path` has no weights this project can read, in one phrase (None when it
    has them): no model.safetensors nor index, or an index naming a missing file. Only file names are
    looked at (no weights read)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{index.name} is not a safetensors index (JSON with a weight_map)"
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            return f"{index.name} names {missing[0]}, which is missing" + (
                f" ({len(missing)} of {len(names)} weight files missing)" if len(missing) > 1 else "")
        return None
    if (root / "model.safetensors").is_file():
        return None
    other = sorted(p.name for p in root.glob("*.bin")) if root.is_dir() else []
    return ("no model.safetensors or model.safetensors.index.json (" +
            (f"only {other[0]}: convert the checkpoint to safetensors" if other else "config.json but no weights") + ")")


def _weight_files(path: str) -> dict[str, str]:
    """Map tensor name -> safetensors file, for single-file and sharded checkpoints."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            return {k: str(root / v) for k, v in json.load(f)["weight_map"].items()}
    single = root / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: str(single) for k in f.keys()}


def load_embed_and_head(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Read only the target's input embedding and LM head, [V, H] each, from its safetensors files.

    With `tie_word_embeddings` (or no lm_head tensor saved) the head is the embedding: the same tensor
    object is returned twice, so the drafter stores it once.
    """
    from safetensors import safe_open

    config = _read_config(path)
    files = _weight_files(path)
    embed_keys = sorted(k for k in files if k.endswith("embed_tokens.weight"))
    head_keys = sorted(k for k in files if k.endswith("lm_head.weight"))
    if not embed_keys:
        raise KeyError(f"{path}: no '*embed_tokens.weight' tensor in the checkpoint")

    def read(key):
        with safe_open(files[key], framework="pt") as f:
            return f.get_tensor(key)

    embed = read(embed_keys[0])
    tied = bool(config.get("tie_word_embeddings", False))
    if tied or not head_keys:
        return embed, embed
    return embed, read(head_keys[0])


def default_mask_token_id(vocab_size: int, tokenizer=None) -> int:
    """The block's MASK id: the tokenizer's mask token, else the first id past the tokenizer's vocabulary
    (Qwen3: 151669, an embedding row no text uses), else the last embedding row."""
    if tokenizer is not None:
        if getattr(tokenizer, "mask_token_id", None) is not None:
            return int(tokenizer.mask_token_id)
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
    return int(vocab_size) - 1


# ----------------------------------------------------------------------------- a target over k processes
def load_target_stage(path: str, layer_ids: list[int], stages: list[tuple[int, int]], rank: int,
                      device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> "TargetFeatureExtractor":
    """A TargetFeatureExtractor holding only decoder layers [start, stop) = stages[rank] (`stage_layers`)
    (and the embedding when start is 0,
    the final norm when a tap is on the target's last layer): one process's part of a target replica split
    over several (`replica_features`). The model is built on the meta device and only this stage's tensors
    are read from the safetensors files onto `device`: a 70B target's stage never sits whole anywhere."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModel

    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    start, stop = stages[rank]
    config = AutoConfig.from_pretrained(path)
    text = text_config(config)
    total = int(text.num_hidden_layers)
    keep = max(int(i) for i in layer_ids) + 1
    if stages[-1][1] != keep:
        raise ValueError(f"stages {stages} do not end at the last tapped layer's successor ({keep})")
    text.num_hidden_layers = keep
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:keep]
    with torch.device("meta"):
        model = AutoModel.from_config(config, dtype=dtype, attn_implementation="sdpa")
    mine = [f"layers.{i}." for i in range(start, stop)] + (["embed_tokens."] if start == 0 else []) + ["norm."]
    wanted = {}
    for key, file in _weight_files(path).items():
        name = key[len("model."):] if key.startswith("model.") else key
        if any(name.startswith(p) for p in mine):
            wanted.setdefault(file, []).append((key, name))
    state = {}
    for file, keys in wanted.items():
        with safe_open(file, framework="pt", device=str(device) if device.type == "cuda" else "cpu") as f:
            for key, name in keys:
                state[name] = f.get_tensor(key).to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    with torch.device(device):   # the rotary embedding's buffers are computed, not read
        model.rotary_emb = type(model.rotary_emb)(config=text)
    model.eval().requires_grad_(False)
    return TargetFeatureExtractor(model, layer_ids, num_target_layers=total, stages=stages, rank=rank)


@torch.no_grad()
def replica_features(stage: "TargetFeatureExtractor", input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     group=None) -> torch.Tensor | None:
    """The tapped-layer features of a target split over the processes of `group` (rank r holds stage r:
    `load_target_stage`), in a pipeline: every rank gets the same ids and mask, rank 0 embeds and runs its
    layers, each rank hands its last hidden state to the next (send/recv: NCCL between GPUs, gloo on CPUs),
    and every rank's tapped slices go to rank 0, which returns [B, S, taps x H] (the others None)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    b, s = input_ids.shape
    h = stage.hidden_size
    dtype = next(stage.decoder.layers[stage.stage[0]].parameters()).dtype
    if rank == 0:
        hidden = stage.decoder.embed_tokens(input_ids)
    else:
        hidden = torch.empty(b, s, h, dtype=dtype, device=input_ids.device)
        dist.recv(hidden, src=to_global(rank - 1), group=group)
    out = hidden.new_zeros(b, s, len(stage.layer_ids) * h)
    hidden = stage.run_layers(hidden, input_ids, attention_mask, out)
    if rank < size - 1:
        dist.send(hidden.contiguous(), dst=to_global(rank + 1), group=group)
    mine = [j for j, i in enumerate(stage.layer_ids) if stage.stage[0] <= i < stage.stage[1]]
    if rank != 0:
        for j in mine:
            dist.send(out[..., j * h:(j + 1) * h].contiguous(), dst=to_global(0), group=group)
        return None
    for src in range(1, size):
        lo, hi = stage.stages[src]
        for j, i in enumerate(stage.layer_ids):
            if lo <= i < hi:
                part = torch.empty(b, s, h, dtype=out.dtype, device=out.device)
                dist.recv(part, src=to_global(src), group=group)
                out[..., j * h:(j + 1) * h] = part
    return out
