"""Draft-OPD's reference form on tiny models: the current drafter's chain blocks on greedy text
equal the real decoder's steps, the post-rejection teacher rows equal the target's logits under
the drafted prefix, the cached-store path equals the computed one, and the loss trains."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from lightning_spec.decoding.build import parse_tree_spec
from lightning_spec.decoding.engine import SpeculativeDecoder
from lightning_spec.decoding.replay import text_pass
from lightning_spec.models.target import TargetModel
from lightning_spec.models.tiny import tiny_config
from lightning_spec.objectives import opd_suffix
from lightning_spec.objectives.draft_opd import DraftOPD


def _sft_helpers():  # noqa: ANN202 - test_sft's builders, reused as plain functions
    path = Path(__file__).with_name("test_sft.py")
    spec = importlib.util.spec_from_file_location("sft_helpers_opd_suffix", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HELPERS = _sft_helpers()
PROMPTS = [[5, 9, 14, 3], [40, 41]]
CHAIN = 4


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_config("llama", num_layers=2), seed=1)


@pytest.fixture(scope="module")
def state(target: TargetModel, greedy_fit) -> dict:  # noqa: ANN001
    """A drafter trained a little on the target's greedy text: some drafts accepted, some not."""
    drafter = HELPERS._drafter(target)
    greedy_fit(target, drafter, PROMPTS)
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def _module(target: TargetModel, state: dict, **overrides: object) -> DraftOPD:
    options = {"lr": 1e-2, "warmup_steps": 1, "max_steps_for_schedule": 10, "chain": CHAIN}
    options.update(overrides)
    drafter = HELPERS._drafter(target)
    drafter.load_state_dict(state)
    return DraftOPD.from_objects(target, drafter, **options)


def _greedy_batch(module: DraftOPD, new_tokens: int = 20) -> dict:
    """Prompt + the target's greedy continuation per row (loss mask on the continuation)."""
    decoder = SpeculativeDecoder(module.target, module.drafter, parse_tree_spec("chain:1"))
    sequences = [p + decoder.generate(p, new_tokens, stop_on_eos=False).tokens for p in PROMPTS]
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for row, (prompt, sequence) in enumerate(zip(PROMPTS, sequences, strict=True)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        attention[row, : len(sequence)] = 1
        loss_mask[row, len(prompt) : len(sequence)] = 1
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def _cached(module: DraftOPD, batch: dict) -> dict:
    """The batch as the regenerated store serves it: features, final hidden states, argmax."""
    with torch.no_grad():
        output = module.target(batch["input_ids"], output_features=True, use_cache=False)
    return {
        **batch,
        "features": output.features,
        "last_hidden": output.last_hidden,
        "target_argmax": output.logits.argmax(dim=-1),
    }


def test_chain_blocks_are_the_decoders_own_steps(target: TargetModel, state: dict) -> None:
    module = _module(target, state)
    prompt = PROMPTS[0]
    decoder = SpeculativeDecoder(target, module.drafter, parse_tree_spec(f"chain:{CHAIN}"))
    generation = decoder.generate(prompt, 24, stop_on_eos=False)
    ids = torch.tensor(prompt + generation.tokens)
    text = text_pass(target, ids.unsqueeze(0), len(prompt), features=True)
    blocks = opd_suffix.chain_blocks(target, module.drafter, ids, len(prompt), chain=CHAIN, text=text)
    assert blocks is not None
    records = generation.records
    assert blocks.anchors.tolist() == [r.anchor for r in records]
    assert blocks.accepted.tolist() == [r.accept_length for r in records]
    assert blocks.drafts.tolist() == [r.tree.tokens.tolist() for r in records]
    # each correction is the step's bonus token where the step was not cut
    for s, record in enumerate(records):
        if record.bonus_committed and record.accept_length < CHAIN:
            assert int(blocks.corrections[s]) == record.committed[-1]


def test_post_rejection_teacher_rows_are_the_target_under_the_drafted_prefix(
    target: TargetModel,
) -> None:
    """Every row: the target's logits after the prefix its slot was drafted from, the wrong
    draft d_{n+1} and the drafts after it included (an untrained drafter errs early, so most
    blocks have a long post-rejection suffix)."""
    drafter = HELPERS._drafter(target, noise=0.5)
    prompt = PROMPTS[0]
    decoder = SpeculativeDecoder(target, drafter, parse_tree_spec("chain:1"))
    ids = torch.tensor(prompt + decoder.generate(prompt, 16, stop_on_eos=False).tokens)
    start = len(prompt)
    text = text_pass(target, ids.unsqueeze(0), start, features=True)
    blocks = opd_suffix.chain_blocks(target, drafter, ids, start, chain=CHAIN, text=text)
    assert blocks is not None
    with torch.no_grad():
        cache = target(ids.unsqueeze(0), output_features=False, use_cache=True).cache
        text_logits = target.head_logits(text.last_hidden).float()
        rows = opd_suffix.teacher_rows(target, cache, ids, blocks, text_logits, text_start=start - 1)
    suffix_rows = 0
    for b in range(blocks.num_blocks):
        a, n = int(blocks.anchors[b]), int(blocks.accepted[b])
        for j in range(CHAIN):
            if j <= n:
                context = ids[: a + j + 1]
            elif bool(blocks.rejected[b]):
                context = torch.cat([ids[: a + n + 1], blocks.drafts[b, n:j]])
                suffix_rows += 1
            else:
                continue  # the text ended inside the block: no verified rejection, no stream
            with torch.no_grad():
                direct = target(context.unsqueeze(0), use_cache=False).logits[0, -1].float()
            torch.testing.assert_close(rows[b, j], direct, atol=1e-4, rtol=1e-4)
    assert suffix_rows >= 3


def test_stream_masks_on_hand_made_blocks() -> None:
    blocks = opd_suffix.ChainBlocks(
        anchors=torch.tensor([3, 5, 10]),
        drafts=torch.tensor([[7, 8, 9], [1, 2, 3], [4, 5, 6]]),
        accepted=torch.tensor([1, 3, 0]),
        corrections=torch.tensor([11, 12, -1]),  # block 3: the text ends at its anchor
    )
    accepted, rejected = opd_suffix.stream_masks(blocks)
    assert accepted.tolist() == [[True, True, False], [True, True, True], [False, False, False]]
    assert rejected.tolist() == [[False, True, True], [False, False, False], [False, False, False]]
    assert opd_suffix.realised_tokens(blocks).tolist() == [[7, 11, 9], [1, 2, 3], [4, 5, 6]]
    without, same = opd_suffix.stream_masks(blocks, correction=False)  # the ablation
    assert without.tolist() == [[True, False, False], [True, True, True], [False, False, False]]
    assert torch.equal(same, rejected)


@pytest.mark.parametrize("kl", ["exact", "estimator"])
def test_the_suffix_loss_trains_and_the_cached_path_equals_the_computed_one(
    target: TargetModel, state: dict, kl: str
) -> None:
    module = _module(target, state, kl=kl)
    batch = _greedy_batch(module)
    module.on_train_batch_start(batch, 0)  # greedy texts need no step records
    computed = module.opd_loss(batch)
    cached = module.opd_loss(_cached(module, batch))
    loss = computed["loss"]
    assert torch.isfinite(loss) and float(loss.detach()) > 0
    assert computed["accepted"] > 0 and computed["rejected"] > 0
    assert float(cached["loss"].detach()) == pytest.approx(float(loss.detach()), rel=1e-4)
    assert cached["rejected"] == computed["rejected"]
    loss.backward()
    assert float(module.drafter.fc.weight.grad.abs().sum()) > 0


def test_the_suffix_stream_holds_more_than_the_first_wrong_slot(
    target: TargetModel, state: dict
) -> None:
    """The reference form trains every slot after the first rejection: more rejected terms than
    there are rejected blocks, at block positions beyond n + 1."""
    module = _module(target, state)
    batch = _greedy_batch(module)
    row = 0
    length = int(batch["attention_mask"][row].sum())
    blocks, teacher, draft = module.suffix_rows(batch, row, length).real
    assert teacher.shape == draft.shape == (blocks.num_blocks, CHAIN, draft.shape[-1])
    _, rejected = opd_suffix.stream_masks(blocks)
    assert int(rejected.sum()) > int(blocks.rejected.sum())


def test_a_text_that_is_not_greedy_is_cut_to_its_greedy_prefix(
    target: TargetModel, state: dict
) -> None:
    module = _module(target, state)
    batch = _greedy_batch(module)
    length = int(batch["attention_mask"][0].sum())
    start = len(PROMPTS[0])
    whole, _, _ = module.suffix_rows(batch, 0, length).real
    broken = {k: v.clone() for k, v in batch.items()}
    broken["input_ids"][0, start + 6] = (broken["input_ids"][0, start + 6] + 1) % 64
    cut, _, _ = module.suffix_rows(broken, 0, length).real
    assert module._not_greedy == 1
    assert int((cut.anchors + cut.accepted).max()) <= start + 5
    assert cut.num_blocks <= whole.num_blocks


def test_random_anchors_move_the_accepted_stream_only(target: TargetModel, state: dict) -> None:
    """The reference's ablation: the accepted stream's blocks (same lengths) move to random
    response positions along the text; the rejected stream stays at the drafter's errors."""
    batch = _greedy_batch(_module(target, state))
    errors = _module(target, state).opd_loss(batch)
    moved = _module(target, state, anchors="random").opd_loss(batch)
    assert moved["rejected"] == errors["rejected"]
    assert moved["loss_rejected"] == pytest.approx(errors["loss_rejected"], rel=1e-5)
    assert moved["loss_accepted"] != pytest.approx(errors["loss_accepted"], rel=1e-3)
    assert torch.isfinite(moved["loss"])
    blocks = opd_suffix.ChainBlocks(
        torch.tensor([4, 6]), torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([1, 3]),
        torch.tensor([9, 9]),
    )  # fmt: skip
    ids = torch.arange(20, 32)
    shifted = opd_suffix.moved_blocks(blocks, ids, 4, torch.Generator().manual_seed(0))
    for b in range(2):
        a, n = int(shifted.anchors[b]), int(shifted.accepted[b])
        assert 4 <= a <= 10 and n <= int(blocks.accepted[b])
        assert shifted.drafts[b, :n].tolist() == ids[a + 1 : a + 1 + n].tolist()


def test_options_are_checked(target: TargetModel, state: dict) -> None:
    with pytest.raises(ValueError, match="rejected_stream"):
        _module(target, state, rejected_stream="siblings")
    with pytest.raises(ValueError, match="chain"):
        _module(target, state, chain=-1)


def test_a_dflash_drafter_trains_on_its_whole_block(target: TargetModel) -> None:
    """The reference's student: a DFlash drafter, chain = its block - 1 drafts by default."""
    from lightning_spec.models.drafters.dflash import DFlashDrafter

    drafter = DFlashDrafter.from_target(target, block_size=5, num_layers=1, intermediate_size=64)
    module = DraftOPD.from_objects(target, drafter, lr=1e-2, warmup_steps=1, max_steps_for_schedule=10)
    assert opd_suffix.default_chain(drafter) == 4
    batch = _greedy_batch(module)
    rows = module.suffix_rows(batch, 0, int(batch["attention_mask"][0].sum()))
    blocks, teacher, draft = rows.real
    assert blocks.drafts.shape[1] == 4 and teacher.shape == draft.shape
    result = module.opd_loss(batch)
    assert torch.isfinite(result["loss"]) and result["rejected"] > result["accepted"] > 0
    result["loss"].backward()
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in drafter.parameters())
