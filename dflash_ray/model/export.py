"""Export a drafter as a Hugging Face directory that the reference `dflash.DFlashDraftModel.from_pretrained`
loads, and load it back here.

config.json: the drafter's Qwen3 fields, `architectures: ["DFlashDraftModel"]`, `num_target_layers`, and
`block_size` / `mask_token_id` / `target_layer_ids` both at top level and under `dflash_config` (the
reference's `_draft_value` reads the nested dict first, then the attribute); RoPE both as
`rope_parameters` (transformers 5) and `rope_theta` / `rope_scaling` (transformers 4). model.safetensors: the
trainable weights under the reference's names (layers.N.self_attn.q_proj.weight, fc.weight,
hidden_norm.weight, norm.weight, ...). The target's embedding and head are not exported: they are the target's.
`dtype` and `torch_dtype` (the name transformers 4 and older serving images read) both say the weights' dtype.
`auto_map: {"AutoModel": "modeling_dflash.DFlashDraftModel"}` and the code it names (SHIPPED: this package's own
modeling_dflash.py, draft_core.py, speculative.py, layers.py, attention.py, copied as they are): transformers'
`AutoModel.from_pretrained(dir, trust_remote_code=True)` loads the drafter with its `spec_generate`, as the DFlash
authors' published drafters load. The reference builds `DFlashDraftModel` itself (AutoConfig reads
`model_type: qwen3`), and SGLang and vLLM map `architectures: ["DFlashDraftModel"]` to their own classes
(docs/serving.md: which fields each reads).

README.md: the model card people publish (`write_model_card`): front matter the hub reads (`library_name`,
`base_model` = the target's hub id, `tags`), then the target, tapped layers, block size, MASK id, data, steps,
held-out tau and the SGLang / vLLM / reference commands that serve it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from transformers import Qwen3Config

from ..atomic import atomic_dir
from ..run_layout import EXPORT_CARD as CARD_NAME
from ..run_layout import EXPORT_CODE as SHIPPED
from ..run_layout import EXPORT_WEIGHTS as WEIGHTS_NAME
from .drafter import DFlashDrafter

AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def export_drafter(drafter: DFlashDrafter, out_dir: str, dtype: torch.dtype | None = None,
                   card: dict | None = None) -> str:
    """Write config.json + model.safetensors + README.md (the model card) to out_dir (replacing it whole);
    dtype None keeps the parameters' dtype. `card`: the run's facts for the model card (CARD_FIELDS: target,
    data, steps, heldout_tau, ...; see write_model_card); None writes a card with what the drafter knows."""
    drafter = getattr(drafter, "module", drafter)  # unwrap DDP
    with atomic_dir(out_dir) as tmp:  # complete or absent; no stale files from an earlier export
        _write_export(drafter, tmp, dtype)
        write_model_card(tmp, card, draft_path=str(Path(out_dir).resolve()))
    return out_dir


def _write_export(drafter: DFlashDrafter, out_dir, dtype) -> None:
    from safetensors.torch import save_file

    state = {
        name: (t.detach().to(dtype) if dtype is not None else t.detach()).cpu().contiguous()
        for name, t in drafter.state_dict().items()
    }
    save_file(state, str(Path(out_dir) / WEIGHTS_NAME), metadata={"format": "pt"})

    config = drafter.config.to_dict()
    config.update(
        architectures=["DFlashDraftModel"],
        block_size=drafter.block_size,
        mask_token_id=drafter.mask_token_id,
        target_layer_ids=list(drafter.target_layer_ids),
        num_target_layers=drafter.num_target_layers,
        dflash_config={"block_size": drafter.block_size, "mask_token_id": drafter.mask_token_id,
                       "target_layer_ids": list(drafter.target_layer_ids)},
        dtype=str(next(iter(state.values())).dtype).replace("torch.", ""),
        auto_map=dict(AUTO_MAP),
    )
    config["torch_dtype"] = config["dtype"]  # transformers 4 (and serving images built on it) read this name
    # transformers 5 writes RoPE only as `rope_parameters`; a loader on transformers 4 (a serving image)
    # reads `rope_theta` / `rope_scaling` and would silently fall back to theta 10000. Write both; 5 reads
    # rope_parameters first.
    rope = dict(config.get("rope_parameters") or {})
    if rope:
        config["rope_theta"] = rope.pop("rope_theta", None)
        config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    with open(Path(out_dir) / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    for name in SHIPPED:
        shutil.copyfile(Path(__file__).with_name(name), Path(out_dir) / name)
    # readable by the serving engine's user too (safetensors writes 0600)
    os.chmod(out_dir, 0o755)
    for name in (WEIGHTS_NAME, "config.json", *SHIPPED):
        os.chmod(Path(out_dir) / name, 0o644)


# ----------------------------------------------------------------------------- the model card
# the run's facts a card may say (all optional): the target (a path or hub id) and its hub id when the path
# does not show it, the training data (text), optimizer steps, tokens, epochs, the held-out tau (a number, or
# the summary's {"initial": {"tau", "prompts"}, "trained": {...}}), a license id, and the hub repo the
# export is published as (the serve commands then name it instead of the export directory)
CARD_FIELDS = ("target", "base_model", "data", "steps", "tokens", "epochs", "heldout_tau", "license", "repo_id")
CARD_TAGS = ["dflash", "speculative-decoding", "block-diffusion", "draft-model", "dflash-ray"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")


def target_hub_id(target: str | None) -> str | None:
    """The hub id of a target given as a hub id or as its snapshot in the Hugging Face cache (what a hub id
    resolves to: .../models--Qwen--Qwen3-8B/snapshots/<sha>); None for any other path."""
    if not target:
        return None
    target = str(target)
    m = _CACHE_SNAPSHOT.search(target)
    if m:
        return f"{m.group(1)}/{m.group(2)}"
    if _HUB_ID.match(target) and not os.path.exists(target) and "://" not in target:
        return target
    return None


def _tau_text(tau) -> str:
    def one(v):
        if isinstance(v, dict):
            prompts = f" on {v['prompts']} prompts" if v.get("prompts") else ""
            return f"{float(v['tau']):.2f}{prompts}"
        return f"{float(v):.2f}"

    if isinstance(tau, dict) and "trained" in tau:
        text = one(tau["trained"])
        if tau.get("initial") is not None:
            text += f" (freshly initialised drafter: {one(tau['initial'])})"
        return text
    return one(tau)


def model_card_text(config: dict, card: dict | None = None, draft_path: str | None = None) -> str:
    """The model card (front matter + markdown) of an export with this config.json, for the run's facts
    in `card` (CARD_FIELDS). ValueError on a key that is not one of CARD_FIELDS."""
    from huggingface_hub import ModelCardData

    # plain JSON values (a summary's numpy numbers too): the front matter is YAML
    card = json.loads(json.dumps(dict(card or {}), default=lambda o: o.item() if hasattr(o, "item") else str(o)))
    unknown = sorted(set(card) - set(CARD_FIELDS))
    if unknown:
        raise ValueError(f"model card: unknown fields {unknown} (known: {', '.join(CARD_FIELDS)})")
    target = card.get("target")
    base_model = card.get("base_model") or target_hub_id(target)
    block, mask = _field(config, "block_size"), _field(config, "mask_token_id")
    taps = _field(config, "target_layer_ids")
    draft = card.get("repo_id") or draft_path or "<the export directory>"
    serve_target = base_model or target or "<the target>"
    missing = "not recorded"
    # the front matter: what the hub reads, and the run's facts as given (read back by read_card_facts)
    meta = ModelCardData(library_name="dflash", base_model=base_model, tags=list(CARD_TAGS),
                         license=card.get("license"), dflash_ray=card or None)
    rows = [
        ("target", f"`{target}`" + (f" (hub: `{base_model}`)" if base_model and base_model != target else "")
         if target else (f"`{base_model}`" if base_model else missing)),
        ("target layers tapped", f"{', '.join(map(str, taps))} (of {config.get('num_target_layers')}; "
                                 "0-based decoder-layer outputs, concatenated)"),
        ("block size", f"{block} (the anchor token + {block - 1} MASK positions drafted in one pass)"),
        ("MASK token id", str(mask)),
        ("drafter", f"{config.get('num_hidden_layers')} Qwen3 decoder layers, hidden {config.get('hidden_size')}, "
                    f"{config.get('dtype')}; the target's embedding and LM head are shared, not included"),
        ("training data", str(card["data"]) if card.get("data") is not None else missing),
        ("training steps", (f"{card['steps']:,}" if isinstance(card.get("steps"), int) else str(card["steps"]))
         if card.get("steps") is not None else missing),
    ]
    if card.get("epochs") is not None:
        rows.append(("epochs", str(card["epochs"])))
    if card.get("tokens") is not None:
        tokens = card["tokens"]
        rows.append(("training tokens", f"{tokens:,}" if isinstance(tokens, int) else str(tokens)))
    rows.append(("held-out tau", _tau_text(card["heldout_tau"]) + " (greedy speculative decoding against the "
                 "target; tau = accepted draft tokens + 1 per target forward)"
                 if card.get("heldout_tau") is not None else missing))
    table = "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
    spec_config = json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": block - 1})
    name = (base_model or (Path(str(target)).name if target else "its target")).split("/")[-1]
    body = f"""
# DFlash drafter for {name}

A [DFlash](https://github.com/z-lab/dflash) draft model: a small block-diffusion model that drafts a whole
block of tokens in one forward pass, conditioned on hidden states of the frozen target model, for lossless
speculative decoding of the target. Trained with dflash-ray.

{table}

## Serve

SGLang (`--speculative-algorithm DFLASH`; the draft token count defaults to the block size):

```bash
python -m sglang.launch_server --model-path {serve_target} \\
    --speculative-algorithm DFLASH --speculative-draft-model-path {draft}
```

vLLM (`num_speculative_tokens` counts the MASK positions: block size - 1):

```bash
vllm serve {serve_target} --speculative-config '{spec_config}'
```

Transformers alone (the drafter's code ships with it; greedy, its output equals the target's):

```python
from transformers import AutoModel, AutoModelForCausalLM
draft = AutoModel.from_pretrained("{draft}", trust_remote_code=True, dtype="auto").eval()
target = AutoModelForCausalLM.from_pretrained("{serve_target}", dtype="auto").eval()
output_ids = draft.spec_generate(input_ids=input_ids, max_new_tokens=256, target=target,
                                 stop_token_ids=[tokenizer.eos_token_id], temperature=0.0)
```

The reference `dflash` package:

```python
from dflash.model import DFlashDraftModel
draft = DFlashDraftModel.from_pretrained("{draft}")
```

The engine flags are those of SGLang's speculative-decoding documentation (DFlash section) and of the
z-lab/dflash README's vLLM example; serving engines change quickly, so check your version's documentation.
dflash-ray's tests load this export with transformers' `AutoModel` and in the reference package; they do not
run SGLang or vLLM.
"""
    return f"---\n{meta.to_yaml()}\n---\n{body}"


def write_model_card(export_dir: str, card: dict | None = None, draft_path: str | None = None) -> str:
    """(Re)write README.md, the model card, in an export directory from its config.json and the run's
    facts (`card`, CARD_FIELDS); the serve commands name `card["repo_id"]`, else `draft_path`, else the
    directory. Written whole (temporary file, then renamed); returns its path."""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    text = model_card_text(config, card, draft_path=draft_path or str(Path(export_dir).resolve()))
    path = Path(export_dir) / CARD_NAME
    tmp = path.with_name(f".{CARD_NAME}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return str(path)


def read_card_facts(export_dir: str) -> dict:
    """The run's facts an export's model card was written with (its front matter's `dflash_ray`); {} when
    the directory has no card or the card has none."""
    from huggingface_hub import ModelCard

    path = Path(export_dir) / CARD_NAME
    if not path.is_file():
        return {}
    facts = ModelCard.load(path).data.to_dict().get("dflash_ray") or {}
    return {k: v for k, v in facts.items() if k in CARD_FIELDS}


# What must agree for an export's weights to mean the same in another drafter: the target's width and
# vocabulary, the tapped layers, the block and its MASK id (what the weights were trained on), and every
# field that sets a weight's shape.
INIT_FIELDS = ("hidden_size", "vocab_size", "target_layer_ids", "block_size", "mask_token_id", "num_hidden_layers",
               "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias")
_DFLASH_FIELDS = ("target_layer_ids", "block_size", "mask_token_id")


def _field(config, name):
    """A config field as the reference reads it (`_draft_value`: dflash_config first, then top level)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    nested = get("dflash_config") or {}
    value = nested.get(name, get(name)) if name in _DFLASH_FIELDS else get(name)
    return list(value) if isinstance(value, (list, tuple)) else value


def export_mismatch(export_dir: str, config) -> str | None:
    """Why the export in `export_dir` cannot initialise a drafter of `config` (a drafter's Qwen3Config or
    its dict), in one line; None when it can."""
    path = Path(export_dir) / "config.json"
    if not path.is_file() or not (Path(export_dir) / WEIGHTS_NAME).is_file():
        return f"{export_dir} is not an exported drafter (no config.json and {WEIGHTS_NAME})"
    exported = json.loads(path.read_text())
    diffs = [f"{k} {_field(exported, k)} != {_field(config, k)}" for k in INIT_FIELDS
             if _field(exported, k) != _field(config, k)]
    if diffs:
        return f"the export at {export_dir} does not match this run's drafter (export vs run): " + ", ".join(diffs)
    return None


def init_from_export(drafter: DFlashDrafter, export_dir: str) -> DFlashDrafter:
    """Copy an export's weights into `drafter` in place (a warm start), in the drafter's own dtype and
    device; ValueError (one line) when the export does not match the drafter (`export_mismatch`)."""
    from safetensors.torch import load_file

    reason = export_mismatch(export_dir, drafter.config)
    if reason:
        raise ValueError(reason)
    state = load_file(str(Path(export_dir) / WEIGHTS_NAME))
    missing, unexpected = set(drafter.state_dict()) - set(state), set(state) - set(drafter.state_dict())
    if missing or unexpected:
        raise ValueError(f"the export at {export_dir} has other weights than this run's drafter: missing "
                         f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
    drafter.load_state_dict(state, strict=True)  # copies into the existing parameters: dtype/device kept
    return drafter


def load_drafter(out_dir: str, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 **drafter_kwargs) -> DFlashDrafter:
    """Rebuild a DFlashDrafter from an exported directory (weights restored exactly, in their saved dtype)."""
    from safetensors.torch import load_file

    config = Qwen3Config.from_pretrained(out_dir)
    state = load_file(str(Path(out_dir) / WEIGHTS_NAME))
    drafter = DFlashDrafter(config, embed_weight, head_weight, **drafter_kwargs)
    # assign=True adopts the saved tensors as they are (dtype included); the frozen buffers are untouched.
    drafter.load_state_dict(state, strict=True, assign=True)
    return drafter.eval()
