"""Held-out tau: real greedy speculative decoding of an exported drafter against the target on prompts no
run trained on (model/evaluate.py counts tau as the reference `dflash_generate` does), for the freshly
initialised drafter and the trained one."""
from __future__ import annotations

import tempfile


def heldout_tau(run_spec, drafter_dir: str) -> dict:
    """tau of the drafter in `drafter_dir` on the run's held-out prompts."""
    from dflash_ray.data.prompts import find_tokenizer, read_prompts
    from dflash_ray.model.evaluate import evaluate_acceptance

    tok = find_tokenizer(run_spec.tokenizer, run_spec.target_path)
    prompts = read_prompts(run_spec.heldout, tok, limit=1 << 30)
    stop = [tok.eos_token_id] if tok is not None and tok.eos_token_id is not None else None
    s = evaluate_acceptance(drafter_dir, run_spec.target_path, prompts, run_spec.heldout_max_new_tokens,
                            stop_token_ids=stop)
    return {"tau": s["tau"], "prompts": s["num_prompts"], "new_tokens": s["new_tokens"],
            "outputs_match_greedy": s["outputs_match_greedy"], "target_time_speedup": s["target_time_speedup"],
            "acceptance_histogram": s["acceptance_histogram"]}


def heldout_tau_of_weights(run_spec, weights: dict, out_dir: str) -> dict:
    """Export the drafter with these weights to out_dir and measure its held-out tau (a Ray task)."""
    import torch

    from dflash_ray.model.export import export_drafter
    from dflash_ray.runtime.training.model import build_run_drafter

    torch.set_num_threads(1)
    drafter = build_run_drafter(run_spec, torch.device("cpu"))
    drafter.load_state_dict(weights, strict=True)
    export_drafter(drafter, out_dir)
    r = heldout_tau(run_spec, out_dir)
    return {k: r[k] for k in ("tau", "prompts", "outputs_match_greedy")}


def initial_and_trained_tau(run_spec, export_dir: str) -> dict:
    """Held-out tau of the drafter as the run initialised it (same seed; on the CPU the same weights as
    step 0, on a GPU run another draw of the same initialisation, as the ranks initialise on the device) and of
    the exported one."""
    import torch

    from dflash_ray.model.export import export_drafter
    from dflash_ray.runtime.training.model import build_run_drafter

    with tempfile.TemporaryDirectory(prefix="dflash-initial-") as initial:
        export_drafter(build_run_drafter(run_spec, torch.device("cpu")), initial)
        before = heldout_tau(run_spec, initial)
    return {"initial": before, "trained": heldout_tau(run_spec, export_dir), "prompts_file": run_spec.heldout}
