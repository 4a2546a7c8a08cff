"""Held-out tau: real greedy speculative decoding of an exported drafter against the target on prompts no
run trained on (model/evaluate.py counts tau as the reference `dflash_generate` does): during training
(HeldoutEvaluations: evals.jsonl and best/), and at the end for the freshly initialised drafter and the
trained one (final_tau)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time

from dflash_ray.threads import use_threads


def heldout_prompts(run_spec, during_training: bool = False) -> tuple[list, list | None]:
    """The run's held-out prompts as token ids (the first eval.during_training_prompts of them for an evaluation
    during training), and the token ids decoding stops at (read where the prompts file is: the driver's node)."""
    from dflash_ray.data.prompts import find_tokenizer, read_prompts
    from dflash_ray.model.generation import declared_end_token_ids

    tok = find_tokenizer(run_spec.tokenizer, run_spec.target_path)
    limit = run_spec.heldout_max_prompts
    if during_training and run_spec.heldout_training_prompts is not None:
        limit = min(limit, run_spec.heldout_training_prompts)
    prompts = read_prompts(run_spec.heldout, tok, limit=limit, template_kwargs=run_spec.chat_template_kwargs)
    return prompts, declared_end_token_ids(tok, run_spec.target_path)


def heldout_tau(run_spec, drafter_dir: str, prompts: tuple | None = None, greedy: dict | None = None,
                progress: str | None = None) -> dict:
    """tau of the drafter in `drafter_dir` on the run's held-out prompts (`prompts`: heldout_prompts's
    answer when already read), and "greedy_reference", the target's plain greedy decoding of them, which a
    later call passes as `greedy` instead of decoding it again (model/evaluate.py evaluate_acceptance).
    `progress`: a name for a progress line over the prompts (None: silent, as beside training's lines)."""
    from dflash_ray.data.report import Tracked
    from dflash_ray.model.evaluate import evaluate_acceptance

    ids, stop = prompts or heldout_prompts(run_spec)
    if progress:
        ids = Tracked(ids, progress, "prompts")
    s = evaluate_acceptance(drafter_dir, run_spec.target_path, ids, run_spec.heldout_max_new_tokens,
                            stop_token_ids=stop, greedy=greedy)
    return {"tau": s["tau"], "prompts": s["num_prompts"], "new_tokens": s["new_tokens"],
            "outputs_match_greedy": s["outputs_match_greedy"], "target_time_speedup": s["target_time_speedup"],
            "acceptance_histogram": s["acceptance_histogram"], "greedy_reference": s["greedy_reference"]}


def heldout_tau_of_weights(run_spec, weights: dict, out_dir: str, greedy: dict | None = None) -> dict:
    """Export the drafter with these weights to out_dir and measure its held-out tau (a Ray task); `greedy`:
    an earlier evaluation's greedy_reference (returned here too)."""
    import torch

    from dflash_ray.model.export import export_drafter
    from dflash_ray.runtime.training.model import build_run_drafter

    use_threads(run_spec.cluster.cpu_threads, "evaluate")
    drafter = build_run_drafter(run_spec, torch.device("cpu"))
    drafter.load_state_dict(weights, strict=True)
    export_drafter(drafter, out_dir)
    r = heldout_tau(run_spec, out_dir, heldout_prompts(run_spec, during_training=True), greedy=greedy)
    return {k: r[k] for k in ("tau", "prompts", "outputs_match_greedy", "greedy_reference")}


class HeldoutEvaluations:
    """The evaluations during training, each a Ray task pinned to this node (the run directory is here;
    training does not wait for them), and the files they leave: one evals.jsonl line each, and best/, the
    drafter with the highest held-out tau so far, exported. Hosted by the run record's actor (it outlives
    trainer restarts and sits on the driver's node), which passes `on_result` to record each result in its
    gauges and trackers. A resumed run's earlier evaluations count for best/."""

    def __init__(self, files, on_result, on_failure):
        from dflash_ray.runtime.record.ledger import read_jsonl

        self.files, self.on_result, self.on_failure = files, on_result, on_failure
        self.done: list[dict] = read_jsonl(files.evals)
        self.running = 0
        self.finished = asyncio.Condition()
        self.greedy_reference: dict | None = None   # the target's greedy decoding of the prompts, decoded once

    @property
    def latest_tau(self) -> float | None:
        return self.done[-1]["tau"] if self.done else None

    async def evaluate(self, run_spec, step: int, weights) -> None:
        """Held-out tau of the drafter weights of `step` (an ObjectRef of a state dict); an evaluation that
        fails never stops the run: `on_failure` reports it."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        out = self.files.eval_work(step)
        node = ray.get_runtime_context().get_node_id()
        task = ray.remote(heldout_tau_of_weights).options(
            num_cpus=0.5, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
        self.running += 1
        try:
            result = await task.remote(run_spec, weights, str(out), self.greedy_reference)
            self.greedy_reference = result.pop("greedy_reference")
        except Exception as e:
            self.on_failure(int(step), str(e)[:500])
            return
        finally:
            self.running -= 1
            async with self.finished:
                self.finished.notify_all()
        line = {"step": int(step), "time": time.time(), **result}
        best = max((e["tau"] for e in self.done), default=float("-inf"))
        self.done.append(line)
        with open(self.files.evals, "a") as f:
            f.write(json.dumps(line) + "\n")
        if result["tau"] > best:
            _replace_dir(out, self.files.best)
        else:
            shutil.rmtree(out, ignore_errors=True)
        self.on_result(int(step), result)

    async def wait(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the running evaluations (they belong to the run's report); how many are
        still running after it."""
        async with self.finished:
            try:
                await asyncio.wait_for(self.finished.wait_for(lambda: self.running == 0), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.running


def _replace_dir(src, dst) -> None:
    """dst becomes src, whole (the old dst is moved aside first, then removed)."""
    old = dst.with_name(f".{dst.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dst.exists():
        os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def initial_and_trained_tau(run_spec, export_files: dict, prompts: tuple) -> dict:
    """Held-out tau of the drafter as the run initialised it (same seed; on the CPU the same weights as
    step 0, on a GPU run another draw of the same initialisation, as the ranks initialise on the device) and
    of the run's export (`export_files`: its files by name, measured exactly as exported). A Ray task on a
    target GPU (final_tau), where the device is the task's own."""
    import torch

    from dflash_ray.model.export import export_drafter
    from dflash_ray.runtime.training.model import build_run_drafter

    if not run_spec.cluster.use_gpu:
        use_threads(run_spec.cluster.cpu_threads, "evaluate")
    with tempfile.TemporaryDirectory(prefix="dflash-initial-") as initial, \
            tempfile.TemporaryDirectory(prefix="dflash-export-") as trained:
        export_drafter(build_run_drafter(run_spec, torch.device("cpu")), initial)
        for name, data in export_files.items():
            with open(f"{trained}/{name}", "wb") as f:
                f.write(data)
        # the target's greedy decoding once, for both drafters (it does not depend on the drafter)
        measured = heldout_tau(run_spec, trained, prompts, progress="held-out tau, trained drafter")
        greedy = measured.pop("greedy_reference")
        fresh = heldout_tau(run_spec, initial, prompts, greedy=greedy, progress="held-out tau, fresh drafter")
        fresh.pop("greedy_reference")
        return {"initial": fresh, "trained": measured, "prompts_file": run_spec.heldout}


# how long the final tau waits for the target actors' resources to be free after training (then it runs here)
RESOURCE_WAIT_S = 120.0


def final_tau(run_spec, export_dir: str, log=print, wait_s: float = RESOURCE_WAIT_S) -> dict:
    """initial_and_trained_tau as a Ray task with a target actor's resources (a target GPU share; the target
    slot on CPU machines), after training, when the target actors have let them go: the target's forwards
    run on a GPU, not on the driver. The prompts and the export travel with the task (the run directory is
    on the driver's node only); the target is read where the target actors read it. Nothing waits without a
    bound: when those resources are not free within `wait_s` (an actor pool not torn down yet, target nodes
    scaled away), the tau is measured in this process, as before the task existed, and a line says so."""
    from pathlib import Path

    import ray

    c = run_spec.cluster
    res = dict(num_gpus=c.target_gpus, num_cpus=1) if c.use_gpu else dict(num_cpus=0.5, resources={c.target_resource: 1})
    name, amount = ("GPU", c.target_gpus) if c.use_gpu else (c.target_resource, 1)
    files = {p.name: p.read_bytes() for p in Path(export_dir).iterdir() if p.is_file()}
    prompts = heldout_prompts(run_spec)
    log(f"held-out tau: {len(prompts[0])} prompts x up to {run_spec.heldout_max_new_tokens} tokens, the fresh and "
        "the trained drafter against plain greedy decoding")
    if not resource_free_within(name, amount, wait_s):
        log(f"held-out tau: no free {name} for a target-side task after {wait_s:.0f} s; measured in the driver")
        return initial_and_trained_tau(run_spec, files, prompts)
    # DEFAULT: never inside the caller's placement group (a sweep's trial runs in Ray Tune's, which holds no target slot)
    task = ray.remote(initial_and_trained_tau).options(**res, scheduling_strategy="DEFAULT")
    return ray.get(task.remote(run_spec, ray.put(files), prompts))


def resource_free_within(name: str, amount: float, wait_s: float, poll_s: float = 1.0) -> bool:
    """Whether the connected cluster has `amount` of resource `name` free within `wait_s` seconds."""
    import time

    import ray

    deadline = time.monotonic() + wait_s
    while ray.available_resources().get(name, 0) < amount:
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
