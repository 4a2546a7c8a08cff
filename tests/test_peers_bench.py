"""benchmarks/peers/: the parts that run without the peers' venv (the peers themselves are measured by
benchmarks/peers/step_loop.py, not by the tests: their venv is outside the project's dependencies)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"


def _load(name):
    sys.path.insert(0, str(PEERS))
    try:
        spec = importlib.util.spec_from_file_location(name, PEERS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PEERS))


def test_the_profile_puts_a_log_softmax_in_the_cross_entropy_and_sdpa_in_attention():
    harness = _load("harness")
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    w = torch.randn(8, 64, requires_grad=True)

    def step():
        h = F.scaled_dot_product_attention(q, q, q)
        F.cross_entropy((h.reshape(-1, 8) @ w), torch.zeros(32, dtype=torch.long)).backward()

    out = harness.profile_steps(step, 2)
    parts = out["by_part"]
    assert parts["cross-entropy over the vocabulary"] > 0 and parts["attention"] > 0
    assert parts["matmuls (linear layers and the LM head)"] > 0
    assert abs(sum(parts.values()) - out["seconds_per_step"]) < 1e-9
    # the op names it was told apart by: a log-softmax is never attention, whatever "softmax" says
    part_of = lambda name: next((p for p, frags in harness.PARTS if any(f in name.lower() for f in frags)), "other")  # noqa: E731
    assert part_of("aten::_log_softmax_backward_data") == "cross-entropy over the vocabulary"
    assert part_of("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"


def test_without_the_peers_venv_the_command_says_what_to_run_and_exits_2(tmp_path, capsys):
    step_loop = _load("step_loop")
    step_loop.PEERS_PY = tmp_path / "no-venv" / "bin" / "python"
    assert step_loop.main(["--work", str(tmp_path / "w.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "benchmarks/peers/setup.sh" in err[0]
    assert not (tmp_path / "w.pt").exists()


def test_the_feature_dump_writes_each_sample_as_specforge_reads_it_equal_to_its_own_forward(tmp_path):
    """SpecForge's offline input (benchmarks/peers/whole_job.py's adapter, this project's code): one file a
    sample, input_ids [S], loss_mask [S], hidden_states [S, taps x H] with their layer id k = transformers'
    hidden_states[k + 1]. Rows of different lengths share right-padded batches, and the dump's forward stops
    after the last tap and one more layer: every file must equal the sample's own unpadded, whole forward."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM

    from dflash_ray.model.target import build_synthetic_target
    from helpers_model import TINY_QWEN3

    whole_job = _load("whole_job")
    target = build_synthetic_target({**TINY_QWEN3, "num_hidden_layers": 4}, 97, str(tmp_path / "target"), seed=1)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 9, 17, 3, 12]
    ids = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in lengths]
    (tmp_path / "shards").mkdir()
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": masks}), tmp_path / "shards" / "part-0.parquet")
    taps = [0, 1]     # the dump stops after layer 2 of 4: the states it keeps must be the whole forward's
    # a budget of 30 tokens: batches of one to three rows, most of them padded
    out = whole_job.dump_features({"shards": str(tmp_path / "shards"), "target": target}, tmp_path / "features",
                                  taps, max_batch_tokens=30)
    # supervised runs of n - n // 2 tokens: one pair fewer (in the shards' order)
    assert out == {"samples": 6, "tokens": sum(lengths), "supervised_pairs": [n - n // 2 - 1 for n in lengths]}
    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    files = sorted((tmp_path / "features").glob("*.ckpt"))
    assert [f.name for f in files] == [f"{i:06d}.ckpt" for i in range(6)]
    for i, f in enumerate(files):
        saved = torch.load(f, weights_only=True)
        assert saved["input_ids"].tolist() == ids[i] and saved["loss_mask"].tolist() == masks[i]
        with torch.no_grad():
            hs = model(torch.tensor([ids[i]]), output_hidden_states=True).hidden_states
        expected = torch.cat([hs[1][0], hs[2][0]], dim=-1)   # their layer ids 0 and 1
        assert saved["hidden_states"].shape == (lengths[i], 2 * TINY_QWEN3["hidden_size"])
        torch.testing.assert_close(saved["hidden_states"], expected, atol=1e-5, rtol=1e-5)


def test_the_block_counter_counts_what_a_peers_sampler_kept():
    """The peers' trained blocks are counted from their own sampler's output (its keep mask), on an object or
    on a class, and read once per step."""
    harness = _load("harness")

    class Sampler:
        def _sample_anchor_positions(self, seq_len, loss_mask, device):
            keep = loss_mask[:, :4] > 0                    # a row keeps its supervised positions among the first 4
            return torch.zeros_like(keep, dtype=torch.long), keep

    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 1, 1]])
    one = Sampler()
    counter = harness.BlockCounter(one)
    one._sample_anchor_positions(5, mask, "cpu")
    one._sample_anchor_positions(5, mask, "cpu")
    assert counter.take() == 2 * (3 + 1) and counter.take() == 0
    on_class = harness.BlockCounter(Sampler)
    Sampler()._sample_anchor_positions(5, mask, "cpu")
    assert on_class.take() == 4
