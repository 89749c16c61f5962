"""GTO on tiny models: prefix groups, the decoder's own trees and scores,
L_GTO = 0 while the drafter equals its reference, gradients after it moves, a Lightning run that
keeps the reference frozen and out of checkpoints, misalignment statistics by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.decoding.tree import DraftTree
from lightning_spec.models.drafters.eagle3 import Eagle3Drafter
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.objectives.gto import GTO, choose_groups, misalignment

VOCAB = 128


def _sft_helpers():  # noqa: ANN202 - test_sft's builders, reused as plain functions
    path = Path(__file__).with_name("test_sft.py")
    spec = importlib.util.spec_from_file_location("sft_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HELPERS = _sft_helpers()


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


def _batch(length: int = 40) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    ids[:, 10:] = ids[:, :10].repeat(1, length // 10)[:, : length - 10]  # repeats: acceptable
    attention = torch.ones(2, length, dtype=torch.long)
    attention[1, length - 6 :] = 0
    ids[1, length - 6 :] = 0
    loss_mask = torch.zeros(2, length, dtype=torch.long)
    loss_mask[:, 8:] = 1
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask * attention}


def _module(target: TargetModel, **overrides: object) -> GTO:
    drafter = HELPERS._drafter(target)
    options = {
        "tree": "dynamic:3,3,8",
        "group_size": 4,
        "groups": 2,
        "ttt_steps": 2,
        "lr": 1e-2,
        "warmup_steps": 1,
        "max_steps_for_schedule": 10,
    }
    options.update(overrides)
    return GTO.from_objects(target, drafter, **options)


def test_choose_groups_partitions_valid_roots_into_non_overlapping_groups() -> None:
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1])
    generator = torch.Generator().manual_seed(0)
    # valid roots R: next token is a loss token -> R in {2..6, 8, 9}: runs 2..6 and 8..9
    roots = choose_groups(mask, groups=5, group_size=3, offset=1, generator=generator)
    assert roots.tolist() == [[2, 3, 4]]  # 5..6 and 8..9 are too short for a whole group
    pairs = choose_groups(mask, groups=5, group_size=2, offset=1, generator=generator)
    assert pairs.tolist() == [[2, 3], [4, 5], [8, 9]]  # K up to s / m, none overlapping
    assert choose_groups(mask, groups=2, group_size=6, offset=1, generator=generator) is None
    two = choose_groups(mask, groups=2, group_size=2, offset=1, generator=generator)
    assert two.shape == (2, 2) and len(set(two.flatten().tolist())) == 4
    assert choose_groups(mask, groups=9, group_size=1, offset=4, generator=generator).flatten().tolist() == [4, 5, 6, 8, 9]
    # a tree 3 deep from R must end inside the 11-token text: R + 3 < 11, so 8 and 9 drop out
    reached = choose_groups(mask, groups=9, group_size=1, offset=4, generator=generator, reach=3)
    assert reached.flatten().tolist() == [4, 5, 6]


def test_gto_term_is_zero_at_the_reference_and_trains_once_it_moves(
    target: TargetModel,
) -> None:
    # T = 1 expected-acceptance factors: after 30 token-loss steps the 0/1 factors leave only
    # clipped ratios here (test_greedy_factors_are_the_t0_default covers those)
    module = _module(target, reward_factors="probs")
    batch = _batch()
    result = module.gto_term(batch, statistics=True)
    assert result.prefixes == 16  # 2 sequences x 2 groups x 4 prefixes
    assert result.trees_scored == 32 and result.rows_scored > 32
    # current == reference: debiased rewards are all 0, so are the advantages and the loss
    assert result.reward == pytest.approx(result.reference_reward)
    assert float(result.loss.detach()) == 0.0 and result.ratio_mean == pytest.approx(1.0)
    assert result.accept_length == pytest.approx(result.reference_accept_length)
    assert 0.0 <= result.pruned <= 1.0 and 0.0 <= result.follows <= 1.0
    assert result.pruned == result.reference_pruned
    # move the drafter (a few token-loss steps on this batch, so its drafts get accepted):
    # rewards differ from the reference and the surrogate has gradients
    optimizer = torch.optim.Adam(module.drafter.parameters(), lr=3e-3)
    for _ in range(30):
        optimizer.zero_grad()
        module._common_step(batch).loss.backward()
        optimizer.step()
    module._generator.manual_seed(0)
    moved = module.gto_term(batch)
    assert moved.reward != pytest.approx(moved.reference_reward)
    assert moved.accept_length > 0  # the repeated text makes drafts acceptable
    module.drafter.zero_grad()
    moved.loss.backward()
    grads = [p.grad for p in module.drafter.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)
    assert all(p.grad is None for p in module.reference.parameters())


def test_trees_are_the_decoders_trees(target: TargetModel) -> None:
    """The tree GTO scores at root R is the one the decoder drafts after the same prefix."""
    module = _module(target, tree="dynamic:3,3,8")
    ids = _batch()["input_ids"][:1, :20]
    with torch.no_grad():
        features = target(ids).features
        trees = module._trees(module.drafter, ids, torch.tensor([12]), features)
    decoder = SpeculativeDecoder(target, module.drafter, parse_tree_spec("dynamic:3,3,8"))
    session = decoder.start(ids[0, :12].tolist(), 2)  # prefill commits t_12 = the root
    session.sequence[-1] = int(ids[0, 12])  # the root token the trees were built from
    session._absorb_all()
    record = session.step()
    assert torch.equal(record.tree.tokens, trees[0].tokens)
    assert torch.equal(record.tree.parents, trees[0].parents)


def test_misalignment_by_hand() -> None:
    # tree: root -> 5 (node 0) -> 7 (node 1); root -> 6 (node 2)
    tree = DraftTree(torch.tensor([5, 7, 6]), torch.tensor([-1, 0, -1]), torch.zeros(3))
    kept = DraftTree(torch.tensor([5, 7]), torch.tensor([-1, 0]), torch.zeros(2))
    pruned = DraftTree(torch.tensor([6, 9]), torch.tensor([-1, 0]), torch.zeros(2))
    shares = misalignment([tree, tree, tree], [kept, pruned, kept], [[0, 1], [2], []])
    # chain 5,7 is in the tree; chain 6,9 is cut after 6. Accepted 5,7 follows chain 5,7;
    # accepted 6 follows chain 6,9; the empty path follows any chain.
    assert shares == (pytest.approx(1 / 3), 1.0)
    assert misalignment([tree], [kept], [[2]]) == (0.0, 0.0)


def test_gto_fit_keeps_the_reference_frozen_and_out_of_checkpoints(
    target: TargetModel, tmp_path: Path
) -> None:
    module = _module(target)
    reference_before = {k: v.clone() for k, v in module.reference.state_dict().items()}
    drafter_before = module.drafter.fc.weight.clone()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        max_epochs=1,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        logger=False,
    )
    trainer.fit(module, datamodule=HELPERS.TinyData(_batch()))
    assert trainer.global_step == 2
    assert not torch.equal(module.drafter.fc.weight, drafter_before)
    for key, value in module.reference.state_dict().items():
        assert torch.equal(value, reference_before[key]), key
    metrics = trainer.logged_metrics
    for key in (
        "train/loss_gto",
        "train/reward_gap",
        "train/clip_fraction",
        "val/reward",
        "val/greedy_pruned",
        "val/greedy_reference_follows",
        "train/score_trees_per_s",
    ):
        assert key in metrics, key
    trainer.save_checkpoint(tmp_path / "gto.ckpt")
    checkpoint = torch.load(tmp_path / "gto.ckpt", weights_only=False)
    keys = checkpoint["state_dict"]
    assert not [k for k in keys if k.startswith(("target.", "reference."))]
    fresh = _module(target)
    fresh.on_load_checkpoint(checkpoint)
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)
    torch.testing.assert_close(fresh.drafter.fc.weight, module.drafter.fc.weight)
    assert fresh._prefixes_seen == module._prefixes_seen > 0


def test_gto_needs_a_trained_drafter_and_valid_switches(target: TargetModel) -> None:
    with pytest.raises(ValueError, match="drafter_init"):
        _module(target).build_drafter(target)
    with pytest.raises(ValueError, match="aggregation"):
        _module(target, aggregation="median")
    with pytest.raises(ValueError, match="group_size"):
        _module(target, group_size=0)
    single = _module(target, group_size=1).gto_term(_batch())
    assert single.prefixes == 4  # 2 sequences x 2 groups of one


def test_gto_at_temperature_one_samples_with_the_decoders_verifier(target: TargetModel) -> None:
    module = _module(target, temperature=1.0)
    result = module.gto_term(_batch(), statistics=True)
    assert result.prefixes == 16 and float(result.loss.detach()) == 0.0
    assert Eagle3Drafter is type(module.reference)


# ------------------------------------------------------------------ T = 0 defaults
def _greedy_text_batch(target: TargetModel, rows: int = 2, length: int = 48) -> dict:
    """The target's own greedy continuations of random prompts, with the cached teacher-forced
    pass a `regenerated` feature store would carry (features, final hidden states, argmax)."""
    from lightning_spec.decoding.engine import autoregressive_generate

    generator = torch.Generator().manual_seed(4)
    texts = []
    for _ in range(rows):
        prompt = torch.randint(3, VOCAB, (6,), generator=generator).tolist()
        texts.append(prompt + autoregressive_generate(target, prompt, length - 6, stop_on_eos=False))
    ids = torch.tensor(texts)
    with torch.no_grad():
        output = target(ids, output_features=True)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 6:] = 1
    return {
        "input_ids": ids,
        "loss_mask": loss_mask,
        "features": output.features,
        "last_hidden": output.last_hidden,
        "target_argmax": target.head_argmax(output.last_hidden),
    }


def test_greedy_factors_are_the_t0_default(target: TargetModel) -> None:
    assert _module(target).factors == "greedy"
    assert _module(target, temperature=1.0).factors == "probs"
    assert _module(target, reward_factors="probs").factors == "probs"


def test_cached_pass_gives_exactly_what_scoring_through_the_target_gives(
    target: TargetModel, greedy_fit
) -> None:
    """On greedy text, rewards, accepted paths, the loss and its gradients from the cached
    teacher-forced pass equal those from the target's tree-scoring forwards, and the cached
    step runs no target forward."""
    batch = _greedy_text_batch(target)
    drafter = Eagle3Drafter.from_target(target, intermediate_size=64)  # the full vocabulary
    greedy_fit(target, drafter, [batch["input_ids"][i, :6].tolist() for i in range(2)], length=48, steps=30)
    module = GTO.from_objects(
        target, drafter, tree="dynamic:3,3,8", group_size=4, groups=3, ttt_steps=2
    )
    with torch.no_grad():  # move the drafter off its reference, so advantages are not all 0
        for p in module.drafter.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    results, grads = [], []
    for cached in (True, False):
        module.hparams.cached_rewards = cached
        module._generator.manual_seed(0)
        calls: list[int] = []
        handle = target.register_forward_hook(lambda *a, calls=calls: calls.append(1))
        try:
            result = module.gto_term(batch, statistics=True)
        finally:
            handle.remove()
        assert (len(calls) == 0) == cached
        module.drafter.zero_grad()
        result.loss.backward()
        grads.append([p.grad.clone() for p in module.drafter.parameters() if p.grad is not None])
        results.append(result)
    fast, scored = results
    assert module._cached_sequences == 2 and module._scored_sequences == 2
    assert fast.accept_length > 0.5  # the fitted head gets drafts accepted: a real comparison
    for name in ("reward", "reference_reward", "accept_length", "reference_accept_length",
                 "clip_fraction", "ratio_mean", "pruned", "follows"):
        assert getattr(fast, name) == pytest.approx(getattr(scored, name), abs=1e-6), name
    assert float(fast.loss.detach()) == pytest.approx(float(scored.loss.detach()), abs=1e-6)
    assert any(float(g.abs().sum()) > 0 for g in grads[0])  # a live gradient, not two zeros
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))


def test_text_scores_refuse_what_is_not_greedy_text(target: TargetModel) -> None:
    from lightning_spec.decoding.score import text_scores

    batch = _greedy_text_batch(target, rows=1)
    ids, argmax = batch["input_ids"][0], batch["target_argmax"][0]
    module = _module(target)
    roots = torch.tensor([10, 11])
    with torch.no_grad():
        trees = module._trees(module.drafter, ids[None, :12], roots, batch["features"][:, :12])
    assert text_scores(trees, ids, argmax, roots) is not None
    edited = ids.clone()
    edited[12] = (int(edited[12]) + 1) % VOCAB  # no longer the target's argmax after ids[:12]
    assert text_scores(trees, edited, argmax, roots) is None
    assert text_scores(trees, ids[:13], argmax, roots) is None  # the text ends inside the tree


def test_validation_prefixes_do_not_depend_on_training(target: TargetModel) -> None:
    module = _module(target, reward_factors="probs")
    batch = _batch()
    first = module.gto_term(batch, generator=torch.Generator().manual_seed(5))
    module.gto_term(batch)  # training draws move the training generator only
    again = module.gto_term(batch, generator=torch.Generator().manual_seed(5))
    assert again.reward == first.reward and again.prefixes == first.prefixes


@pytest.mark.parametrize("omega", [1.0, -1.0])
def test_gto_only_steps_move_the_surrogate_in_the_direction_of_their_sign(
    target: TargetModel, greedy_fit, omega: float
) -> None:
    """The mechanism's plumbing: GTO-only steps (token loss weight 0) on fixed prefixes lower
    L_GTO there with omega > 0 and raise it with omega < 0 (no sign or stop-gradient slip).
    Whether that raises the tree reward is measured, not assumed: experiments/gto-draft-opd/scripts/gto_sign_test.py
    (experiments/gto-draft-opd/LOG.md: on this tiny model it lowers it, whatever the sign)."""
    batch = _greedy_text_batch(target)
    drafter = Eagle3Drafter.from_target(target, intermediate_size=64)
    greedy_fit(target, drafter, [batch["input_ids"][i, :6].tolist() for i in range(2)], length=48, steps=30)
    module = GTO.from_objects(
        target, drafter, tree="dynamic:3,3,8", group_size=4, groups=3, ttt_steps=2,
        omega=omega, token_weight=0.0,
    )
    with torch.no_grad():
        for p in module.drafter.parameters():
            p.add_(0.003 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))

    def surrogate() -> float:
        with torch.no_grad():
            return float(module.gto_term(batch, generator=torch.Generator().manual_seed(0)).loss)

    before = surrogate()
    optimizer = torch.optim.SGD(module.drafter.parameters(), lr=1e-2)
    for _ in range(3):
        result = module.gto_term(batch, generator=torch.Generator().manual_seed(0))
        optimizer.zero_grad()
        (omega * result.loss).backward()
        optimizer.step()
    after = surrogate()
    assert before != 0.0
    assert (after < before) if omega > 0 else (after > before), (before, after)
