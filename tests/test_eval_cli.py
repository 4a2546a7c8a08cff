"""`dflash-ray eval`: the CLI glue around dflash_ray.model.evaluate (prompt files, tokenizer, output)."""
import json
from pathlib import Path

import pytest
from helpers_data import make_tokenizer, write_jsonl
from helpers_model import reference_acceptance_lengths
from transformers import AutoTokenizer

from dflash_ray.cli import run_command


CONVERSATION = [{"role": "user", "content": "Count from 3 to 9."}, {"role": "assistant", "content": "3"}]
TEXT = "Repeat 'red blue' 3 times."
# The reference passes `past_key_values`, which transformers 5 deprecates in favour of `cache`.
pytestmark = [pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"), pytest.mark.rounding]


def _rendered(tok, messages):
    """A prompt as serving renders it: the chat template with the generation prompt, tokenized by it."""
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def _spy(monkeypatch) -> list:
    """evaluate_acceptance, recording the prompts eval gives it (the real one runs)."""
    import dflash_ray.model.evaluate as evaluate

    seen, real = [], evaluate.evaluate_acceptance

    def spy(drafter, target, prompts, *a, **k):
        seen.append(list(getattr(prompts, "items", prompts)))   # eval may wrap the list for its progress line
        return real(drafter, target, prompts, *a, **k)

    monkeypatch.setattr(evaluate, "evaluate_acceptance", spy)
    return seen


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a drafter trained for 10 steps on the target's greedy continuation of the
    conversation prompt: accepted there (and on the text prompt, which continues the same way), not on
    the input_ids prompt, so tau depends on the prompts and on how they are averaged."""
    import torch

    from dflash_ray.model.drafter import DrafterConfig, build_drafter
    from dflash_ray.model.evaluate import greedy_generate
    from dflash_ray.model.export import export_drafter
    from dflash_ray.model.target import TargetFeatureExtractor, build_synthetic_target, load_embed_and_head, load_target

    root = tmp_path_factory.mktemp("eval")
    _, tokdir = make_tokenizer(root)
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    tcfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=True)
    target_dir = build_synthetic_target(tcfg, len(tok), str(root / "target"), seed=0)
    target = load_target(target_dir)
    embed, head = load_embed_and_head(target_dir)
    drafter = build_drafter(DrafterConfig(num_draft_layers=1, block_size=4, num_anchors=8,
                                          mask_token_id=tok.mask_token_id), target.config, embed, head, seed=0)
    prompt = _rendered(tok, CONVERSATION[:1])
    ids = greedy_generate(target, torch.tensor([prompt]), 12)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, len(prompt) - 1:] = 1
    context = TargetFeatureExtractor(target, drafter.target_layer_ids)(ids)
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(10):
        out = drafter.training_loss(ids, loss_mask, context, torch.tensor([ids.shape[1]]), g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return root, tokdir, target_dir, export_drafter(drafter, str(root / "drafter"))


def test_eval_reads_conversation_and_text_prompts_and_reports_tau(pair, capsys, monkeypatch):
    """The prompts eval decodes are the chat template's rendering (turns after the last user turn dropped),
    and its tau is the reference's on those prompts (mean of per-prompt means)."""
    root, tokdir, target_dir, drafter_dir = pair
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    prompts = write_jsonl(root / "p.jsonl", [
        {"conversations": CONVERSATION}, {"prompt": TEXT}, {"input_ids": [5, 6, 7, 8]},
    ])
    seen = _spy(monkeypatch)
    rc = run_command("eval", [f"drafter={drafter_dir}", f"target={target_dir}", f"data.prompts={prompts}",
                              f"data.tokenizer={tokdir}", "eval.max_new_tokens=10", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    expected = [_rendered(tok, CONVERSATION[:1]), _rendered(tok, [{"role": "user", "content": TEXT}]), [5, 6, 7, 8]]
    assert seen == [expected]
    lengths = reference_acceptance_lengths(drafter_dir, target_dir, expected, 10, [tok.eos_token_id], monkeypatch)
    assert out["per_prompt_acceptance_lengths"] == lengths
    assert out["tau"] == pytest.approx(sum(sum(x) / len(x) for x in lengths) / len(lengths))
    # The drafter is accepted on some prompts and not others: tau is neither 1 nor the per-cycle mean.
    assert 1.5 < out["tau"] < 4.0 and out["tau"] != pytest.approx(out["tau_per_cycle"])
    assert out["num_prompts"] == 3 and out["outputs_match_greedy"] is True
    assert sum(out["acceptance_histogram"]) == out["num_cycles"]

    # the target named as everywhere else (model.target_path); target= above is eval's alias
    rc = run_command("eval", [f"drafter={drafter_dir}", f"model.target_path={target_dir}", f"data.prompts={prompts}",
                              f"data.tokenizer={tokdir}", "eval.max_new_tokens=6", "eval.max_prompts=1"])
    text = capsys.readouterr().out
    assert rc == 0 and "1 prompts" in text and "output equals plain greedy decoding     : yes" in text
    [first] = reference_acceptance_lengths(drafter_dir, target_dir, expected[:1], 6, [tok.eos_token_id], monkeypatch)
    assert f"tau (mean accepted + 1 per cycle)       : {sum(first) / len(first):.3f}" in text


def test_eval_bad_inputs_exit_2_with_one_line(pair, tmp_path, capsys):
    root, tokdir, target_dir, drafter_dir = pair
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [1, 2]}, "{not json"])
    rc = run_command("eval", [f"drafter={drafter_dir}", f"target={target_dir}", f"data.prompts={bad}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "bad.jsonl: line 2: malformed JSON" in err[0]
    rc = run_command("eval", [f"drafter={tmp_path}", f"target={target_dir}", f"data.prompts={bad}"])
    assert rc == 2 and "no config.json" in capsys.readouterr().err
    rc = run_command("eval", [f"target={target_dir}", f"data.prompts={bad}"])
    assert rc == 2 and "config key 'drafter' must be set" in capsys.readouterr().err
    rc = run_command("eval", [f"drafter={drafter_dir}", f"data.prompts={bad}"])
    assert rc == 2 and "config key 'model.target_path' must be set" in capsys.readouterr().err


@pytest.mark.parametrize("row,expect", [
    ({"input_ids": []}, "prompt 1: needs 1+ token ids"),
    ({"input_ids": [1, 10**6]}, "prompt 1: needs 1+ token ids"),
    ({"input_ids": ["a"]}, "line 1: input_ids must be a list of integers"),
    ({"text": "hi"}, "line 1: expected 'conversations', 'messages', 'prompt' or 'input_ids'"),
    ({"conversations": [{"from": "alien", "value": "hi"}]}, "line 1: message 0: unknown role 'alien'"),
])
def test_eval_rejects_bad_prompts(pair, tmp_path, capsys, row, expect):
    root, tokdir, target_dir, drafter_dir = pair
    bad = write_jsonl(tmp_path / "p.jsonl", [row])
    rc = run_command("eval", [f"drafter={drafter_dir}", f"target={target_dir}", f"data.prompts={bad}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and expect in err[0], err


def test_eval_renders_prompts_as_prepare_does_template_arguments_tools_and_system(pair, tmp_path, capsys,
                                                                                  monkeypatch):
    """data.chat_template_kwargs, the row's tools and ShareGPT's system prompt reach the prompt (expected text
    written by hand from test_data_supervision's Qwen3-style template)."""
    from test_data_supervision import QWEN3_STYLE

    root, tokdir, target_dir, drafter_dir = pair
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    tok.chat_template = QWEN3_STYLE
    tok.save_pretrained(str(tmp_path / "tok"))
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"system": "Be brief.", "tools": [tool], "conversations": [
        {"from": "human", "value": "Count from 3 to 9."}, {"from": "gpt", "value": "3"}]}])
    seen = _spy(monkeypatch)
    rc = run_command("eval", [f"drafter={drafter_dir}", f"target={target_dir}", f"data.prompts={prompts}",
                              f"data.tokenizer={tmp_path / 'tok'}", "eval.max_new_tokens=4",
                              "data.chat_template_kwargs={enable_thinking: false}", "--json"])
    capsys.readouterr()
    text = ('<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n{"type": "function", "function": {"name": "add", '
            '"parameters": {"type": "object"}}}\n</tools><|im_end|>\n<|im_start|>user\nCount from 3 to 9.<|im_end|>\n'
            '<|im_start|>assistant\n<think>\n\n</think>\n\n')
    assert rc == 0 and seen == [[tok(text, add_special_tokens=False)["input_ids"]]]


def test_eval_rejects_a_drafter_of_another_target(pair, tmp_path, capsys):
    root, tokdir, target_dir, drafter_dir = pair
    other = tmp_path / "drafter"
    other.mkdir()
    cfg = json.loads((Path(drafter_dir) / "config.json").read_text())
    cfg["hidden_size"] = 64
    (other / "config.json").write_text(json.dumps(cfg))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": [1, 2]}])
    rc = run_command("eval", [f"drafter={other}", f"target={target_dir}", f"data.prompts={prompts}"])
    assert rc == 2 and "drafter hidden_size 64 does not fit target" in capsys.readouterr().err
