"""An export loads the way the DFlash authors' drafters load: transformers' `AutoModel.from_pretrained(dir,
trust_remote_code=True)` in a fresh process builds the drafter from the code the export ships (config.json's
`auto_map`), without dflash-ray's package, and its `spec_generate` decodes against the target: the output
equals plain greedy decoding, each cycle's acceptance length equals the reference `dflash_generate`'s, and
its draft hidden states equal the training drafter's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dflash_ray.model.drafter import DrafterConfig, build_drafter
from dflash_ray.model.export import AUTO_MAP, SHIPPED, export_drafter
from dflash_ray.model.speculative import greedy_generate
from dflash_ray.model.target import TargetFeatureExtractor, build_synthetic_target, load_embed_and_head, load_target
from helpers_model import TINY_QWEN3, reference_acceptance_lengths

pytestmark = pytest.mark.rounding

VOCAB = 300
PROMPTS = [[5, 17, 42, 8, 99, 3], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
STOP = [7]

# runs in a fresh interpreter, outside the repository: only transformers and torch, never dflash_ray
LOADER = r"""
import json, sys
import torch
from transformers import AutoModel, AutoModelForCausalLM
export, target_dir, prompts, stop = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
draft = AutoModel.from_pretrained(export, trust_remote_code=True).eval()
target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
out = {"class": type(draft).__name__, "module": type(draft).__module__,
       "dflash_ray_imported": any(m.split(".")[0] == "dflash_ray" for m in sys.modules), "runs": []}
for p in prompts:
    ids = torch.tensor([p])
    # positionally, in the DFlash authors' order: (target, input_ids, max_new_tokens, stop_token_ids, temperature)
    spec, lengths = draft.spec_generate(target, ids, 24, stop, 0.0, return_stats=True)
    greedy = target.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=stop, pad_token_id=0)
    out["runs"].append({"spec": spec[0].tolist(), "greedy": greedy[0].tolist(), "lengths": lengths})
torch.manual_seed(0)
ctx = torch.randn(1, 9, draft.config.hidden_size * len(draft.target_layer_ids))
block = torch.tensor([[11] + [draft.mask_token_id] * (draft.block_size - 1)])
out["hidden"] = draft(block, ctx).flatten().tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    tdir = build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": 6, "tie_word_embeddings": False}, VOCAB,
                                  str(root / "target"), seed=0)
    embed, head = load_embed_and_head(tdir)
    target = load_target(tdir)
    cfg = DrafterConfig(num_draft_layers=2, block_size=4, num_anchors=8, target_layer_ids=(1, 4), mask_token_id=298)
    drafter = build_drafter(cfg, target.config, embed, head, seed=0, attention_backend="sdpa")
    # a few steps on the target's own greedy continuation of the first prompt: drafts get accepted there, so
    # the acceptance lengths compared below are not all 1 (a random drafter's, which any draft code matches)
    ids = greedy_generate(target, torch.tensor([PROMPTS[0]]), 24, STOP)
    mask = torch.zeros_like(ids)
    mask[:, len(PROMPTS[0]) - 1:] = 1
    context = TargetFeatureExtractor(target, drafter.target_layer_ids)(ids)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(30):
        loss = drafter.training_loss(ids, mask, context, torch.tensor([ids.shape[1]]), g).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = export_drafter(drafter, str(root / "drafter"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(root / "modules")   # transformers copies the remote code here
    run = subprocess.run([sys.executable, "-c", LOADER, out, tdir, json.dumps(PROMPTS), json.dumps(STOP)],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return dict(dir=out, target=tdir, drafter=drafter, loaded=json.loads(run.stdout.strip().splitlines()[-1]))


def test_config_maps_automodel_to_the_shipped_code(export):
    config = json.loads(open(f"{export['dir']}/config.json").read())
    assert config["auto_map"] == AUTO_MAP == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert config["architectures"] == ["DFlashDraftModel"]
    for name in SHIPPED:
        assert os.path.isfile(f"{export['dir']}/{name}"), name


def test_automodel_builds_the_drafter_from_the_export_alone(export):
    loaded = export["loaded"]
    assert loaded["class"] == "DFlashDraftModel" and loaded["module"].startswith("transformers_modules.")
    assert loaded["module"].endswith(".modeling_dflash") and not loaded["dflash_ray_imported"]


def test_spec_generate_equals_greedy_and_the_references_acceptance(export, monkeypatch):
    runs = export["loaded"]["runs"]
    for r in runs:
        assert r["spec"] == r["greedy"]
    reference = reference_acceptance_lengths(export["dir"], export["target"], PROMPTS, 24, STOP, monkeypatch)
    assert [r["lengths"] for r in runs] == reference
    assert max(max(x) for x in reference) > 1   # drafts accepted: the lengths say something about the draft


def test_its_draft_equals_the_training_drafters(export):
    drafter = export["drafter"].eval()
    torch.manual_seed(0)
    ctx = torch.randn(1, 9, drafter.config.hidden_size * len(drafter.target_layer_ids))
    block = torch.tensor([[11] + [drafter.mask_token_id] * (drafter.block_size - 1)])
    want = drafter.draft_hidden(drafter.extend_context(drafter.new_cache(), ctx), block)
    torch.testing.assert_close(torch.tensor(export["loaded"]["hidden"]), want.flatten(), rtol=1e-5, atol=1e-6)
