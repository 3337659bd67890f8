"""experiments.ledger: scores kept under the whole recipe of their run, read back instead of measured again."""

import json
import threading

import numpy as np
import pytest

from experiments import ledger

RECIPE = {"recipe": {"lr": 0.003, "stages": [[600, 16, 128]], "qat": True, "seed": 0}, "config": "abc"}


def test_the_key_is_the_whole_recipe_and_not_its_order():
    assert ledger.key(RECIPE) == ledger.key(json.loads(json.dumps(RECIPE, sort_keys=True)))
    assert ledger.key({"config": "abc", "recipe": dict(reversed(list(RECIPE["recipe"].items())))}) == \
        ledger.key(RECIPE)
    for field, other in (("lr", 0.001), ("stages", [[600, 16, 256]]), ("qat", False), ("seed", 1)):
        assert ledger.key({**RECIPE, "recipe": {**RECIPE["recipe"], field: other}}) != ledger.key(RECIPE), field
    assert ledger.key({**RECIPE, "config": "abd"}) != ledger.key(RECIPE)


def test_a_recorded_score_is_read_back_with_where_it_came_from(tmp_path):
    path = tmp_path / "ledger.json"
    assert ledger.lookup(path, RECIPE, "passkey") is None and ledger.load(path) == {}
    ledger.record(path, RECIPE, "passkey", {"digits": np.float32(0.5), "n": np.int64(40)})
    assert ledger.lookup(path, RECIPE, "passkey") == {"digits": 0.5, "n": 40}
    assert ledger.lookup(path, RECIPE, "curve every 150") is None  # another part of the same run
    other = {**RECIPE, "config": "xyz"}
    assert ledger.lookup(path, other, "passkey") is None
    entry = ledger.load(path)[ledger.key(RECIPE)]
    assert entry["recipe"] == RECIPE
    assert set(entry["scores"]["passkey"]) == {"value", "commit", "date"}
    assert entry["scores"]["passkey"]["commit"]  # this test runs inside the repository's git checkout
    assert not list(tmp_path.glob(".*.partial"))  # written whole, then renamed over the ledger


def test_cached_measures_once(tmp_path):
    path, calls = tmp_path / "ledger.json", []

    def measure():
        calls.append(1)
        return {"keys": (1, 2)}

    assert ledger.cached(path, RECIPE, "passkey", measure) == {"keys": [1, 2]}  # as JSON reads it back
    assert ledger.cached(path, RECIPE, "passkey", measure) == {"keys": [1, 2]}
    assert len(calls) == 1
    assert ledger.cached(None, RECIPE, "passkey", measure) == {"keys": (1, 2)} and len(calls) == 2  # no ledger


def test_an_entry_holding_another_recipe_is_refused(tmp_path):
    path = tmp_path / "ledger.json"
    ledger.record(path, RECIPE, "passkey", 1.0)
    edited = ledger.load(path)
    edited[ledger.key(RECIPE)]["recipe"]["recipe"]["lr"] = 1.0
    path.write_text(json.dumps(edited))
    with pytest.raises(ValueError, match=f"entry {ledger.key(RECIPE)} holds another recipe"):
        ledger.lookup(path, RECIPE, "passkey")


def test_processes_recording_at_once_keep_every_score(tmp_path):
    """Each writer reads the file again under the lock: no record overwrites another's."""
    path = tmp_path / "ledger.json"
    recipes = [{**RECIPE, "config": str(i)} for i in range(8)]
    threads = [threading.Thread(target=lambda r=r: [ledger.record(path, r, f"part {j}", j) for j in range(5)])
               for r in recipes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(ledger.lookup(path, r, f"part {j}") == j for r in recipes for j in range(5))


def test_the_tree_digest_names_every_bit_of_every_leaf():
    """`tree_digest` changes with one flipped bit, a dtype, a shape or the leaves' order, and with nothing else."""
    tree = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [np.ones(2, np.int32)]}
    same = {"b": [np.ones(2, np.int32)], "a": np.arange(6, dtype=np.float32).reshape(2, 3)}
    assert ledger.tree_digest(tree) == ledger.tree_digest(same)
    flipped = tree["a"].copy()
    flipped.view(np.uint32)[1, 2] ^= 1  # the last bit of one float
    for other in ({**tree, "a": flipped}, {**tree, "a": tree["a"].astype(np.float64)},
                  {**tree, "a": tree["a"].reshape(3, 2)}, {"a": tree["b"][0], "b": [tree["a"]]}):
        assert ledger.tree_digest(other) != ledger.tree_digest(tree)
