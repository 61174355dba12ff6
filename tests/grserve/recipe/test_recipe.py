"""The generalized GR trainer (grserve.recipe): the dropout forward is the served forward, the catalog loss is the
served (renormalized) score, overlapping windows, and the SID tokenizer's ids are the catalog layout's."""

import json

import numpy as np
import pytest
import torch

from grserve.config import SearchConfig
from grserve.engine.retrieval import RetrievalRunner
from grserve.model import Decoder
from grserve.recipe.forward import train_forward
from grserve.recipe.losses import IGNORE, SidTargets, next_token_loss
from grserve.recipe.train import CausalBatchContext, TrainConfig, init_weights, model_spec, train_gr, windows

from gr_fixtures import grid_catalog

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, max_items=6, batch_size=8, warmup_steps=2, lr=1e-2, threads=1)


@pytest.fixture(scope="module")
def catalog():
    """Depth 3, 4 codes per level, 30 of the 64 SIDs: tries with 1..4 children per node."""
    return grid_catalog(30, seed=3, first_id=100)


@pytest.fixture(scope="module")
def model(catalog):
    m = Decoder(model_spec(TrainConfig(**TINY), catalog))
    init_weights(m, 0)
    with torch.no_grad():  # larger weights than the init's, so the distributions are far from uniform
        for p in m.parameters():
            p.mul_(8.0 if p.ndim >= 2 else 1.0)
    return m.eval().requires_grad_(False)


def test_train_forward_without_dropout_is_the_served_forward(model):
    rng = np.random.default_rng(0)
    inp = torch.from_numpy(rng.integers(16, model.spec.vocab_size, (3, 11)))
    ref = model(inp.reshape(-1), torch.arange(11).repeat(3), CausalBatchContext(3, 11))
    torch.testing.assert_close(train_forward(model, inp), ref, atol=1e-6, rtol=1e-6)
    model.train()
    try:
        torch.manual_seed(0)
        dropped = train_forward(model, inp, dropout=0.3, attention_dropout=0.3)
    finally:
        model.eval()
    assert not torch.allclose(dropped, ref, atol=1e-3)  # dropout acts in training mode
    torch.testing.assert_close(train_forward(model, inp, dropout=0.3), ref, atol=1e-6, rtol=1e-6)  # and not in eval


def _item_nll(model, catalog, history: np.ndarray, item: int, kind: str) -> float:
    """The training loss of one target item (its SID tokens only) after ``history``, summed over levels."""
    sid = SidTargets(catalog)
    items = np.append(history, item)
    tokens = catalog.layout.sids_to_tokens(catalog.sids_of_items(items))
    inp = torch.from_numpy(tokens[:-1])[None]
    tgt = torch.full((1, len(tokens) - 1), IGNORE)
    tgt[0, -catalog.depth:] = torch.from_numpy(tokens[-catalog.depth:])
    nodes = torch.from_numpy(sid.token_nodes(items)[1:])
    hidden = model(inp.reshape(-1), torch.arange(inp.shape[1]), CausalBatchContext(1, inp.shape[1]))
    return float(next_token_loss(model, hidden, tgt.reshape(-1), nodes, kind, sid, reduction="sum"))


def test_catalog_loss_is_minus_the_served_renormalized_score(model, catalog):
    """What the catalog loss trains is exactly what the served search ranks by: for every catalog item, the loss
    of the item after a history = − its score from a beam wide enough to keep every item."""
    history = catalog.item_ids[[3, 17, 8]]
    prompt = catalog.layout.sids_to_tokens(catalog.sids_of_items(history))
    runner = RetrievalRunner(model, SearchConfig(scoring="renormalized"))
    try:
        hits = runner.run([prompt], 64, [len(catalog)], catalog).hits[0]
    finally:
        runner.close()
    assert len(hits) == len(catalog)
    for h in hits:
        assert _item_nll(model, catalog, history, h.item_id, "catalog") == pytest.approx(-h.score, abs=1e-4)


def test_level_and_full_losses_normalise_over_wider_sets(model, catalog):
    """Each wider normalisation gives every item a larger loss (more competing tokens); all three differ."""
    history = catalog.item_ids[[1, 2]]
    for item in catalog.item_ids[:10]:
        full, level, cat = (_item_nll(model, catalog, history, item, k) for k in ("full", "level", "catalog"))
        assert full > level > cat > 0 or (level == pytest.approx(cat) and full > level)


def test_label_smoothing_spreads_over_allowed_codes_only(model, catalog):
    sid = SidTargets(catalog)
    items = catalog.item_ids[[0, 5, 9]]
    tokens = torch.from_numpy(catalog.layout.sids_to_tokens(catalog.sids_of_items(items)))
    nodes = torch.from_numpy(sid.token_nodes(items))
    hidden = model(tokens[:-1], torch.arange(len(tokens) - 1), CausalBatchContext(1, len(tokens) - 1))
    smooth = next_token_loss(model, hidden, tokens[1:], nodes[1:], "catalog", sid, label_smoothing=0.2)
    plain = next_token_loss(model, hidden, tokens[1:], nodes[1:], "catalog", sid)
    assert torch.isfinite(smooth) and smooth > plain  # -inf (disallowed) logits never enter the smoothing term


def test_windows_with_a_stride_overlap_and_reach_the_start():
    w = windows([np.arange(1, 12)], 5, stride=3)
    assert [x.tolist() for x in w] == [[7, 8, 9, 10, 11], [4, 5, 6, 7, 8], [1, 2, 3, 4, 5]]
    assert [x.tolist() for x in windows([np.arange(1, 4)], 5, stride=3)] == [[1, 2, 3]]


def test_training_with_the_catalog_loss_and_dropout_learns(catalog):
    rng = np.random.default_rng(0)
    ids = catalog.item_ids
    seqs = [ids[(rng.integers(30) + np.arange(9)) % 30] for _ in range(40)]  # item i is followed by item i+1
    hist, nxt = [s[:-1] for s in seqs], np.array([s[-1] for s in seqs])
    cfg = TrainConfig(**{**TINY, "max_items": 5}, window_items=6, window_stride=2, length_buckets=True,
                      dropout=0.1, attention_dropout=0.1, loss="catalog", label_smoothing=0.1, epochs=6,
                      time_budget_s=120)
    res = train_gr(hist, catalog, cfg, valid=(hist, nxt), progress=False)
    assert res.history[-1]["valid_nll"] < res.history[0]["valid_nll"]
    assert res.history[-1]["train_loss"] < res.history[0]["train_loss"]


def test_sid_tokenizer_ids_are_the_layout_ids(tmp_path, catalog):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from grserve.recipe.tokenizer import save_sid_tokenizer, sid_token

    save_sid_tokenizer(catalog, tmp_path, vocab_size=48)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 48
    sids = catalog.sids[:5]
    text = "".join(sid_token(level, int(c)) for sid in sids for level, c in enumerate(sid))
    assert tok.encode(text, add_special_tokens=False) == catalog.layout.sids_to_tokens(sids).tolist()
    assert tok.convert_ids_to_tokens([0, 1, 16, 20, 24]) == ["<pad>", "<eos>", "<a_0>", "<b_0>", "<c_0>"]


def test_weight_average_blends_and_swaps_back(catalog):
    from grserve.recipe.ema import WeightAverage

    m = Decoder(model_spec(TrainConfig(**TINY), catalog))
    init_weights(m, 0)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    avg = WeightAverage(m, decay=0.9)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    avg.update(m)  # decay min(0.9, 2/11)
    d = 2 / 11
    for k, v in m.state_dict().items():
        torch.testing.assert_close(avg.shadow[k], d * before[k] + (1 - d) * v)
    raw = {k: v.clone() for k, v in m.state_dict().items()}
    with avg.swapped(m):
        torch.testing.assert_close(m.model.embed_tokens.weight, avg.shadow["model.embed_tokens.weight"])
        assert m.lm_head.weight is m.model.embed_tokens.weight  # still tied
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, raw[k])


def test_training_with_a_weight_average_keeps_the_average(catalog):
    seqs = [catalog.item_ids[(i + np.arange(8)) % 30] for i in range(30)]
    seen = []
    cfg = TrainConfig(**TINY, epochs=2, ema_decay=0.99, time_budget_s=120)
    res = train_gr(seqs, catalog, cfg, progress=False,
                   on_epoch=lambda model, entry: seen.append({k: v.clone() for k, v in model.state_dict().items()}))
    assert len(seen) == 2 and res.best_epoch == -1  # no validation: the last average is kept
    for k, v in res.model.state_dict().items():
        torch.testing.assert_close(v, seen[-1][k])


def test_keep_last_keeps_the_last_epoch_whatever_the_validation_nll(catalog):
    seqs = [catalog.item_ids[(i + np.arange(8)) % 30] for i in range(30)]
    hist, nxt = [s[:-1] for s in seqs], np.array([s[-1] for s in seqs])
    seen = []
    cfg = TrainConfig(**TINY, epochs=3, keep="last", time_budget_s=120)
    res = train_gr(hist, catalog, cfg, valid=(hist[:4], nxt[:4]), progress=False,
                   on_epoch=lambda model, entry: seen.append({k: v.clone() for k, v in model.state_dict().items()}))
    assert res.best_epoch == 3
    for k, v in res.model.state_dict().items():
        torch.testing.assert_close(v, seen[-1][k])
    with pytest.raises(ValueError, match="keep"):
        TrainConfig(keep="first")


def test_a_run_resumed_from_its_checkpoint_ends_with_the_uninterrupted_weights(catalog, tmp_path):
    seqs = [catalog.item_ids[(i + np.arange(8)) % 30] for i in range(30)]
    hist, nxt = [s[:-1] for s in seqs], np.array([s[-1] for s in seqs])
    cfg = TrainConfig(**TINY, epochs=3, ema_decay=0.9, dropout=0.1, loss="catalog")
    whole = train_gr(hist, catalog, cfg, valid=(hist[:4], nxt[:4]), progress=False)
    ckpt = tmp_path / "ckpt.pt"
    # the first two epochs, then "killed": a run of 2 epochs' budget would change the schedule, so stop by
    # raising from on_epoch after the checkpoint of epoch 2 is written (it is written after on_epoch's epoch)
    seen = []

    def stop(model, entry):
        seen.append(entry["epoch"])
        if entry["epoch"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_gr(hist, catalog, cfg, valid=(hist[:4], nxt[:4]), progress=False, on_epoch=stop, checkpoint=ckpt)
    assert seen == [1, 2] + [3] and torch.load(ckpt, weights_only=False)["epoch"] == 2
    logs: list[str] = []
    resumed = train_gr(hist, catalog, cfg, valid=(hist[:4], nxt[:4]), progress=False, checkpoint=ckpt, resume=True,
                       log=logs.append)
    assert any("resuming" in m and "after epoch 2" in m for m in logs)
    epochs = [json.loads(m) for m in logs if m.startswith("{")]  # one whole JSON line per epoch, rounded
    assert [e["epoch"] for e in epochs] == [3] and all(len(str(v)) <= 12 for v in epochs[0].values())
    assert resumed.steps == whole.steps and resumed.best_epoch == whole.best_epoch
    assert [e["train_loss"] for e in resumed.history] == [e["train_loss"] for e in whole.history]
    for k, v in resumed.model.state_dict().items():
        torch.testing.assert_close(v, whole.model.state_dict()[k], rtol=0, atol=0)
    other = train_gr(hist, catalog, TrainConfig(**TINY, epochs=1), progress=False, checkpoint=ckpt, resume=True,
                     log=logs.append)  # another recipe: the checkpoint is not used
    assert other.steps < whole.steps and any("other settings" in m for m in logs)
