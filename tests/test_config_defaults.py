"""One home for every default: the typed schema (dflash_ray/config.py). The YAML under dflash_ray/conf/ picks the group
options, and an option sets only the keys whose value differs from the schema's default; what a user gets
composed stays what the YAML gave before the defaults moved (the expected values below are written out by
hand from the options as they were, not read from the code under test). Nor does the package's code state them a
second time: a parameter or dataclass field naming a key has no literal default equal to the key's (restated_defaults;
NOT_THE_KEY: the few that only share a key's name)."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dflash_ray.config import CONF_DIR, RootConfig, _schema_keys, compose_config

GROUPS = ("model", "data", "cluster", "train")
LEAVES = set(_schema_keys())   # every typed key that is not a group of its own


def _defaults() -> dict:
    return OmegaConf.to_container(OmegaConf.structured(RootConfig), resolve=False)


def _repeats(written: dict, defaults: dict, prefix: str) -> list[str]:
    """Keys of `written` set to the value the schema has already (a group of the schema, such as
    data.synthetic, key by key; a dict-valued key such as model.target_config as one value). Keys the
    schema does not have are listed too."""
    found = []
    for key, value in written.items():
        full = f"{prefix}{key}"
        if key not in defaults:
            found.append(f"{full} (not in the schema)")
        elif full not in LEAVES and isinstance(value, dict):
            found.extend(_repeats(value, defaults[key], full + "."))
        elif value == defaults[key] and isinstance(value, bool) == isinstance(defaults[key], bool):
            found.append(f"{full}: {value!r}")
    return found


def _options():
    return [(group, path) for group in GROUPS for path in sorted((CONF_DIR / group).glob("*.yaml"))]


@pytest.mark.parametrize("group, path", _options(), ids=lambda x: getattr(x, "name", x))
def test_an_option_sets_only_what_differs_from_the_schema(group, path):
    written = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    defaults = _defaults()
    if "# @package _global_" in path.read_text().splitlines():
        found = _repeats(written, defaults, "")
    else:
        found = _repeats(written, defaults[group], f"{group}.")
    assert found == [], f"{path.relative_to(CONF_DIR)} repeats the schema's defaults: {found}"


def test_the_root_config_only_picks_the_options():
    written = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml"), resolve=False)
    assert set(written) == {"defaults"}
    assert written["defaults"] == [{"train": "default"}, {"model": "tiny"}, {"data": "synthetic"},
                                   {"cluster": "local"}, "_self_"]


def test_the_repeat_finder_finds_one():
    defaults = _defaults()
    assert _repeats({"max_batches_in_flight": 4, "nodes": 2}, defaults["cluster"], "cluster.") == \
        ["cluster.max_batches_in_flight: 4"]
    assert _repeats({"synthetic": {"regenerate": True, "target_steps": 0}}, defaults["data"], "data.") == \
        ["data.synthetic.regenerate: True"]
    assert _repeats({"train": {"checkpoint_every_minutes": 30}}, defaults, "") == ["train.checkpoint_every_minutes: 30"]
    assert _repeats({"cluster": {"num_cpu": 4}}, defaults, "") == ["cluster.num_cpu (not in the schema)"]


SEED_BUCKETS = [512, 1024, 1536, 2304, 3296, 8192]
DEMO_BUCKETS = [96, 128, 192, 256, 384, 512]


@pytest.mark.parametrize("overrides, expected", [
    ([], {"cluster.max_batches_in_flight": 8, "cluster.object_store_memory": 600000000, "cluster.num_cpus": 4,
          "cluster.address": None, "cluster.use_gpu": False, "cluster.name": "local",
          "data.shard_size": 256, "data.bucket_boundaries": DEMO_BUCKETS, "data.max_tokens_per_batch": 1024,
          "data.output": "runs/default/shards", "data.shards": "runs/default/shards", "run.dir": "runs/default",
          "data.synthetic.num_conversations": 600, "model.name": "tiny", "model.num_draft_layers": 2,
          "model.block_size": 8, "model.num_anchors": 64, "model.anchors_per_batch": None, "model.target_path": None,
          "train.epochs": 10, "train.lr": 3e-3, "train.checkpoint_every": 100, "train.heldout_every": 100,
          "train.checkpoint_every_minutes": 30.0}),
    (["cluster=8gpu"], {"cluster.max_batches_in_flight": 16, "cluster.object_store_memory": None,
                        "cluster.num_cpus": None, "cluster.address": "auto", "cluster.use_gpu": True,
                        "cluster.target_workers": 6, "cluster.drafter_workers": 2, "cluster.name": "8gpu",
                        "data.shard_size": 256}),
    (["cluster=1gpu"], {"cluster.max_batches_in_flight": 4, "cluster.drafter_workers": 1, "cluster.target_workers": 1,
                        "cluster.target_gpus": 0.5, "cluster.drafter_gpus": 0.5, "cluster.nodes": 1}),
    (["cluster=multinode"], {"cluster.max_batches_in_flight": 32, "cluster.nodes": 2, "cluster.target_workers": 12,
                             "cluster.drafter_workers": 4, "cluster.object_store_memory": None}),
    (["data=sharegpt", "model=qwen3_8b", "cluster=8gpu"],
     {"data.shard_size": 10000, "data.bucket_boundaries": SEED_BUCKETS, "data.max_tokens_per_batch": 16384,
      "data.synthetic.num_conversations": 0, "data.synthetic.regenerate": False, "data.prompts": None,
      "model.name": "qwen3_8b", "model.num_draft_layers": 5, "model.block_size": 16, "model.num_anchors": 512,
      "model.anchors_per_batch": None, "model.max_block_tokens_per_batch": 16384,
      "model.target_config.hidden_size": 4096,
      "model.target_config.num_hidden_layers": 36, "model.target_config.head_dim": 128, "train.epochs": 6, "train.lr": 6e-4,
      "train.checkpoint_every": None, "cluster.max_batches_in_flight": 16}),
    # keys the options leave out are still set and deleted as before (`~key`: the schema's default)
    (["seed=3", "run.name=r1", "cluster=8gpu", "cluster.object_store_memory=5", "data.synthetic.target_steps=2"],
     {"seed": 3, "run.dir": "runs/r1", "data.shards": "runs/r1/shards", "cluster.object_store_memory": 5,
      "data.synthetic.target_steps": 2}),
    (["~data.shard_size", "~cluster.max_batches_in_flight"],
     {"data.shard_size": 10000, "cluster.max_batches_in_flight": 4}),
])
def test_composed_values_are_what_the_options_gave(overrides, expected):
    cfg = compose_config(overrides)
    got = {k: OmegaConf.select(cfg, k, throw_on_missing=False) for k in expected}
    got = {k: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for k, v in got.items()}
    assert got == expected


def test_required_values_of_an_option_stay_required():
    cfg = compose_config(["data=sharegpt", "model=llama3_8b"])
    assert OmegaConf.missing_keys(cfg) == {"data.input", "data.tokenizer", "model.target_path"}
    assert OmegaConf.missing_keys(compose_config(["data=sharegpt", "data.input=x"])) == {"data.tokenizer"}


# ----------------------------------------------------------------------------- defaults restated in the package
PKG = Path(__file__).resolve().parent.parent / "dflash_ray"
# the data layer's name for a config key whose name differs (data/interleave.py's `strategy` is data.interleave)
ALIASES = {"strategy": "interleave"}
# names that share a key's leaf name and default but are not that key, each with what it is instead (a default
# that must stay put whatever the key's default becomes)
NOT_THE_KEY = {
    "runtime/spec.py: RunSpec.features": "train.features resolved: online | hybrid | offline, never auto; online "
                                         "until with_feature_cache answers",
}


@functools.cache
def _leaf_defaults() -> dict[str, list]:
    """A typed key's leaf name -> the defaults of the keys of that name."""
    root = OmegaConf.structured(RootConfig)
    found: dict[str, list] = {}
    for key in LEAVES:
        value = OmegaConf.select(root, key, throw_on_missing=False)
        found.setdefault(key.rpartition(".")[2], []).append(
            OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
    return found


def _named_defaults(tree: ast.AST, owner: str = ""):
    """(owner.name, default node) of every parameter with a default and every annotated class attribute with a
    value (a dataclass field; `field(default=...)` read through)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            for arg, default in pairs:
                yield f"{owner}{node.name}.{arg.arg}", default
            yield from _named_defaults(node, f"{owner}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
                    value = st.value
                    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
                        value = next((k.value for k in value.keywords if k.arg == "default"), None)
                    if value is not None:
                        yield f"{owner}{node.name}.{st.target.id}", value
            yield from _named_defaults(node, f"{owner}{node.name}.")


def _related(name: str, leaf: str) -> bool:
    """The parameter names the key: its leaf name, or that name with a prefix on either side
    (cluster.token_block_mb <-> block_mb, eval.max_new_tokens <-> heldout_max_new_tokens)."""
    name = ALIASES.get(name, name)
    return name == leaf or leaf.endswith("_" + name) or name.endswith("_" + leaf)


def restated_defaults(source: str, where: str = "") -> list[str]:
    """Parameters and dataclass fields of `source` whose default is a literal equal to the default of a typed
    key they name (_related). What it catches: a literal written where the config's default should be read
    (`block_mb: float = 8.0` for cluster.token_block_mb). What it does not: a default computed from other
    values, a parameter named unlike its key (unless in ALIASES), and the defaults that say nothing of their
    own -- None, booleans, 0, 1 and "" (absence and switches, which many unrelated parameters share)."""
    leaves = _leaf_defaults()
    found = []
    for name, node in _named_defaults(ast.parse(source)):
        try:
            value = ast.literal_eval(node)
        except ValueError:
            continue   # not a literal: read from somewhere (the config, a constant)
        if value is None or isinstance(value, bool) or (isinstance(value, (int, float, str)) and value in (0, 1, "")):
            continue
        param = name.rpartition(".")[2]
        if any(_related(param, leaf) and not isinstance(d, bool) and d == value
               for leaf, defaults in leaves.items() for d in defaults):
            found.append(f"{where}{name}")
    return found


def _package_restatements() -> set[str]:
    found = set()
    for path in sorted(PKG.rglob("*.py")):
        if path != PKG / "config.py":   # the schema states them, once
            found.update(restated_defaults(path.read_text(), f"{path.relative_to(PKG).as_posix()}: "))
    return found


def test_no_signature_restates_a_config_default():
    found = _package_restatements() - NOT_THE_KEY.keys()
    assert not found, f"these restate a config default; read it from the typed config instead: {sorted(found)}"


def test_each_name_that_is_not_its_key_is_still_there():
    gone = NOT_THE_KEY.keys() - _package_restatements()
    assert not gone, f"no longer found (renamed, removed, or read from the config): take off NOT_THE_KEY: {sorted(gone)}"


def test_the_restatement_finder_finds_the_plan_and_token_store_ones():
    source = '''
@dataclass
class PlanSpec:
    boundaries: list[int]
    overlong: str = "truncate"
    chunk_batches: int = field(default=64)
    strategy: str = "default"
    block_size: int = ModelConfig.block_size
    min_tokens: int = 0
    num_anchors: int | None = None

def build_token_store(shards, vocab_size, block_mb: float = 8.0, cache_mb=256.0, ray_data=None):
    def inner(key="local", attention_backend="auto", seed=0, block_mb=ClusterConfig.token_block_mb, cache_mb=64.0):
        pass
'''
    assert restated_defaults(source) == ["PlanSpec.overlong", "PlanSpec.chunk_batches", "PlanSpec.strategy",
                                         "build_token_store.block_mb", "build_token_store.cache_mb"]
