"""csa2.checkpoints.hf: the released DeepSeek-V4.1 layout, on synthetic checkpoints these tests write in the
release's names and formats (FP8 32×32 blocks, packed FP4 experts, FP8 Engram rows, BF16/F32 floats)."""

import collections
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from csa2 import engram_vocab
from csa2.checkpoints import hf, load_hf, read_hf, released, save_hf, weights
from csa2.checkpoints.shards import DTYPES, Shards, write_shards
from csa2.cli import main
from csa2.model import abstract_params
from csa2.presets import preset

MINI = preset("mini")


def random_params(cfg, seed):
    """Random parameters in the structure of `init_params(cfg)` (no compile)."""
    rng = np.random.default_rng(seed)
    tree = jax.tree.map(lambda a: (0.05 * rng.standard_normal(a.shape)).astype(np.float32),
                        nnx.to_pure_dict(abstract_params(cfg)))
    return hf.as_params(cfg, tree)


def host(params):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(params))


def assert_bit_identical(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes()


def rewrite(src, dst, tensors=None, text_config=None):
    """A copy of checkpoint `src` at `dst` with tensors replaced (None drops one) and text_config keys changed."""
    store = Shards(src)
    out = {name: np.array(store.read(name)) for name in store.names()}
    for name, value in (tensors or {}).items():
        if value is None:
            out.pop(name)
        else:
            out[name] = value
    write_shards(dst, sorted(out.items()))
    config = json.loads((src / hf.CONFIG).read_text())
    config["text_config"].update(text_config or {})
    (dst / hf.CONFIG).write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def released_mini(tmp_path_factory):
    """A mini checkpoint in the release's own storage formats."""
    path = tmp_path_factory.mktemp("hf") / "mini-released"
    save_hf(random_params(MINI, 0), MINI, path, formats="released")
    return path


def slot_shape(t, leaves):
    leaf = leaves
    for key in t.path:
        leaf = leaf[key]
    return leaf.shape[len(t.index):], leaf


# ---------------------------------------------------------------------------------------------
# The name map

@pytest.mark.parametrize("name", ["mini", "tiny", "v41_flash"])
def test_name_map_fills_every_parameter_exactly_once(name):
    cfg = preset(name)
    leaves = nnx.to_pure_dict(abstract_params(cfg))
    filled, slots = collections.Counter(), set()
    for t in released.tensors(cfg):
        shape, leaf = slot_shape(t, leaves)
        assert released.to_param(t, np.broadcast_to(np.float32(0), t.shape)).shape == shape, t.name
        assert (t.path, t.index) not in slots, f"{t.name} fills a slot twice"
        slots.add((t.path, t.index))
        filled[id(leaf)] += int(np.prod(shape))
    for path, leaf in jax.tree_util.tree_flatten_with_path(leaves)[0]:
        if path[0].key == engram_vocab.PARAM:  # not a tensor of the release: built from its tokenizer
            assert filled[id(leaf)] == 0
            continue
        assert filled[id(leaf)] == int(np.prod(leaf.shape)), jax.tree_util.keystr(path)


def test_v41_flash_census_equals_the_released_checkpoint(v41_flash):
    """Tensor counts and bytes per stored dtype of the release (its 48 shard headers: 96,085 tensors,
    510,286,023,000 bytes), with the vision tower's 266 BF16 tensors (970,536,960 bytes) on top of the text model."""
    count, size = collections.Counter(), collections.Counter()
    for t in released.tensors(v41_flash):
        stored = t.fmt.stored_shape(t.shape) if t.fmt else t.shape
        count[t.dtype] += 1
        size[t.dtype] += int(np.prod(stored)) * DTYPES[t.dtype].itemsize
        if t.fmt:
            count["F8_E8M0"] += 1
            size["F8_E8M0"] += int(np.prod(t.fmt.scale_shape(t.shape)))
    count["BF16"] += 266
    size["BF16"] += 970_536_960
    assert dict(count) == {"BF16": 520, "F32": 387, "F8_E4M3": 357, "F8_E8M0": 47_589, "I8": 47_232}
    assert dict(size) == {"BF16": 3_952_883_712, "F32": 169_229_128, "F8_E4M3": 204_015_223_296,
                          "F8_E8M0": 23_563_015_184, "I8": 278_585_671_680}
    assert sum(count.values()) == 96_085 and sum(size.values()) == 510_286_023_000


def vision_names():
    names = ["vision.patch_embed.proj.weight", "vision.patch_embed.proj.bias", "vision.norm.weight",
             "image_start", "image_end", "image_newline"]
    for b in range(32):
        names += [f"vision.blocks.{b}.{n}" for n in ("norm1.weight", "norm2.weight", "attn.wqkv.weight",
                                                     "attn.wqkv.bias", "attn.wo.weight", "attn.wo.bias",
                                                     "mlp.w1.weight", "mlp.w2.weight")]
    return names + [f"aligner.w{i}.{p}" for i in (1, 2) for p in ("weight", "bias")]


def test_dry_run_over_the_full_v41_flash_index_leaves_nothing_unmapped(v41_flash, tmp_path, capsys):
    cfg = v41_flash
    names = [n for t in released.tensors(cfg) for n in (t.name, t.scale_name) if n] + vision_names()
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: "model-00001-of-00048.safetensors" for n in names}}))
    assert main(["convert", "dry-run", "--preset", "v41_flash", "--index", str(index)]) == 0
    out = capsys.readouterr().out
    assert "96085 names in the index: 95819 mapped, 266 skipped, 0 unmapped" in out
    assert "layers.20.attn.indexer.wk.weight → groups/" in out
    assert "vision.blocks.31.mlp.w2.weight: skipped, the vision tower" in out
    # A name the map does not know is reported and fails the command.
    index.write_text(json.dumps({"weight_map": {n: "x" for n in names + ["layers.3.attn.ape"]}}))
    assert main(["convert", "dry-run", "--preset", "v41_flash", "--index", str(index)]) == 2
    assert "layers.3.attn.ape" in capsys.readouterr().err


def test_dry_run_lists_every_tensor_and_the_parameter_it_becomes(capsys):
    assert main(["convert", "dry-run", "--preset", "mini"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(released.tensors(MINI)) + 1
    assert ("layers.1.ffn.experts.7.w2.weight  I8 [64, 32] + layers.1.ffn.experts.7.w2.scale F8_E8M0 [64, 2]"
            in "\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Loading the released formats

def test_loaded_values_are_the_hand_decoded_tensors_in_parameter_layout(released_mini):
    cfg, params = load_hf(released_mini)
    p = host(params)
    store = Shards(released_mini)
    table = {t.name: t for t in released.tensors(cfg)}

    def stored(name, fmt):
        return weights.decode(fmt, np.asarray(store.read(name + ".weight")), np.asarray(store.read(name + ".scale")))

    t = table["layers.3.ffn.experts.5.w2.weight"]
    leaf = p["groups"][t.path[1]][t.path[2]]["moe"]["w2"]
    np.testing.assert_array_equal(leaf[t.index], stored("layers.3.ffn.experts.5.w2", weights.FP4).T)
    t = table["layers.1.engram.embed.weight"]
    assert (t.path, t.index) == (("engram", 0, "table"), ())  # layer 1 holds the first Engram memory, unstacked
    np.testing.assert_array_equal(p["engram"][0]["table"], stored("layers.1.engram.embed", weights.FP8_ROWS))
    t = table["layers.6.attn.wo_a.weight"]
    wo_a = stored("layers.6.attn.wo_a", weights.FP8_BLOCK).reshape(cfg.o_groups, cfg.o_lora_rank, -1)
    np.testing.assert_array_equal(p["groups"][t.path[1]][t.path[2]]["attn"]["wo_a"][t.index], wo_a.transpose(0, 2, 1))
    sink = np.asarray(store.read("mtp.0.attn.attn_sink"))
    assert sink.dtype == np.float32
    np.testing.assert_array_equal(p["drafter"]["stages"][0]["attn"]["sink"], sink)
    head = np.asarray(store.read("head.weight"))
    assert head.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(p["head"], head.astype(np.float32).T)
    assert type(params["groups"][0][0]["moe"]["bias"]).__name__ == "RouterBias"  # variable types kept


@pytest.mark.parametrize("name", ["mini", "tiny"])
def test_load_save_load_is_bit_exact(tiny, name, released_mini, tmp_path):
    if name == "mini":
        cfg, first = MINI, released_mini
    else:
        cfg, first = tiny, tmp_path / "tiny-released"
        save_hf(random_params(cfg, 1), cfg, first, formats="released")
    _, params = load_hf(first, cfg)
    save_hf(params, cfg, tmp_path / "float")
    _, again = load_hf(tmp_path / "float", cfg)
    assert_bit_identical(host(again), host(params))
    # The safetensors package reads the float32 shards the same.
    index = json.loads((tmp_path / "float" / "model.safetensors.index.json").read_text())["weight_map"]
    name, file = sorted(index.items())[7]
    with safe_open(tmp_path / "float" / file, framework="numpy") as f:
        np.testing.assert_array_equal(f.get_tensor(name), Shards(tmp_path / "float").read(name))


def test_saved_config_reads_back_to_the_same_config(released_mini):
    assert hf.read_config(released_mini, MINI) == MINI
    text = json.loads((released_mini / hf.CONFIG).read_text())["text_config"]
    assert text["engram_pad_token_id"] == MINI.engram_pad_id and len(text["compress_ratios"]) == 8 + 1


def test_bfloat16_load_is_the_float32_load_rounded(released_mini):
    _, p32 = load_hf(released_mini, MINI)
    _, p16 = load_hf(released_mini, MINI, dtype="bfloat16")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a).astype(ml_dtypes.bfloat16), b),
                 host(p32), host(p16))


def test_fp8_engram_tables_stay_packed_bit_for_bit(tmp_path):
    """`engram_table_format="fp8"` keeps the release's table bytes as the parameter (never decoded whole),
    writes them back unchanged, and decodes to the float model's table."""
    cfg = MINI.replace(engram_head_dim=32)
    save_hf(random_params(cfg, 3), cfg, tmp_path / "src", formats="released")
    packed_cfg = cfg.replace(engram_table_format="fp8")
    _, packed = load_hf(tmp_path / "src", packed_cfg)
    _, dense = load_hf(tmp_path / "src", cfg)
    store = Shards(tmp_path / "src")
    t = next(t for t in released.tensors(cfg) if t.name.endswith("engram.embed.weight"))
    engram = host(packed)["engram"][t.path[1]]
    assert engram["table"][t.index].tobytes() == np.asarray(store.read(t.name)).tobytes()
    assert engram["table_scale"][t.index].tobytes() == np.asarray(store.read(t.scale_name)).tobytes()
    assert type(packed["engram"][t.path[1]]["table"]).__name__ == "EngramRows"
    decoded = weights.decode(weights.FP8_ROWS, engram["table"][t.index].view(ml_dtypes.float8_e4m3fn),
                             engram["table_scale"][t.index])
    np.testing.assert_array_equal(host(dense)["engram"][t.path[1]]["table"][t.index], decoded)
    save_hf(packed, packed_cfg, tmp_path / "again", formats="released")
    again = Shards(tmp_path / "again")
    for name in (t.name, t.scale_name):
        assert np.asarray(again.read(name)).tobytes() == np.asarray(store.read(name)).tobytes()
    save_hf(packed, packed_cfg, tmp_path / "float")  # a float export decodes the table
    _, back = load_hf(tmp_path / "float", cfg)
    np.testing.assert_array_equal(host(back)["engram"][t.path[1]]["table"][t.index], decoded)


def test_the_compressed_vocabulary_comes_from_the_checkpoints_tokenizer(tmp_path):
    """The release stores no tensor for it: `load_hf` builds it from `tokenizer.json` (or takes `engram_table`)."""
    cfg = MINI.replace(engram_compressed_vocab_size=200, engram_pad_id=0)
    save_hf(random_params(cfg, 4), cfg, tmp_path, formats="released")
    with pytest.raises(ValueError, match=r"needs the compressed vocabulary.*put the checkpoint's tokenizer.json"):
        load_hf(tmp_path, cfg)
    words = [f"w{i}" for i in range(200)] + [f"W{i}" for i in range(59)]  # "W7" and "w7" share a key
    Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0")).save(str(tmp_path / hf.TOKENIZER))
    _, params = load_hf(tmp_path, cfg)
    np.testing.assert_array_equal(host(params)[engram_vocab.PARAM], np.r_[np.arange(200), np.arange(59)])
    mine = np.r_[np.arange(200)[::-1], np.zeros(59, np.int32)]
    _, params = load_hf(tmp_path, cfg, engram_table=mine)
    np.testing.assert_array_equal(host(params)[engram_vocab.PARAM], mine)
    with pytest.raises(ValueError, match=r"engram_vocab: ids span \[0, 258\]"):
        load_hf(tmp_path, cfg, engram_table=np.arange(259))


def test_load_holds_only_a_few_copies_of_the_largest_tensor_beyond_the_parameters(tmp_path):
    """Peak host memory above the parameters while reading stays bounded by the largest tensor (float32),
    not by the checkpoint: the embedding and head (16384 × 64) are the largest tensors here."""
    cfg = MINI.replace(vocab_size=16384, engram_compressed_vocab_size=16384)
    save_hf(random_params(cfg, 2), cfg, tmp_path / "big", formats="released")
    _, _, summary = read_hf(tmp_path / "big", cfg)
    assert summary.largest_tensor_bytes == 16384 * 64 * 4
    assert summary.transient_bytes <= 4 * summary.largest_tensor_bytes
    assert summary.transient_bytes < summary.param_bytes / 2


# ---------------------------------------------------------------------------------------------
# Bad checkpoints

def bf16(shape):
    return np.zeros(shape, ml_dtypes.bfloat16)


@pytest.mark.parametrize("change, message", [
    ({"layers.3.attn.unknown.weight": bf16((4,))},
     r"1 tensor\(s\) this config has no parameter for.*layers.3.attn.unknown"),
    ({"layers.5.attn.kv_norm.weight": None}, r"lacks 1 tensor\(s\).*layers.5.attn.kv_norm.weight"),
    ({"layers.5.attn.kv_norm.weight": bf16((31,))},
     r"'layers.5.attn.kv_norm.weight': stored shape \(31,\).*expects \(32,\)"),
    ({"layers.2.attn.wq_a.scale": None},
     r"'layers.2.attn.wq_a.weight': dtype F8_E4M3 without a 'layers.2.attn.wq_a.scale'"),
    ({"layers.2.attn.wq_a.weight": None}, r"'layers.2.attn.wq_a.scale' is a scale without its payload"),
    ({"layers.2.attn.q_norm.scale": bf16((1,))}, r"'layers.2.attn.q_norm.weight': payload dtype BF16 beside a scale"),
    ({"layers.2.attn.wq_a.scale": np.zeros((1, 1), ml_dtypes.float8_e8m0fnu)},
     r"'layers.2.attn.wq_a.weight': scale shape \(1, 1\)"),
])
def test_bad_tensors_are_refused_by_name(released_mini, tmp_path, change, message):
    bad = rewrite(released_mini, tmp_path / "bad", change)
    with pytest.raises(ValueError, match=message):
        load_hf(bad, MINI)


def test_a_config_that_does_not_match_the_weights_is_refused(released_mini, tmp_path):
    bad = rewrite(released_mini, tmp_path / "experts", text_config={"n_routed_experts": 4, "num_experts_per_tok": 2})
    with pytest.raises(ValueError, match=r"no parameter for.*experts\.[4-7]\."):
        load_hf(bad)
    with pytest.raises(ValueError, match=r"does not describe cfg \(n_routed_experts: config.json 4 vs cfg 8"):
        load_hf(bad, MINI)
    bad = rewrite(released_mini, tmp_path / "engram", text_config={"engram_num_embeddings": [1000]})
    with pytest.raises(ValueError, match=r"engram_num_embeddings=\[1000\].*gives \[\d+\]"):
        load_hf(bad, MINI)


def test_bad_arguments_are_refused(tiny, released_mini, tmp_path):
    with pytest.raises(ValueError, match=r"dtype='float16'.*float32 or bfloat16"):
        load_hf(released_mini, dtype="float16")
    with pytest.raises(ValueError, match=r"no config.json"):
        load_hf(tmp_path)
    with pytest.raises(ValueError, match=r"formats='fp8'"):
        save_hf(random_params(MINI, 0), MINI, tmp_path / "x", formats="fp8")
    with pytest.raises(ValueError, match=r"parameter structure of cfg"):
        save_hf(random_params(MINI, 0), tiny, tmp_path / "y")


# ---------------------------------------------------------------------------------------------
# The convert command

def test_convert_both_ways_through_an_orbax_checkpoint(released_mini, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["convert", "from-hf", str(released_mini), str(run)]) == 0
    out = capsys.readouterr().out
    assert f"read {len(released.tensors(MINI))} tensors" in out and "peak host memory above them" in out
    assert main(["convert", "to-hf", str(run), str(tmp_path / "back")]) == 0
    assert "wrote" in capsys.readouterr().out
    _, want = load_hf(released_mini, MINI)
    _, got = load_hf(tmp_path / "back", MINI)
    assert_bit_identical(host(got), host(want))
    shutil.rmtree(run)
