"""`dflash-ray eval drafter=DIR target=DIR data.prompts=FILE [eval.max_new_tokens=N]`: acceptance length
of an exported drafter against its target with greedy speculative decoding (dflash_ray.model.evaluate).

Also `python -m dflash_ray.eval [overrides]`.

Prompts file: jsonl, one prompt a line, as {"conversations": [...]} (turns after the last user turn are
dropped; the chat template's generation prompt is added), {"prompt": "text"} or {"input_ids": [...]}.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_ray.config import require
from dflash_ray.errors import UserError


def _tokenizer(cfg, target_dir: str):
    from dflash_ray.data.prepare import load_tokenizer

    for cand in (cfg.data.tokenizer, target_dir):
        if cand and (Path(cand) / "tokenizer.json").exists():
            return load_tokenizer(cand)
    return None


def read_prompts(path: str, tok, limit: int) -> list[list[int]]:
    src = Path(path)
    if not src.is_file():
        raise UserError(f"{src}: prompts file does not exist")
    prompts = []
    with open(src) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{src}: line {lineno}: malformed JSON ({e.msg})") from e
            if isinstance(row, dict) and isinstance(row.get("input_ids"), list):
                if not all(isinstance(x, int) for x in row["input_ids"]):
                    raise UserError(f"{src}: line {lineno}: input_ids must be a list of integers")
                prompts.append(row["input_ids"])
            elif isinstance(row, dict) and ("conversations" in row or "prompt" in row):
                if tok is None:
                    raise UserError(f"{src}: line {lineno}: text prompts need a tokenizer (data.tokenizer=DIR)")
                conv = row.get("conversations") or [{"role": "user", "content": str(row["prompt"])}]
                users = [i for i, m in enumerate(conv) if isinstance(m, dict) and m.get("role") == "user"]
                if not users:
                    raise UserError(f"{src}: line {lineno}: no user turn to prompt with")
                text = tok.apply_chat_template(conv[:users[-1] + 1], tokenize=False, add_generation_prompt=True)
                prompts.append(tok(text, add_special_tokens=False)["input_ids"])
            else:
                raise UserError(f"{src}: line {lineno}: expected 'conversations', 'prompt' or 'input_ids'")
            if len(prompts) >= limit:
                break
    if not prompts:
        raise UserError(f"{src}: no prompts")
    return prompts


def format_eval(s: dict) -> str:
    hist = " ".join(f"{k}:{v}" for k, v in enumerate(s["acceptance_histogram"]) if v)
    return "\n".join([
        f"drafter {s['drafter']} vs target {s['target']}: {s['num_prompts']} prompts, {s['new_tokens']} new tokens, block {s['block_size']}",
        f"  tau (mean accepted + 1 per cycle)       : {s['tau']:.3f}  (per cycle over all prompts: {s['tau_per_cycle']:.3f})",
        f"  acceptance lengths (length:cycles)      : {hist}",
        f"  target forwards, speculative vs greedy  : {s['target_forwards_speculative']} vs {s['target_forwards_greedy']}",
        f"  target seconds, speculative vs greedy   : {s['target_seconds_speculative']:.3f} vs {s['target_seconds_greedy']:.3f} "
        f"(x{s['target_time_speedup']:.2f}, {s['target_seconds_saved']:.3f} s saved)",
        f"  output equals plain greedy decoding     : {'yes' if s['outputs_match_greedy'] else 'NO'}",
    ])


def eval_command(cfg, args) -> int:
    from dflash_ray.model.evaluate import evaluate_acceptance

    drafter_dir, target_dir = require(cfg, "drafter"), require(cfg, "target")
    for key, d in (("drafter", drafter_dir), ("target", target_dir)):
        if not (Path(d) / "config.json").exists():
            raise UserError(f"{d}: no config.json (config key '{key}' must name a Hugging Face-format directory)")
    tcfg, dcfg = (json.loads((Path(d) / "config.json").read_text()) for d in (target_dir, drafter_dir))
    tcfg = tcfg.get("text_config", tcfg)
    for key, want in (("hidden_size", tcfg.get("hidden_size")), ("num_target_layers", tcfg.get("num_hidden_layers"))):
        if dcfg.get(key) != want:
            raise UserError(f"{drafter_dir}: drafter {key} {dcfg.get(key)} does not fit target {target_dir} ({want})")
    tok = _tokenizer(cfg, target_dir)
    prompts = read_prompts(require(cfg, "data.prompts"), tok, int(cfg.eval.max_prompts))
    vocab = int(tcfg["vocab_size"])
    for i, p in enumerate(prompts):
        if not p or min(p) < 0 or max(p) >= vocab:
            raise UserError(f"{cfg.data.prompts}: prompt {i + 1}: needs 1+ token ids in [0, {vocab}), got {p[:8]}")
    stop = [tok.eos_token_id] if tok is not None and tok.eos_token_id is not None else None
    stats = evaluate_acceptance(drafter_dir, target_dir, prompts, int(cfg.eval.max_new_tokens), stop_token_ids=stop)
    print(json.dumps(stats, indent=2) if args.json else format_eval(stats))
    if stats["outputs_match_greedy"]:
        return 0
    import torch

    if torch.cuda.is_available():
        # bf16: verifying a block and decoding one token can round differently without any bug
        print("warning: speculative output differs from plain greedy decoding (bf16 rounding?)", file=sys.stderr)
        return 0
    return 1  # fp32: the outputs must be equal; a difference is a bug



if __name__ == "__main__":
    from dflash_ray.cli import run_command

    sys.exit(run_command("eval", sys.argv[1:]))
