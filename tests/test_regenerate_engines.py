"""`regenerate.engine=vllm | sglang`: everything around the serving engine that runs without a GPU. Ray Data
LLM's processor is built for each engine from the config (the engine's arguments passed through, token ids
in and out, no chat template or tokenizer stage of its own); a turn's sampling is mapped to each engine's
names; the ids an engine returns become the turn by the regenerator's rules (end tokens, the cap, the loop
stop); and the driver's walk, one pass of the stage per turn depth, writes what the independent greedy loop
of test_regenerate.py writes, counts a row the engine failed, and resumes. The engines themselves run in
benchmarks/gpu_ray_check.sh on a GPU machine: here the stage is transformers' own greedy `generate` behind
the processor's contract (ids in; the generated ids out, the end token included, as vLLM returns them)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from helpers_data import write_jsonl
from test_regenerate import CONVS, expected_regeneration, world  # noqa: F401  (world: its fixture, the tiny target)

from dflash_ray.runtime.jobs.regenerate import engine_answer, engine_processor_config, engine_sampling_params

pytestmark = pytest.mark.rounding


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_processor_is_the_engine_alone_with_the_users_arguments(world, ray_session, engine):
    from ray.data.llm import build_processor

    _, _, target, _ = world
    config = engine_processor_config(engine, target, batch_size=16, concurrency=3,
                                     engine_kwargs={"tensor_parallel_size": 2, "max_model_len": 4096})
    assert config.model_source == target and config.batch_size == 16 and config.concurrency == 3
    assert config.engine_kwargs["tensor_parallel_size"] == 2 and config.engine_kwargs["max_model_len"] == 4096
    # Rendering renders and tokenises; the engine's own template or tokenizer would render other prompts
    assert not config.chat_template_stage and not config.tokenize_stage and not config.detokenize_stage
    stages = [type(s).__name__ for s in build_processor(config).stages.values()]
    assert stages == [{"vllm": "vLLMEngineStage", "sglang": "SGLangEngineStage"}[engine]]
    if engine == "vllm":
        assert config.should_continue_on_error          # a row it fails is counted, the job goes on
    else:
        assert config.engine_kwargs["skip_tokenizer_init"] is True   # SGLang takes ids only without its tokenizer


def test_every_gpu_serves_a_replica_of_tensor_times_pipeline_gpus():
    from dflash_ray.errors import UserError
    from dflash_ray.runtime.jobs.regenerate import engine_replicas

    assert engine_replicas("vllm", 8, {}) == 8
    assert engine_replicas("vllm", 8, {"tensor_parallel_size": 2}) == 4
    assert engine_replicas("vllm", 8, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}) == 2
    assert engine_replicas("sglang", 8, {"tp_size": 4}) == 2
    assert engine_replicas("vllm", 6, {"tensor_parallel_size": 4}) == 1        # two GPUs idle: no replica fits
    with pytest.raises(UserError, match="regenerate.engine=vllm serves on GPUs: the cluster has 0"):
        engine_replicas("vllm", 0, {})


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_engine_not_installed_is_one_line_naming_the_extra(world, ray_session, tmp_path, monkeypatch, engine):
    import importlib.util

    from dflash_ray.errors import UserError
    from dflash_ray.runtime.jobs import regenerate as job

    real = importlib.util.find_spec
    monkeypatch.setattr(job.importlib.util, "find_spec", lambda name, *a: None if name == engine else real(name, *a))
    _, tokdir, target, _ = world
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "conversations": CONVS[1]}])
    with pytest.raises(UserError, match=rf"regenerate.engine={engine}: {engine} is not installed here: pip install "
                                        rf"'dflash-ray\[{engine}\]'"):
        job.regenerate(str(src), str(tmp_path / "out.jsonl"), target_dir=target, tokenizer_dir=tokdir, cluster=None,
                       max_new_tokens=4, batch_size=2, on_max_tokens="keep", engine=engine, log=lambda *a: None)


def test_sampling_in_each_engines_names():
    greedy = {"temperature": 0.0, "top_p": 1.0, "seed": None}
    assert engine_sampling_params("vllm", 40, greedy, [7, 9]) == \
        {"temperature": 0.0, "top_p": 1.0, "stop_token_ids": [7, 9], "max_tokens": 40}
    assert engine_sampling_params("sglang", 40, greedy, [7]) == \
        {"temperature": 0.0, "top_p": 1.0, "stop_token_ids": [7], "max_new_tokens": 40}
    sampled = {"temperature": 0.7, "top_p": 0.9, "seed": 3}
    assert engine_sampling_params("vllm", 8, sampled, [7]) == \
        {"temperature": 0.7, "top_p": 0.9, "stop_token_ids": [7], "max_tokens": 8, "seed": 3}


def test_an_engines_ids_become_the_turn_by_the_regenerators_rules(world):
    _, _, _, tok = world
    words = tok("red blue red", add_special_tokens=False)["input_ids"]
    end = tok.eos_token_id
    # stopped at an end token: the text is the ids before it, the end token counted as generated
    assert engine_answer(words + [end], [end], 40, "max_new_tokens", tok, None) == \
        (tok.decode(words), True, "max_new_tokens", len(words) + 1)
    # a second declared end token stops it too; what follows an end token is not the turn's
    assert engine_answer(words + [5, end], [end, 5], 40, "max_new_tokens", tok, None)[:2] == (tok.decode(words), True)
    # the cap: no end token, the cap named
    assert engine_answer(words, [end], len(words), "the target's context", tok, None) == \
        (tok.decode(words), False, "the target's context", len(words))
    # a loop (period 1 over 6 tokens with span 6, period <= 2): dropped, the tokens up to the end counted
    looped = [11, 12, 13, 14, 14, 14, 14, 14, 14]
    assert engine_answer(looped, [end], 40, "max_new_tokens", tok, (6, 2)) == ("", False, "a greedy loop", 9)
    assert engine_answer(looped + [end], [end], 40, "max_new_tokens", tok, None)[1:3] == (True, "max_new_tokens")


def _stage(target, tok):
    # defined here, so Ray pickles the class by value (the workers do not import the tests)
    class GreedyStage:
        """The processor's contract with transformers' greedy `generate` behind it on the same weights: rows of
        {"i", "prompt", "ids", "max_tokens"} in, {"i", "max_tokens", "tokens", "error"} out. A prompt holding
        FAIL is a row the engine fails."""

        def __init__(self, target_dir: str, ends: list[int]):
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
            self.ends = ends

        def __call__(self, batch: dict) -> dict:
            import torch

            tokens, errors = [], []
            for prompt, ids, n in zip(batch["prompt"], batch["ids"], batch["max_tokens"]):
                if "FAIL" in prompt:
                    tokens.append([])
                    errors.append("the engine failed this prompt")
                    continue
                with torch.no_grad():
                    out = self.model.generate(torch.tensor([list(ids)]), max_new_tokens=int(n), do_sample=False,
                                              eos_token_id=self.ends, pad_token_id=self.ends[0])
                tokens.append(out[0, len(ids):].tolist())
                errors.append("")
            return {"i": batch["i"], "max_tokens": batch["max_tokens"], "tokens": np.array(tokens + [None], dtype=object)[:-1],
                    "error": np.array(errors, dtype=object)}

    return lambda ds: ds.map_batches(GreedyStage, fn_constructor_args=(target, [tok.eos_token_id]), batch_size=2,
                                     concurrency=1, num_cpus=1)


def _run(src, out, world, **kw):
    from types import SimpleNamespace

    from dflash_ray.runtime.jobs.regenerate import regenerate

    _, tokdir, target, tok = world
    return regenerate(str(src), str(out), target_dir=target, tokenizer_dir=tokdir,
                      cluster=SimpleNamespace(use_gpu=False, target_resource="target_slot", target_workers=1),
                      max_new_tokens=12, batch_size=2, on_max_tokens="keep", engine="vllm", stage=_stage(target, tok),
                      log=lambda *a: None, **kw)


@pytest.mark.slow   # Ray Data passes, one per turn depth
def test_the_walk_one_pass_a_turn_depth_writes_the_greedy_conversations_counts_failures_and_resumes(
        world, ray_session, tmp_path):
    _, _, target, tok = world
    fail = [{"role": "user", "content": "FAIL this one."}, {"role": "assistant", "content": "no"}]
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "source": "forum", "conversations": CONVS[0]},
                                              {"id": "b", "conversations": CONVS[1]},
                                              {"id": "f", "conversations": fail},
                                              "{not json"])
    out = tmp_path / "out.jsonl"
    counts = _run(src, out, world)
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == ["b", "a"]          # a's second turn takes a second pass: b is finished and written first
    assert rows["a"] == {"id": "a", "source": "forum", "conversations": expected_regeneration(CONVS[0], tok, target, 12)}
    assert rows["b"]["conversations"] == expected_regeneration(CONVS[1], tok, target, 12)
    assert counts["regenerated turns"] == 3 and counts["turns dropped: the engine failed it"] == 1
    assert counts["bad row: malformed_json"] == 1 and counts["written"] == 2
    # killed halfway through its last line: the rerun cuts it, redoes that conversation, skips the other
    whole = out.read_bytes()
    last = whole.rstrip(b"\n").rsplit(b"\n", 1)[-1]
    out.write_bytes(whole[:len(whole) - len(last) // 2 - 1])
    again = _run(src, out, world)
    assert again["torn last line cut off (its conversation redone)"] == 1
    assert again["skipped: already in the output"] == 1 and again["written"] == 1
    assert {r["id"]: r for r in map(json.loads, out.read_text().splitlines())} == rows


def test_sampling_is_seeded_and_a_nucleus_of_one_token_is_the_greedy_answer(world):
    """regenerate.temperature > 0 samples: the same seed draws the same conversations, another seed others
    (at temperature 5 the tiny target's next-token distribution is near uniform over its vocabulary, so two
    seeds agreeing on every token of every turn is as good as impossible); a nucleus so small it holds only
    the most likely token (top_p -> 0) must give the greedy answer whatever the temperature."""
    from dflash_ray.data.supervision import Rendering
    from dflash_ray.model.generation import Regenerator

    _, tokdir, target, tok = world
    rendering = Rendering(tok, None)

    def run(**sampling):
        regen = Regenerator(target, rendering, max_new_tokens=12, batch_size=2, on_max_tokens="keep",
                            sampling=sampling or None)
        return regen(CONVS)[0]

    greedy = run()
    assert greedy == [expected_regeneration(c, tok, target, 12) for c in CONVS]
    hot = dict(temperature=5.0, top_p=1.0)
    assert run(**hot, seed=1) == run(**hot, seed=1)
    assert run(**hot, seed=1) != run(**hot, seed=2)
    assert run(temperature=5.0, top_p=1e-9, seed=1) == greedy
